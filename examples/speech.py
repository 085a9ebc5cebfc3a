"""Text to speech through /v1/audio/speech with the official `openai` client; saves the WAV
(`mstar models` lists each model's voices).

    python examples/speech.py --model orpheus --voice tara --input "Hello there." --out speech.wav
    curl http://127.0.0.1:8000/v1/audio/speech -H 'Content-Type: application/json' \
      -d '{"input": "Hello there.", "voice": "tara", "response_format": "wav"}' -o speech.wav
"""

from __future__ import annotations

from common import parser, save
from openai import OpenAI


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--input", default="Hello there.")
    p.add_argument("--voice", default="tara")
    p.add_argument("--out", default="speech.wav")
    args = p.parse_args()
    client = OpenAI(base_url=f"{args.base_url}/v1", api_key=args.api_key)
    answer = client.audio.speech.create(model=args.model, voice=args.voice, input=args.input,
                                        response_format="wav", extra_body=dict(args.option))
    save(args.out, answer.content)


if __name__ == "__main__":
    main()
