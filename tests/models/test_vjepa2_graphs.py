"""V-JEPA 2-AC's graphed steps at tiny size on CPU (#40 item 3): the world model's capture plans (the
one-frame step at each frame position of a lane's preallocated cache) run eagerly on padded static
buffers, replayed as the engine replays graphs, give the eager rollout and the eager search; a second
request that finds a lane held runs eagerly on a cache of its own and gets the same answer."""

from __future__ import annotations

from collections.abc import Hashable

import pytest
import torch

from mstar.engines.base import CapturePlan, StepItem
from mstar.models.vjepa2.ac_predictor import ACPredictor
from mstar.models.vjepa2.components import WorldModelComponent
from mstar.models.vjepa2.rollout import rollout
from mstar.models.vjepa2.tiny import tiny_ac_config
from mstar.models.vjepa2.weights import build

HW, E, A = 16, 64, 7


class PaddedEagerGraphs:
    """`StepGraphs.replay` as the engine's graphs behave, without CUDA: each (key, size) has static input
    buffers of `size` rows, padded rows hold garbage, the plan's function runs on the whole buffers and
    the first rows of its outputs come back; replays are counted."""

    def __init__(self, plans: list[CapturePlan]) -> None:
        self.plans = {plan.key: plan for plan in plans}
        self.buffers: dict[tuple[Hashable, int], list[torch.Tensor]] = {}
        self.replays = 0

    def __bool__(self) -> bool:
        return True

    def replay(self, key: Hashable, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
        plan, batch = self.plans.get(key), inputs[0].shape[0]
        if plan is None or batch > max(plan.sizes):
            return None
        size = min(s for s in plan.sizes if s >= batch)
        if (key, size) not in self.buffers:
            self.buffers[key, size] = [100 * torch.randn(size, *shape).to(dtype) for shape, dtype in plan.example]
        static = self.buffers[key, size]
        for buffer, value in zip(static, inputs, strict=True):
            buffer[:batch] = value
        self.replays += 1
        return tuple(out[:batch] for out in plan.fn(*static))


def _predictor() -> ACPredictor:
    return build(lambda: ACPredictor(tiny_ac_config()), torch.float32, "cpu", None, None, seed=5, std=0.3).eval()


@pytest.fixture()
def worlds():
    """(graphed, eager): the same predictor, one with padded-eager graphs on lanes of 8 rollout frames
    and 3 plan frames at 4 or 32 candidates."""
    predictor = _predictor()
    graphed = WorldModelComponent(predictor, rollout_frames=8, plan_samples=(4, 32), plan_frames=3)
    graphed.graphs = PaddedEagerGraphs(graphed.capture_plans())
    return graphed, WorldModelComponent(predictor)


def _request(seed: int, context: int, actions: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"latents": torch.nn.functional.layer_norm(torch.randn(context, HW, E, generator=gen), (E,)),
            "states": torch.rand(context, A, generator=gen), "actions": 0.1 * torch.randn(actions, A, generator=gen),
            "goal_latents": torch.nn.functional.layer_norm(torch.randn(HW, E, generator=gen), (E,))}


def _rollout_steps(world: WorldModelComponent, rid: str, x: dict, horizon: int) -> list[dict]:
    """The rollout walk's steps as the engine's loop feeds them (frame and state looped back)."""
    inputs = {k: x[k] for k in ("latents", "states", "actions")}
    outs = []
    for _ in range(horizon):
        out = world.run_items([StepItem(rid, "rollout", "step", dict(inputs), {"horizon": horizon})])[0]
        inputs.update(frame=out["frame"], state=out["state"])
        outs.append(out)
    return outs


@pytest.mark.parametrize("context", [1, 2])
def test_graphed_rollout_steps_give_the_eager_rollout(worlds, context: int) -> None:
    graphed, eager = worlds
    horizon = 6
    x = _request(1, context, context - 1 + horizon)
    got = _rollout_steps(graphed, "r", x, horizon)
    expected = _rollout_steps(eager, "r", x, horizon)
    with torch.no_grad():
        frames, states = rollout(graphed.predictor, x["latents"][None], x["states"][None], x["actions"][None])
    assert graphed.graphs.replays == horizon - (context > 1)  # a context of several frames goes eagerly
    for step, (g, e) in enumerate(zip(got, expected, strict=True)):
        torch.testing.assert_close(g["frame"], e["frame"], atol=1e-5, rtol=0)
        torch.testing.assert_close(g["frame"], frames[0, step], atol=1e-5, rtol=0)
        torch.testing.assert_close(g["state"], states[0, step], atol=1e-6, rtol=0)
    assert got[-1]["stop"] and not graphed.holders  # the lane is free again
    assert (frames[0, -1] - frames[0, 0]).abs().mean() > 0.1


def test_a_held_lane_sends_the_next_rollout_to_its_own_cache(worlds) -> None:
    graphed, eager = worlds
    x, y = _request(2, 1, 4), _request(3, 1, 4)
    first = graphed.run_items([StepItem("a", "rollout", "step", {k: x[k] for k in ("latents", "states", "actions")},
                                        {"horizon": 4})])[0]
    assert graphed.holders == {"rollout": "a"}
    got = _rollout_steps(graphed, "b", y, 4)  # while "a" holds the lane
    assert graphed.graphs.replays == 1
    expected = _rollout_steps(eager, "b", y, 4)
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g["frame"], e["frame"], atol=1e-5, rtol=0)
    torch.testing.assert_close(first["frame"], _rollout_steps(eager, "a", x, 4)[0]["frame"], atol=1e-5, rtol=0)
    graphed.release("a")
    assert not graphed.holders


