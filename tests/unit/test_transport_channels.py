"""Control channels: inproc queues, ZMQ ipc/tcp, ordering across processes, dead peers.

torch is imported inside the helpers so the spawned dead-peer child starts fast.
"""

import multiprocessing as mp
import os
import socket
import time

import msgspec
import pytest

from mstar.transport import (
    Codec,
    InprocNetwork,
    Message,
    PeerUnavailable,
    TensorPayload,
    cleanup_segments,
    list_segments,
    make_network,
    new_session_id,
    pack_tensor,
    unpack_tensor,
)
from mstar.transport.zmq_channels import Directory, ZmqNetwork


class Tokens(Message):
    seq: int
    tensors: dict[str, TensorPayload] = {}


class Done(Message):
    count: int


CODEC = Codec(Tokens | Done)
N_MESSAGES = 1000


@pytest.fixture
def session():
    sid = new_session_id()
    yield sid
    cleanup_segments(sid)


@pytest.fixture(params=["inproc", "ipc", "tcp"])
def network(request, tmp_path):
    if request.param == "tcp":
        net = make_network("tcp", CODEC, port_base=_free_port(), peers=("api",))
    else:
        net = make_network(request.param, CODEC, run_dir=str(tmp_path))
    yield net
    net.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_send_before_inbox_exists_then_in_order(network):
    out = network.outbox()
    for i in range(5):
        out.send("api", Tokens(seq=i))  # the peer is "still starting"
    inbox = network.inbox("api")
    got = [inbox.recv(timeout_s=5) for _ in range(5)]
    assert [m.seq for m in got] == list(range(5))
    assert inbox.recv(timeout_s=0.05) is None
    out.close()
    inbox.close()


def test_inproc_passes_objects_and_rejects_closed_inbox(session):
    import torch

    net = InprocNetwork()
    inbox, out = net.inbox("w0"), net.outbox()
    msg = Tokens(seq=1)
    out.send("w0", msg)
    assert inbox.recv(timeout_s=0) is msg  # no encoding in-process
    with pytest.raises(ValueError, match="already exists"):
        net.inbox("w0")
    inbox.close()
    payload = pack_tensor(torch.ones(100), inline_max_bytes=0, session=session)
    with pytest.raises(PeerUnavailable, match="w0"):
        out.send("w0", Tokens(seq=2, tensors={"x": payload}))
    assert list_segments(session) == []  # the undeliverable message's segment was released


def test_make_network_errors_name_the_fix():
    with pytest.raises(ValueError, match="expected one of"):
        make_network("udp", CODEC)
    with pytest.raises(ValueError, match="pass codec="):
        make_network("ipc")
    with pytest.raises(ValueError, match="shorter run_dir"):
        Directory("ipc", run_dir="/tmp/" + "x" * 120).endpoint("api")
    with pytest.raises(ValueError, match="unknown tcp peer 'w9'"):
        Directory.tcp("127.0.0.1", 5555, ("api",)).endpoint("w9")
    across = Directory.tcp_addresses({"api": "tcp://10.0.0.1:5555", "w0": "tcp://10.0.0.2:6000"})
    assert across.endpoint("w0") == "tcp://10.0.0.2:6000"
    with pytest.raises(ValueError, match="unknown tcp peer 'w9'"):
        across.endpoint("w9")
    with pytest.raises(ValueError, match="tcp:// endpoints"):
        Directory.tcp_addresses({"api": "ipc:///tmp/api.sock"})


def test_send_to_missing_peer_times_out(tmp_path, session):
    import torch

    net = ZmqNetwork(Directory.ipc(str(tmp_path)), CODEC, send_hwm=5, send_timeout_s=0.1)
    out = net.outbox()
    start = time.monotonic()
    with pytest.raises(PeerUnavailable, match="nobody"):
        for i in range(1000):
            payload = pack_tensor(torch.ones(100), inline_max_bytes=0, session=session)
            out.send("nobody", Tokens(seq=i, tensors={"x": payload}))
    assert i < 100 and time.monotonic() - start < 5
    assert len(list_segments(session)) == i  # queued ones remain; the failed one was discarded
    net.close()


def _produce(directory_json: bytes, session: str, received) -> None:
    """Child: sends N_MESSAGES Tokens with an inline and a shm payload each, then Done, and keeps its
    socket open until the parent has them (closing drops what is still queued: LINGER 0)."""
    import torch

    net = ZmqNetwork(msgspec.json.decode(directory_json, type=Directory), CODEC)
    out = net.outbox()
    for i in range(N_MESSAGES):
        ids = torch.arange(i % 7 + 1)
        hidden = torch.full((4, 8), float(i), dtype=torch.bfloat16).t()  # non-contiguous, 64 bytes
        tensors = {
            "ids": pack_tensor(ids, session=session),
            "hidden": pack_tensor(hidden, inline_max_bytes=32, session=session),
        }
        out.send("api", Tokens(seq=i, tensors=tensors))
    out.send("api", Done(count=N_MESSAGES))
    received.wait(timeout=60)
    out.close()
    net.close()


def test_nested_payloads_between_processes_in_order(tmp_path, session):
    import torch

    directory = Directory.ipc(str(tmp_path))
    net = ZmqNetwork(directory, CODEC)
    inbox = net.inbox("api")
    ctx = mp.get_context("spawn")
    received = ctx.Event()
    child = ctx.Process(target=_produce, args=(msgspec.json.encode(directory), session, received))
    child.start()
    seqs = []
    while isinstance(msg := inbox.recv(timeout_s=30), Tokens):
        seqs.append(msg.seq)
        assert not msg.tensors["ids"].in_shm and msg.tensors["hidden"].in_shm
        assert torch.equal(unpack_tensor(msg.tensors["ids"]), torch.arange(msg.seq % 7 + 1))
        hidden = unpack_tensor(msg.tensors["hidden"])
        assert hidden.shape == (8, 4) and hidden.dtype == torch.bfloat16
        assert torch.equal(hidden, torch.full((8, 4), float(msg.seq), dtype=torch.bfloat16))
    received.set()
    child.join(timeout=30)
    assert isinstance(msg, Done) and msg.count == N_MESSAGES
    assert seqs == list(range(N_MESSAGES))
    assert child.exitcode == 0
    assert list_segments(session) == []
    net.close()


def _serve_once_then_die(directory_json: bytes) -> None:
    """Child: receive one message, then die without closing anything."""
    net = ZmqNetwork(msgspec.json.decode(directory_json, type=Directory), CODEC)
    net.inbox("worker").recv(timeout_s=30)
    os._exit(0)


def test_dead_peer_does_not_hang_send(tmp_path):
    directory = Directory.ipc(str(tmp_path))
    child = mp.get_context("spawn").Process(target=_serve_once_then_die, args=(msgspec.json.encode(directory),))
    child.start()
    net = ZmqNetwork(directory, CODEC, send_hwm=10, send_timeout_s=0.2)
    out = net.outbox()
    out.send("worker", Tokens(seq=0))
    child.join(timeout=30)
    assert child.exitcode == 0
    start = time.monotonic()
    with pytest.raises(PeerUnavailable, match="worker"):
        for i in range(100_000):
            out.send("worker", Tokens(seq=i))
    assert time.monotonic() - start < 10
    out.close()
    net.close()
