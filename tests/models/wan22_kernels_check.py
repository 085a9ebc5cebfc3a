"""Checks of the Wan DiT block kernels (`mstar/models/wan22/wan_ops.py`) against the PyTorch forms of
`block_math.py`; run with TRITON_INTERPRET=1 (by test_wan22_kernels.py, in a fresh process so the
interpreter setting holds for every kernel).

float32 inputs check the math to float32 precision. bfloat16 inputs check indexing, broadcasting and
strides within one bf16 step: the interpreter rounds float32 -> bf16 toward zero where the GPU rounds
to nearest even, so the exact-rounding checks live in tests/gpu/test_wan22_fused_gpu.py.
"""

from __future__ import annotations

import torch

from mstar.layers.fused import fused_kernels
from mstar.models.wan22 import block_math as bm
from mstar.models.wan22 import wan_ops


def torch_form(fn, *args, **kwargs):
    """fn(*args, **kwargs) with the kernels off: the PyTorch reference."""
    with fused_kernels(False):
        return fn(*args, **kwargs)


def close(got: torch.Tensor, want: torch.Tensor, steps: float = 1.0) -> None:
    """float32: equal up to float32 rounding; bf16: within `steps` bf16 steps (2**-7 relative) of want,
    or of the tensor's mean magnitude where a rounded input feeds a norm (cancellation near zero)."""
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, want.dtype, got.shape, want.shape)
    rtol = 2e-5 if got.dtype == torch.float32 else steps * 2.0 ** -7
    torch.testing.assert_close(got.float(), want.float(), atol=rtol * want.float().abs().mean().item(), rtol=rtol)


def mods(batch: int, groups: int, dim: int, count: int) -> tuple[torch.Tensor, ...]:
    """`count` [B, T, 1, D] float32 modulation views, strided like the block's unbind of t_mod."""
    return (torch.randn(batch, groups, count, 1, dim) * 0.5).unbind(2)


# (batch, length, dim, timestep groups) of the modulated norm and the gated residual
NORM_SHAPES = ((2, 12, 40, 1), (2, 12, 40, 3), (1, 6, 96, 6), (3, 5, 17, 5))
RESIDUAL_SHAPES = ((2, 12, 40, 1), (2, 12, 40, 4), (3, 5, 17, 5))


def check_modulated_norm(dtype: torch.dtype, shapes=NORM_SHAPES) -> None:
    for batch, length, dim, groups in shapes:
        x = (torch.randn(batch, length, dim) * 3 + 1).to(dtype)
        shift, scale = mods(batch, groups, dim, 2)
        got, same = bm.modulated_norm(x, shift, scale, 1e-6)
        assert same is x
        close(got, torch_form(bm.modulated_norm, x, shift, scale, 1e-6)[0])
        res = torch.randn(batch, length, dim).to(dtype)
        got, summed = bm.modulated_norm(x, shift, scale, 1e-6, residual=res)
        want, want_sum = torch_form(bm.modulated_norm, x, shift, scale, 1e-6, residual=res)
        close(summed, want_sum)
        close(got, want, steps=2.0)
    # x a strided view (every other token of a longer tensor)
    wide = torch.randn(2, 24, 40).to(dtype)
    shift, scale = mods(2, 3, 40, 2)
    close(bm.modulated_norm(wide[:, ::2], shift, scale, 1e-5)[0],
          torch_form(bm.modulated_norm, wide[:, ::2].contiguous(), shift, scale, 1e-5)[0])


def check_gated_residual(dtype: torch.dtype, shapes=RESIDUAL_SHAPES) -> None:
    for batch, length, dim, groups in shapes:
        x, y = torch.randn(batch, length, dim).to(dtype), torch.randn(batch, length, dim).to(dtype)
        (gate,) = mods(batch, groups, dim, 1)
        got, none = bm.gated_residual(x, y, gate)
        assert none is None
        close(got, torch_form(bm.gated_residual, x, y, gate)[0])
        for wdtype in {dtype, torch.float32}:
            norm = torch.nn.LayerNorm(dim, eps=1e-6).to(wdtype)
            with torch.no_grad():
                norm.weight.copy_(1 + 0.2 * torch.randn(dim))
                norm.bias.copy_(0.3 * torch.randn(dim))
            got, h = bm.gated_residual(x, y, gate, norm)
            want, want_h = torch_form(bm.gated_residual, x, y, gate, norm)
            close(got, want)
            close(h, want_h, steps=2.0)


def check_norm_heads(dtype: torch.dtype) -> None:
    from mstar.models.wan22.transformer import rope_angles

    heads, head_dim, grid = 3, 12, (3, 2, 2)
    dim, length = heads * head_dim, 12
    norm = torch.nn.RMSNorm(dim, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.2 * torch.randn(dim))
    qkv = (torch.randn(2, length, 3 * dim) * 2).to(dtype)
    q = qkv.chunk(3, dim=-1)[1]  # a strided view, as the block passes it
    rope = bm.rope_tables(rope_angles(grid, head_dim, 10000.0, torch.device("cpu")))
    got = bm.norm_heads(q, norm, heads, rope)
    assert got.shape == (2, length, heads, head_dim)
    want = torch_form(bm.norm_heads, q, norm, heads, rope)
    assert not torch.equal(want, torch_form(bm.norm_heads, q, norm, heads))  # the rope rotates
    close(got, want, steps=3.0)  # torch's CPU RMSNorm rounds twice in bf16 (normed, then * weight)
    close(bm.norm_heads(q, norm, heads), torch_form(bm.norm_heads, q, norm, heads), steps=2.0)
    # a sequence-parallel shard: the rope table rows are a slice of the whole table
    shard = (rope[0][4:8], rope[1][4:8])
    close(bm.norm_heads(q[:, 4:8], norm, heads, shard),
          torch_form(bm.norm_heads, q[:, 4:8], norm, heads, shard), steps=3.0)


