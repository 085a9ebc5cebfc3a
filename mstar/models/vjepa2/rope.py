"""V-JEPA 2's 3D rotary embedding as per-token (cos, sin) tables over a whole head.

A head's channels are three equal even slices (frame, row, column; `rope_axis_dim`) and a remainder
left as is. Inside a slice of width D, channels (2k, 2k+1) rotate as a pair, and channel i turns by
position * 10000^(-(i mod D/2) / (D/2)): the checkpoints were trained with that layout (the frequency
list repeated, not interleaved), so it is kept. A token may leave an axis unrotated (the AC
predictor's action and state tokens rotate by frame only): its table holds cos 1, sin 0 there.
"""

from __future__ import annotations

import torch

from mstar.kernels.guard import KernelGuard
from mstar.layers.fused import FUSED
from mstar.models.vjepa2.config import rope_axis_dim

_ROTARY = KernelGuard("vjepa2 rotary")


def rope_tables(positions: torch.Tensor, head_dim: int, rotate: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each [..., head_dim] float32, for `positions` [..., 3] (frame, row, column; floats
    allowed); `rotate` [..., 3] bool (default all true) says which axes turn for each token."""
    dim = rope_axis_dim(head_dim)
    half = dim // 2
    omega = torch.arange(half, dtype=torch.float32, device=positions.device)
    omega = 1.0 / 10000 ** (omega / (dim / 2.0))
    angles = positions.to(torch.float32).unsqueeze(-1) * omega  # [..., 3, half]
    cos, sin = angles.cos(), angles.sin()
    if rotate is not None:
        keep = rotate.unsqueeze(-1)
        cos, sin = torch.where(keep, cos, 1.0), torch.where(keep, sin, 0.0)
    cos = torch.cat([cos, cos], dim=-1).flatten(-2)  # [..., 3 * dim]: each axis' list twice
    sin = torch.cat([sin, sin], dim=-1).flatten(-2)
    rest = head_dim - 3 * dim
    if rest:
        cos = torch.cat([cos, cos.new_ones(*cos.shape[:-1], rest)], dim=-1)
        sin = torch.cat([sin, sin.new_zeros(*sin.shape[:-1], rest)], dim=-1)
    return cos, sin


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor | None = None,
               carry: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """x [..., N, head_dim] turned by tables broadcastable to it: x * cos + turned * sin, where pairs
    (2k, 2k+1) turn to (-x[2k+1], x[2k]); written into `out` (x's shape, any strides) when given.
    `carry` = (c, c_out): c also copied into c_out (the values beside the keys going into a cache). One
    kernel for all of it (`fused_ops.rotary_pairs`, the same roundings) where the fused kernels serve x."""

    def eager() -> torch.Tensor:
        turned = _apply_rope_torch(x, cos, sin, out)
        if carry is not None:
            carry[1].copy_(carry[0])
        return turned

    ops = FUSED.ops_for(x)
    if ops is None or not _fusable(x, cos, sin, out, carry):
        return eager()
    return _ROTARY.run(lambda: ops.rotary_pairs(x, cos, sin, out, carry), eager)


def _fusable(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor | None,
             carry: tuple[torch.Tensor, torch.Tensor] | None) -> bool:
    """Whether the kernel takes these: x [B < 65536, heads, N, D], tables [N, D] or [B or 1, 1, N, D] of one
    layout, `out` of x's dtype, unit last strides throughout; a carry laid out as (x, out), of x's dtype."""
    shared = cos.dim() == 2 or (cos.dim() == 4 and cos.shape[1] == 1 and cos.shape[0] in (1, x.shape[0]))
    fits = (x.dim() == 4 and x.shape[0] < 65536 and shared and cos.shape[-2:] == x.shape[-2:]
            and cos.stride() == sin.stride() and cos.shape == sin.shape and x.stride(-1) == cos.stride(-1) == 1
            and (out is None or (out.stride(-1) == 1 and out.dtype == x.dtype)))
    if carry is None or not fits:
        return fits
    c, c_out = carry
    return (out is not None and c.shape == c_out.shape == x.shape and c.stride() == x.stride()
            and c_out.stride() == out.stride() and c.dtype == c_out.dtype == x.dtype)


def _apply_rope_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor | None
                      ) -> torch.Tensor:
    """`apply_rope`'s PyTorch form."""
    # the pair swap and the sign go to a copy of x and to the small table, so the wide tensor is passed over
    # three times (swap, x * cos, add-multiply) instead of five
    swapped = x.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
    halves = sin.unflatten(-1, (-1, 2))
    signed = torch.stack((-halves[..., 0], halves[..., 1]), dim=-1).flatten(-2)
    return torch.addcmul(x * cos.to(x.dtype), swapped, signed.to(x.dtype), out=out)


def grid_positions(frames: int, rows: int, cols: int, device: torch.device | None = None,
                   col_scale: float = 1.0) -> torch.Tensor:
    """[frames * rows * cols, 3] (frame, row, column) of tokens laid out frame-major, row-major;
    columns scaled by `col_scale` (the AC predictor snaps a non-square grid onto its row count)."""
    f, r, c = torch.meshgrid(torch.arange(frames, device=device), torch.arange(rows, device=device),
                             torch.arange(cols, device=device), indexing="ij")
    return torch.stack([f.float(), r.float(), c.float() * col_scale], dim=-1).reshape(-1, 3)


def ids_to_positions(ids: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Flat token indexes (frame-major, row-major) -> [..., 3] (frame, row, column)."""
    per_frame = rows * cols
    frame = ids // per_frame
    row = (ids - frame * per_frame) // cols
    col = ids - frame * per_frame - row * cols
    return torch.stack([frame, row, col], dim=-1)
