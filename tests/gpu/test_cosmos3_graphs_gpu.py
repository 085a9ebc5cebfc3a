"""The Cosmos3 DiT's step graphs on CUDA at tiny size: a step of rows of several requests, prompt lengths and
sizes replayed from real CUDA graphs (`capture_step_graphs`) gives the eager component's velocities
(float32 tightly, bfloat16 within its rounding) and replays the graphs it should; a graphed step makes no
host sync and launches far fewer kernels than the eager one; through the runtime, a text to image request
gives the same latents with `cuda_graphs` on and off, and replays graphs with them on. At Cosmos3-Nano's
shapes: the masked attention the graphs hold, replayed from a graph, equals the float64 attention over each
row's kept keys (padded rows of no prompt, garbage in the masked slots), under the default SDPA choice and
each backend that takes the mask; and the default twelve graphs' private pool fits the memory plan's
allowance."""

from __future__ import annotations

import contextlib
import dataclasses
import time

import pytest
import torch

from mstar.engines.base import StepGraphs
from mstar.engines.cuda_graphs import BatchGraphs
from mstar.engines.stateless import capture_step_graphs
from mstar.models.cosmos3.components import TEXT_BUCKETS, GeneratorComponent
from mstar.models.cosmos3.config import NANO, Cosmos3TransformerConfig
from mstar.models.cosmos3.tiny import TINY_TRANSFORMER
from mstar.models.cosmos3.transformer import _attend_masked
from mstar.models.cosmos3.weights import build_generator
from tests.models.test_cosmos3_step_graphs import mixed_step

CUDA = torch.device("cuda")
SIZES = [1, 2, 4]


class _Counted:
    """A component's graphs whose replays are counted by key."""

    def __init__(self, graphs: StepGraphs) -> None:
        self.graphs, self.replays = graphs, {}

    def __bool__(self) -> bool:
        return bool(self.graphs)

    def keys(self):
        return self.graphs.keys()

    def sizes(self, key):
        return self.graphs.sizes(key)

    def replay(self, key, *inputs):
        out = self.graphs.replay(key, *inputs)
        self.replays[key] = self.replays.get(key, 0) + (out is not None)
        return out


def _generator(dtype: torch.dtype, layers: int = TINY_TRANSFORMER["num_hidden_layers"]):
    config = Cosmos3TransformerConfig.from_hf({**TINY_TRANSFORMER, "num_hidden_layers": layers, "dtype": "float32"})
    torch.manual_seed(0)
    g = build_generator(config, torch.float32)
    for p in g.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return g.to(CUDA, dtype).eval()


def _velocities(component: GeneratorComponent, items) -> list[torch.Tensor]:
    with torch.no_grad():
        return [out["velocity"] for out in component.run_items(items)]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 0.1)], ids=["float32", "bfloat16"])
def test_replayed_steps_give_the_eager_velocities(dtype, tol) -> None:
    g = _generator(dtype)
    eager = GeneratorComponent(g, 4)
    graphed = GeneratorComponent(g, 4, graph_tokens=(4,), graph_rows=max(SIZES))
    capture_step_graphs(graphed, SIZES, CUDA)
    assert sorted(graphed.graphs.keys()) == [("step", 4, b) for b in TEXT_BUCKETS]
    counted = graphed.graphs = _Counted(graphed.graphs)
    items = mixed_step(CUDA)
    for step in range(3):
        want, got = _velocities(eager, items), _velocities(graphed, items)
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            assert b.abs().mean() > 0.05
            torch.testing.assert_close(a, b, atol=tol * b.abs().max().item(), rtol=0, msg=f"step {step} item {i}")
        for item in items:
            item.inputs["timestep"] = item.inputs["timestep"] - 100
    # per step: one chunk of four rows at the longest bucket, one row at the shortest
    assert counted.replays == {("step", 4, TEXT_BUCKETS[-1]): 3, ("step", 4, TEXT_BUCKETS[0]): 3}


