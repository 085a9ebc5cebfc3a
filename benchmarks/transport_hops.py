"""Cost of one transport hop between two processes on one host (measures; asserts nothing).

- small message (one token id) over ZMQ ipc: round trip at the sender, one way at the receiver;
- tensor hop (pack + send + recv + unpack, then optionally a full read) through shared memory for
  1 MB and 64 MB, and inline for comparison at 64 KiB and 1 MB (the inline-threshold choice);
- with --cuda, GPU tensor hops of 1 KB, 1 MB and 256 MB from a process on the first of --devices to one
  on the second (default: both on GPU 0): CUDA IPC (`CudaIpcTensorChannel`, which the runtime picks
  between GPU workers of one host, on one GPU or two: transport.placed_channels) against shared memory
  (`ShmTensorChannel`: a copy to the host, then onto the receiver's device) and, on two GPUs, NCCL
  point-to-point (`DistTensorChannel`). A CUDA IPC tensor arrives on the sender's device and is copied
  to the receiver's (peer to peer where the GPUs allow it), as a worker does with its inputs;
- with --dist-cpu, host tensors of the same sizes by `DistTensorChannel` under gloo against shared
  memory: the two-GPU run's NCCL code path, on a CPU.
A hop ends when the tensor is usable on the receiver's device (its stream synchronized); bandwidth is
bytes over the p50 hop. Each case's first (warm-up) hop also compares every received byte with the
sent tensor (`bytes_equal`).
Both processes run torch with one thread. One-way times use CLOCK_MONOTONIC (time.monotonic_ns), which is shared by processes on Linux.
Messages go one at a time (the receiver answers each), so these are latencies, not throughput.

    python3 benchmarks/transport_hops.py [--iters 5000] [--dist-cpu]    # -> results/transport_hops_cpu[_gloo].json
    python3 benchmarks/transport_hops.py --cuda                         # -> results/transport_hops_cuda_<gpu>.json
    python3 benchmarks/transport_hops.py --cuda --devices 0 1           # -> results/transport_hops_cuda_<gpu>_2gpu.json
--quick (a smoke run: few hops a case) writes a file only with --out.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import re
import shutil
import socket
import sys
import tempfile
import time
from datetime import timedelta
from functools import partial
from pathlib import Path

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install

from benchmarks.results_io import write_results  # noqa: E402
from mstar.transport import Codec, Message, ShmTensorChannel, new_session_id, pack_tensor  # noqa: E402
from mstar.transport.cuda_ipc import CudaIpcTensorChannel  # noqa: E402
from mstar.transport.dist_tensors import DistPayload, DistTensorChannel  # noqa: E402
from mstar.transport.placed_channels import CUDA_IPC, NCCL, SHM, AnyPayload, Endpoint, choose_transport  # noqa: E402
from mstar.transport.tensors import cleanup_segments  # noqa: E402
from mstar.transport.zmq_channels import Directory, ZmqNetwork  # noqa: E402

SIZES = (("1KB", 1 << 10, 500), ("1MB", 1 << 20, 200), ("256MB", 256 << 20, 10))  # name, bytes, timed hops
BENCH, ECHO = 0, 1  # torch.distributed ranks of the two processes
GLOO = "gloo"


class Ping(Message):
    t_ns: int
    token: int = 0
    tensor: AnyPayload | None = None
    device: str = ""  # the receiver copies the tensor there if it is elsewhere and synchronizes; "": host
    check_seed: int = -1  # >= 0: compare every byte with `_pattern(numel, check_seed)`


class WarmDist(Message):
    """Both ends post one point-to-point transfer on `device` at once, so a lazily created NCCL
    communicator is set up before a timed send waits on it."""

    device: str


class Pong(Message):
    one_way_ns: int  # sender's clock before it packed -> receiver's clock after recv + unpack
    unpack_ns: int = 0
    read_ns: int = 0  # one full read of the unpacked tensor (page faults of the zero-copy mapping)
    free_ns: int = 0  # dropping the tensor (unmapping frees the segment's pages)
    bytes_equal: bool | None = None  # the check a Ping asked for


class Stop(Message):
    pass


CODEC = Codec(Ping | WarmDist | Pong | Stop)


def _pattern(numel: int, seed: int):
    """The float32 values a case sends, made on the host from `seed` so the receiver can make them again."""
    import torch

    return torch.randn(numel, generator=torch.Generator().manual_seed(seed))


def bytes_equal(received, seed: int) -> bool:
    """Whether `received` holds exactly the bytes of `_pattern(numel, seed)` (float32, flat)."""
    import torch

    return received.dtype == torch.float32 and torch.equal(received.cpu().reshape(-1), _pattern(received.numel(), seed))


def _init_dist(backend: str, init: str, rank: int) -> None:
    import torch.distributed as dist

    dist.init_process_group(backend, init_method=init, rank=rank, world_size=2, timeout=timedelta(seconds=120))


def _echo(directory_json: bytes, device: str, dist_backend: str, dist_init: str) -> None:
    """Child: answers each Ping with a Pong carrying its measurements."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # intra-op threads only add noise on a shared, small CPU
    if device:
        torch.cuda.set_device(device)
    if dist_backend:
        _init_dist(dist_backend, dist_init, ECHO)
    net = ZmqNetwork(msgspec.json.decode(directory_json, type=Directory), CODEC)
    inbox, out = net.inbox("echo"), net.outbox()
    channel = CudaIpcTensorChannel()  # unpacks shared-memory payloads too
    dist_channels: dict[str, DistTensorChannel] = {}  # by the device received tensors are made on
    while isinstance(msg := inbox.recv(), Ping | WarmDist):
        if isinstance(msg, WarmDist):
            dist.recv(torch.empty(1, device=msg.device or "cpu"), group_src=BENCH)
            if msg.device:
                torch.cuda.synchronize(msg.device)
            out.send("bench", Pong(one_way_ns=0))
            continue
        t_recv = time.monotonic_ns()
        times = {}
        if msg.tensor is not None:
            if isinstance(msg.tensor, DistPayload):
                where = msg.device or "cpu"
                t = dist_channels.setdefault(where, DistTensorChannel({"bench": BENCH}, where)).unpack(msg.tensor)
            else:
                t = channel.unpack(msg.tensor)
            if msg.device:
                t = t.to(msg.device)
                torch.cuda.synchronize(msg.device)
            t_unpacked = time.monotonic_ns()
            t.sum().item()
            t_read = time.monotonic_ns()
            if msg.check_seed >= 0:
                times["bytes_equal"] = bytes_equal(t, msg.check_seed)
                t_read_checked = time.monotonic_ns()
            else:
                t_read_checked = t_read
            del t
            times |= {"unpack_ns": t_unpacked - t_recv, "read_ns": t_read - t_unpacked,
                      "free_ns": time.monotonic_ns() - t_read_checked}
            t_recv = t_unpacked
        out.send("bench", Pong(one_way_ns=t_recv - msg.t_ns, **times))
    net.close()
    if dist_backend:
        dist.destroy_process_group()


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


