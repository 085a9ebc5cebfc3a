"""Run a function on P spawned ranks joined by `mstar.distributed.ProcessGroups`; collect each rank's result.

`run_ranks(fn, size, device_type)` spawns `size` processes; rank r calls `fn(replica_group, device)`
and its (picklable, CPU) return value comes back in rank order. A failing rank fails the call with
its traceback.
"""

from __future__ import annotations

import socket
import traceback
from pathlib import Path
from typing import Any

import torch


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_main(rank: int, fn, size: int, port: int, device_type: str, out_dir: str) -> None:
    from mstar.distributed.groups import ProcessGroups, Rendezvous

    device = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
    if device_type == "cuda":
        torch.cuda.set_device(device)
    groups = ProcessGroups(Rendezvous("127.0.0.1", port, size, timeout_s=60.0), rank, device)
    path = Path(out_dir) / f"rank{rank}.pt"
    try:
        groups.start([tuple(range(size))])
        result = fn(groups.group(tuple(range(size))), device)
        torch.save({"ok": result}, path)
    except BaseException:
        torch.save({"error": traceback.format_exc()}, path)
        raise
    finally:
        groups.close()


def run_ranks(fn, size: int, device_type: str, tmp_path: Path) -> list[Any]:
    """fn(replica_group, device) on `size` spawned ranks; the results, rank 0 first."""
    import torch.multiprocessing as mp

    mp.spawn(_rank_main, args=(fn, size, free_port(), device_type, str(tmp_path)), nprocs=size)
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(size)]
    errors = [r["error"] for r in results if "error" in r]
    assert not errors, "\n".join(errors)
    return [r["ok"] for r in results]
