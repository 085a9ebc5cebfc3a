"""V-JEPA 2 through the SDK (`MStarClient`, native POST /generate): `encode` a clip to latents (vjepa2,
vjepa2_ac), `rollout` latents under robot actions and `plan` actions toward a goal image (vjepa2_ac). Saves
the array as .npy. Sample frames stand in when no --video is given.

    python examples/vjepa2.py --model vjepa2 --task encode --video input.mp4 --out latents.npy
    python examples/vjepa2.py --model vjepa2_ac --task plan --out plan.npy
    curl http://127.0.0.1:8000/generate -F files=@input.mp4 -F outputs=pooled -F stream=false
"""

from __future__ import annotations

import numpy as np
from common import frames, parser, sdk

STATE = [[0.1, 0.2, 0.3, 0.0, 0.0, 0.0, 0.5]]  # end-effector position, orientation, gripper


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--task", choices=("encode", "rollout", "plan"), default="encode")
    p.add_argument("--video", help="a video file (default: sample frames)")
    p.add_argument("--pooled", action="store_true", help="encode: the mean latent instead of every token")
    p.add_argument("--out", default="latents.npy")
    args = p.parse_args()
    client = sdk(args)
    video = args.video or frames(4)
    if args.task == "encode":
        array = client.encode_video(video, pooled=args.pooled)
    elif args.task == "rollout":
        array = client.rollout(frames(1), actions=[[0.01, 0, 0, 0, 0, 0, 0]] * 3, states=STATE)
    else:
        array = client.plan(frames(1), goal=frames(1, seed=90)[0], states=STATE, samples=16, topk=4, cem_iterations=2,
                            seed=0)
    print(f"{args.task}: {array.dtype} {list(array.shape)}, first values {array.ravel()[:4]}")
    np.save(args.out, array)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
