"""Ulysses sequence parallelism on CPU: 2 spawned ranks over gloo against one process, float32.

One spawn (module fixture) runs every check on both ranks; each test asserts on its part.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.models.sp_testing import run_ranks

TOL = 1e-5


def _full_attention(q, k, v):
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)


def _attention_checks(group) -> dict:
    from mstar.distributed.sequence import SequenceShard
    from mstar.distributed.ulysses import ulysses_attention

    out = {}
    gen = torch.Generator().manual_seed(0)
    for length in (8, 7):  # even, and padded (7 tokens over 2 ranks)
        q, k, v = (torch.randn(2, length, 4, 6, generator=gen) for _ in range(3))
        shard = SequenceShard(group, length)
        local = shard.attention(shard.split(q), shard.split(k), shard.split(v))
        out[f"attention_{length}"] = (shard.gather(local) - _full_attention(q, k, v)).abs().max().item()
    q, k, v = (torch.randn(1, 8, 4, 6, generator=gen) for _ in range(3))  # the same on both ranks
    mine = slice(4 * torch.distributed.get_rank(group), 4 * torch.distributed.get_rank(group) + 4)
    direct = ulysses_attention(q[:, mine], k[:, mine], v[:, mine], group)  # the raw call on shards
    out["attention_direct"] = (direct - _full_attention(q, k, v)[:, mine]).abs().max().item()
    odd = torch.randn(1, 4, 3, 6)
    try:
        ulysses_attention(odd, odd, odd, group)
    except ValueError as exc:
        out["heads_error"] = str(exc)
    return out


def _tiny_dit(heads: int = 2):
    from mstar.models.wan22.config import WanTransformerConfig
    from mstar.models.wan22.tiny import TINY_TRANSFORMER
    from mstar.models.wan22.transformer import WanTransformer

    config = WanTransformerConfig.from_hf({**TINY_TRANSFORMER, "num_attention_heads": heads, "torch_dtype": "float32"})
    torch.manual_seed(0)
    model = WanTransformer(config).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # non-trivial everywhere (the modulation tables start at zero)
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            param.copy_(1 + 0.2 * noise if "norm" in name and param.ndim == 1 else 0.3 * noise)
    return model


DIT_CASES = {  # name -> (latent F, H, W, timestep kind)
    "t2v_per_request": ((3, 4, 4), "request"),
    "t2v_per_frame": ((3, 4, 4), "frame"),  # 12 tokens, 4 per frame: shards cut a frame (per-token mod)
    "i2v_first_frame": ((3, 4, 4), "i2v"),
    "i2v_aligned": ((2, 4, 4), "i2v"),  # 8 tokens: each rank holds whole frames (sliced mod)
    "per_token_padded": ((3, 2, 2), "token"),  # 3 tokens over 2 ranks: padding and a key mask
}


def _timestep(kind: str, batch: int, grid: tuple[int, int, int]) -> torch.Tensor:
    gen = torch.Generator().manual_seed(2)
    t = torch.rand(batch, generator=gen) * 1000
    if kind == "request":
        return t
    frames = t[:, None].expand(batch, grid[0]).clone()
    if kind == "i2v":
        frames[:, 0] = 0.0  # the conditioning first frame is clean
    if kind == "token":
        return (frames + torch.arange(grid[0])).repeat_interleave(grid[1] * grid[2], dim=1)
    return frames


def _dit_checks(group) -> dict:
    out = {}
    model = _tiny_dit()
    gen = torch.Generator().manual_seed(3)
    text = torch.randn(2, 16, 32, generator=gen)
    with torch.no_grad():
        for name, ((f, h, w), kind) in DIT_CASES.items():
            latents = torch.randn(2, 16, f, h, w, generator=gen)
            timestep = _timestep(kind, 2, (f, h // 2, w // 2))
            single = model(latents, timestep, text)
            parallel = model(latents, timestep, text, sp_group=group)
            out[name] = ((parallel - single).abs().max().item(), single.abs().max().item())
        try:
            _tiny_dit(heads=3)(latents, timestep, text, sp_group=group)
        except ValueError as exc:
            out["dit_heads_error"] = str(exc)
    return out


def _all_checks(replica, device) -> dict:
    assert replica.size == 2 and replica.index == replica.rank
    return {**_attention_checks(replica.group), **_dit_checks(replica.group), "index": replica.index}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    return run_ranks(_all_checks, 2, "cpu", tmp_path_factory.mktemp("sp"))


def test_ranks_joined_one_group(results) -> None:
    assert [r["index"] for r in results] == [0, 1]


@pytest.mark.parametrize("case", ["attention_8", "attention_7", "attention_direct"])
def test_ulysses_attention_equals_full_attention(results, case) -> None:
    for rank in results:
        assert rank[case] < TOL, (case, rank[case])


@pytest.mark.parametrize("case", sorted(DIT_CASES))
def test_sequence_parallel_dit_equals_single_process(results, case) -> None:
    for rank in results:
        diff, scale = rank[case]
        assert scale > 0.1, "the prediction is too small for the comparison to mean anything"
        assert diff < TOL, (case, diff, scale)


def test_heads_not_divisible_is_a_clear_error(results) -> None:
    for rank in results:
        for key in ("heads_error", "dit_heads_error"):
            assert "3 heads over sp_size=2" in rank[key], rank.get(key)
