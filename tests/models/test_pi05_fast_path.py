"""Pi0.5's fast paths at tiny size on CPU, float32 (#39 item 4): the whole flow in one call equals the
step-by-step flow; a batch of robots with different prompt lengths gives each what it gets alone; the
flow's capture plan, run eagerly on static buffers of the graph's shapes (the page table at its full
width, padded rows), gives the eager path's actions; the vision plan's function is the tower; the policy
component batches flows by step count and frees the pages."""

from __future__ import annotations

import pytest
import torch

from mstar.engines.base import StepItem
from mstar.models.pi05.components import PolicyComponent, VisionComponent
from mstar.models.pi05.network import PolicyNet, euler_step, flow_time
from mstar.models.pi05.prefix_kv import PrefixKVPool
from mstar.models.pi05.siglip import VisionTower
from mstar.models.pi05.tiny import tiny_config
from mstar.models.pi05.weights import build

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py
CONFIG = tiny_config()
TOKENS = CONFIG.vision.tokens
PAGE = 16
TOL = 1e-5


@pytest.fixture(scope="module")
def vision() -> VisionTower:
    return build(lambda: VisionTower(CONFIG.vision, CONFIG.llm.width), torch.float32, "cpu", None, None, seed=3,
                 std=0.3).eval()


@pytest.fixture(scope="module")
def net() -> PolicyNet:
    # std 0.1: a flow that moves the noise but does not grow float32 rounding (at 0.3 a 1e-6 change of the
    # noise moves the actions by 5e-4, which no comparison of two summation orders could tell from a bug)
    return build(lambda: PolicyNet(CONFIG), torch.float32, "cpu", None, None, seed=4, std=0.1).eval()


