"""Pi0.5's CUDA graphs at tiny size (#39): the SigLIP tower, the Gemma prefix (per prompt-length bucket)
and the whole flow (every Euler step over the paged prefix) replayed from graphs give the eager actions for
batches of 1 and 3 robots with different prompt lengths and camera counts, and the graphs are actually
replayed; the prefix graphs on and off (the flow's graph on) give the same actions; prefix and flow calls
make no host sync, with graphs and without; at the full expert's shapes in bfloat16, the attention bias made
once and adaRMS's rounding store give what a boolean mask per call and a cast after the addcmul give, bit
for bit, the fused adaRMS norm (alone and with the gated residual add before it) gives the PyTorch form's
within a bf16 step, and the flow's attention over the valid keys only gives the masked form's within bf16 rounding,
eagerly and replayed from a graph; uint8 cameras mapped on the GPU give the host's float32 pixels and tokens, bit
for bit; through the runtime, a robot's chunk is the same with `cuda_graphs` on and off."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mstar.engines.base import StepGraphs, StepItem
from mstar.engines.stateless import capture_step_graphs
from mstar.layers.fused import fused_kernels
from mstar.models.pi05 import components as pi05_components
from mstar.models.pi05.components import PolicyComponent, VisionComponent
from mstar.models.pi05.config import PI05_BASE
from mstar.models.pi05.gemma import AdaRMSNorm, GemmaAttention, attention_bias, rms_normed
from mstar.models.pi05.network import PolicyNet
from mstar.models.pi05.prefix_kv import PrefixKVPool
from mstar.models.pi05.processor import unit_pixels
from mstar.models.pi05.siglip import VisionTower
from mstar.models.pi05.tiny import tiny_config
from mstar.models.pi05.weights import build

CONFIG = tiny_config()
CUDA = torch.device("cuda")
SIZES = [1, 2, 4, 8]  # image counts for the tower (3 robots: 6 images), robots for the flow
ROBOTS = {"a": (1, 3, 21), "b": (2, 1, 5), "c": (3, 2, 60)}  # seed, cameras, prompt tokens


class _Counted:
    """A component's graphs whose replays are counted, less those whose key `skip` names."""

    def __init__(self, graphs: StepGraphs, skip=lambda key: False) -> None:
        self.graphs, self.skip, self.replays = graphs, skip, 0

    def __bool__(self) -> bool:
        return bool(self.keys())

    def keys(self):
        return [key for key in self.graphs.keys() if not self.skip(key)]

    def sizes(self, key):
        return self.graphs.sizes(key)

    def replay(self, key, *inputs):
        out = None if self.skip(key) else self.graphs.replay(key, *inputs)
        self.replays += out is not None
        return out


def _is_prefix(key) -> bool:
    return isinstance(key, tuple) and key[0] == "prefix"


