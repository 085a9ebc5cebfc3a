"""The Cosmos3 DiT's step graphs, checked on CPU through the function they capture: `forward_padded` (rows
padded to one prompt length, masked) gives each row what `forward` gives it, whatever lies in the padding
and in padded batch rows; the component's replay path (rows grouped by token count, prompts copied into the
graphs' buffer, chunks of `graph_rows`, the rest eager) gives the eager component's velocities; and a text
to image request through the runtime with the graphs' function standing in for the graphs gives the
latents of diffusers' Cosmos3OmniPipeline after every step. tests/gpu/test_cosmos3_graphs_gpu.py replays
real CUDA graphs."""

from __future__ import annotations

import pytest
import torch

from mstar.engines.base import CapturePlan, StepGraphs, StepItem
from mstar.models.cosmos3.components import TEXT_BUCKETS, GeneratorComponent
from mstar.models.cosmos3.config import Cosmos3TransformerConfig
from mstar.models.cosmos3.guidance import Layout
from mstar.models.cosmos3.positions import GenLayout, gen_positions, rope_tables
from mstar.models.cosmos3.tiny import TINY_TRANSFORMER
from mstar.models.cosmos3.transformer import GenRow
from mstar.models.cosmos3.weights import build_generator

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py

CONFIG = Cosmos3TransformerConfig.from_hf({**TINY_TRANSFORMER, "dtype": "float32"})


class EagerBatchGraphs:
    """What `cuda_graphs.BatchGraphs` does around its graphs, on CPU: inputs copied into static rows of the
    next size (rows past the batch keep whatever they held), the function run on them, the first rows of its
    outputs returned; replays counted."""

    def __init__(self, plan: CapturePlan, sizes: list[int]) -> None:
        self.fn, self.sizes, self.replays = plan.fn, sorted(sizes), 0
        self.static = {size: [torch.randn(size, *shape).to(dtype) for shape, dtype in plan.example]
                       for size in self.sizes}
        for size in self.sizes:  # BatchGraphs' static inputs start as zeros: padded rows of no prompt
            self.static[size][-1].zero_()

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def __call__(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        batch = inputs[0].shape[0]
        static = self.static[next(s for s in self.sizes if s >= batch)]
        for buffer, value in zip(static, inputs, strict=True):
            buffer[:batch].copy_(value)
        out = self.fn(*static)
        assert all(torch.isfinite(o).all() for o in (out if isinstance(out, tuple) else (out,))), \
            "a padded row's NaN would stay in the graph's buffers"
        self.replays += 1
        return tuple(o[:batch] for o in (out if isinstance(out, tuple) else (out,)))


def install_eager_graphs(component: GeneratorComponent, sizes: list[int]) -> dict:
    """The component's capture plans as `EagerBatchGraphs` (its `graphs`), its text buffer full of finite noise."""
    captured = {plan.key: EagerBatchGraphs(plan, list(plan.sizes or sizes)) for plan in component.capture_plans()}
    assert component.text_buffer is not None
    component.text_buffer.normal_()  # stale keys and values of earlier prompts: masked out
    component.graphs = StepGraphs(captured)
    return captured


@pytest.fixture(scope="module")
def generator():
    torch.manual_seed(0)
    g = build_generator(CONFIG, torch.float32).eval()
    for p in g.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return g


def _row(g, prompt_len: int, grid: tuple[int, int, int], seed: int, timestep: int, sound: int = 0,
         action: int = 0) -> GenRow:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 400, (prompt_len,), generator=gen)
    frames, hp, wp = grid
    layout = GenLayout(grid, 24.0, sound, action)
    cos, sin = rope_tables(CONFIG, gen_positions(CONFIG, layout, prompt_len, 4), torch.float32, "cpu")
    noisy = torch.arange(frames) >= (1 if frames > 1 else 0)
    return GenRow(g.text_kv(ids), cos, sin, torch.randn(16, frames, 2 * hp, 2 * wp, generator=gen), noisy, timestep,
                  torch.randn(8, sound, generator=gen) if sound else None,
                  torch.randn(action, 16, generator=gen) if action else None,
                  torch.ones(action, dtype=torch.bool) if action else None, 3)


