"""Pi0.5's fast paths at tiny size on CPU, float32 (#39 item 4): the whole flow in one call equals the
step-by-step flow; a batch of robots with different prompt lengths gives each what it gets alone; the
flow's capture plan, run eagerly on static buffers of the graph's shapes (the page table at its full
width, padded rows), gives the eager path's actions; the prefix's plans, run on buffers padded to their
prompt bucket and batch size, write the eager prefix's keys and values, and the whole policy replaying
them gives the eager actions; the vision plan's function is the tower; the policy component batches flows
by step count and frees the pages; the attention bias made once and adaRMS's rounding store give what a
boolean mask per call and a cast after the addcmul give, bit for bit."""

from __future__ import annotations

import pytest
import torch

from mstar.engines.base import CapturePlan, StepGraphs, StepItem
from mstar.models.pi05 import components
from mstar.models.pi05.components import (
    PREFIX_GRAPH_SIZES,
    PROMPT_BUCKET,
    PolicyComponent,
    VisionComponent,
    prefix_buckets,
)
from mstar.models.pi05.gemma import AdaRMSNorm, GemmaAttention, attention_bias, rms_normed
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
            x_t = euler_step(x_t, net.velocity(x_t, t, view.layer, view.lengths), CONFIG.num_steps)
        sampled = net.sample(noise, view.layer, view.lengths, CONFIG.num_steps)
        got = torch.stack([out["actions"] for out in policy.run_items(_items("flow", robots))])
    torch.testing.assert_close(sampled, x_t, atol=1e-6, rtol=0)
    torch.testing.assert_close(got, x_t, atol=TOL, rtol=0)
    assert (x_t - noise).abs().mean() > 0.05
    assert policy.pool.free_pages == policy.pool.keys.shape[1] - 1 and not policy.pool.held  # all but the sink


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
    plan = policy.capture_plans()[-1]
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


def test_the_vision_component_maps_uint8_pixels_on_its_device(vision) -> None:
    """uint8 cameras (what the processor sends at the policy's size) give the tokens of the float32 pixels the
    host made before, bit for bit, alone and batched with a robot whose cameras came as float32."""
    component = VisionComponent(vision)
    side = CONFIG.vision.image_size
    pixels = torch.randint(0, 256, (3, 3, side, side), dtype=torch.uint8, generator=torch.Generator().manual_seed(9))
    floats = pixels.float().div_(255.0).mul_(2.0).sub_(1.0)
    other = torch.rand(2, 3, side, side, generator=torch.Generator().manual_seed(10)) * 2 - 1
    with torch.no_grad():
        (alone,) = component.run_items([StepItem("a", "prefix", "vision", {"images": pixels}, {})])
        (before,) = component.run_items([StepItem("a", "prefix", "vision", {"images": floats}, {})])
        mixed = component.run_items([StepItem("a", "prefix", "vision", {"images": pixels}, {}),
                                     StepItem("b", "prefix", "vision", {"images": other}, {})])
        together = component.run_items([StepItem("a", "prefix", "vision", {"images": floats}, {}),
                                        StepItem("b", "prefix", "vision", {"images": other}, {})])
    assert torch.equal(alone["image_tokens"], before["image_tokens"])
    for got, expected in zip(mixed, together, strict=True):
        assert torch.equal(got["image_tokens"], expected["image_tokens"])


