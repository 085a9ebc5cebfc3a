"""CUDA IPC tensor channel: two processes on one GPU exchange tensors of every dtype and layout
bit-exactly, with no device-to-host copy on either side (counted in a profiler trace) and no new
allocation in the receiver; a sent block outlives the sender's tensor until the receiver is done."""

from __future__ import annotations

import torch
import torch.multiprocessing as tmp

from mstar.transport import Codec
from mstar.transport.placed_channels import AnyPayload
from tests.unit.tensor_channel_cases import bit_equal, cases

CODEC = Codec(AnyPayload)
BIG = 64 << 20


def _host_copies(prof) -> int:
    """Copies between host and device in a profiler trace (kineto names them 'Memcpy DtoH ...')."""
    return sum(1 for e in prof.events() if "DtoH" in e.name or "HtoD" in e.name)


def _profiled(fn):
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        out = fn()
        torch.cuda.synchronize()
    return out, _host_copies(prof)


def _sender(pipe, results) -> None:
    from mstar.transport.cuda_ipc import CudaIpcTensorChannel

    channel = CudaIpcTensorChannel()
    on_gpu = {name: t.cuda() for name, t in cases().items()}
    payloads, copies = _profiled(lambda: [channel.pack(t, "receiver") for t in on_gpu.values()])
    results.put(("sender host copies", copies))
    on_gpu.clear()  # the blocks must outlive our tensors: the receiver has not mapped them yet
    junk = [torch.full((n,), 0x5A, dtype=torch.uint8, device="cuda") for n in (1 << 10, 1 << 16, 1 << 20) * 20]
    torch.cuda.synchronize()
    for p in payloads:
        pipe.send_bytes(CODEC.encode(p))
    assert pipe.recv() == "received"
    torch.cuda.ipc_collect()  # the blocks the receiver has let go of
    # discard: the block stays parked until the receiver releases it, then ipc_collect frees it
    big = channel.pack(torch.ones(BIG // 4, device="cuda"), "receiver")
    torch.cuda.synchronize()
    parked = torch.cuda.memory_allocated()
    torch.cuda.ipc_collect()
    results.put(("kept before discard", torch.cuda.memory_allocated() == parked))
    pipe.send_bytes(CODEC.encode(big))
    assert pipe.recv() == "discarded"
    torch.cuda.ipc_collect()
    results.put(("freed after discard", parked - torch.cuda.memory_allocated() >= BIG))
    del junk
    pipe.send("done")


def _receiver(pipe, results) -> None:
    from mstar.transport.cuda_ipc import CudaIpcTensorChannel

    channel = CudaIpcTensorChannel()
    want = cases()
    payloads = [CODEC.decode(pipe.recv_bytes()) for _ in want]
    torch.cuda.init()
    allocated = torch.cuda.memory_allocated()
    got, copies = _profiled(lambda: [channel.unpack(p) for p in payloads])
    results.put(("receiver host copies", copies))
    results.put(("receiver allocated", torch.cuda.memory_allocated() - allocated))
    results.put(("on device", all(t.is_cuda for t in got)))
    results.put(("not bit-exact", [name for name, t in zip(want, got) if not bit_equal(t, want[name])]))
    del got
    pipe.send("received")
    channel.discard(CODEC.decode(pipe.recv_bytes()))
    pipe.send("discarded")
    assert pipe.recv() == "done"


def test_two_processes_on_one_gpu_exchange_tensors_without_host_copies():
    ctx = tmp.get_context("spawn")
    a, b = ctx.Pipe()
    results = ctx.Queue()
    procs = [ctx.Process(target=_sender, args=(a, results)), ctx.Process(target=_receiver, args=(b, results))]
    for p in procs:
        p.start()
    try:
        seen = dict(results.get(timeout=300) for _ in range(7))
    finally:
        for p in procs:
            p.join(timeout=60)
    assert [p.exitcode for p in procs] == [0, 0]
    assert seen == {
        "sender host copies": 0, "receiver host copies": 0, "receiver allocated": 0, "on device": True,
        "not bit-exact": [], "kept before discard": True, "freed after discard": True,
    }
