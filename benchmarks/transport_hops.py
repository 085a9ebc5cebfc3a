"""Cost of one transport hop between two processes on one host (measures; asserts nothing).

- small message (one token id) over ZMQ ipc: round trip at the sender, one way at the receiver;
- tensor hop (pack + send + recv + unpack, then optionally a full read) through shared memory for
  1 MB and 64 MB, and inline for comparison at 64 KiB and 1 MB (the inline-threshold choice);
- with --cuda, GPU tensor hops of 1 KB, 1 MB and 256 MB between two processes on one GPU: CUDA IPC
  (`CudaIpcTensorChannel`) against shared memory (`ShmTensorChannel`: a copy to the host, then back
  to the device at the receiver). A GPU hop ends when the tensor is usable on the receiver's device
  (its stream synchronized), and bandwidth is bytes over the p50 hop.
Both processes run torch with one thread. One-way times use CLOCK_MONOTONIC (time.monotonic_ns), which is shared by processes on Linux.
Messages go one at a time (the receiver answers each), so these are latencies, not throughput.

    python3 benchmarks/transport_hops.py [--iters 5000] [--out benchmarks/results/transport_hops_cpu.json]
    python3 benchmarks/transport_hops.py --cuda --iters 2000 --out benchmarks/results/transport_hops_cuda.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import sys
import time
from pathlib import Path

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install

from mstar.transport import Codec, Message, ShmTensorChannel, new_session_id, pack_tensor  # noqa: E402
from mstar.transport.cuda_ipc import CudaIpcTensorChannel  # noqa: E402
from mstar.transport.placed_channels import AnyPayload  # noqa: E402
from mstar.transport.tensors import cleanup_segments  # noqa: E402
from mstar.transport.zmq_channels import Directory, ZmqNetwork  # noqa: E402


class Ping(Message):
    t_ns: int
    token: int = 0
    tensor: AnyPayload | None = None
    on_gpu: bool = False  # the receiver moves the tensor to its GPU (if not there) and synchronizes


class Pong(Message):
    one_way_ns: int  # sender's clock before it packed -> receiver's clock after recv + unpack
    unpack_ns: int = 0
    read_ns: int = 0  # one full read of the unpacked tensor (page faults of the zero-copy mapping)
    free_ns: int = 0  # dropping the tensor (unmapping frees the segment's pages)


class Stop(Message):
    pass


CODEC = Codec(Ping | Pong | Stop)


def _echo(directory_json: bytes) -> None:
    """Child: answers each Ping with a Pong carrying its measurements."""
    import torch

    torch.set_num_threads(1)  # intra-op threads only add noise on a shared, small CPU
    net = ZmqNetwork(msgspec.json.decode(directory_json, type=Directory), CODEC)
    inbox, out = net.inbox("echo"), net.outbox()
    channel = CudaIpcTensorChannel()  # unpacks shared-memory payloads too
    while isinstance(msg := inbox.recv(), Ping):
        t_recv = time.monotonic_ns()
        times = {}
        if msg.tensor is not None:
            t = channel.unpack(msg.tensor)
            if msg.on_gpu:
                t = t.cuda()
                torch.cuda.synchronize()
            t_unpacked = time.monotonic_ns()
            t.sum().item()
            t_read = time.monotonic_ns()
            del t
            times = {"unpack_ns": t_unpacked - t_recv, "read_ns": t_read - t_unpacked,
                     "free_ns": time.monotonic_ns() - t_read}
            t_recv = t_unpacked
        out.send("bench", Pong(one_way_ns=t_recv - msg.t_ns, **times))
    net.close()


def _stats_us(values_ns: list[int]) -> dict[str, float]:
    xs = sorted(values_ns)
    pick = lambda q: xs[min(len(xs) - 1, int(q * len(xs)))] / 1e3  # noqa: E731
    return {"p50_us": pick(0.50), "p99_us": pick(0.99), "mean_us": sum(xs) / len(xs) / 1e3, "n": len(xs)}


def _small_messages(inbox, out, iters: int) -> dict:
    rtt, one_way = [], []
    for i in range(iters + iters // 10):
        t0 = time.monotonic_ns()
        out.send("echo", Ping(t_ns=t0, token=i))
        pong = inbox.recv()
        if i >= iters // 10:  # the first tenth warms up
            rtt.append(time.monotonic_ns() - t0)
            one_way.append(pong.one_way_ns)
    return {"round_trip": _stats_us(rtt), "one_way": _stats_us(one_way)}


def _tensor_hops(inbox, out, nbytes: int, inline: bool, iters: int, session: str) -> dict:
    import torch

    t = torch.randn(nbytes // 4)
    limit = nbytes if inline else 0
    return _hops(inbox, out, lambda: pack_tensor(t, inline_max_bytes=limit, session=session), iters, False)


def _gpu_hops(inbox, out, nbytes: int, channel, iters: int) -> dict:
    import torch

    t = torch.randn(nbytes // 4, device="cuda")
    result = _hops(inbox, out, lambda: channel.pack(t, "echo"), iters, True)
    result["bandwidth_GBps"] = nbytes / (result["hop"]["p50_us"] * 1e3)
    return result


def _hops(inbox, out, pack_one, iters: int, on_gpu: bool) -> dict:
    hop, pack, unpack, read, free = [], [], [], [], []
    for i in range(iters + 2):
        t0 = time.monotonic_ns()
        payload = pack_one()
        t_packed = time.monotonic_ns()
        out.send("echo", Ping(t_ns=t0, tensor=payload, on_gpu=on_gpu))
        pong = inbox.recv()
        if i >= 2:
            hop.append(pong.one_way_ns)
            pack.append(t_packed - t0)
            unpack.append(pong.unpack_ns)
            read.append(pong.read_ns)
            free.append(pong.free_ns)
    parts = {"hop": hop, "pack": pack, "unpack": unpack, "read": read, "free": free}
    return {name: _stats_us(values) for name, values in parts.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=5000, help="small-message round trips")
    parser.add_argument("--out", default=None, help="default: benchmarks/results/transport_hops_{cpu,cuda}.json")
    parser.add_argument("--cuda", action="store_true", help="also GPU tensors: CUDA IPC against shared memory")
    args = parser.parse_args()
    args.out = args.out or f"benchmarks/results/transport_hops_{'cuda' if args.cuda else 'cpu'}.json"
    import torch
    import zmq

    torch.set_num_threads(1)
    session = new_session_id()
    directory = Directory.ipc()
    net = ZmqNetwork(directory, CODEC, owns_run_dir=True)
    inbox, out = net.inbox("bench"), net.outbox()
    child = mp.get_context("spawn").Process(target=_echo, args=(msgspec.json.encode(directory),))
    child.start()
    results = {"small_message_ipc": _small_messages(inbox, out, args.iters)}
    cases = [("64KiB_inline", 64 << 10, True, 500), ("64KiB_shm", 64 << 10, False, 500),
             ("1MB_inline", 1 << 20, True, 200), ("1MB_shm", 1 << 20, False, 200), ("64MB_shm", 64 << 20, False, 20)]
    for name, nbytes, inline, iters in cases:
        results[f"tensor_{name}"] = _tensor_hops(inbox, out, nbytes, inline, iters, session)
    if args.cuda:
        channels = {"cuda_ipc": CudaIpcTensorChannel(session), "shm": ShmTensorChannel(session)}
        for size, nbytes, iters in (("1KB", 1 << 10, 500), ("1MB", 1 << 20, 200), ("256MB", 256 << 20, 10)):
            for kind, channel in channels.items():
                results[f"gpu_{size}_{kind}"] = _gpu_hops(inbox, out, nbytes, channel, iters)
    out.send("echo", Stop())
    child.join(timeout=30)
    net.close()
    cleanup_segments(session)
    report = {
        "command": "python3 " + " ".join(sys.argv),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
                    "torch": torch.__version__, "pyzmq": zmq.__version__, "msgspec": msgspec.__version__,
                    "gpu": torch.cuda.get_device_name() if args.cuda else None},
        "notes": "microseconds; one message in flight at a time; hop = pack + send + recv + unpack "
                 "(gpu_*: and the copy to the receiver's GPU, synchronized; read = first full read of "
                 "the unpacked tensor, free = dropping it; not in hop); bandwidth_GBps = bytes / p50 hop",
        "results": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
