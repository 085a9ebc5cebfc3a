"""The values of /generate's array chunks (`action`, `tensor`): JSON numbers or raw little-endian bytes.

bfloat16 is float32 with the low 16 bits dropped, so the bytes of a bfloat16 array are the top halves of
its float32 values: arrays are rounded to bfloat16 by torch (to nearest, ties to even) and sent as those
halves; numpy, which has no bfloat16, reads them back as float32 by shifting them up again, torch as
`torch.bfloat16` itself. torch is imported only where bfloat16 needs it (the client may go without).
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

def itemsize(dtype: str) -> int:
    """Bytes per element of a wire dtype name."""
    return 2 if dtype == "bfloat16" else np.dtype(dtype).itemsize


def base64_length(nbytes: int) -> int:
    """Characters of the padded standard base64 of `nbytes` bytes."""
    return 4 * ((nbytes + 2) // 3)


def to_bfloat16(array: np.ndarray) -> np.ndarray:
    """`array`'s values rounded to bfloat16, held in float32 (exactly: bfloat16 is a subset of float32)."""
    import torch

    return torch.from_numpy(np.array(array, np.float32)).to(torch.bfloat16).float().numpy()


def raw_bytes(array: np.ndarray, dtype: str) -> bytes:
    """C-order little-endian bytes of `array` in `dtype` (bfloat16: rounded, then the top half of each float32)."""
    if dtype == "bfloat16":
        import torch

        halves = torch.from_numpy(np.ascontiguousarray(array, np.float32)).to(torch.bfloat16).view(torch.int16)
        return halves.numpy().astype("<i2", copy=False).tobytes()
    return np.ascontiguousarray(array, np.dtype(dtype).newbyteorder("<")).tobytes()


def from_raw(raw: bytes, dtype: str, shape: list[int]) -> np.ndarray:
    """The numpy array of raw wire bytes; bfloat16 comes back as float32 holding the same values."""
    if dtype == "bfloat16":
        return (np.frombuffer(raw, "<u2").astype(np.uint32) << 16).view(np.float32).reshape(shape)
    return np.frombuffer(raw, np.dtype(dtype).newbyteorder("<")).astype(dtype).reshape(shape)


def torch_from_raw(raw: bytes, dtype: str, shape: list[int]) -> torch.Tensor:
    """The torch tensor of raw wire bytes in `dtype` itself (bfloat16 included)."""
    import torch

    if dtype == "bfloat16":
        assert sys.byteorder == "little", "bfloat16 bytes are read in place on little-endian hosts"
        return torch.frombuffer(bytearray(raw), dtype=torch.bfloat16).reshape(shape)
    return torch.from_numpy(from_raw(raw, dtype, shape).copy())