class _EagerGraphs:
    """A plan as `cuda_graphs.BatchGraphs` replays it, run eagerly on CPU: the inputs copied into the first
    rows of static buffers of the next captured size, whose other rows hold what an earlier batch left
    there (page tables of page 1, which a robot holds: a stale row written through would show)."""

    def __init__(self, plan: CapturePlan, sizes: tuple[int, ...]) -> None:
        self.fn, self.sizes, self.calls = plan.fn, sorted(plan.sizes or sizes), 0
        gen = torch.Generator().manual_seed(11)
        self.static = {size: [torch.ones(size, *shape, dtype=dtype) if dtype == torch.long
                              else torch.randn(size, *shape, generator=gen).to(dtype) for shape, dtype in plan.example]
                       for size in self.sizes}

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def __call__(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        batch = inputs[0].shape[0]
        static = self.static[next(size for size in self.sizes if size >= batch)]
        for buffer, value in zip(static, inputs, strict=True):
            buffer[:batch] = value
        self.calls += 1
        out = self.fn(*static)
        return tuple(o[:batch] for o in (out if isinstance(out, tuple) else (out,)))


def _graphed(policy: PolicyComponent) -> dict:
    """The policy's plans as `_EagerGraphs`, installed as its graphs (flows at batch sizes 1, 2, 4, 8)."""
    graphs = {plan.key: _EagerGraphs(plan, (1, 2, 4, 8)) for plan in policy.capture_plans()}
    policy.graphs = StepGraphs(graphs)
    return graphs


def test_prefix_buckets_cover_every_prefix_in_whole_pages() -> None:
    buckets = prefix_buckets(CONFIG, PAGE)
    assert buckets == sorted(set(buckets)) and all(b % PAGE == 0 for b in buckets)
    assert buckets[-1] >= CONFIG.max_prefix_tokens and buckets[0] >= TOKENS
    for cameras in range(1, len(CONFIG.cameras) + 1):  # every prefix pads by less than a bucket step and a page
        for prompt in range(1, CONFIG.max_prompt_tokens + 1):
            tokens = cameras * TOKENS + prompt
            assert 0 <= next(b for b in buckets if b >= tokens) - tokens < PROMPT_BUCKET + PAGE


@pytest.mark.parametrize("longest", [False, True], ids=["next_bucket", "longest_bucket"])
def test_the_prefix_plan_on_padded_buffers_writes_the_eager_prefix(net, longest) -> None:
    """The plan's function over prompts padded to a bucket (the next one that holds them, the longest) and a
    batch padded to the next captured size (padded rows: zero prefixes and the sink's pages) writes what the
    eager prefix writes."""
    robots = {rid: _robot(*spec) for rid, spec in ROBOTS.items()}
    rids = list(robots)
    eager, graphed = _policy(net), _policy(net)
    lengths = [len(r["image_tokens"]) + len(r["prompt_ids"]) for r in robots.values()]
    bucket = graphed.buckets[-1] if longest else next(n for n in graphed.buckets if n >= max(lengths))
    assert not longest or bucket > -(-max(lengths) // PAGE) * PAGE  # padding past the eager width
    plans = {plan.key: plan for plan in graphed.capture_plans()}
    plan = plans[("prefix", bucket)]
    assert plan.sizes == PREFIX_GRAPH_SIZES and [shape for shape, _ in plan.example] == [
        (bucket, CONFIG.llm.width), (bucket // PAGE + 1,)]
    with torch.no_grad():
        eager.run_items(_items("prefix", robots))
        for rid, n in zip(rids, lengths, strict=True):
            graphed.pool.allocate(rid, n)
        rows = 4
        prefixes = net.prefix_embeddings([r["image_tokens"] for r in robots.values()],
                                         [r["prompt_ids"] for r in robots.values()], bucket, rows)
        table = graphed.pool.page_table(rids, bucket // PAGE)
        assert plan.fn(prefixes, torch.cat([table, table.new_zeros(rows - len(rids), table.shape[1])])) == ()
    want, got = eager.pool.view(rids), graphed.pool.view(rids)
    assert torch.equal(want.lengths, got.lengths)
    valid = want.valid[None, :, :, None, None]
    torch.testing.assert_close(got.keys * valid, want.keys * valid, atol=TOL, rtol=0)
    torch.testing.assert_close(got.values * valid, want.values * valid, atol=TOL, rtol=0)
    assert want.keys.abs().mean() > 0.1
    assert torch.isfinite(graphed.pool.keys[:, 0]).all()  # the sink took the padding, and no NaN


@pytest.mark.parametrize("step", [32, 128], ids=["prompt_step_32", "prompt_step_128"])
def test_the_policy_replaying_its_plans_gives_the_eager_actions(net, step, monkeypatch) -> None:
    """Robots of different prompt lengths and camera counts, as a batch of 3 and alone: prefixes and flows
    through the plans' functions on padded buffers give the eager actions; a batch of 5 prefixes (more than
    the largest prefix graph) runs eagerly. At a prompt step of 128 the buckets are coarser than pages, so
    prefixes are padded past the eager path's width."""
    monkeypatch.setattr(components, "PROMPT_BUCKET", step)
    batches = [{rid: _robot(*spec) for rid, spec in ROBOTS.items()}, {"b": _robot(*ROBOTS["b"])},
               {f"r{i}": _robot(10 + i, 1 + i % 3, 7 * i + 1) for i in range(5)}]
    for robots in batches:
        eager = _chunks(_policy(net, robots=5), robots)
        policy = _policy(net, robots=5)
        graphs = _graphed(policy)
        replayed = _chunks(policy, robots)
        for got, want in zip(replayed, eager, strict=True):
            torch.testing.assert_close(got, want, atol=TOL, rtol=0)
        called = [key[1] for key, g in graphs.items() if key != "flow" for _ in range(g.calls)]
        assert (len(called), graphs["flow"].calls) == (len(robots) <= max(PREFIX_GRAPH_SIZES), 1)
        longest = max(len(r["image_tokens"]) + len(r["prompt_ids"]) for r in robots.values())
        assert step == 32 or all(n > -(-longest // PAGE) * PAGE for n in called)
        assert not policy.pool.held


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_bias_and_rounding_store_are_the_plain_forms_bit_for_bit(dtype) -> None:
    gen = torch.Generator().manual_seed(12)
    shape = CONFIG.expert
    attn = GemmaAttention(shape).to(dtype)
    q = torch.randn(2, 50, shape.num_heads, shape.head_dim, generator=gen).to(dtype)
    keys, values = (torch.randn(2, 130, 1, shape.head_dim, generator=gen).to(dtype) for _ in range(2))
    valid = torch.arange(130)[None, :] < torch.tensor([[70], [130]])
    bias = attention_bias(valid, dtype)
    assert bias.dtype == dtype and torch.equal(bias == 0, valid) and torch.isneginf(bias[~valid]).all()
    assert bias.stride(0) == 144  # 130 keys, rows 16-element aligned
    with torch.no_grad():  # SDPA takes the boolean mask as well, and converts it on every call
        assert torch.equal(attn.attend(q, keys, values, bias), attn.attend(q, keys, values, valid))
    norm = AdaRMSNorm(shape.width, shape.width, shape.rms_norm_eps).to(dtype)
    x = (torch.randn(2, 50, shape.width, generator=gen) * 3).to(dtype)
    with torch.no_grad():
        modulation = norm.modulation(torch.randn(1, shape.width, generator=gen))
        normed, _ = norm.modulate(x, modulation)
    scale, shift, _ = modulation
    assert normed.dtype == dtype
    assert torch.equal(normed, torch.addcmul(shift, rms_normed(x, shape.rms_norm_eps), scale).to(dtype))
