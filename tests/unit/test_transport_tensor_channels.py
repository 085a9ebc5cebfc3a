"""Tensor channels beside shared memory: TCP pull, torch.distributed point-to-point under gloo (two
processes), and the per-edge choice from placement. Every dtype and layout must arrive bit-exact."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.multiprocessing as tmp

from mstar.transport import Codec, ShmTensorChannel, new_session_id
from mstar.transport.dist_tensors import DistPayload
from mstar.transport.placed_channels import (
    CUDA_IPC,
    NCCL,
    SHM,
    TCP,
    AnyPayload,
    EdgeTransport,
    Endpoint,
    PlacedTensorChannel,
    choose_transport,
    needed_kinds,
)
from mstar.transport.tcp_tensors import TcpPayload, TcpTensorChannel
from mstar.transport.tensors import TensorPayload
from tests.unit.tensor_channel_cases import bit_equal, cases

CODEC = Codec(AnyPayload)
CASES = cases()


@pytest.fixture(scope="module")
def tcp_pair():
    sender, receiver = TcpTensorChannel(), TcpTensorChannel(timeout_s=10)
    yield sender, receiver
    sender.close()
    receiver.close()


@pytest.mark.parametrize("name", list(CASES))
def test_tcp_moves_every_dtype_and_layout_bit_exactly(name, tcp_pair):
    sender, receiver = tcp_pair
    t = CASES[name]
    payload = CODEC.decode(CODEC.encode(sender.pack(t, "peer")))
    big = t.numel() * t.element_size() > sender.inline_max_bytes
    assert isinstance(payload, TcpPayload if big else TensorPayload)
    out = receiver.unpack(payload)
    assert bit_equal(out, t) and out.is_contiguous()


def test_tcp_sender_may_reuse_its_tensor_and_payload_is_pulled_once(tcp_pair):
    sender, receiver = tcp_pair
    t = torch.arange(100_000, dtype=torch.int64)
    payload = sender.pack(t, "peer")
    t.fill_(-1)
    assert torch.equal(receiver.unpack(payload), torch.arange(100_000))
    with pytest.raises(KeyError, match="unpacked once"):
        receiver.unpack(payload)


def test_tcp_discard_and_cleanup_free_held_tensors(tcp_pair):
    sender, receiver = tcp_pair
    dropped = sender.pack(torch.ones(50_000), "peer")
    receiver.discard(dropped)
    kept = sender.pack(torch.ones(50_000), "peer")
    assert torch.equal(receiver.unpack(kept), torch.ones(50_000))  # served after the drop, in order
    with pytest.raises(KeyError):
        receiver.unpack(dropped)
    sender.pack(torch.ones(50_000), "peer")
    assert sender.cleanup() == 1


def test_tcp_answer_to_an_abandoned_request_is_skipped(tcp_pair):
    sender, receiver = tcp_pair
    abandoned, wanted = sender.pack(torch.zeros(50_000), "peer"), sender.pack(torch.ones(50_000), "peer")
    # as requests that timed out would leave them: asked for, their answers (one found, one not) never read
    for _ in range(2):
        receiver._client(abandoned.address).send_multipart([b"get", abandoned.transfer_id.to_bytes(8, "little")])
    assert torch.equal(receiver.unpack(wanted), torch.ones(50_000))


def test_tcp_unpack_times_out_when_the_sender_is_gone():
    sender, receiver = TcpTensorChannel(), TcpTensorChannel(timeout_s=0.3)
    payload = sender.pack(torch.ones(50_000), "peer")
    sender.close()
    with pytest.raises(TimeoutError, match="is the sender alive"):
        receiver.unpack(payload)
    receiver.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _dist_worker(rank: int, port: int, pipe, results) -> None:
    """Rank 0 packs every case (and two more for the order checks) and sends the payloads' bytes;
    rank 1 unpacks them and reports the names that did not arrive bit-exact."""
    import torch.distributed as dist

    from mstar.transport.dist_tensors import DistTensorChannel

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    channel = DistTensorChannel({"r0": 0, "r1": 1})
    want = cases()
    if rank == 0:
        for t in [*want.values(), torch.ones(3), torch.full((4,), 7)]:
            pipe.send_bytes(CODEC.encode(channel.pack(t, "r1")))
    else:
        payloads = [CODEC.decode(pipe.recv_bytes()) for _ in range(len(want) + 2)]
        bad = [name for name, p in zip(want, payloads) if not bit_equal(channel.unpack(p), want[name])]
        skipped, last = payloads[-2:]
        try:
            channel.unpack(last)
            bad.append("out of order accepted")
        except RuntimeError as exc:
            assert "in the order sent" in str(exc)
        channel.discard(skipped)
        if not torch.equal(channel.unpack(last), torch.full((4,), 7)):
            bad.append("after discard")
        results.put(bad)
    dist.barrier()  # rank 0's sends stay alive until rank 1 has them
    dist.destroy_process_group()


def test_dist_channel_under_gloo_moves_every_dtype_and_layout_bit_exactly():
    ctx = tmp.get_context("spawn")
    ends, results, port = ctx.Pipe(), ctx.Queue(), _free_port()
    procs = [ctx.Process(target=_dist_worker, args=(rank, port, ends[rank], results)) for rank in range(2)]
    for p in procs:
        p.start()
    try:
        assert results.get(timeout=120) == []
    finally:
        for p in procs:
            p.join(timeout=30)
    assert [p.exitcode for p in procs] == [0, 0]


def test_dist_payload_of_an_empty_tensor_takes_no_sequence_number():
    assert DistPayload("float32", (0, 4), 0, 0, -1).nbytes == 0


def test_choice_per_edge_follows_placement():
    gpu_a, cpu_a, gpu_b, cpu_b = Endpoint("a", "cuda"), Endpoint("a", "cpu"), Endpoint("b", "cuda"), Endpoint("b", "cpu")
    assert choose_transport(gpu_a, gpu_a) == EdgeTransport(CUDA_IPC, SHM)
    assert choose_transport(gpu_a, cpu_a) == EdgeTransport(SHM, SHM)
    assert choose_transport(cpu_a, gpu_a) == EdgeTransport(SHM, SHM)
    assert choose_transport(gpu_a, gpu_b) == EdgeTransport(TCP, TCP)  # no NCCL group between hosts
    assert choose_transport(gpu_a, gpu_b, nccl=True) == EdgeTransport(NCCL, TCP)
    assert choose_transport(gpu_a, cpu_b, nccl=True) == EdgeTransport(TCP, TCP)
    ends = {"api": cpu_a, "w0": gpu_a, "w1": gpu_a, "w2": gpu_b}
    assert needed_kinds("w0", ends) == {SHM, CUDA_IPC, TCP}
    assert needed_kinds("w0", ends, nccl=True) == {SHM, CUDA_IPC, NCCL, TCP}
    assert needed_kinds("api", ends, nccl=True) == {SHM, TCP}


class _Recording:
    def __init__(self, kind: str) -> None:
        self.kind, self.packed = kind, []

    def pack(self, tensor, peer):
        self.packed.append(peer)
        return TensorPayload("float32", (0,), 0)

    def unpack(self, payload):
        return self.kind

    def discard(self, payload):
        pass

    def cleanup(self) -> int:
        return 1


def test_placed_channel_routes_by_edge_and_device(caplog):
    ends = {"api": Endpoint("a", "cpu"), "w0": Endpoint("a", "cuda"), "w1": Endpoint("a", "cuda"),
            "w2": Endpoint("b", "cuda")}
    channels = {kind: _Recording(kind) for kind in (SHM, CUDA_IPC, NCCL, TCP)}
    with caplog.at_level("INFO", logger="mstar.transport.placed_channels"):
        PlacedTensorChannel("w0", ends, {kind: channels[kind] for kind in (SHM, CUDA_IPC, TCP)})
        placed = PlacedTensorChannel("w0", ends, channels, nccl=True)
    assert sorted(r.getMessage() for r in caplog.records) == [
        "tensors w0 -> api: GPU tensors by shm, host tensors by shm",
        "tensors w0 -> api: GPU tensors by shm, host tensors by shm",
        "tensors w0 -> w1: GPU tensors by cuda_ipc, host tensors by shm",
        "tensors w0 -> w1: GPU tensors by cuda_ipc, host tensors by shm",
        "tensors w0 -> w2: GPU tensors by nccl, host tensors by tcp",
        "tensors w0 -> w2: GPU tensors by tcp, host tensors by tcp",
    ]
    host = torch.ones(2)
    for peer in ("api", "w1", "w2"):
        placed.pack(host, peer)
    assert channels[SHM].packed == ["api", "w1"] and channels[TCP].packed == ["w2"]
    assert placed.unpack(TcpPayload("float32", (1,), 4, "tcp://x:1", 0)) == TCP
    assert placed.unpack(DistPayload("float32", (1,), 4, 2, 0)) == NCCL
    assert placed.cleanup() == 4
    with pytest.raises(KeyError, match="no tensor edge to 'w9'"):
        placed.pack(host, "w9")
    with pytest.raises(ValueError, match=r"need channels \['tcp'\]"):
        PlacedTensorChannel("w0", ends, {SHM: channels[SHM], CUDA_IPC: channels[CUDA_IPC]})
    with pytest.raises(ValueError, match=r"need channels \['nccl', 'tcp'\]"):
        PlacedTensorChannel("w0", ends, {SHM: channels[SHM], CUDA_IPC: channels[CUDA_IPC]}, nccl=True)


def test_placed_codec_sends_gpu_tensors_between_hosts_by_tcp(caplog):
    from mstar.runtime.codecs import placed_codec

    ends = {"api": Endpoint("a", "cpu"), "w0": Endpoint("a", "cuda"), "w2": Endpoint("b", "cuda")}
    tcp = _Recording(TCP)
    with caplog.at_level("INFO", logger="mstar.transport.placed_channels"):
        channel = placed_codec(new_session_id(), "w0", ends, tcp).channel
    assert channel.edges["w2"] == EdgeTransport(TCP, TCP) and channel.channels[TCP] is tcp
    assert NCCL not in channel.channels
    assert "tensors w0 -> w2: GPU tensors by tcp, host tensors by tcp" in [r.getMessage() for r in caplog.records]


def test_cuda_ipc_channel_sends_host_tensors_through_shared_memory():
    from mstar.transport.cuda_ipc import CudaIpcTensorChannel

    channel = CudaIpcTensorChannel(new_session_id(), inline_max_bytes=0)
    t = CASES["bfloat16_strided_large"]
    payload = CODEC.decode(CODEC.encode(channel.pack(t, "peer")))
    assert isinstance(payload, TensorPayload) and payload.in_shm
    assert bit_equal(channel.unpack(payload), t)
    channel.discard(channel.pack(t, "peer"))
    channel.pack(t, "peer")
    assert channel.cleanup() == 1


def test_messages_carry_and_discard_every_payload_kind():
    from mstar.transport import Message, discard_message, iter_payloads
    from mstar.transport.cuda_ipc import CudaIpcPayload

    class Carrier(Message):
        tensors: dict[str, AnyPayload]

    shm = ShmTensorChannel(new_session_id(), inline_max_bytes=0)
    tensors = {"shm": shm.pack(torch.ones(4), "peer"), "tcp": TcpPayload("float32", (1,), 4, "tcp://x:1", 0),
               "nccl": DistPayload("int8", (2,), 2, 0, 0),
               "ipc": CudaIpcPayload("float32", (0,), 0, b"", 0, 0, b"", 0, b"", False)}
    codec = Codec(Carrier)
    msg = codec.decode(codec.encode(Carrier(tensors=tensors)))
    assert msg.tensors == tensors
    assert sorted(type(p).__name__ for p in iter_payloads(msg)) == sorted(type(p).__name__ for p in tensors.values())
    assert discard_message(msg) == 4 and shm.cleanup() == 0  # the shm segment went with the message