def _padded(g, rows: list[GenRow], bucket: int, extra_rows: int = 0):
    """`forward_padded` over `rows` (and `extra_rows` rows of noise) with prompts padded to `bucket` by noise."""
    c = g.config
    n = rows[0].num_tokens
    text = torch.randn(len(rows) + extra_rows, 2, c.num_layers, bucket, c.num_kv_heads, c.head_dim)
    for j, row in enumerate(rows):
        text[j, :, :, : row.text.length] = row.text.packed
    noise = torch.randn(extra_rows, n, c.hidden_size)
    x = torch.cat([torch.stack([g.embed_row(row) for row in rows]), noise])
    cos = torch.cat([torch.stack([row.cos for row in rows]), torch.randn(extra_rows, n, c.head_dim)])
    sin = torch.cat([torch.stack([row.sin for row in rows]), torch.randn(extra_rows, n, c.head_dim)])
    # padded rows: one of no prompt (what BatchGraphs' zeroed static lengths give), the others full
    lengths = torch.tensor([row.text.length for row in rows] + [0 if j == 0 else bucket for j in range(extra_rows)])
    hidden = g.forward_padded(x, cos, sin, text, lengths)
    assert torch.isfinite(hidden).all()
    with torch.no_grad():
        return [g.heads(row, hidden[j]) for j, row in enumerate(rows)]


def test_padded_forward_gives_each_row_what_forward_gives():
    """Rows of one token count with prompts of 9, 4 and 20 tokens padded to 24 (noise in the padding and in a
    padded batch row), one of them with sound and action tokens: each row's velocities equal `forward`'s."""
    g = build_generator(CONFIG, torch.float32).eval()
    torch.manual_seed(1)
    for p in g.parameters():
        torch.nn.init.normal_(p, std=0.3)
    image = [_row(g, 9, (1, 3, 5), 1, 700), _row(g, 4, (1, 3, 5), 2, 999), _row(g, 20, (1, 3, 5), 3, 300)]
    mixed = _row(g, 7, (1, 2, 3), 4, 500, sound=5, action=4)  # 6 + 5 + 4 tokens: as many as the images
    assert mixed.num_tokens == image[0].num_tokens == 15
    rows = [*image, mixed]
    want = g(rows)
    got = _padded(g, rows, 24, extra_rows=2)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert b.vision.abs().mean() > 0.1
        torch.testing.assert_close(a.vision, b.vision, atol=1e-5, rtol=0, msg=f"row {i}")
        for part in ("sound", "action"):
            if getattr(b, part) is not None:
                torch.testing.assert_close(getattr(a, part), getattr(b, part), atol=1e-5, rtol=0, msg=f"row {i} {part}")
    assert got[3].sound is not None and got[3].action is not None


