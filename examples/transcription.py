"""Speech to text through /v1/audio/transcriptions with the official `openai` client (a sample tone when no
--audio is given).

    python examples/transcription.py --model qwen3_omni --audio input.wav
    curl http://127.0.0.1:8000/v1/audio/transcriptions -F file=@input.wav
"""

from __future__ import annotations

from common import parser, read_or, wav
from openai import OpenAI


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--audio", help="a WAV, FLAC, MP3 or other sound file")
    args = p.parse_args()
    client = OpenAI(base_url=f"{args.base_url}/v1", api_key=args.api_key)
    sound = ("input.wav", read_or(args.audio, wav()), "audio/wav")
    print(client.audio.transcriptions.create(model=args.model, file=sound, extra_body=dict(args.option)).text)


if __name__ == "__main__":
    main()
