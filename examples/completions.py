"""Complete a prompt through /v1/completions with the official `openai` client (the LLM entries).

    python examples/completions.py --model qwen3 --prompt "Once upon a time"
    curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \
      -d '{"prompt": "Once upon a time", "max_tokens": 16}'
"""

from __future__ import annotations

from common import parser
from openai import OpenAI


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--prompt", default="Once upon a time")
    p.add_argument("--max-tokens", type=int, default=16)
    args = p.parse_args()
    client = OpenAI(base_url=f"{args.base_url}/v1", api_key=args.api_key)
    answer = client.completions.create(model=args.model, prompt=args.prompt, max_tokens=args.max_tokens,
                                       extra_body=dict(args.option))
    print(args.prompt + answer.choices[0].text)


if __name__ == "__main__":
    main()
