"""Tensor payloads: inline and shared-memory roundtrips, segment lifetime, nesting in messages."""

import msgspec
import pytest
import torch

from mstar.transport import (
    Codec,
    Message,
    ShmTensorChannel,
    TensorPayload,
    cleanup_segments,
    discard_message,
    discard_payload,
    iter_payloads,
    list_segments,
    new_session_id,
    pack_tensor,
    session_id,
    unpack_tensor,
)

INLINE = 1 << 30  # every tensor inline
SHM = 0  # every non-empty tensor through shared memory


@pytest.fixture
def session():
    sid = new_session_id()
    yield sid
    cleanup_segments(sid)


def _cases() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "float32": torch.randn(3, 5, generator=g),
        "bfloat16": torch.randn(4, 6, generator=g).to(torch.bfloat16),
        "int64": torch.arange(-7, 30),
        "bool": torch.rand(9, generator=g) > 0.5,
        "empty": torch.empty(0, 4),
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "non_contiguous": torch.randn(6, 8, generator=g)[::2, 1::3].t(),
        "uint8_3d": torch.randint(0, 255, (2, 3, 4), dtype=torch.uint8, generator=g),
    }


@pytest.mark.parametrize("limit", [INLINE, SHM], ids=["inline", "shm"])
@pytest.mark.parametrize("name", list(_cases()))
def test_roundtrip_through_codec(name, limit, session):
    t = _cases()[name]
    payload = pack_tensor(t, inline_max_bytes=limit, session=session)
    expect_shm = limit == SHM and t.numel() > 0
    assert payload.in_shm == expect_shm
    assert (payload.data is not None) == (not expect_shm and t.numel() > 0)
    decoded = Codec(TensorPayload).decode(Codec(TensorPayload).encode(payload))
    out = unpack_tensor(decoded)
    assert out.dtype == t.dtype and out.shape == t.shape and out.is_contiguous()
    assert torch.equal(out, t)
    assert list_segments(session) == []


def test_threshold_is_inclusive(session):
    t = torch.zeros(16, dtype=torch.float32)  # 64 bytes
    assert not pack_tensor(t, inline_max_bytes=64, session=session).in_shm
    assert pack_tensor(t, inline_max_bytes=63, session=session).in_shm


def test_default_threshold_is_64_kib(session):
    assert not pack_tensor(torch.zeros(16 * 1024), session=session).in_shm  # exactly 64 KiB
    assert pack_tensor(torch.zeros(16 * 1024 + 1), session=session).in_shm


def test_sender_may_reuse_tensor_after_pack(session):
    for limit in (INLINE, SHM):
        t = torch.arange(10, dtype=torch.int32)
        payload = pack_tensor(t, inline_max_bytes=limit, session=session)
        t.fill_(-1)
        assert torch.equal(unpack_tensor(payload), torch.arange(10, dtype=torch.int32))


def test_shm_unpack_unlinks_and_stays_valid(session):
    t = torch.randn(256, 256)
    payload = pack_tensor(t, inline_max_bytes=SHM, session=session)
    assert list_segments(session) == [payload.shm_name]
    assert payload.shm_name.startswith(f"mstar-{session}-")
    out = unpack_tensor(payload)
    assert list_segments(session) == []  # unlinked at once, mapping still alive
    out.add_(1)  # writable
    assert torch.allclose(out, t + 1)
    with pytest.raises(FileNotFoundError, match="unpacked once"):
        unpack_tensor(payload)


def test_discard_removes_segment_and_is_idempotent(session):
    payload = pack_tensor(torch.ones(1000), inline_max_bytes=SHM, session=session)
    assert len(list_segments(session)) == 1
    discard_payload(payload)
    discard_payload(payload)
    assert list_segments(session) == []
    with pytest.raises(FileNotFoundError):
        unpack_tensor(payload)


def test_cleanup_removes_only_its_session(session):
    other = new_session_id()
    for _ in range(3):
        pack_tensor(torch.ones(100), inline_max_bytes=SHM, session=session)
    kept = pack_tensor(torch.ones(100), inline_max_bytes=SHM, session=other)
    assert len(list_segments(session)) == 3
    assert cleanup_segments(session) == 3
    assert list_segments(session) == []
    assert list_segments(other) == [kept.shm_name]
    assert torch.equal(unpack_tensor(kept), torch.ones(100))


def test_session_from_env_and_validation(monkeypatch):
    monkeypatch.setenv("MSTAR_SESSION", "abc_123")
    assert session_id() == "abc_123"
    assert session_id("explicit") == "explicit"
    with pytest.raises(ValueError, match="invalid transport session id 'a-b'"):
        session_id("a-b")


class Step(Message):
    request_id: str
    tensors: dict[str, TensorPayload] = {}


class Finish(Message):
    request_id: str
    reason: str
    last: TensorPayload | None = None


def test_payloads_nest_in_message_unions(session):
    codec = Codec(Step | Finish)
    small, big = torch.arange(5), torch.randn(64, 64)
    msg = Step(
        request_id="r1",
        tensors={
            "ids": pack_tensor(small, session=session),
            "h": pack_tensor(big, inline_max_bytes=SHM, session=session),
        },
    )
    out = codec.decode(codec.encode(msg))
    assert isinstance(out, Step) and out.request_id == "r1"
    assert torch.equal(unpack_tensor(out.tensors["ids"]), small)
    assert torch.equal(unpack_tensor(out.tensors["h"]), big)
    fin = codec.decode(codec.encode(Finish(request_id="r1", reason="stop")))
    assert isinstance(fin, Finish) and fin.last is None
    with pytest.raises(msgspec.ValidationError):
        codec.decode(Codec(TensorPayload).encode(pack_tensor(small)))


def test_discard_message_frees_nested_segments(session):
    msg = Finish(
        request_id="r2",
        reason="cancelled",
        last=pack_tensor(torch.ones(10), inline_max_bytes=SHM, session=session),
    )
    payloads = {str(i): pack_tensor(torch.ones(10), inline_max_bytes=SHM, session=session) for i in range(3)}
    step = Step(request_id="r2", tensors=payloads)
    assert len(list_segments(session)) == 4
    assert len(list(iter_payloads([msg, step]))) == 4
    assert discard_message(msg) == 1 and discard_message(step) == 3
    assert list_segments(session) == []


def test_shm_tensor_channel(session):
    channel = ShmTensorChannel(session=session, inline_max_bytes=1024)
    small, big = torch.ones(8), torch.ones(1024)
    p_small, p_big = channel.pack(small, "worker0"), channel.pack(big, "worker0")
    assert not p_small.in_shm and p_big.in_shm
    assert torch.equal(channel.unpack(p_big), big)
    channel.pack(big, "worker0")
    assert channel.cleanup() == 1
