"""torch.compile'd Wan2.2 DiT blocks on a GPU, bf16, full width: compiled against eager, one GPU and
Ulysses over two (the eager `attend` between the compiled halves runs the NCCL all-to-alls).

Run on the lent machine: `python3 -m pytest -q -m gpu tests/gpu/test_wan22_compile_gpu.py -s` (the
two-GPU test needs 2 GPUs). Timings are printed for information, never asserted.
"""

from __future__ import annotations

import time

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
FULL_WIDTH = {"patch_size": [1, 2, 2], "num_attention_heads": 24, "attention_head_dim": 128, "in_channels": 48,
              "out_channels": 48, "text_dim": 4096, "freq_dim": 256, "ffn_dim": 14336, "num_layers": 2,
              "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads", "eps": 1e-6}


def _models(device: torch.device):
    """(eager, compiled) 2-layer full-width DiTs in bf16 with the same dummy weights on `device`."""
    import copy

    from mstar.models.common.loading import fill_dummy_weights
    from mstar.models.wan22.compile import compile_blocks
    from mstar.models.wan22.config import WanTransformerConfig
    from mstar.models.wan22.transformer import build_transformer

    eager = build_transformer(WanTransformerConfig.from_hf(FULL_WIDTH), torch.bfloat16, "cpu")
    fill_dummy_weights(eager, seed=0, std=0.05)  # on the CPU: the same weights on every rank
    compiled = copy.deepcopy(eager)
    compile_blocks(compiled)
    return eager.to(device), compiled.to(device)


def _inputs(batch: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """832x480, 33 frames (9 latent frames), 512 text tokens; per-frame timesteps with frame 0 clean."""
    from mstar.models.wan22 import denoise

    gen = torch.Generator().manual_seed(batch)
    latents = torch.randn(batch, 48, 9, 30, 52, generator=gen).to(device, torch.bfloat16)
    text = torch.randn(batch, 512, 4096, generator=gen).to(device, torch.bfloat16)
    steps = torch.linspace(999, 100, batch).tolist()
    timestep = torch.stack([denoise.frame_timesteps(t, 9, True, device) for t in steps])
    return latents, timestep, text


def _timed(fn, *args: torch.Tensor) -> tuple[torch.Tensor, float]:
    fn(*args)  # warm-up (compiles)
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn(*args)
    torch.cuda.synchronize()
    return out.float(), time.perf_counter() - start


def _check(got: torch.Tensor, expected: torch.Tensor) -> dict:
    cosine = torch.nn.functional.cosine_similarity(got.flatten(), expected.flatten(), dim=0).item()
    result = {"diff": (got - expected).abs().max().item(), "scale": expected.abs().max().item(), "cosine": cosine}
    assert result["scale"] > 0.01, result
    assert result["diff"] < 0.02 * result["scale"], result  # bf16: inductor may skip intermediate roundings
    assert result["cosine"] > 0.9999, result
    return result


def test_compiled_blocks_match_eager_on_one_gpu() -> None:
    device = torch.device("cuda")
    eager, compiled = _models(device)
    for batch in (2, 4, 2):  # CFG rows of 1 and 2 requests; back to 2 reuses the dynamic graph
        inputs = _inputs(batch, device)
        with torch.no_grad():
            expected, eager_s = _timed(eager, *inputs)
            got, compiled_s = _timed(compiled, *inputs)
        r = _check(got, expected)
        print(f"batch {batch}: diff {r['diff']:.4g} of {r['scale']:.4g}, cosine {r['cosine']:.6f}; 2 layers: "
              f"eager {eager_s * 1e3:.1f} ms, compiled {compiled_s * 1e3:.1f} ms")


def _sp_compare(replica, device) -> dict:
    eager, compiled = _models(device)
    latents, timestep, text = _inputs(2, device)
    with torch.no_grad():
        expected = eager(latents, timestep, text).float()
        got = compiled(latents, timestep, text, sp_group=replica.group).float()
    diff = (got - expected).abs().max().item()
    cosine = torch.nn.functional.cosine_similarity(got.flatten(), expected.flatten(), dim=0).item()
    return {"diff": diff, "scale": expected.abs().max().item(), "cosine": cosine}


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_compiled_blocks_with_ulysses_on_two_gpus_match_eager_one_gpu(tmp_path) -> None:
    from sp_testing import run_ranks

    for rank, r in enumerate(run_ranks(_sp_compare, 2, "cuda", tmp_path)):
        print(f"rank {rank}: diff {r['diff']:.4g} of {r['scale']:.4g}, cosine {r['cosine']:.6f}")
        assert r["scale"] > 0.01 and r["diff"] < 0.02 * r["scale"] and r["cosine"] > 0.9999, r