def _hops(inbox, out, pack_one, iters: int, device: str, seed: int) -> dict:
    """`iters` timed hops after two warm-up ones; the first warm-up hop checks the received bytes."""
    hop, pack, unpack, read, free = [], [], [], [], []
    checked = None
    for i in range(iters + 2):
        t0 = time.monotonic_ns()
        payload = pack_one()
        t_packed = time.monotonic_ns()
        out.send("echo", Ping(t_ns=t0, tensor=payload, device=device, check_seed=seed if i == 0 else -1))
        pong = inbox.recv()
        if i == 0:
            checked = pong.bytes_equal
        if i >= 2:
            hop.append(pong.one_way_ns)
            pack.append(t_packed - t0)
            unpack.append(pong.unpack_ns)
            read.append(pong.read_ns)
            free.append(pong.free_ns)
    parts = {"hop": hop, "pack": pack, "unpack": unpack, "read": read, "free": free}
    return {name: _stats_us(values) for name, values in parts.items()} | {"bytes_equal": checked}


def _warm_dist(inbox, out, device: str) -> None:
    import torch
    import torch.distributed as dist

    out.send("echo", WarmDist(device))
    dist.send(torch.zeros(1, device=device or "cpu"), group_dst=ECHO)
    inbox.recv()


def _sized_hops(inbox, out, channels: dict, send_device: str, recv_device: str, prefix: str, scale) -> dict:
    """Every size of SIZES through every channel (name -> TensorChannel), one tensor per size."""
    results = {}
    for size, nbytes, iters in SIZES:
        t = _pattern(nbytes // 4, nbytes).to(send_device or "cpu")
        for kind, channel in channels.items():
            result = _hops(inbox, out, partial(channel.pack, t, "echo"), scale(iters), recv_device, nbytes)
            result["bandwidth_GBps"] = nbytes / (result["hop"]["p50_us"] * 1e3)
            results[f"{prefix}_{size}_{kind}"] = result
    return results


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=5000, help="small-message round trips")
    parser.add_argument("--out", default=None, help="default: benchmarks/results/transport_hops_<cpu|cuda_<gpu>>"
                                                    "[_2gpu|_gloo].json (none for --quick)")
    parser.add_argument("--cuda", action="store_true", help="also GPU tensors: CUDA IPC (and NCCL on two GPUs) "
                                                            "against shared memory")
    parser.add_argument("--devices", type=int, nargs=2, default=None, metavar=("SENDER", "RECEIVER"),
                        help="the two processes' GPUs with --cuda (default: 0 0)")
    parser.add_argument("--dist-cpu", action="store_true", help="also host tensors by torch.distributed (gloo) "
                                                                "against shared memory")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 20 small messages, 2 timed hops a case")
    args = parser.parse_args(argv)
    if args.devices is not None and not args.cuda:
        sys.exit("transport_hops: --devices needs --cuda")
    args.devices = args.devices or [0, 0]
    if args.cuda:
        import torch

        visible = torch.cuda.device_count()
        if max(args.devices) >= visible:
            sys.exit(f"transport_hops: --devices {args.devices[0]} {args.devices[1]} needs GPU "
                     f"{max(args.devices)}, but {visible} GPU(s) are visible")
    if args.quick:
        args.iters = min(args.iters, 20)
    return args


