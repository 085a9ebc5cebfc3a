"""Text (or an image) to video through the /v1/videos jobs with the official `openai` client: create, poll,
download the MP4.

    python examples/video.py --model wan22 --prompt "a kite over the sea" --out video.mp4
    curl http://127.0.0.1:8000/v1/videos/generations -H 'Content-Type: application/json' \
      -d '{"prompt": "a kite over the sea", "size": "64x32"}' -o video.mp4   # the MP4 in one answer
"""

from __future__ import annotations

import warnings
from pathlib import Path

from common import parser, save
from openai import OpenAI


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--prompt", default="a kite over the sea")
    p.add_argument("--image", help="a first frame to start from (PNG or JPEG)")
    p.add_argument("--size", help="WIDTHxHEIGHT (default: the model's)")
    p.add_argument("--out", default="video.mp4")
    args = p.parse_args()
    warnings.simplefilter("ignore", DeprecationWarning)  # the openai client marks its videos API deprecated
    client = OpenAI(base_url=f"{args.base_url}/v1", api_key=args.api_key)
    kwargs = {"input_reference": ("input.png", Path(args.image).read_bytes(), "image/png")} if args.image else {}
    if args.size:
        kwargs["size"] = args.size
    job = client.videos.create_and_poll(model=args.model, prompt=args.prompt, extra_body=dict(args.option),
                                        poll_interval_ms=200, **kwargs)
    if job.status != "completed":
        raise SystemExit(f"video job {job.id} {job.status}: {job.error}")
    print(f"job {job.id}: {job.size}, {job.seconds} s")
    save(args.out, client.videos.download_content(job.id).content)


if __name__ == "__main__":
    main()
