"""Wall time per decode step of the autoregressive engine with the caller's work included, for a checkout given
as the first argument (results JSON: the second), so that a commit before engine loops and one after compare.

`decode_step.py` times `engine.step()` alone; before engine loops the caller fed each token back between
steps, work that overlapped the GPU but fell outside that timing. Here the whole decode phase is timed:
before engine loops (no `LoopSpec` in the checkout) items are fed back one token at a time, as the worker
did; after, each request is one engine-loop item. Orpheus-3B shape, bf16, dummy weights, 64-token prompts,
256 new tokens, greedy; batches 1, 8, 32, the median of 3 runs each. Needs a CUDA GPU.

    python3 benchmarks/decode_wall.py <checkout> <out.json>
"""
import json
import sys
import time

import torch

sys.path.insert(0, sys.argv[1])
from benchmarks.decode_step import ORPHEUS_3B, make_engine  # noqa: E402
from mstar.engines import base  # noqa: E402
from mstar.models.common.loading import fill_dummy_weights  # noqa: E402
from mstar.models.llama.config import LlamaConfig  # noqa: E402
from mstar.models.llama.model import build_model  # noqa: E402

loops = hasattr(base, "LoopSpec")
device = torch.device("cuda")
config = LlamaConfig.from_hf(ORPHEUS_3B)
model = build_model(config, torch.bfloat16, device)
fill_dummy_weights(model, seed=0)
engine = make_engine(model, device, 32, 64 + 256, "auto", True)


def run(prompts, n, tag):
    opts = {"temperature": 0.0, "ignore_eos": True, "max_tokens": n}
    for i, p in enumerate(prompts):
        kw = {"loop": base.LoopSpec(n)} if loops else {}
        engine.submit(base.StepItem(f"{tag}-{i}", "gen", "llm", {"input_ids": p}, opts, **kw))
    got = 0
    while got < len(prompts):
        rs = engine.step()
        got += len(rs)
        for r in rs:
            if not loops and not r.stop:
                engine.submit(base.StepItem(r.request_id, "gen", "llm", {"input_ids": r.outputs["token"]}, opts))
    torch.cuda.synchronize()
    t0, steps = time.perf_counter(), 0
    while engine.has_work():
        rs = engine.step()
        steps += 1
        for r in rs:
            if not loops and not r.stop:
                engine.submit(base.StepItem(r.request_id, "gen", "llm", {"input_ids": r.outputs["token"]}, opts))
    return 1e3 * (time.perf_counter() - t0) / steps


rows = []
for bs in (1, 8, 32):
    prompts = torch.randint(0, config.vocab_size, (bs, 64), generator=torch.Generator().manual_seed(bs))
    run(prompts[:, :8], 4, f"w{bs}")
    ms = [run(prompts, 256, f"b{bs}-{k}") for k in range(3)]
    rows.append({"batch": bs, "wall_ms_per_step": sorted(ms)[1], "runs": [round(m, 4) for m in ms]})
    print(json.dumps(rows[-1]), flush=True)
json.dump({"command": "python3 " + " ".join(sys.argv), "engine_loops": loops, "device": torch.cuda.get_device_name(),
           "rows": rows}, open(sys.argv[2], "w"), indent=1)
