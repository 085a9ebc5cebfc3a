"""The Cosmos3 DiT's step graphs on CUDA at tiny size: a step of rows of several requests, prompt lengths and
sizes replayed from real CUDA graphs (`capture_step_graphs`) gives the eager component's velocities
(float32 tightly, bfloat16 within its rounding) and replays the graphs it should; a graphed step makes no
host sync and launches far fewer kernels than the eager one; through the runtime, a text to image request
gives the same latents with `cuda_graphs` on and off."""

from __future__ import annotations

import pytest
import torch

from mstar.engines.base import StepGraphs
from mstar.engines.stateless import capture_step_graphs
from mstar.models.cosmos3.components import TEXT_BUCKETS, GeneratorComponent
from mstar.models.cosmos3.config import Cosmos3TransformerConfig
from mstar.models.cosmos3.tiny import TINY_TRANSFORMER
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

    names = {"cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch"}
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.name in names)


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
    from mstar.runtime.offline import MStar
    from tests.models.cosmos3_testing import NEGATIVE, PROMPTS

    config = {"model": "cosmos3", "device": "cuda", "cuda_graphs": {"enabled": graphs},
              "model_kwargs": {"graph_sizes": ["64x64"], "reasoner": False}}
    with MStar("cosmos3", config=config, tiny=True) as m:
        handles = [m.submit({"text": prompt}, num_inference_steps=4, seed=5 + i, modalities=["image"],
                            negative_prompt=NEGATIVE, width=64, height=64, debug_outputs=True)
                   for i, prompt in enumerate(PROMPTS[:2])]
        return [torch.cat(list(h.result().outputs["step_latents"])) for h in handles]


def test_runtime_latents_are_the_same_with_and_without_graphs() -> None:
    with_graphs, without = _runtime_latents(True), _runtime_latents(False)
    for got, want in zip(with_graphs, without, strict=True):
        assert got.shape[0] == 4
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