@pytest.fixture(scope="module")
def components():
    vision = build(lambda: VisionTower(CONFIG.vision, CONFIG.llm.width), torch.float32, CUDA, None, None, seed=3,
                   std=0.1).eval()
    net = build(lambda: PolicyNet(CONFIG), torch.float32, CUDA, None, None, seed=4, std=0.1).eval()
    llm = CONFIG.llm
    pool = PrefixKVPool(llm.depth, llm.num_kv_heads, llm.head_dim, 4 * -(-CONFIG.max_prefix_tokens // 16), 16,
                        torch.float32, CUDA)
    return VisionComponent(vision), PolicyComponent(net, pool)


def _inputs(seed: int, cameras: int, prompt: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    side = CONFIG.vision.image_size
    return {"images": (torch.rand(cameras, 3, side, side, generator=gen) * 2 - 1).to(CUDA),
            "prompt_ids": torch.randint(0, CONFIG.vocab_size, (prompt,), generator=gen).to(CUDA),
            "noise": torch.randn(CONFIG.chunk_size, CONFIG.max_action_dim, generator=gen).to(CUDA)}


def _chunks(vision: VisionComponent, policy: PolicyComponent, robots: dict[str, dict]) -> torch.Tensor:
    options = {"num_steps": CONFIG.num_steps}
    with torch.no_grad():
        tokens = vision.run_items([StepItem(r, "prefix", "vision", {"images": x["images"]}) for r, x in robots.items()])
        policy.run_items([StepItem(r, "prefix", "prefix", {"image_tokens": t["image_tokens"],
                                                            "prompt_ids": x["prompt_ids"]}, options)
                          for (r, x), t in zip(robots.items(), tokens, strict=True)])
        out = policy.run_items([StepItem(r, "act", "flow", {"noise": x["noise"]}, options) for r, x in robots.items()])
    return torch.stack([o["actions"] for o in out])


@pytest.mark.parametrize("names", [["a"], ["a", "b", "c"]])
def test_graphs_give_the_eager_actions(components, names) -> None:
    vision, policy = components
    robots = {name: _inputs(*ROBOTS[name]) for name in names}
    vision.graphs = policy.graphs = StepGraphs()
    eager = _chunks(vision, policy, robots)
    for component in components:
        capture_step_graphs(component, SIZES, CUDA)
    counted = [_Counted(c.graphs) for c in components]
    vision.graphs, policy.graphs = counted
    try:
        replayed = _chunks(vision, policy, robots)
    finally:
        vision.graphs = policy.graphs = StepGraphs()
    assert [c.replays for c in counted] == [1, 2]  # vision; prefix and flow
    torch.testing.assert_close(replayed, eager, atol=1e-4, rtol=0)
    assert (eager - torch.stack([r["noise"] for r in robots.values()])).abs().mean() > 0.05
    assert not policy.pool.held


@pytest.mark.parametrize("step", [32, 128], ids=["prompt_step_32", "prompt_step_128"])
def test_prefix_graphs_on_and_off_give_the_same_actions(components, step, monkeypatch) -> None:
    """The flow's graph in both runs: only the prefix differs (a bucket-padded graph against the eager
    forward at the longest prefix's pages; at a prompt step of 128 the bucket is longer than that)."""
    monkeypatch.setattr(pi05_components, "PROMPT_BUCKET", step)
    vision, policy = components
    robots = {name: _inputs(*ROBOTS[name]) for name in ROBOTS}
    capture_step_graphs(policy, SIZES, CUDA)
    graphs = policy.graphs
    try:
        policy.graphs = without = _Counted(graphs, skip=_is_prefix)
        off = _chunks(vision, policy, robots)
        policy.graphs = with_prefix = _Counted(graphs)
        on = _chunks(vision, policy, robots)
    finally:
        policy.graphs = StepGraphs()
    assert (without.replays, with_prefix.replays) == (1, 2)
    torch.testing.assert_close(on, off, atol=1e-5, rtol=0)
    assert not policy.pool.held


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_prefix_and_flow_calls_make_no_host_sync(components, graphs) -> None:
    vision, policy = components
    robots = {name: _inputs(*ROBOTS[name]) for name in ROBOTS}
    if graphs:
        capture_step_graphs(policy, SIZES, CUDA)
    options = {"num_steps": CONFIG.num_steps}
    try:
        with torch.no_grad():
            tokens = vision.run_items([StepItem(r, "prefix", "vision", {"images": x["images"]})
                                       for r, x in robots.items()])
            items = [StepItem(r, "prefix", "prefix", {"image_tokens": t["image_tokens"], "prompt_ids": x["prompt_ids"]},
                              options) for (r, x), t in zip(robots.items(), tokens, strict=True)]
            flows = [StepItem(r, "act", "flow", {"noise": x["noise"]}, options) for r, x in robots.items()]
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                policy.run_items(items)
                policy.run_items(flows)
            finally:
                torch.cuda.set_sync_debug_mode("default")
    finally:
        policy.graphs = StepGraphs()
    assert not policy.pool.held


def test_uint8_cameras_map_on_the_gpu_as_on_the_host(components) -> None:
    """Every uint8 value the vision component maps on the GPU is the host formula's float32 value, and the
    tower's tokens from uint8 cameras (graph replayed) are those of the host's float32 pixels."""
    vision, _ = components
    side = CONFIG.vision.image_size
    pixels = torch.randint(0, 256, (3, 3, side, side), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
    pixels.view(-1)[:256] = torch.arange(256, dtype=torch.uint8)
    host = pixels.float().div_(255.0).mul_(2.0).sub_(1.0)
    assert torch.equal(unit_pixels(pixels.to(CUDA), vision.pixel_values).cpu(), host)
    vision.graphs = StepGraphs()
    capture_step_graphs(vision, SIZES, CUDA)
    counted = vision.graphs = _Counted(vision.graphs)
    try:
        (got,) = vision.run_items([StepItem("a", "prefix", "vision", {"images": pixels.to(CUDA)})])
        (expected,) = vision.run_items([StepItem("a", "prefix", "vision", {"images": host.to(CUDA)})])
    finally:
        vision.graphs = StepGraphs()
    assert counted.replays == 2
    assert torch.equal(got["image_tokens"], expected["image_tokens"])


def test_bias_and_rounding_store_are_the_plain_forms_bit_for_bit() -> None:
    """A flow step's shapes: 50 actions x 8 query heads over 976 prefix keys (some padding) and the 50
    actions' own, one KV head of 256 channels."""
    shape, dtype = PI05_BASE.expert, torch.bfloat16
    gen = torch.Generator(device=CUDA).manual_seed(13)
    attn = GemmaAttention(shape).to(CUDA, dtype)
    q = torch.randn(1, 50, shape.num_heads, shape.head_dim, generator=gen, device=CUDA).to(dtype)
    keys, values = (torch.randn(1, 1026, 1, shape.head_dim, generator=gen, device=CUDA).to(dtype) for _ in range(2))
    valid = torch.arange(1026, device=CUDA)[None, :] < 1026
    valid[:, 850:976] = False
    with torch.no_grad():
        assert torch.equal(attn.attend(q, keys, values, attention_bias(valid, dtype)),
                           attn.attend(q, keys, values, valid))
        norm = AdaRMSNorm(shape.width, shape.width, shape.rms_norm_eps).to(CUDA, dtype)
        x = (torch.randn(1, 50, shape.width, generator=gen, device=CUDA) * 3).to(dtype)
        modulation = norm.modulation(torch.randn(1, shape.width, generator=gen, device=CUDA))
        scale, shift, gate = modulation
        with fused_kernels(False):
            plain = norm.modulate(x, modulation)[0]
            assert torch.equal(plain, torch.addcmul(shift, rms_normed(x, shape.rms_norm_eps), scale).to(dtype))
            plain_sum, plain_next = norm.add_modulate(x, plain, gate, modulation)[:2]
        step = 2.0 ** -7  # the fused norm (norm_kernel.py) may round a sum or a product apart: one bf16 step
        torch.testing.assert_close(norm.modulate(x, modulation)[0], plain, atol=step * plain.abs().max().item(),
                                   rtol=step)
        fused_sum, fused_next = norm.add_modulate(x, plain, gate, modulation)[:2]
        torch.testing.assert_close(fused_sum, plain_sum, atol=step * plain_sum.abs().max().item(), rtol=step)
        torch.testing.assert_close(fused_next, plain_next, atol=step * plain_next.abs().max().item(), rtol=step)


@pytest.mark.parametrize("splits", [None, 1, 4])
def test_valid_keys_attention_is_the_masked_form(splits) -> None:
    """A flow step's shapes: 50 actions x 8 query heads over prefixes of 848, 976, 300 and 0 valid keys
    padded to 976, and the actions' own keys, one KV head of 256 channels, bf16; then replayed from a graph
    after the lengths changed in place."""
    from mstar.models.pi05.flow_attention import valid_keys_attention

    shape, dtype = PI05_BASE.expert, torch.bfloat16
    gen = torch.Generator(device=CUDA).manual_seed(14)
    qkv = torch.randn(4, 50, shape.num_heads + 2, shape.head_dim, generator=gen, device=CUDA).to(dtype)
    q, k, v = qkv.split([shape.num_heads, 1, 1], dim=2)
    prefix_k, prefix_v = (torch.randn(4, 976, 1, shape.head_dim, generator=gen, device=CUDA).to(dtype)
                          for _ in range(2))
    table = torch.tensor([[848, 0], [976, 0], [300, 0], [0, 0]], device=CUDA)

    def masked() -> torch.Tensor:
        keys, values = torch.cat([prefix_k, k], 1), torch.cat([prefix_v, v], 1)
        positions = torch.arange(1026, device=CUDA)[None, :]
        valid = (positions < table[:, :1]) | (positions >= 976)
        return _masked_rows(q, keys, values, valid)

    with torch.no_grad():
        got = valid_keys_attention(q, prefix_k, prefix_v, table[:, 0], k, v, splits)
        torch.testing.assert_close(got, masked(), atol=2e-2, rtol=2e-2)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            replayed = valid_keys_attention(q, prefix_k, prefix_v, table[:, 0], k, v, splits)
        table[:, 0] = torch.tensor([10, 500, 976, 1], device=CUDA)
        graph.replay()
        torch.testing.assert_close(replayed, masked(), atol=2e-2, rtol=2e-2)


def _masked_rows(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """SDPA in float32 over all keys [B, Lk, 1, D], masked where `valid` [B, Lk] is False -> [B, Lq, H, D]."""
    heads = q.shape[2]
    keys, values = (x.transpose(1, 2).float().expand(-1, heads, -1, -1) for x in (keys, values))
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2).float(), keys, values, attn_mask=attention_bias(valid, torch.float32)[:, None, None, :])
    return out.transpose(1, 2).to(q.dtype)


def _runtime_chunks(graphs: bool) -> list[np.ndarray]:
    from mstar.runtime.offline import MStar

    config = {"model": "pi05", "device": "cuda", "max_concurrent_requests": 3, "model_kwargs": {"max_robots": 3},
              "cuda_graphs": {"enabled": graphs}}
    rng = np.random.default_rng(0)
    cameras = CONFIG.cameras
    observations = [({"text": task, "media": [{"type": "image", "name": c, "data": rng.integers(0, 256, (48, 48, 3),
                                                                                                   dtype=np.uint8)}
                                               for c in cams]}, rng.uniform(-1, 1, CONFIG.state_dim).tolist())
                    for task, cams in (("pick up the red cube", cameras), ("push", cameras[:1]),
                                       ("open the drawer and fold the towel", cameras[1:]))]
    with MStar("pi05", config=config, tiny=True) as m:
        alone = [m.generate(observations[0][0], state=observations[0][1], seed=1).outputs["actions"][0]]
        handles = [m.submit(req, state=st, seed=1 + i) for i, (req, st) in enumerate(observations)]
        return alone + [h.decoded().outputs["actions"][0] for h in handles]


def test_runtime_chunks_are_the_same_with_and_without_graphs() -> None:
    with_graphs, without = _runtime_chunks(True), _runtime_chunks(False)
    for got, expected in zip(with_graphs, without, strict=True):
        np.testing.assert_allclose(got, expected, atol=1e-4, rtol=0)
    np.testing.assert_allclose(with_graphs[0], with_graphs[1], atol=1e-4, rtol=0)  # batch 1 and batch 3 agree