def step_item(rid: str, node: str, prompt_len: int, size: tuple[int, int], seed: int, timestep: int,
              device: torch.device | str = "cpu") -> StepItem:
    """A DiT item of a (width, height) image request's branch `node`, with a random prompt and latents."""
    gen = torch.Generator().manual_seed(seed)
    layout = Layout(vision=(16, 1, size[1] // 16, size[0] // 16))
    inputs = {"prompt_ids": torch.randint(0, 400, (prompt_len,), generator=gen),
              "latents": torch.randn(layout.vision, generator=gen), "timestep": torch.tensor([timestep])}
    return StepItem(rid, "denoise", node, {k: v.to(device) for k, v in inputs.items()},
                    {"layout": layout.to_option(), "fps": 24.0})


def mixed_step(device: torch.device | str = "cpu") -> list[StepItem]:
    """Seven rows: five 64x64 images (two requests' cond and uncond with prompts of different lengths, one
    more cond), one 64x64 image whose prompt is longer than the largest bucket and one 64x96 image."""
    long = TEXT_BUCKETS[-1] + 3
    spec = [("a", "cond", 30, (64, 64)), ("a", "uncond", 12, (64, 64)), ("b", "cond", 140, (64, 96)),
            ("c", "cond", 200, (64, 64)), ("c", "uncond", 5, (64, 64)), ("d", "cond", long, (64, 64)),
            ("e", "cond", 9, (64, 64))]
    return [step_item(rid, node, n, size, seed, 900 - 50 * seed, device)
            for seed, (rid, node, n, size) in enumerate(spec)]


def _component(g, graph_tokens=(), graph_rows=4) -> GeneratorComponent:
    return GeneratorComponent(g, 4, graph_tokens, graph_rows)


def test_component_replay_path_gives_the_eager_velocities(generator):
    """`mixed_step`: the 64x64 rows have a graph's token count, the long prompt and the 64x96 image none;
    the graphed component (chunks of at most 4 rows, padded batch rows) gives the eager component's
    velocities, over two steps, and replays twice per step."""
    items = mixed_step()
    eager = _component(generator)
    graphed = _component(generator, graph_tokens=(4,), graph_rows=4)
    captured = install_eager_graphs(graphed, [1, 2, 4])
    assert sorted(captured) == [("step", 4, b) for b in TEXT_BUCKETS]
    for step in range(2):
        want = eager.run_items(items)
        got = graphed.run_items(items)
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            assert a.keys() == b.keys() == {"velocity"}
            torch.testing.assert_close(a["velocity"], b["velocity"], atol=1e-5, rtol=0, msg=f"step {step} item {i}")
        for item in items:
            item.inputs["timestep"] = item.inputs["timestep"] - 100
    # per step: rows a, a, c, c in one chunk (bucket 512, as c's prompt is 200), row e alone (bucket 128)
    assert captured[("step", 4, TEXT_BUCKETS[-1])].replays == 2 and captured[("step", 4, TEXT_BUCKETS[0])].replays == 2


def test_sequence_parallel_drops_the_graphs(generator):
    graphed = _component(generator, graph_tokens=(4,))
    install_eager_graphs(graphed, [1, 2])
    graphed.set_sp_group(object())
    assert not graphed.graphs and graphed.text_buffer is None


def test_graph_tokens_and_buffer_follow_the_config():
    """`graph_sizes` images give the DiT its graphs' token counts (by default 320x192 and 832x480 for
    cosmos3, none for the policy), the engine's largest batch size its buffer's rows, counted by the memory
    plan; a bad size is refused naming it."""
    from mstar.models.cosmos3.model import Cosmos3DroidModel, Cosmos3Model

    model = Cosmos3Model(Cosmos3Model.make_config(tiny=True, graph_sizes=["64x64", "96x64", "64x96"]))
    assert model.graph_tokens == [4, 6, 6]
    model.engine_settings = {"dit": {"cuda_graph_sizes": [1, 8]}}
    built = model.build_component("dit", torch.device("cpu"))
    assert built.module.graph_tokens == (4, 6) and built.module.graph_rows == 8
    c = CONFIG
    rows = 8 * 2 * c.num_layers * TEXT_BUCKETS[-1] * c.num_kv_heads * c.head_dim
    assert built.engine.graph_buffers.nbytes == rows * 4 and built.engine.cuda_graph_sizes == [1, 8]
    none = Cosmos3Model(Cosmos3Model.make_config(tiny=True, graph_sizes=[]))
    assert none.build_component("dit", torch.device("cpu")).engine.graph_buffers is None
    assert Cosmos3Model(Cosmos3Model.make_config(tiny=True)).graph_tokens == [60, 390]  # 320x192, 832x480
    assert Cosmos3DroidModel(Cosmos3DroidModel.make_config(tiny=True)).graph_tokens == []
    with pytest.raises(ValueError, match="65x64"):
        Cosmos3Model.make_config(tiny=True, graph_sizes=["65x64"])
    with pytest.raises(ValueError, match="a list of 'WxH'"):
        Cosmos3Model.make_config(tiny=True, graph_sizes="64x64")


def test_text_to_image_with_graphs_matches_cosmos3_pipeline(tmp_path, monkeypatch):
    """Through the runtime with the DiT's graphs standing in as their function (`EagerBatchGraphs`): a text to
    image request gives diffusers' latents after every step, and its steps were replayed."""
    pytest.importorskip("diffusers")
    from mstar.runtime.offline import MStar
    from tests.models.cosmos3_testing import (
        NEGATIVE,
        PROMPTS,
        SIZE,
        outputs_of,
        reference_pipeline,
        run_reference,
        write_pipeline_dir,
    )

    root = write_pipeline_dir(tmp_path / "pipeline")
    made: list[dict] = []
    original = GeneratorComponent.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        made.append(install_eager_graphs(self, [1, 2, 4]))

    monkeypatch.setattr(GeneratorComponent, "__init__", init)
    config = {"model": "cosmos3", "model_kwargs": {"graph_sizes": [f"{SIZE}x{SIZE}"], "reasoner": False}}
    with MStar("cosmos3", config, tiny=True, model_path=str(root)) as m:
        result = m.submit({"text": PROMPTS[0]}, num_inference_steps=3, seed=11, modalities=["image"],
                          negative_prompt=NEGATIVE, width=SIZE, height=SIZE, debug_outputs=True).result()
    ours = outputs_of(result)
    ref = run_reference(reference_pipeline(root), 3, 11, prompt=PROMPTS[0], negative_prompt=NEGATIVE, num_frames=1,
                        height=SIZE, width=SIZE)
    assert len(ours["steps"]) == len(ref["steps"]) == 3
    for i, (got, want) in enumerate(zip(ours["steps"], ref["steps"], strict=True)):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0, msg=f"latents after step {i}")
    assert sum(g.replays for graphs in made for g in graphs.values()) == 3  # cond and uncond in one replay a step