def check_bad_shapes() -> None:
    x = torch.randn(2, 12, 40)
    for bad in (torch.randn(2, 5, 1, 40), torch.randn(2, 3, 40), torch.randn(1, 3, 1, 40)):
        try:
            wan_ops.gated_residual(x, x, bad)
        except ValueError as err:
            assert "[B, T, 1, D]" in str(err)
        else:
            raise AssertionError(f"gate {tuple(bad.shape)} accepted")


class CallCounter:
    """Counts calls of the wan_ops entry points while installed."""

    NAMES = ("layer_norm_modulate", "gated_residual", "rms_norm_rope")

    def __init__(self) -> None:
        self.calls = dict.fromkeys(self.NAMES, 0)
        self._saved = {name: getattr(wan_ops, name) for name in self.NAMES}
        for name, fn in self._saved.items():
            setattr(wan_ops, name, self._counted(name, fn))

    def _counted(self, name, fn):
        def call(*args, **kwargs):
            self.calls[name] += 1
            return fn(*args, **kwargs)
        return call

    def remove(self) -> None:
        for name, fn in self._saved.items():
            setattr(wan_ops, name, fn)


def tiny_models():
    """(diffusers reference float32, ours float32, ours bf16) with the same random weights."""
    from diffusers import WanTransformer3DModel

    from mstar.models.common.loading import load_named_tensors
    from mstar.models.wan22.config import WanTransformerConfig
    from mstar.models.wan22.tiny import TINY_TRANSFORMER
    from mstar.models.wan22.transformer import build_transformer
    from mstar.models.wan22.weights import transformer_mapper

    cfg = {k: v for k, v in TINY_TRANSFORMER.items() if not k.startswith("_")}
    torch.manual_seed(0)
    reference = WanTransformer3DModel(**cfg).eval()
    with torch.no_grad():
        for name, param in reference.named_parameters():
            param.copy_(1 + 0.2 * torch.randn_like(param) if "norm" in name and param.ndim == 1
                        else 0.3 * torch.randn_like(param))
    config = WanTransformerConfig.from_hf(cfg)
    ours = []
    for dtype in (torch.float32, torch.bfloat16):
        ours.append(build_transformer(config, dtype))
        load_named_tensors(ours[-1], reference.state_dict().items(), transformer_mapper(config))
    return reference, *ours


def check_tiny_dit() -> None:
    """The tiny DiT with the kernels on: float32 equals diffusers (1e-4) and our torch form, timesteps
    per request and per frame (one per token is a group of one token: the kernel checks cover it); bf16 is about as close to the float32 truth as the torch form's bf16 (the
    interpreter truncates where the GPU rounds, which costs a little)."""
    from mstar.models.wan22.tiny import TINY_TEXT_LENGTH

    reference, ours32, ours16 = tiny_models()
    gen = torch.Generator().manual_seed(3)
    latents = torch.randn(2, 16, 3, 4, 6, generator=gen)
    text = torch.randn(2, TINY_TEXT_LENGTH, 32, generator=gen)
    per_frame = torch.tensor([[0.0, 999.0, 999.0], [0.0, 412.0, 412.0]])
    per_token = per_frame.repeat_interleave(6, dim=1)  # 6 = 2 x 3 patches per latent frame
    for timestep in (torch.tensor([999.0, 412.0]), per_frame):
        # diffusers takes [B] or per-token [B, L]
        want = reference(latents, per_token if timestep.ndim == 2 else timestep, text, return_dict=False)[0]
        counter = CallCounter()
        try:
            got32 = ours32(latents, timestep, text)
        finally:
            counter.remove()
        # per block: 2 modulated norms, 2 gated residuals, 3 q/k norms; the head: 1 modulated norm
        assert counter.calls == {"layer_norm_modulate": 2 * 2 + 1, "gated_residual": 2 * 2,
                                 "rms_norm_rope": 2 * 3}, counter.calls
        torch.testing.assert_close(got32, want, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(got32, torch_form(ours32, latents, timestep, text), atol=2e-5, rtol=2e-5)
    got16 = ours16(latents.bfloat16(), per_frame, text.bfloat16()).float()
    torch_16 = torch_form(ours16, latents.bfloat16(), per_frame, text.bfloat16()).float()
    truth = torch_form(ours32, latents, per_frame, text)
    fused_err, torch_err = (got16 - truth).abs().mean().item(), (torch_16 - truth).abs().mean().item()
    assert 0 < fused_err <= 1.5 * torch_err, (fused_err, torch_err)


@torch.no_grad()
def quick() -> None:
    """One float32 shape of each kernel (the default test run, through wan22_quick_check.py)."""
    check_modulated_norm(torch.float32, NORM_SHAPES[1:2])
    check_gated_residual(torch.float32, RESIDUAL_SHAPES[1:2])
    check_norm_heads(torch.float32)


@torch.no_grad()
def main() -> None:
    assert bm.wan_kernels(torch.zeros(1)) is wan_ops, "run with TRITON_INTERPRET=1"
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        check_modulated_norm(dtype)
        check_gated_residual(dtype)
        check_norm_heads(dtype)
    wan_ops.SHUFFLE_PAIRS = False  # the re-reading variant of the rope's pair swap
    check_norm_heads(torch.float32)
    wan_ops.SHUFFLE_PAIRS = True
    check_bad_shapes()
    check_tiny_dit()
    print("wan ops ok")


if __name__ == "__main__":
    main()
