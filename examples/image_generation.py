"""Text to image through /v1/images/generations with the official `openai` client; saves the PNG.

    python examples/image_generation.py --model bagel --prompt "a lighthouse at dusk" --out image.png
    curl http://127.0.0.1:8000/v1/images/generations -H 'Content-Type: application/json' \
      -d '{"prompt": "a lighthouse at dusk", "size": "64x32"}'   # the PNG is data[0].b64_json
"""

from __future__ import annotations

import base64

from common import parser, save
from openai import OpenAI


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--prompt", default="a lighthouse at dusk")
    p.add_argument("--size", help="WIDTHxHEIGHT (default: the model's)")
    p.add_argument("--out", default="image.png")
    args = p.parse_args()
    client = OpenAI(base_url=f"{args.base_url}/v1", api_key=args.api_key)
    size = {"size": args.size} if args.size else {}
    answer = client.images.generate(model=args.model, prompt=args.prompt, response_format="b64_json",
                                    extra_body=dict(args.option), **size)
    save(args.out, base64.b64decode(answer.data[0].b64_json))


if __name__ == "__main__":
    main()