def _plan(world: WorldModelComponent, x: dict, context: int, samples: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    options = {"horizon": 2, "samples": samples, "topk": 4, "cem_iterations": 3, "maxnorm": 0.05, "seed": 9,
               "return_sequence": True}
    inputs = {"latents": x["latents"], "states": x["states"], "goal_latents": x["goal_latents"],
              "history": x["actions"][:context - 1]}
    energies = []
    for _ in range(options["cem_iterations"]):
        out = world.run_items([StepItem("p", "plan", "cem", inputs, options)])[0]
        energies.append(out["energy"])
    return out["actions"], energies


@pytest.mark.parametrize("context,samples", [(1, 24), (2, 4)])
def test_graphed_search_gives_the_eager_search(worlds, context: int, samples: int) -> None:
    graphed, eager = worlds
    x = _request(4, context, context)
    got, got_energies = _plan(graphed, x, context, samples)
    expected, expected_energies = _plan(eager, x, context, samples)
    assert graphed.graphs.replays == 3 * 2  # every step of every iteration
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(torch.cat(got_energies), torch.cat(expected_energies), atol=1e-5, rtol=0)
    assert got.shape == (2, A) and got[:, :3].abs().max() > 1e-4 and not graphed.holders


def test_a_search_longer_than_the_plan_lane_runs_eagerly(worlds) -> None:
    graphed, eager = worlds
    x = _request(5, 3, 3)  # 2 history frames + 2 searched: more than the lane's 3 frames
    got, _ = _plan(graphed, x, 3, 24)
    expected, _ = _plan(eager, x, 3, 24)
    assert graphed.graphs.replays == 0
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_lanes_turned_off_capture_nothing_and_bad_sizes_are_refused() -> None:
    from mstar.models.vjepa2.model import VJEPA2ServeConfig

    world = WorldModelComponent(_predictor(), rollout_frames=0, plan_samples=(), plan_frames=2)
    assert world.capture_plans() == [] and world.lanes == {}
    cache, _ = world.steps("rollout", "r", 1, 4)
    assert cache.capacity == 4 and not world.holders
    with pytest.raises(ValueError, match="plan_graph_samples=-1"):
        VJEPA2ServeConfig(plan_graph_samples=-1)


def test_full_size_steps_and_a_search_iteration_read_no_device_values() -> None:
    """On the meta device (shapes, no values) any `.item()`, `.tolist()` or data-dependent shape raises:
    the full-size graphed steps and a whole search iteration run there, so they read nothing back."""
    from mstar.models.vjepa2.config import AC_VITG
    from mstar.models.vjepa2.planning import CEMSearch, CEMSettings

    with torch.device("meta"):
        predictor = ACPredictor(AC_VITG).to(torch.bfloat16)
    world = WorldModelComponent(predictor)
    plans = world.capture_plans()
    assert [p.key for p in plans] == [("rollout", i) for i in range(32)] + [("plan", 0), ("plan", 1)]
    with torch.no_grad():
        for plan in (plans[0], plans[31], plans[-1]):
            inputs = [torch.zeros(max(plan.sizes), *shape, dtype=dtype, device="meta") for shape, dtype in plan.example]
            frame, state = plan.fn(*inputs)
            assert frame.shape == (max(plan.sizes), 256, 1408) and state.shape == (max(plan.sizes), 7)
        latents = torch.zeros(1, 256, 1408, dtype=torch.bfloat16, device="meta")
        states = torch.zeros(1, 7, device="meta")
        cache, steps = world.steps("plan", "p", 400, 2)
        search = CEMSearch(predictor, latents, states, states[:0], latents[0], CEMSettings(), torch.Generator(),
                           cache, steps)
        assert search.iterate().shape == () and search.actions().shape == (2, 7)
