"""The Wan video DiT (WanTransformer3DModel as TI2V-5B uses it), plain single-device PyTorch.

Latents [B, C, F, H, W] are cut into (1, 2, 2) patches; each block runs self-attention with a 3D rope,
cross-attention to the projected text, and a GELU FFN, all modulated (AdaLN: shift, scale, gate) by
the timestep embedding. The timestep is per request [B], per latent frame [B, F'] or per token
[B, L]: an image-to-video request keeps timestep 0 on its conditioning first frame. Modulation is
applied per timestep group (one per request, frame or token), so per-frame timesteps cost no more than
one per request. Norms, modulation and residual sums run in float32 like the reference.

The elementwise and norm steps (modulated norms, gated residuals, q/k norms with rope, the FFN's
bias + GELU) live in `block_math.py`: float32 math with one rounding to the model dtype, as PyTorch on
CPU and under torch.compile, as fused Triton kernels (and a GEMM epilogue) on CUDA.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mstar.layers.embedders import MLP, timestep_features
from mstar.layers.fp8 import empty_fp8_decoder, method_block
from mstar.models.common.meta import build_on_meta
from mstar.models.wan22.block_math import (
    addcmul_as,
    apply_rope,
    gated_residual,
    layer_norm32,
    layer_norm_as_input,
    linear_gelu,
    modulated_norm,
    norm_heads,
    rope_tables,
)
from mstar.models.wan22.config import WanTransformerConfig

# Re-exported for callers that import the math from here (the tests did before block_math.py existed).
__all__ = ["WanBlock", "WanTransformer", "addcmul_as", "apply_rope", "build_transformer", "layer_norm32",
           "layer_norm_as_input", "rope_angles", "rope_tables", "sdpa_attention"]


def rope_angles(grid: tuple[int, int, int], head_dim: int, theta: float, device: torch.device) -> torch.Tensor:
    """[L, head_dim/2] rotation angles for tokens laid out (frame, row, column) over `grid`.

    The head splits into frame, height and width parts (height = width = 2 * (head_dim // 6)), each a
    standard 1D rope over its own coordinate; angles are computed in float64.
    """
    hw_dim = 2 * (head_dim // 6)
    parts = []
    for axis, (size, dim) in enumerate(zip(grid, (head_dim - 2 * hw_dim, hw_dim, hw_dim), strict=True)):
        freqs = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device=device) / dim)
        angles = torch.outer(torch.arange(size, dtype=torch.float64, device=device), freqs)
        shape = [1, 1, 1, dim // 2]
        shape[axis] = size
        parts.append(angles.view(shape).expand(*grid, dim // 2))
    return torch.cat(parts, dim=-1).reshape(math.prod(grid), head_dim // 2)


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Full attention on one device: q, k, v and the result are [B, L, H, D]."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    return out.transpose(1, 2)


Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # [B, L, H, D] x3 -> [B, L, H, D]


class SelfAttention(nn.Module):
    """Fused QKV, RMS norm of q and k across all heads, 3D rope, then `attend` (SDPA, or Ulysses over
    a sequence-parallel group: the projections and norms are per token, so they run on any shard)."""

    def __init__(self, dim: int, heads: int, eps: float) -> None:
        super().__init__()
        self.heads = heads
        self.to_qkv = nn.Linear(dim, 3 * dim)
        self.norm_q = nn.RMSNorm(dim, eps=eps)
        self.norm_k = nn.RMSNorm(dim, eps=eps)
        self.to_out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attend: Attend = sdpa_attention) -> torch.Tensor:
        return self.to_out(attend(*self.project(x, cos, sin)).flatten(2))

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [B, L, D] -> q, k, v [B, L, H, d]: normed and roped q and k, as `attend` takes them."""
        q, k, v = self.to_qkv(x).chunk(3, dim=-1)
        q = norm_heads(q, self.norm_q, self.heads, (cos, sin))
        k = norm_heads(k, self.norm_k, self.heads, (cos, sin))
        return q, k, v.unflatten(-1, (self.heads, -1))


class CrossAttention(nn.Module):
    """Queries from the video tokens, fused K/V from the text tokens (all 512 attended, unmasked)."""

    def __init__(self, dim: int, heads: int, eps: float) -> None:
        super().__init__()
        self.heads = heads
        self.to_q = nn.Linear(dim, dim)
        self.to_kv = nn.Linear(dim, 2 * dim)
        self.norm_q = nn.RMSNorm(dim, eps=eps)
        self.norm_k = nn.RMSNorm(dim, eps=eps)
        self.to_out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, text: torch.Tensor | tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """x [B, L, D] attends to `text` [B, Lt, D], or to its precomputed `text_kv(text)`."""
        k, v = text if isinstance(text, tuple) else self.text_kv(text)
        q = norm_heads(self.to_q(x), self.norm_q, self.heads).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v)
        return self.to_out(out.transpose(1, 2).flatten(2))

    def text_kv(self, text: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (RMS-normed) and values [B, H, Lt, d] of the projected text: they depend on the text only,
        so a request can compute them once and reuse them at every denoising step."""
        k, v = self.to_kv(text).chunk(2, dim=-1)
        k = self.norm_k(k).unflatten(-1, (self.heads, -1)).transpose(1, 2)
        return k, v.unflatten(-1, (self.heads, -1)).transpose(1, 2)


TextKV = list[tuple[torch.Tensor, torch.Tensor]]  # per block: cross-attention (k, v) [B, H, Lt, d]


class WanBlock(nn.Module):
    """Modulated self-attention, plain cross-attention, modulated FFN; gates scale the residual adds."""

    def __init__(self, config: WanTransformerConfig) -> None:
        super().__init__()
        dim = config.dim
        self.eps = config.eps
        self.attn1 = SelfAttention(dim, config.num_heads, config.eps)
        self.norm2 = nn.LayerNorm(dim, eps=config.eps) if config.cross_attn_norm else None
        self.attn2 = CrossAttention(dim, config.num_heads, config.eps)
        self.ffn_in = nn.Linear(dim, config.ffn_dim)
        self.ffn_out = nn.Linear(config.ffn_dim, dim)
        self.scale_shift_table = nn.Parameter(torch.zeros(1, 6, dim))  # the checkpoint's shape

    def forward(self, x: torch.Tensor, text: torch.Tensor | tuple, t_mod: torch.Tensor, rope: tuple,
                attend: Attend = sdpa_attention) -> torch.Tensor:
        """x [B, L, D]; text [B, Lt, D] or this block's precomputed cross-attention (k, v); t_mod [B, T, 6, D] float32 with T dividing L; rope (cos, sin);
        `attend` runs the self-attention core (see SelfAttention)."""
        q, k, v = self.pre_attention(x, t_mod, *rope)
        return self.post_attention(x, attend(q, k, v), text, t_mod)

    def pre_attention(self, x: torch.Tensor, t_mod: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The modulated norm of x, projected to the self-attention's q, k, v [B, L, H, d]."""
        shift, scale = self._mods(t_mod)[:2]
        return self.attn1.project(modulated_norm(x, shift, scale, self.eps)[0], cos, sin)

    def post_attention(self, x: torch.Tensor, attended: torch.Tensor, text: torch.Tensor | tuple,
                       t_mod: torch.Tensor) -> torch.Tensor:
        """Gated residual of the self-attention output [B, L, H, d], cross-attention, gated FFN."""
        _, _, gate, c_shift, c_scale, c_gate = self._mods(t_mod)
        x, h = gated_residual(x, self.attn1.to_out(attended.flatten(2)), gate, self.norm2)  # h = norm2(x)
        cross = self.attn2(x if h is None else h, text)
        h, x = modulated_norm(x, c_shift, c_scale, self.eps, residual=cross)  # x += cross; the FFN's norm
        ff = self.ffn_out(linear_gelu(h, self.ffn_in))
        return gated_residual(x, ff, c_gate)[0]

    def _mods(self, t_mod: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """shift, scale, gate, c_shift, c_scale, c_gate: each [B, T, 1, D] float32."""
        return (self.scale_shift_table.float()[:, None] + t_mod).unsqueeze(3).unbind(2)


class WanTransformer(nn.Module):
    """`forward(latents [B,C,F,H,W], timestep, text [B,Lt,text_dim]) -> prediction [B,C,F,H,W]`.

    `text_kv=text_states(text)` may replace `text` (pass None): the cross-attention keys and values
    depend on the text alone, so a caller can compute them once per request instead of every step.

    `timestep` is [B] (one per request), [B, F'] (one per latent frame) or [B, L] (one per token, L =
    F' * H' * W' after patching, as diffusers passes it). Rows of one batch may be at different steps
    and hold different prompts, so requests (and guidance branches) batch freely when shapes match.

    With `sp_group` (a torch.distributed group of P ranks, all calling forward with the same inputs)
    the forward is sequence-parallel: each rank keeps 1/P of the patch tokens with their rope angles
    and modulation, self-attention runs as Ulysses attention over the group, cross-attention and the
    FFN stay local (the text is replicated), and every rank returns the whole prediction.
    """

    def __init__(self, config: WanTransformerConfig) -> None:
        super().__init__()
        self.config = config
        dim = config.dim
        self.patch_embedding = nn.Conv3d(config.in_channels, dim, config.patch_size, stride=config.patch_size)
        self.time_embedder = MLP(config.freq_dim, dim, "silu")
        self.time_proj = nn.Linear(dim, 6 * dim)
        self.text_embedder = MLP(config.text_dim, dim, "gelu_tanh")
        self.blocks = nn.ModuleList(WanBlock(config) for _ in range(config.num_layers))
        self.proj_out = nn.Linear(dim, config.out_channels * math.prod(config.patch_size))
        self.scale_shift_table = nn.Parameter(torch.zeros(1, 2, dim))
        self._rope_cache: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def forward(self, latents: torch.Tensor, timestep: torch.Tensor, text: torch.Tensor | None,
                sp_group: Any = None, text_kv: TextKV | None = None) -> torch.Tensor:
        grid = self._grid(latents.shape)
        x = self._patchify(latents)
        temb = self._time_embedding(timestep, grid, x.dtype)  # [B, T, D]
        t_mod = self.time_proj(F.silu(temb)).unflatten(-1, (6, -1)).float()  # [B, T, 6, D]
        if text_kv is None:
            text_kv = self.text_states(text)
        cos, sin = self._rope(grid, latents.device)
        attend: Attend = sdpa_attention
        if sp_group is not None:
            from mstar.distributed.sequence import SequenceShard

            shard = SequenceShard(sp_group, x.shape[1])
            x, cos, sin = shard.split(x), shard.split(cos, dim=0), shard.split(sin, dim=0)
            temb, t_mod = shard.split_groups(temb), shard.split_groups(t_mod)
            attend = shard.attention
        for block, kv in zip(self.blocks, text_kv, strict=True):
            x = block(x, kv, t_mod, (cos, sin), attend)
        out = self._head(x, temb)
        if sp_group is not None:
            out = shard.gather(out)
        return self._unpatchify(out, grid)

    def text_states(self, text: torch.Tensor) -> TextKV:
        """Every block's cross-attention (k, v) for raw text embeddings [B, Lt, text_dim]: what `forward`
        computes from `text` when no `text_kv` is passed (same for every denoising step of a request)."""
        embedded = self.text_embedder(text.to(self.proj_out.weight.dtype))
        return [block.attn2.text_kv(embedded) for block in self.blocks]

    def _head(self, x: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        """Final modulated norm and projection: tokens [B, L, D] -> patches [B, L, pt*ph*pw*C]."""
        shift, scale = (self.scale_shift_table.float()[:, None] + temb.float().unsqueeze(2)).unsqueeze(3).unbind(2)
        return self.proj_out(modulated_norm(x, shift, scale, self.config.eps)[0])

    def _grid(self, shape: torch.Size) -> tuple[int, int, int]:
        _, channels, *sizes = shape
        if channels != self.config.in_channels or any(s % p for s, p in zip(sizes, self.config.patch_size)):
            raise ValueError(f"latents of shape {tuple(shape)} do not fit the transformer: need "
                             f"{self.config.in_channels} channels and (F, H, W) multiples of the patch "
                             f"{self.config.patch_size}")
        return tuple(s // p for s, p in zip(sizes, self.config.patch_size, strict=True))

    def _patchify(self, latents: torch.Tensor) -> torch.Tensor:
        """[B, C, F, H, W] -> tokens [B, L, D]: the patch Conv3d as one matmul over (C, pt, ph, pw)."""
        b, c, f, h, w = latents.shape
        pt, ph, pw = self.config.patch_size
        x = latents.view(b, c, f // pt, pt, h // ph, ph, w // pw, pw).permute(0, 2, 4, 6, 1, 3, 5, 7)
        x = x.reshape(b, (f // pt) * (h // ph) * (w // pw), c * pt * ph * pw).to(self.patch_embedding.weight.dtype)
        return F.linear(x, self.patch_embedding.weight.flatten(1), self.patch_embedding.bias)

    def _unpatchify(self, x: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        """Tokens [B, L, pt*ph*pw*C] -> [B, C, F, H, W]."""
        pt, ph, pw = self.config.patch_size
        x = x.view(x.shape[0], *grid, pt, ph, pw, -1).permute(0, 7, 1, 4, 2, 5, 3, 6)
        return x.reshape(x.shape[0], x.shape[1], grid[0] * pt, grid[1] * ph, grid[2] * pw)

    def _time_embedding(self, timestep: torch.Tensor, grid: tuple[int, int, int], dtype: torch.dtype):
        """[B, T, D] in `dtype`, T = 1, F' or L: the time MLP runs in its own (float32) weights."""
        if timestep.ndim == 1:
            timestep = timestep[:, None]
        if timestep.ndim != 2 or timestep.shape[1] not in (1, grid[0], math.prod(grid)):
            raise ValueError(f"timestep of shape {tuple(timestep.shape)} fits none of [B], [B, {grid[0]}] "
                             f"(per latent frame) or [B, {math.prod(grid)}] (per token)")
        features = timestep_features(timestep.flatten(), self.config.freq_dim)
        temb = self.time_embedder(features.to(self.time_embedder.linear_1.weight.dtype))
        return temb.to(dtype).view(*timestep.shape, -1)

    def _rope(self, grid: tuple[int, int, int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        key = (grid, device)
        if key not in self._rope_cache:
            angles = rope_angles(grid, self.config.head_dim, self.config.rope_theta, device)
            self._rope_cache[key] = rope_tables(angles)
        return self._rope_cache[key]


# Kept in float32 whatever the serving dtype (diffusers' _keep_in_fp32_modules): timestep precision.
FP32_PARAMETERS = ("time_embedder.", "scale_shift_table")


def build_transformer(
    config: WanTransformerConfig, dtype: torch.dtype | None = None, device: str | torch.device = "cpu",
    quantization: str | None = None,
) -> WanTransformer:
    """A DiT in `dtype` (the config's by default) on `device` with UNINITIALISED weights; load next.

    The time embedder and modulation tables stay float32 (sinusoids of t up to 1000 need it).
    With `quantization` ("fp8", "fp8_block"; layers/fp8.py) the blocks' attention and FFN linears are
    empty `Fp8Linear`s, quantized as their weights load: they hold almost all of the weights and FLOPs.
    The rest keeps its dtype: norms are elementwise; the time embedding, `time_proj` and the modulation
    tables set every token's shift, scale and gate, so their error would scale the whole residual stream;
    the patch embedding and `proj_out` touch the latents directly and are a fraction of a percent of the
    FLOPs; the text embedder runs once per request (its output is cached across steps).
    """
    dtype = dtype or config.dtype

    def make() -> WanTransformer:
        model = WanTransformer(config)
        for name, param in model.named_parameters():
            keep32 = any(part in name for part in FP32_PARAMETERS)
            param.data = param.data.to(torch.float32 if keep32 else dtype)
        if quantization is not None:
            empty_fp8_decoder(model.blocks, method_block(quantization))
        return model

    model = build_on_meta(make, torch.float32, device)
    assert isinstance(model, WanTransformer)
    return model
