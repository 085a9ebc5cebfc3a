"""A robot policy's action chunk through the SDK (`MStarClient.predict_actions`, native POST /generate):
camera frames, a task and (Pi0.5: option state) the robot's state in, actions [chunk, width] out, saved as .npy.

    python examples/robot_policy.py --model pi05 --option 'state=[0, 0, 0, 0, 0, 0, 0, 0]'
    python examples/robot_policy.py --model cosmos3_droid --task "pick up the red cube" --out actions.npy
    curl http://127.0.0.1:8000/generate -F text="pick up the red cube" -F files=@input.png -F outputs=actions \
      -F stream=false -F 'options={"state": [0, 0, 0, 0, 0, 0, 0, 0]}'   # Pi0.5; Cosmos3 DROID takes no state
"""

from __future__ import annotations

import numpy as np
from common import frames, parser, sdk


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--task", default="pick up the red cube")
    p.add_argument("--out", default="actions.npy")
    args = p.parse_args()
    actions = sdk(args).predict_actions(frames(1), args.task, seed=0, **dict(args.option))
    print(f"actions {list(actions.shape)}:\n{np.array2string(actions, precision=3, threshold=40)}")
    np.save(args.out, actions)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