def _result_name(args: argparse.Namespace) -> str:
    if not args.cuda:
        return "transport_hops_cpu" + ("_gloo" if args.dist_cpu else "")
    import torch

    found = re.search(r"h100|h200|b200|a100", torch.cuda.get_device_name(args.devices[0]), re.IGNORECASE)
    kind = found.group(0).lower() if found else "gpu"
    return f"transport_hops_cuda_{kind}" + ("_2gpu" if args.devices[0] != args.devices[1] else "") + \
        ("_gloo" if args.dist_cpu else "")


def _report(args: argparse.Namespace, argv: list[str] | None, backend: str, results: dict) -> dict:
    import torch
    import zmq

    two_gpus = args.cuda and args.devices[0] != args.devices[1]
    here = Endpoint(socket.gethostname(), "cuda")
    return {
        "command": "python3 " + " ".join(sys.argv if argv is None else [__file__, *argv]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
                    "torch": torch.__version__, "pyzmq": zmq.__version__, "msgspec": msgspec.__version__,
                    "gpu": [torch.cuda.get_device_name(d) for d in args.devices] if args.cuda else None,
                    "peer_access": torch.cuda.can_device_access_peer(*args.devices) if two_gpus else None},
        "devices": args.devices if args.cuda else None,
        "dist_backend": backend or None,
        "runtime_gpu_channel": choose_transport(here, here).gpu,  # what placement picks between GPU workers of a host
        "notes": "microseconds; one message in flight at a time; hop = pack + send + recv + unpack "
                 "(gpu_*: and the copy to the receiver's GPU, synchronized; read = first full read of "
                 "the unpacked tensor, free = dropping it; not in hop); bandwidth_GBps = bytes / p50 hop; "
                 "bytes_equal: every byte of the first warm-up hop's tensor compared with the sent one",
        "results": results,
    }


def main(argv: list[str] | None = None) -> dict:
    args = _parse(argv)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    send_device, recv_device = (f"cuda:{d}" for d in args.devices) if args.cuda else ("", "")
    two_gpus = args.cuda and args.devices[0] != args.devices[1]
    # one group for both: gloo carries host tensors, NCCL GPU ones
    backend = ",".join(([f"cpu:{GLOO}"] if args.dist_cpu else []) + (["cuda:nccl"] if two_gpus else []))
    if send_device:
        torch.cuda.set_device(send_device)
    session = new_session_id()
    directory = Directory.ipc()
    net = ZmqNetwork(directory, CODEC, owns_run_dir=True)
    inbox, out = net.inbox("bench"), net.outbox()
    dist_dir = tempfile.mkdtemp(prefix="transport_hops_")
    dist_init = f"file://{dist_dir}/store"
    child = mp.get_context("spawn").Process(target=_echo, args=(msgspec.json.encode(directory), recv_device,
                                                                 backend, dist_init))
    child.start()
    if backend:
        _init_dist(backend, dist_init, BENCH)
    scale = (lambda n: min(n, 2)) if args.quick else (lambda n: n)
    results = {"small_message_ipc": _small_messages(inbox, out, args.iters)}
    cases = [("64KiB_inline", 64 << 10, True, 500), ("64KiB_shm", 64 << 10, False, 500),
             ("1MB_inline", 1 << 20, True, 200), ("1MB_shm", 1 << 20, False, 200), ("64MB_shm", 64 << 20, False, 20)]
    for name, nbytes, inline, iters in cases:
        t = _pattern(nbytes // 4, nbytes)
        pack_one = partial(pack_tensor, t, inline_max_bytes=nbytes if inline else 0, session=session)
        results[f"tensor_{name}"] = _hops(inbox, out, pack_one, scale(iters), "", nbytes)
    senders = {}  # a dist channel per device, as the receiver has: each numbers its own payloads
    if args.dist_cpu:
        _warm_dist(inbox, out, "")
        senders[GLOO] = DistTensorChannel({"echo": ECHO})
        results |= _sized_hops(inbox, out, {GLOO: senders[GLOO], SHM: ShmTensorChannel(session)}, "", "", "host",
                               scale)
    if args.cuda:
        channels = {CUDA_IPC: CudaIpcTensorChannel(session), SHM: ShmTensorChannel(session)}
        if two_gpus:
            _warm_dist(inbox, out, send_device)
            channels[NCCL] = senders[NCCL] = DistTensorChannel({"echo": ECHO}, send_device)
        results |= _sized_hops(inbox, out, channels, send_device, recv_device, "gpu", scale)
    out.send("echo", Stop())
    child.join(timeout=60)
    net.close()
    cleanup_segments(session)
    for sender in senders.values():
        sender.cleanup()
    if backend:
        dist.destroy_process_group()
    shutil.rmtree(dist_dir, ignore_errors=True)
    report = _report(args, argv, backend, results)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_results(report, args.out, args.quick, _result_name(args))
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