def _policy(net: PolicyNet, robots: int = 4) -> PolicyComponent:
    pages = robots * -(-CONFIG.max_prefix_tokens // PAGE)
    llm = CONFIG.llm
    return PolicyComponent(net, PrefixKVPool(llm.depth, llm.num_kv_heads, llm.head_dim, pages, PAGE, torch.float32,
                                             "cpu"))


def _robot(seed: int, cameras: int, prompt: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"image_tokens": torch.randn(cameras * TOKENS, CONFIG.llm.width, generator=gen),
            "prompt_ids": torch.randint(0, CONFIG.vocab_size, (prompt,), generator=gen),
            "noise": torch.randn(CONFIG.chunk_size, CONFIG.max_action_dim, generator=gen)}


def _items(node: str, robots: dict[str, dict], steps: int = CONFIG.num_steps) -> list[StepItem]:
    walk = "prefix" if node == "prefix" else "act"
    return [StepItem(rid, walk, node, inputs, {"num_steps": steps}) for rid, inputs in robots.items()]


def _chunks(policy: PolicyComponent, robots: dict[str, dict], steps: int = CONFIG.num_steps) -> list[torch.Tensor]:
    """Prefixes written, then every robot's whole flow in one call: its actions."""
    with torch.no_grad():
        lengths = policy.run_items(_items("prefix", robots))
        assert [int(out["prefix_len"]) for out in lengths] == [len(r["image_tokens"]) + len(r["prompt_ids"])
                                                              for r in robots.values()]
        return [out["actions"] for out in policy.run_items(_items("flow", robots, steps))]


ROBOTS = {"a": (1, 3, 21), "b": (2, 1, 5), "c": (3, 2, 60)}  # seed, cameras, prompt tokens


def test_one_call_equals_the_step_by_step_flow(net) -> None:
    """`PolicyNet.sample` and the component's flow node give what ten `velocity` + `euler_step` calls give."""
    policy = _policy(net)
    robots = {rid: _robot(*spec) for rid, spec in ROBOTS.items()}
    with torch.no_grad():
        policy.run_items(_items("prefix", robots))
        view = policy.pool.view(list(robots))
        noise = torch.stack([r["noise"] for r in robots.values()])
        x_t = noise
        for step in range(CONFIG.num_steps):
            t = torch.full((len(robots),), flow_time(step, CONFIG.num_steps))
            x_t = euler_step(x_t, net.velocity(x_t, t, view.layer, view.valid, view.lengths), CONFIG.num_steps)
        sampled = net.sample(noise, view.layer, view.valid, view.lengths, CONFIG.num_steps)
        got = torch.stack([out["actions"] for out in policy.run_items(_items("flow", robots))])
    torch.testing.assert_close(sampled, x_t, atol=1e-6, rtol=0)
    torch.testing.assert_close(got, x_t, atol=TOL, rtol=0)
    assert (x_t - noise).abs().mean() > 0.05
    assert policy.pool.free_pages == policy.pool.keys.shape[1] and not policy.pool.held  # every page back


def test_a_batch_of_robots_gets_what_each_gets_alone(net) -> None:
    together = _chunks(_policy(net), {rid: _robot(*spec) for rid, spec in ROBOTS.items()})
    for (rid, spec), got in zip(ROBOTS.items(), together, strict=True):
        alone = _chunks(_policy(net), {rid: _robot(*spec)})[0]
        torch.testing.assert_close(got, alone, atol=TOL, rtol=0)
    assert not torch.allclose(together[0], together[1], atol=1e-3)


def test_the_flow_plan_run_on_static_buffers_equals_the_eager_flow(net) -> None:
    """The plan's function as its graph would run it: inputs copied into the first rows of buffers of the
    next captured size (stale rows below), the page table at the width of the longest possible prefix."""
    policy = _policy(net)
    robots = {rid: _robot(*spec) for rid, spec in ROBOTS.items()}
    (plan,) = policy.capture_plans()
    assert plan.key == "flow" and [shape for shape, _ in plan.example] == [
        (CONFIG.chunk_size, CONFIG.max_action_dim), (policy.table_width + 1,)]
    size = 4  # the captured size 3 rows run in
    static = [torch.randn(size, *shape).to(dtype) for shape, dtype in plan.example]
    static[1].zero_()
    static[1][-1, 0], static[1][-1, -1] = 1, 7  # a stale padded row: pages of nobody, harmless
    with torch.no_grad():
        policy.run_items(_items("prefix", robots))
        static[0][:3] = torch.stack([r["noise"] for r in robots.values()])
        static[1][:3] = policy.pool.page_table(list(robots), policy.table_width)
        replayed = plan.fn(*static)[:3]
        eager = torch.stack([out["actions"] for out in policy.run_items(_items("flow", robots))])
    torch.testing.assert_close(replayed, eager, atol=TOL, rtol=0)


def test_flows_batch_by_step_count(net) -> None:
    """Another step count runs its own batch (eagerly: the graph holds the config's count) and differs."""
    policy = _policy(net)
    item = _items("flow", {"a": _robot(1, 3, 21)}, steps=4)[0]
    assert policy.batch_key(item) != policy.batch_key(_items("flow", {"a": _robot(1, 3, 21)})[0])
    four = _chunks(policy, {"a": _robot(1, 3, 21)}, steps=4)[0]
    ten = _chunks(policy, {"a": _robot(1, 3, 21)})[0]
    assert not torch.allclose(four, ten, atol=1e-3)


def test_the_vision_plan_is_the_tower(vision) -> None:
    component = VisionComponent(vision)
    (plan,) = component.capture_plans()
    side = CONFIG.vision.image_size
    assert plan.example == (((3, side, side), torch.float32),)
    images = torch.rand(5, 3, side, side, generator=torch.Generator().manual_seed(8)) * 2 - 1
    items = [StepItem("a", "prefix", "vision", {"images": images[:3]}, {}),
             StepItem("b", "prefix", "vision", {"images": images[3:]}, {})]
    with torch.no_grad():
        got = component.run_items(items)
        direct = plan.fn(torch.cat([images, torch.zeros(3, 3, side, side)]))[:5]  # padded to a size of 8
    torch.testing.assert_close(torch.cat([got[0]["image_tokens"], got[1]["image_tokens"]]),
                               direct.flatten(0, 1), atol=TOL, rtol=0)
