"""Count (not assert) the host instructions of one Orpheus vocoder step per window, with callgrind.

The vocoder's `run_batch` runs on the host path of the worker that also runs the LM (window
metadata, validity, one copy of the spans in, the emitted spans out, the stateless engine's host
copies); its SNAC decode is replaced by an instant fake. Each figure is the difference of two
callgrind runs that differ only in the number of steps (start-up and imports cancel out), so it is
reproducible where CPU timings on a shared machine are not.

    python3 benchmarks/vocoder_host.py --batch 1 8            # ~25 minutes on the shared 2-core machine; needs valgrind
    python3 benchmarks/vocoder_host.py --child 8 50           # the measured program alone
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEPS = (20, 420)  # start-up is ~6e9 instructions: the difference must dwarf its run-to-run noise


def child(batch: int, steps: int) -> None:
    sys.path.insert(0, str(ROOT))  # this checkout's mstar
    import torch

    from mstar.engines.base import StepItem
    from mstar.engines.stateless import StatelessEngine
    from mstar.models.orpheus.snac import SnacConfig
    from mstar.models.orpheus.tokens import FRAME, OrpheusTokens
    from mstar.models.orpheus.vocoder import OrpheusVocoder
    from mstar.models.orpheus.weights import load_snac

    torch.set_num_threads(1)
    vocoder = OrpheusVocoder(load_snac(SnacConfig(), None, torch.device("cpu")), OrpheusTokens())
    spf = vocoder.samples_per_frame
    out = torch.zeros(64, 4 * spf)
    vocoder.decode_windows = lambda tokens, first: out[: tokens.shape[0], : tokens.shape[1] // FRAME * spf]
    layout = vocoder.tokens
    gen = torch.Generator().manual_seed(1)

    def window(start: int) -> dict:  # an ordinary 4-frame window of valid codes
        codes = torch.randint(1, 4096, (4, FRAME), generator=gen)
        flat = (codes + layout.audio_offset + torch.arange(FRAME) * 4096).reshape(-1)
        return {"codes": flat, "codes_new": torch.tensor(FRAME), "codes_start": torch.tensor(start),
                "codes_final": torch.tensor(False)}

    engine = StatelessEngine(vocoder)
    windows = [window(FRAME * (i + 1)) for i in range(batch)]
    for _ in range(5 + steps):
        for i, w in enumerate(windows):
            engine.submit(StepItem(f"r{i}", "speak", "vocode", w))
        assert len(engine.step()) == batch


def instructions(batch: int, steps: int) -> int:
    env = {**os.environ, "PYTHONHASHSEED": "0"}  # the same dict layouts in both runs
    run = subprocess.run(["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", sys.executable,
                          __file__, "--child", str(batch), str(steps)], capture_output=True, text=True, check=True,
                         env=env)
    return int(re.search(r"Collected : (\d+)", run.stderr).group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--child", type=int, nargs=2, metavar=("BATCH", "STEPS"))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.child:
        child(*args.child)
        return
    rows = []
    for batch in args.batch:
        few, many = (instructions(batch, s) for s in STEPS)
        per_step = (many - few) / (STEPS[1] - STEPS[0])
        rows.append({"batch": batch, "instructions_per_step": round(per_step),
                     "instructions_per_window": round(per_step / batch)})
        print(rows[-1], flush=True)
    if args.out:
        result = {"command": "python3 benchmarks/vocoder_host.py " + " ".join(sys.argv[1:]),
                  "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": platform.machine(),
                  "python": platform.python_version(), "rows": rows}
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
