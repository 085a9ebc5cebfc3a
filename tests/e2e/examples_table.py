"""examples/README.md's table as data, and checks that what an example or curl line produced is real: PNGs
open in Pillow, WAVs in soundfile, MP4s in PyAV, arrays in numpy, and JSON answers have their route's shape.
Shared by tests/e2e/test_examples.py (tiny servers in this process) and tests/e2e/test_newcomer.py (a fresh
venv)."""

from __future__ import annotations

import base64
import io
import json
import re
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mstar.models.registry import get_model_class

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
DEFAULT_URL = "http://127.0.0.1:8000"


@dataclass(frozen=True)
class Row:
    """One row: the models it covers, its route, the script's argv (after `python`) and the curl line."""

    models: tuple[str, ...]
    route: str
    script: tuple[str, ...] | None
    curl: str | None


def rows() -> list[Row]:
    """Every row of examples/README.md's table."""
    found = []
    for line in (EXAMPLES / "README.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        if not line.startswith("| `") or len(cells) != 4:
            continue
        models = tuple(re.findall(r"`([^`]+)`", cells[0]))
        script, curl = (c[1:-1] if c.startswith("`") else None for c in cells[2:])
        argv = tuple(shlex.split(script)[1:]) if script else None
        found.append(Row(models, cells[1], argv, curl))
    return found


def rows_of(model: str) -> list[Row]:
    return [r for r in rows() if model in r.models]


SEEDED = ("chat.py", "completions.py")  # scripts whose stdout is a sampled answer


def script_args(row: Row, base: str, model: str) -> list[str]:
    """The script's argv (path first) pointed at `base`, naming `model` where the row covers several."""
    args = [str(ROOT / row.script[0]), *row.script[1:], "--base-url", base]
    # a tiny model's random weights may sample an empty answer: pin one (the toy samples nothing and takes no seed)
    if Path(row.script[0]).name in SEEDED and "seed" in get_model_class(model).accepted_options():
        args += ["--option", "seed=1"]
    return args + ["--model", model] if "--model" not in args else args


def curl_line(row: Row, base: str) -> str:
    """The curl line pointed at `base`, failing on an HTTP error and quiet but for errors."""
    return row.curl.replace(DEFAULT_URL, base).replace("curl ", "curl -sS --fail-with-body ", 1)


def check_file(path: Path) -> str:
    """Decode one output file by its suffix; a short description of what it holds."""
    data = path.read_bytes()
    if path.suffix == ".png":
        from PIL import Image

        image = Image.open(io.BytesIO(data))
        image.load()
        assert image.format == "PNG" and image.width > 0 and image.height > 0, path
        return f"PNG {image.size}"
    if path.suffix == ".wav":
        import soundfile as sf

        samples, rate = sf.read(io.BytesIO(data))
        assert rate > 0 and samples.size > 0 and np.isfinite(samples).all(), path
        return f"WAV {samples.shape} at {rate} Hz"
    if path.suffix == ".mp4":
        import av

        with av.open(io.BytesIO(data)) as container:
            frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
        assert frames and frames[0].size > 0, path
        return f"MP4 {len(frames)} frames of {frames[0].shape}"
    if path.suffix == ".npy":
        array = np.load(path)
        assert array.size > 0 and np.isfinite(array).all(), path
        return f"array {array.shape}"
    raise AssertionError(f"unexpected output file {path.name}")


def check_json_answer(route: str, body: str) -> str:
    """Check a JSON (or NDJSON, for /generate's stream) answer has the route's shape; describe it."""
    # NDJSON frames on "\n" alone: splitlines would also break inside a JSON string at a raw U+2028 or U+0085
    lines = [json.loads(line) for line in body.split("\n") if line.strip()]
    if route.startswith("`/generate`") and "type" in lines[0]:  # a stream, however short
        kinds = [c["type"] for c in lines]
        assert kinds[-1] == "final" and "error" not in kinds, lines
        # random weights may sample an end token first, or only tokens that decode to nothing: then the
        # final chunk alone answers, and its usage says what was generated
        assert len(kinds) > 1 or "usage" in lines[-1], lines
        return f"NDJSON {kinds}"
    answer = json.loads(body)
    assert "error" not in answer, answer
    if route.startswith("`/generate`"):
        assert answer.get("outputs") and all(answer["outputs"].values()), answer
        return f"outputs {sorted(answer['outputs'])}"
    if "/chat/completions" in route:
        message = answer["choices"][0]["message"]
        if message.get("audio"):
            check_wav(base64.b64decode(message["audio"]["data"]))
            return "spoken answer"
        assert isinstance(message["content"], str), answer
        # random weights may sample an end token first: an empty answer is then the model's, not the server's
        ended_at_once = answer["choices"][0]["finish_reason"] == "stop" and answer["usage"]["completion_tokens"] == 1
        assert message["content"] or ended_at_once, answer
        return "chat answer"
    if "/completions" in route:
        assert isinstance(answer["choices"][0]["text"], str), answer
        return "completion"
    if "/images/" in route:
        png = base64.b64decode(answer["data"][0]["b64_json"])
        assert png[:8] == b"\x89PNG\r\n\x1a\n", png[:8]
        return "PNG in JSON"
    if "/transcriptions" in route:
        assert isinstance(answer["text"], str) and answer["text"], answer
        return "transcript"
    raise AssertionError(f"no JSON check for route {route}")


def check_wav(data: bytes) -> None:
    import soundfile as sf

    samples, rate = sf.read(io.BytesIO(data))
    assert rate > 0 and samples.size > 0


def outputs_of(cwd: Path, before: dict[str, float]) -> list[Path]:
    """Files under `cwd` written since `before` (name -> mtime) was taken."""
    return sorted(p for p in cwd.iterdir() if p.is_file() and before.get(p.name) != p.stat().st_mtime_ns)


def snapshot(cwd: Path) -> dict[str, float]:
    return {p.name: p.stat().st_mtime_ns for p in cwd.iterdir() if p.is_file()}


def out_file(argv: list[str] | tuple[str, ...]) -> str | None:
    """The file a curl line writes with `-o`, if any."""
    argv = list(argv)
    return argv[argv.index("-o") + 1] if "-o" in argv else None


def check_curl(row: Row, base: str, cwd: Path) -> None:
    """Run the row's curl line against `base` in `cwd`; check its answer or the file it wrote."""
    line = curl_line(row, base)
    before = snapshot(cwd)
    done = subprocess.run(["bash", "-c", line], cwd=cwd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{line}\n{done.stdout}\n{done.stderr}"
    target = out_file(shlex.split(line))
    if target is None:
        check_json_answer(row.route, done.stdout)
    else:
        assert target in [p.name for p in outputs_of(cwd, before)], line
        check_file(cwd / target)
