"""Chat through /v1/chat/completions with the official `openai` client: text, optionally an image or a sound
in the message, optionally a spoken answer (Qwen3-Omni, toy) saved as WAV.

    python examples/chat.py --model smollm2 --prompt "What is the capital of France?"
    curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \
      -d '{"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 32}'
"""

from __future__ import annotations

import base64
from pathlib import Path

from common import parser, save
from openai import OpenAI


def content(args) -> str | list[dict]:
    """The user message: the prompt alone, or parts with the image and sound."""
    if args.image is None and args.audio is None:
        return args.prompt
    parts = [{"type": "text", "text": args.prompt}]
    if args.image is not None:
        url = "data:image/png;base64," + base64.b64encode(Path(args.image).read_bytes()).decode()
        parts.append({"type": "image_url", "image_url": {"url": url}})
    if args.audio is not None:
        data = base64.b64encode(Path(args.audio).read_bytes()).decode()
        parts.append({"type": "input_audio", "input_audio": {"data": data, "format": "wav"}})
    return parts


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--prompt", default="What is the capital of France?")
    p.add_argument("--image", help="a PNG or JPEG to ask about")
    p.add_argument("--audio", help="a WAV to ask about")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--stream", action="store_true", help="print the answer as it is written")
    p.add_argument("--voice", help="answer aloud too, in this voice (models with audio out)")
    p.add_argument("--out", default="answer.wav", help="where the spoken answer goes")
    args = p.parse_args()
    client = OpenAI(base_url=f"{args.base_url}/v1", api_key=args.api_key)
    request = dict(model=args.model, max_tokens=args.max_tokens, extra_body=dict(args.option),
                   messages=[{"role": "user", "content": content(args)}])
    if args.voice:
        request.update(modalities=["text", "audio"], audio={"voice": args.voice, "format": "wav"})
    if args.stream and not args.voice:
        for chunk in client.chat.completions.create(stream=True, **request):
            if chunk.choices:
                print(chunk.choices[0].delta.content or "", end="", flush=True)
        print()
        return
    message = client.chat.completions.create(**request).choices[0].message
    if message.audio is not None:
        print(message.audio.transcript)
        save(args.out, base64.b64decode(message.audio.data))
    else:
        print(message.content)


if __name__ == "__main__":
    main()
