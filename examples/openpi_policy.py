"""Pi0.5 as openpi robots reach it: the `openpi-client` websocket policy at ws://host:port, unchanged. Builds an
observation from the server's example (random camera images and state), asks for an action chunk, saves it.
Needs `pip install --no-deps openpi-client==0.1.2 && pip install msgpack` (--no-deps: it pins numpy<2).

    python examples/openpi_policy.py --base-url http://127.0.0.1:8000 --out actions.npy
"""

from __future__ import annotations

import numpy as np
from common import parser
from openpi_client.websocket_client_policy import WebsocketClientPolicy


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--task", default="pick up the red cube")
    p.add_argument("--out", default="actions.npy")
    args = p.parse_args()
    url = args.base_url.replace("http://", "ws://").replace("https://", "wss://")
    policy = WebsocketClientPolicy(url, api_key=None if args.api_key == "none" else args.api_key)
    example = policy.get_server_metadata()["example_observation"]
    rng = np.random.default_rng(0)
    observation = {"images": {name: rng.integers(0, 256, image.shape, dtype=np.uint8)
                              for name, image in example["images"].items()},
                   "state": rng.uniform(-1, 1, example["state"].shape).astype(np.float32), "prompt": args.task}
    result = policy.infer(observation)
    print(f"actions {list(result['actions'].shape)} in {result['server_timing']['infer_ms']:.1f} ms")
    np.save(args.out, result["actions"])
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
