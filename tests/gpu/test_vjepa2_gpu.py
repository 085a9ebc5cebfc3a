"""V-JEPA 2-AC's CUDA graphs at tiny size (#40 item 3): rollout steps and search iterations replayed from
the world model's graphs (one per frame position of each lane's preallocated cache, candidates padded up
to a captured count) give the eager results, the graphs are actually replayed, and neither a rollout
step nor a search iteration makes a host sync."""

from __future__ import annotations

import pytest
import torch

from mstar.engines.base import StepGraphs, StepItem
from mstar.engines.stateless import capture_step_graphs
from mstar.models.vjepa2.ac_predictor import ACPredictor
from mstar.models.vjepa2.components import WorldModelComponent
from mstar.models.vjepa2.tiny import tiny_ac_config
from mstar.models.vjepa2.weights import build

CUDA = torch.device("cuda")
HW, E, A = 16, 64, 7


class _Counted:
    """A component's graphs whose replays are counted."""

    def __init__(self, graphs: StepGraphs) -> None:
        self.graphs, self.replays = graphs, 0

    def __bool__(self) -> bool:
        return bool(self.graphs)

    def replay(self, key, *inputs):
        out = self.graphs.replay(key, *inputs)
        self.replays += out is not None
        return out


@pytest.fixture(scope="module")
def worlds():
    """(graphed, eager) world models over one float32 predictor on CUDA."""
    predictor = build(lambda: ACPredictor(tiny_ac_config()), torch.float32, CUDA, None, None, seed=5, std=0.3).eval()
    graphed = WorldModelComponent(predictor, rollout_frames=8, plan_samples=(8, 32), plan_frames=3)
    capture_step_graphs(graphed, [1], CUDA)
    assert sorted(graphed.graphs.keys()) == sorted([("rollout", p) for p in range(8)] + [("plan", p) for p in range(3)])
    assert graphed.graphs.sizes(("plan", 0)) == [8, 32]
    return graphed, WorldModelComponent(predictor)


def _request(seed: int, context: int, actions: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = {"latents": torch.nn.functional.layer_norm(torch.randn(context, HW, E, generator=gen), (E,)),
         "states": torch.rand(context, A, generator=gen), "actions": 0.1 * torch.randn(actions, A, generator=gen),
         "goal_latents": torch.nn.functional.layer_norm(torch.randn(HW, E, generator=gen), (E,))}
    return {k: v.to(CUDA) for k, v in x.items()}


def _rollout(world: WorldModelComponent, rid: str, x: dict, horizon: int, no_sync: bool = False) -> torch.Tensor:
    inputs = {k: x[k] for k in ("latents", "states", "actions")}
    frames = []
    for _ in range(horizon):
        torch.cuda.set_sync_debug_mode("error" if no_sync else "default")
        try:
            out = world.run_items([StepItem(rid, "rollout", "step", dict(inputs), {"horizon": horizon})])[0]
        finally:
            torch.cuda.set_sync_debug_mode("default")
        inputs.update(frame=out["frame"], state=out["state"])
        frames.append(out["frame"])
    return torch.stack(frames)


def _plan(world: WorldModelComponent, x: dict, context: int, samples: int, no_sync: bool = False):
    options = {"horizon": 2, "samples": samples, "topk": 4, "cem_iterations": 3, "maxnorm": 0.05, "seed": 9,
               "return_sequence": True}
    inputs = {"latents": x["latents"], "states": x["states"], "goal_latents": x["goal_latents"],
              "history": x["actions"][:context - 1]}
    energies = []
    for _ in range(options["cem_iterations"]):
        torch.cuda.set_sync_debug_mode("error" if no_sync else "default")
        try:
            out = world.run_items([StepItem("p", "plan", "cem", inputs, options)])[0]
        finally:
            torch.cuda.set_sync_debug_mode("default")
        energies.append(out["energy"])
    return out["actions"], torch.cat(energies)


@pytest.mark.parametrize("context", [1, 2])
def test_graphed_rollout_gives_the_eager_one_without_host_syncs(worlds, context: int) -> None:
    graphed, eager = worlds
    horizon = 7
    x = _request(1, context, context - 1 + horizon)
    counted = graphed.graphs = _Counted(graphed.graphs)
    try:
        got = _rollout(graphed, "r", x, horizon, no_sync=True)
    finally:
        graphed.graphs = counted.graphs
    expected = _rollout(eager, "r", x, horizon)
    assert counted.replays == horizon - (context > 1)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
    assert (expected[-1] - expected[0]).abs().mean() > 0.1 and not graphed.holders


@pytest.mark.parametrize("context,samples", [(1, 24), (2, 8)])
def test_graphed_search_gives_the_eager_one_without_host_syncs(worlds, context: int, samples: int) -> None:
    graphed, eager = worlds
    x = _request(4, context, context)
    counted = graphed.graphs = _Counted(graphed.graphs)
    try:
        got, got_energies = _plan(graphed, x, context, samples, no_sync=True)
    finally:
        graphed.graphs = counted.graphs
    expected, expected_energies = _plan(eager, x, context, samples)
    assert counted.replays == 3 * 2
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(got_energies, expected_energies, atol=1e-4, rtol=0)
    assert got[:, :3].abs().max() > 1e-4 and not graphed.holders