def _launches(fn) -> int:
    """Kernel and graph launches `fn` makes from the host (CUDA runtime and driver calls the profiler sees)."""
    from torch.profiler import ProfilerActivity, profile

    # by prefix: the runtime's and driver's names carry variants (ExC, Ex) and, in some CUPTI versions, a suffix
    prefixes = ("cudaLaunchKernel", "cuLaunchKernel", "cudaGraphLaunch")
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.name.startswith(prefixes))


def test_a_graphed_step_makes_no_host_sync_and_few_launches() -> None:
    """Two rows (a request's cond and uncond) of a graphed size through 12 layers: no host sync, and at
    least 8 launches a layer fewer than the eager step (the embedding and heads stay eager)."""
    g = _generator(torch.bfloat16, layers=12)
    eager = GeneratorComponent(g, 4)
    graphed = GeneratorComponent(g, 4, graph_tokens=(4,), graph_rows=max(SIZES))
    capture_step_graphs(graphed, SIZES, CUDA)
    items = mixed_step(CUDA)[:2]
    for component in (eager, graphed):  # the prompts through the understanding tower, once
        _velocities(component, items)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _velocities(graphed, items)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    layers = g.config.num_layers
    eager_launches, graphed_launches = _launches(lambda: _velocities(eager, items)), _launches(
        lambda: _velocities(graphed, items))
    assert eager_launches > 10 * layers, eager_launches
    assert graphed_launches < eager_launches - 8 * layers, (graphed_launches, eager_launches)


def _runtime_latents(graphs: bool) -> list[torch.Tensor]:
    """Two 64x64 text to image requests' latents after each of 4 steps."""
    from mstar.runtime.offline import MStar
    from tests.models.cosmos3_testing import NEGATIVE, PROMPTS

    config = {"model": "cosmos3", "device": "cuda", "cuda_graphs": {"enabled": graphs},
              "model_kwargs": {"graph_sizes": ["64x64"], "reasoner": False}}
    with MStar("cosmos3", config=config, tiny=True) as m:
        handles = [m.submit({"text": prompt}, num_inference_steps=4, seed=5 + i, modalities=["image"],
                            negative_prompt=NEGATIVE, width=64, height=64, debug_outputs=True)
                   for i, prompt in enumerate(PROMPTS[:2])]
        return [torch.cat(list(h.result().outputs["step_latents"])) for h in handles]


def test_runtime_latents_are_the_same_with_and_without_graphs(monkeypatch) -> None:
    """Equal latents prove nothing unless the graphed run replayed: each of at least one request's 4 steps
    ran its rows (cond and uncond) from a graph of the 64x64 token count, and the eager run replayed none."""
    replayed: list = []
    original = StepGraphs.replay

    def replay(self, key, *inputs):
        out = original(self, key, *inputs)
        if out is not None and isinstance(key, tuple) and key[0] == "step":
            replayed.append(key)
        return out

    monkeypatch.setattr(StepGraphs, "replay", replay)
    with_graphs = _runtime_latents(True)
    assert len(replayed) >= 4 and {key[1] for key in replayed} == {4}, replayed
    replayed.clear()
    without = _runtime_latents(False)
    assert replayed == []
    for got, want in zip(with_graphs, without, strict=True):
        assert got.shape[0] == 4
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


NANO_HEADS = (NANO.num_heads, NANO.num_kv_heads, NANO.head_dim)
BACKENDS = {"default": None, "efficient": "EFFICIENT_ATTENTION", "cudnn": "CUDNN_ATTENTION", "math": "MATH"}


