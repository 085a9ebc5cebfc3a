"""Host tensors as msgspec payloads: small ones inline, large ones through POSIX shared memory.

A `TensorPayload` is what a control message carries in place of a tensor. Small tensors ride inline
as bytes; larger ones are written to a file under /dev/shm named `mstar-<session>-<pid>-<counter>`
and the payload carries only the name. Exactly one consumer calls `unpack_tensor` (which maps the
segment and unlinks it at once, so nothing leaks if that process dies later) or `discard_payload`
(which unlinks without reading). Segments whose consumer never came are removed by
`cleanup_segments(session)` at shutdown.

torch is imported inside the functions that need it: processes that only route messages (and
discard payloads) stay cheap to import.
"""

from __future__ import annotations

import itertools
import logging
import mmap
import os
import re
import secrets
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from mstar import envs

if TYPE_CHECKING:
    import numpy as np
    import torch

logger = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
DEFAULT_INLINE_MAX_BYTES = 64 * 1024

_SESSION_RE = re.compile(r"[A-Za-z0-9_]{1,32}")
_counter = itertools.count()


class TensorPayload(msgspec.Struct, tag=True, frozen=True, array_like=True):
    """A CPU tensor inside a message: dtype name, shape, and its bytes either inline or in shm.

    Exactly one of `data` (inline, C-contiguous bytes) and `shm_name` (a segment under /dev/shm
    holding `nbytes` bytes) is set, except for empty tensors, which carry neither.
    """

    dtype: str  # torch dtype name without the "torch." prefix, e.g. "bfloat16"
    shape: tuple[int, ...]
    nbytes: int
    # bytearray (not bytes) so the decoded buffer is writable and unpack can wrap it without a copy.
    data: bytearray | None = None
    shm_name: str | None = None

    @property
    def in_shm(self) -> bool:
        """True when the bytes live in a shared-memory segment the consumer must unlink."""
        return self.shm_name is not None


def new_session_id() -> str:
    """A fresh random session id, for a launcher to export as MSTAR_SESSION before spawning."""
    return secrets.token_hex(6)


def session_id(session: str | None = None) -> str:
    """The session of this process: `session` if given, else $MSTAR_SESSION, else one per pid."""
    value = session or envs.session() or f"pid{os.getpid()}"
    if not _SESSION_RE.fullmatch(value):
        raise ValueError(
            f"invalid transport session id {value!r}: use 1-32 characters from [A-Za-z0-9_] "
            f"(set {envs.SESSION.name} or pass session=...)"
        )
    return value


def pack_tensor(
    t: torch.Tensor, *, inline_max_bytes: int = DEFAULT_INLINE_MAX_BYTES, session: str | None = None
) -> TensorPayload:
    """Describe `t` as a payload; the caller may reuse or free `t` as soon as this returns.

    Any layout is accepted (non-contiguous tensors are packed C-contiguous). GPU tensors are copied
    to the host: a CUDA IPC channel will keep them on device later.
    """
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    dtype, shape, nbytes = dtype_name(t), tuple(t.shape), t.numel() * t.element_size()
    if nbytes == 0:
        return TensorPayload(dtype, shape, 0)
    if nbytes <= inline_max_bytes:
        return TensorPayload(dtype, shape, nbytes, data=bytearray(_as_bytes(t)))
    name = f"mstar-{session_id(session)}-{os.getpid()}-{next(_counter)}"
    _write_segment(name, t, nbytes)
    return TensorPayload(dtype, shape, nbytes, shm_name=name)


def unpack_tensor(p: TensorPayload) -> torch.Tensor:
    """The tensor `p` describes, without a copy. Inline: the tensor shares `p.data`. Shm: this
    consumes the segment, which is unlinked at once while the tensor keeps it mapped (the pages are
    freed with the tensor); a shm payload can be unpacked once."""
    import torch

    dtype = dtype_from_name(p.dtype)
    if p.nbytes == 0:
        return torch.empty(p.shape, dtype=dtype)
    if p.data is not None:
        return torch.frombuffer(p.data, dtype=dtype).view(p.shape)
    assert p.shm_name is not None, "payload has neither inline data nor a segment"
    buf = _map_and_unlink(p.shm_name, p.nbytes)
    return torch.frombuffer(buf, dtype=dtype).view(p.shape)


def discard_payload(p: TensorPayload) -> None:
    """Release `p` without reading it (e.g. its message was dropped). Safe to call twice."""
    if p.shm_name is not None:
        try:
            (SHM_DIR / p.shm_name).unlink()
        except FileNotFoundError:
            pass


def list_segments(session: str | None = None) -> list[str]:
    """Names of the segments of `session` still present under /dev/shm (sorted)."""
    return sorted(f.name for f in SHM_DIR.glob(f"mstar-{session_id(session)}-*"))


def cleanup_segments(session: str | None = None) -> int:
    """Remove every leftover segment of `session` (all processes); returns how many were removed."""
    removed = 0
    for name in list_segments(session):
        try:
            (SHM_DIR / name).unlink()
            removed += 1
        except FileNotFoundError:
            pass  # its consumer got there first
    if removed:
        logger.info("removed %d leftover shared-memory segments of session %s", removed, session)
    return removed


def _write_segment(name: str, t: torch.Tensor, nbytes: int) -> None:
    # pwrite rather than copying into a fresh mmap: the kernel fills the tmpfs pages without a user
    # page fault per 4 KiB and without torch's intra-op threads.
    view = memoryview(_as_bytes(t))
    fd = os.open(SHM_DIR / name, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    try:
        written = 0
        while written < nbytes:
            written += os.pwrite(fd, view[written:], written)
    except BaseException:
        os.unlink(SHM_DIR / name)
        raise
    finally:
        os.close(fd)


def _map_and_unlink(name: str, nbytes: int) -> mmap.mmap:
    path = SHM_DIR / name
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"shared-memory segment {name!r} is gone: a shm payload can be unpacked once, and not "
            f"after discard_payload or cleanup_segments"
        ) from None
    try:
        os.unlink(path)  # the mapping keeps the pages; the name is freed now
        return mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)


def _as_bytes(t: torch.Tensor) -> np.ndarray:
    """The C-contiguous bytes of `t` as a uint8 array (no copy when `t` is already contiguous)."""
    import torch

    return t.contiguous().reshape(-1).view(torch.uint8).numpy()


def dtype_name(t: torch.Tensor) -> str:
    """The payload name of `t`'s dtype: torch's without the "torch." prefix."""
    return str(t.dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """The torch dtype a payload names; ValueError for an unknown name."""
    import torch

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown tensor dtype {name!r} in payload: expected a torch dtype name like 'float32'")
    return dtype
