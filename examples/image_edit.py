"""Image and prompt to image through /v1/images/edits with the official `openai` client (a sample picture when
no --image is given); saves the PNG.

    python examples/image_edit.py --model bagel --image input.png --prompt "make it purple" --out edited.png
    curl http://127.0.0.1:8000/v1/images/edits -F image=@input.png -F prompt="make it purple"
"""

from __future__ import annotations

import base64

from common import parser, png, read_or, save
from openai import OpenAI


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--image", help="the PNG or JPEG to edit")
    p.add_argument("--prompt", default="make it purple")
    p.add_argument("--out", default="edited.png")
    args = p.parse_args()
    client = OpenAI(base_url=f"{args.base_url}/v1", api_key=args.api_key)
    image = ("input.png", read_or(args.image, png()), "image/png")
    answer = client.images.edit(model=args.model, image=image, prompt=args.prompt, response_format="b64_json",
                                extra_body=dict(args.option))
    save(args.out, base64.b64decode(answer.data[0].b64_json))


if __name__ == "__main__":
    main()
