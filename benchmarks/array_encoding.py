"""What /generate's array encodings cost (asserts nothing): for each array, the NDJSON line's size and the
time to write it (chunk built and serialised, as the server does) and to read it (parsed and decoded to
numpy, as the SDK does), as JSON numbers, raw float32 bytes and raw bfloat16 bytes. CPU only.

    python3 benchmarks/array_encoding.py                 # writes benchmarks/results/array_encoding_cpu.json
    python3 benchmarks/array_encoding.py --repeats 5
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without install

from mstar.server.protocol import ActionChunk, TensorChunk, chunk_line, parse_chunk  # noqa: E402

CASES = {  # name: (chunk type, shape)
    "pi05 actions [50, 32]": (ActionChunk, (50, 32)),
    "cosmos3 DROID actions [32, 10]": (ActionChunk, (32, 10)),
    "V-JEPA 2 ViT-L latents, 16 frames at 256 [2048, 1024]": (TensorChunk, (2048, 1024)),
    "V-JEPA 2 ViT-g latents, 64 frames at 256 [8192, 1408]": (TensorChunk, (8192, 1408)),
}
FORMS = {"json": (False, None), "binary float32": (True, None), "binary bfloat16": (True, "bfloat16")}


def _best(fn, repeats: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return min(times), out


def measure(kind, shape, binary: bool, dtype: str | None, repeats: int) -> dict:
    arr = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    if kind is ActionChunk and dtype == "bfloat16":
        return {}
    write_s, line = _best(lambda: chunk_line(kind.from_array("x", 0, arr, binary, dtype or "float32")), repeats)
    read_s, _ = _best(lambda: parse_chunk(line).to_numpy(), repeats)
    return {"bytes": len(line), "bytes_per_value": round(len(line) / arr.size, 2),
            "write_ms": round(write_s * 1e3, 2), "read_ms": round(read_s * 1e3, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/array_encoding_cpu.json")
    args = parser.parse_args()
    results = {}
    for name, (kind, shape) in CASES.items():
        results[name] = {form: row for form, (binary, dtype) in FORMS.items()
                         if (row := measure(kind, shape, binary, dtype, args.repeats))}
        print(name, json.dumps(results[name]), flush=True)
    args.out.write_text(json.dumps({"command": "python3 benchmarks/array_encoding.py", "results": results}, indent=1))


if __name__ == "__main__":
    main()