def _reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """float64 attention of q [N, Hq, d] over the keys of k, v [M, Hk, d] that `keep` [M] keeps (grouped heads)."""
    k, v = k[keep].double(), v[keep].double()
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    scores = torch.einsum("nhd,mhd->hnm", q.double(), k) / q.shape[-1] ** 0.5
    return torch.einsum("hnm,mhd->nhd", scores.softmax(-1), v)


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("tokens,bucket", [(60, TEXT_BUCKETS[0]), (390, TEXT_BUCKETS[-1])], ids=["320x192", "832x480"])
def test_masked_attention_at_nano_shapes_replays_exactly(backend, tokens, bucket) -> None:
    """`_attend_masked` as the step graphs hold it, at Nano's heads in bfloat16 over four rows whose prompts are
    0 (a padded batch row: only its own tokens are kept), 7, half the bucket and the whole bucket long, the
    masked prompt slots full of large finite garbage: captured (`BatchGraphs`, as the engine captures) and
    replayed with new inputs, every row is finite and equals the float64 attention over its kept keys. Run
    under the default SDPA choice (what serving gets) and each backend that takes a mask of these shapes."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    hq, hk, d = NANO_HEADS
    rows, keys = 4, bucket + tokens
    gen = torch.Generator(device=CUDA).manual_seed(tokens)

    def draw(*shape):
        return torch.randn(rows, *shape, device=CUDA, generator=gen).to(torch.bfloat16)

    q, k, v = draw(tokens, hq, d), draw(keys, hk, d), draw(keys, hk, d)
    lengths = torch.tensor([0, 7, bucket // 2, bucket], device=CUDA)
    keep = torch.cat([torch.arange(bucket, device=CUDA)[None] < lengths[:, None],
                      torch.ones(rows, tokens, dtype=torch.bool, device=CUDA)], dim=1)
    masked = ~keep[:, :, None, None]
    k, v = torch.where(masked, 1000 * k, k), torch.where(masked, 1000 * v, v)
    example = [((tokens, hq, d), torch.bfloat16), ((keys, hk, d), torch.bfloat16), ((keys, hk, d), torch.bfloat16),
               ((1, 1, keys), torch.bool)]
    choice = BACKENDS[backend]
    with contextlib.nullcontext() if choice is None else sdpa_kernel([getattr(SDPBackend, choice)]):
        try:  # a backend that refuses the mask raises in the warm-up, before the capture
            graphs = BatchGraphs(_attend_masked, [rows], example, CUDA)
        except RuntimeError as exc:
            if choice is None:
                raise
            pytest.skip(f"{choice} does not take this mask: {exc}")
    out = graphs(q, k, v, keep[:, None, None])[0].clone()
    for r in range(rows):
        assert torch.isfinite(out[r]).all(), f"row {r} (prompt {lengths[r].item()})"
        want = _reference_attention(q[r], k[r], v[r], keep[r])
        torch.testing.assert_close(out[r].double(), want, atol=2e-2, rtol=0, msg=f"row {r} ({backend})")


def test_default_graphs_at_nano_width_fit_the_allowance() -> None:
    """The default step graphs (320x192 and 832x480 rows, both prompt buckets, 1, 2 and 4 rows: twelve) of a
    generator of Nano's widths, captured as the engine does: their private pool stays under the memory
    plan's activation allowance for a stateless component, which is all that counts it (the prompt buffer is
    counted on its own). Two layers: the pool holds one layer's activations at a time, not one per layer.
    The capture time is in the failure message, to scale by 18 for Nano's 36 layers."""
    from mstar.runtime.memory_plan import STATELESS_ALLOWANCE_BYTES

    g = build_generator(dataclasses.replace(NANO, num_layers=2, vocab_size=1024), torch.bfloat16, CUDA)
    with torch.no_grad():
        for p in g.parameters():
            p.normal_(std=0.02)
    component = GeneratorComponent(g, 4, graph_tokens=(60, 390), graph_rows=max(SIZES))
    torch.cuda.synchronize()
    started = time.perf_counter()
    capture_step_graphs(component, SIZES, CUDA)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    torch.cuda.empty_cache()  # pools of graphs already gone (the linears' kernel timing) leave the snapshot
    pool = sum(s["total_size"] for s in torch.cuda.memory_snapshot() if tuple(s["segment_pool_id"]) != (0, 0))
    print(f"twelve Cosmos3 step graphs at Nano width, 2 layers: pool {pool / 2**30:.3f} GiB, capture {seconds:.1f} s")
    assert sorted(component.graphs.keys()) == sorted(("step", t, b) for t in (60, 390) for b in TEXT_BUCKETS)
    assert 0 < pool < STATELESS_ALLOWANCE_BYTES, f"graph pool {pool / 2**30:.2f} GiB, capture {seconds:.1f} s"
