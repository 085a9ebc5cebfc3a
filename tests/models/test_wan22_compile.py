"""Opt-in torch.compile of the Wan DiT blocks (CPU inductor, float32): compiled forwards equal eager ones.

One compiled tiny DiT (module fixture) goes through text-to-video, a conditioned first frame and batches
whose row count changes, in that order, so the later tests also exercise recompiles of a warm cache.
"""

from __future__ import annotations

import copy

import pytest
import torch

from mstar.models.wan22 import denoise
from mstar.models.wan22.compile import compile_blocks
from mstar.models.wan22.config import WanTransformerConfig
from mstar.models.wan22.tiny import TINY_TEXT_LENGTH, TINY_TRANSFORMER
from mstar.models.wan22.transformer import WanTransformer, sdpa_attention

TOL = 1e-5


def _tiny_dit() -> WanTransformer:
    config = WanTransformerConfig.from_hf({**TINY_TRANSFORMER, "torch_dtype": "float32"})
    model = WanTransformer(config).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # non-trivial everywhere (the modulation tables start at zero)
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            param.copy_(1 + 0.2 * noise if "norm" in name and param.ndim == 1 else 0.3 * noise)
    return model


@pytest.fixture(scope="module")
def models() -> tuple[WanTransformer, WanTransformer]:
    """(eager, compiled) with the same weights; compile counters start from zero."""
    eager = _tiny_dit()
    compiled = copy.deepcopy(eager)
    assert compile_blocks(compiled) == len(compiled.blocks) == 2
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    return eager, compiled


def _inputs(batch: int, frames: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    latents = torch.randn(batch, 16, frames, 4, 6, generator=gen)
    return latents, torch.randn(batch, TINY_TEXT_LENGTH, 32, generator=gen)


def _compare(models, latents: torch.Tensor, timestep: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
    eager, compiled = models
    with torch.no_grad():
        expected, got = eager(latents, timestep, text), compiled(latents, timestep, text)
    torch.testing.assert_close(got, expected, atol=TOL, rtol=0)
    assert expected.abs().mean() > 0.1  # the comparison is not between near-zero tensors
    return got


def _unique_graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def test_text_to_video_matches_eager_and_blocks_share_one_compile(models) -> None:
    latents, text = _inputs(2, 3, 0)
    _compare(models, latents, torch.tensor([999.0, 412.0]), text)
    # pre_attention and post_attention compiled once, shared by both blocks
    assert _unique_graphs() == 2


def test_conditioned_first_frame_matches_eager(models) -> None:
    latents, text = _inputs(2, 3, 1)
    latents = denoise.blend_first_frame(latents, _inputs(2, 1, 2)[0])
    frame_ts = torch.stack([denoise.frame_timesteps(t, 3, first_frame_conditioned=True) for t in (950, 300)])
    got = _compare(models, latents, frame_ts, text)
    with torch.no_grad():  # the zero timestep of frame 0 reaches the compiled modulation
        unconditioned = models[1](latents, torch.tensor([950.0, 300.0]), text)
    assert (unconditioned - got).abs().max() > 1e-2


def test_changing_row_counts_match_eager_with_bounded_recompiles(models) -> None:
    before = _unique_graphs()
    for batch in (3, 4, 1, 5, 2):
        latents, text = _inputs(batch, 3, 10 + batch)
        _compare(models, latents, torch.linspace(900, 100, batch), text)
    # dynamic batch after the first change, batch 1 specialised once: not one compile per row count
    assert _unique_graphs() - before <= 4
    assert not torch._dynamo.utils.counters["stats"].get("recompile_limit_hit")


def test_attend_stays_eager_between_compiled_halves(models) -> None:
    """A Python-side attend (as Ulysses' collectives are) runs once per block, untraced."""
    eager, compiled = models
    calls: list[tuple[int, ...]] = []

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        calls.append(tuple(q.shape))
        return sdpa_attention(q, k, v)

    gen = torch.Generator().manual_seed(4)
    x, text = torch.randn(2, 18, 24, generator=gen), torch.randn(2, TINY_TEXT_LENGTH, 24, generator=gen)
    t_mod = torch.randn(2, 1, 6, 24, generator=gen)
    rope = compiled._rope((3, 2, 3), x.device)
    with torch.no_grad():
        got = compiled.blocks[0](x, text, t_mod, rope, attend)
        expected = eager.blocks[0](x, text, t_mod, rope, attend)
    torch.testing.assert_close(got, expected, atol=TOL, rtol=0)
    assert calls == [(2, 18, 2, 12)] * 2


def test_serve_option_compiles_the_dit_and_rejects_non_booleans() -> None:
    from mstar.models.wan22.model import Wan22Model

    assert Wan22Model.make_config(tiny=True).compile is False
    model = Wan22Model(Wan22Model.make_config(tiny=True, compile=True))
    dit = model.build_component("dit", torch.device("cpu")).module.transformer
    assert all(getattr(block, "_mstar_compiled", False) for block in dit.blocks)
    with pytest.raises(RuntimeError, match="already applied"):
        compile_blocks(dit)
    with pytest.raises(ValueError, match="compile='false'"):
        Wan22Model.make_config(tiny=True, compile="false")
