"""Tensors of every dtype and layout for channel tests, made from random bytes (NaN and odd bit
patterns included), and a bit-exact comparison."""

from __future__ import annotations

import torch

DTYPES = (
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.int16, torch.int32,
    torch.int64, torch.uint8, torch.bool, torch.complex64, torch.complex128, torch.float8_e4m3fn,
    torch.float8_e5m2,
)


def _random(shape: tuple[int, ...], dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    numel = 1
    for size in shape:
        numel *= size
    raw = torch.randint(0, 256, (numel * dtype.itemsize,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape)


def cases(large: int = 70_000) -> dict[str, torch.Tensor]:
    """name -> tensor: each dtype small and large (`large` elements: past the 64 KiB inline limit for
    every dtype), plus empty, 0-d and non-contiguous (small, and past the inline limit) layouts."""
    g = torch.Generator().manual_seed(0)
    out = {}
    for dtype in DTYPES:
        name = str(dtype).removeprefix("torch.")
        out[f"{name}_small"] = _random((3, 5), dtype, g)
        out[f"{name}_large"] = _random((large,), dtype, g)
        out[f"{name}_empty"] = _random((0, 4), dtype, g)
        out[f"{name}_scalar"] = _random((), dtype, g)
        out[f"{name}_strided"] = _random((64, 300), dtype, g)[::2, 1::3].t()  # 100 x 32, not contiguous
        out[f"{name}_strided_large"] = _random((512, 1200), dtype, g)[::2, 1::3].t()  # 400 x 256
    return out


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (NaNs compare equal to themselves)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    as_bytes = lambda t: t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)  # noqa: E731
    return torch.equal(as_bytes(a), as_bytes(b))
