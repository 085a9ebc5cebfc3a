"""Any model through the native streaming route, POST /generate, with the SDK (`MStarClient`): text and files
in, typed chunks out as they are made. Text is printed; images, audio, video and arrays are saved as
<out>-<output>-<seq>.png/.wav/.mp4/.npy.

    python examples/generate.py --model toy --prompt "hello" --outputs text,image
    python examples/generate.py --model vjepa2 --file input.mp4 --outputs pooled
    curl -N http://127.0.0.1:8000/generate -H 'Content-Type: application/json' \
      -d '{"text": "hello", "outputs": ["text"], "options": {"max_tokens": 16}}'   # NDJSON, one chunk a line
"""

from __future__ import annotations

import numpy as np
from common import parser, save, sdk

from mstar.client import AudioBuffer


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--prompt")
    p.add_argument("--file", action="append", default=[], help="an image, sound or video to send (repeatable)")
    p.add_argument("--outputs", default="text", help="comma-separated outputs (see GET /v1/models)")
    p.add_argument("--seed", type=int)
    p.add_argument("--out", default="generated", help="file name prefix of media outputs")
    args = p.parse_args()
    client = sdk(args)
    audio: dict[str, list[AudioBuffer]] = {}
    for chunk in client.generate(args.prompt, files=args.file, outputs=args.outputs.split(","), stream=True,
                                 seed=args.seed, **dict(args.option)):
        name = f"{args.out}-{getattr(chunk, 'output', '')}-{getattr(chunk, 'seq', 0)}"
        if chunk.type == "text":
            print(chunk.delta, end="", flush=True)
        elif chunk.type == "image":
            save(f"{name}.png", chunk.png_bytes())
        elif chunk.type == "video":
            save(f"{name}.mp4", chunk.mp4_bytes())
        elif chunk.type == "audio":
            audio.setdefault(chunk.output, []).append(AudioBuffer(chunk.to_numpy(), chunk.sample_rate))
        elif chunk.type in ("action", "tensor"):
            array = chunk.to_numpy()
            print(f"{chunk.output}: {chunk.type} {list(array.shape)}, first values {array.ravel()[:4]}")
            np.save(f"{name}.npy", array)
        elif chunk.type == "final":
            print(f"\n[{chunk.finish_reason}, {chunk.usage.completion_tokens} tokens out]")
    for output, pieces in audio.items():
        save(f"{args.out}-{output}.wav", AudioBuffer.concat(pieces).wav_bytes())


if __name__ == "__main__":
    main()
