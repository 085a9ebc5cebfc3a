"""Config search for the skinny-GEMM kernels, used by gemv_micro.py --sweep.

Triton compiles dominate a sweep's time, so the search is greedy: from the heuristic's pick it
changes one field at a time and keeps the fastest, until
no single change helps; what is left of the cell's time goes to the untried configs nearest the best.
Each batch of candidates is compiled in parallel threads first (one warm-up call each), then timed one
by one with `graph_time_us` (a CUDA graph of back-to-back calls, weights from HBM).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from mstar.kernels.skinny_gemm import SkinnyConfig
from mstar.kernels.timing import graph_time_us

FIELDS = ("block_n", "split_k", "num_warps", "block_k", "num_stages", "fold_k")
Run = Callable[[torch.Tensor, SkinnyConfig], object]


def gemv_grid(bucket: int, n: int, k: int, sms: int) -> set[SkinnyConfig]:
    """GEMV-kernel configs (block_m <= 4) whose accumulator fits in registers and that fill the GPU.
    Unfolded, the accumulators hold bucket x the weight tile; folded by 8 (`fold_k`), an eighth of
    that, so larger weight tiles (more bytes in flight per thread) fit beside them."""
    grid = set()
    for bn, bk, split, warps, stages, fold in itertools.product((1, 2, 4, 8, 16), (256, 512, 1024, 2048),
                                                                (1, 2, 4, 8), (2, 4, 8), (1, 2, 3), (1, 8)):
        tiles, tile_regs = -(-n // bn), bn * bk // (32 * warps)
        acc_regs = bucket * tile_regs // fold
        if not 8 <= max(acc_regs, tile_regs) or acc_regs > 128 or tile_regs > 128:
            continue
        if bk > k or tiles * split < sms or k // split < bk:
            continue
        if split > 1 and tiles >= 4 * sms:
            continue  # enough programs already: a split only adds partial-sum traffic
        grid.add(SkinnyConfig(bucket, bn, bk, split, warps, stages, fold))
    return grid


def dot_grid(bucket: int, n: int, k: int, sms: int) -> set[SkinnyConfig]:
    """tl.dot-kernel configs (block_m >= 16) whose pipeline stages fit in shared memory."""
    bm, grid = max(bucket, 16), set()
    for bn, bk, split, warps, stages in itertools.product((16, 32, 64), (64, 128, 256), (1, 2, 4, 8), (4, 8), (3, 4)):
        if (bm + bn) * bk * 2 * stages > 200_000 or k // split < bk or -(-n // bn) * split < sms:
            continue
        grid.add(SkinnyConfig(bm, bn, bk, split, warps, stages))
    return grid


def _distance(a: SkinnyConfig, b: SkinnyConfig) -> int:
    return sum(getattr(a, f) != getattr(b, f) for f in FIELDS)


class Sweep:
    """Greedy search of `grid` for the fastest config of `run(weight, config)` before `deadline`."""

    def __init__(self, run: Run, weight: torch.Tensor, grid: set[SkinnyConfig], deadline: float,
                 replays: int = 5, threads: int = 8) -> None:
        self.run, self.weight, self.grid, self.deadline = run, weight, grid, deadline
        self.replays, self.threads = replays, threads
        self.timed: dict[SkinnyConfig, float] = {}

    def best(self, starts: list[SkinnyConfig]) -> tuple[SkinnyConfig, float] | None:
        """(config, us) of the fastest config timed, starting from `starts`; None if none could run."""
        self._measure(starts)
        while self.timed and not self._late():
            before = self._best()
            for field in FIELDS:
                values = sorted({getattr(c, field) for c in self.grid})
                moved = (dataclasses.replace(before, **{field: v}) for v in values)
                self._measure([c for c in moved if c in self.grid])
            if self._best() == before:
                break
        if self.timed:  # the rest of the time: untried configs nearest the best, a batch at a time
            rest = sorted(self.grid - self.timed.keys(), key=lambda c: _distance(c, self._best()))
            for i in range(0, len(rest), self.threads):
                if self._late():
                    break
                self._measure(rest[i:i + self.threads])
        if not self.timed or math.isinf(self.timed[self._best()]):
            return None
        return self._best(), self.timed[self._best()]

    def _best(self) -> SkinnyConfig:
        return min(self.timed, key=self.timed.__getitem__)

    def _late(self) -> bool:
        return time.monotonic() > self.deadline

    def _measure(self, batch: list[SkinnyConfig]) -> None:
        batch = [c for c in dict.fromkeys(batch) if c not in self.timed]
        if not batch or self._late():
            return
        with ThreadPoolExecutor(self.threads) as pool:  # compile in parallel; errors show when timed
            list(pool.map(self._warm, batch))
        torch.cuda.synchronize()
        for cfg in batch:
            if self._late():
                return
            try:
                self.timed[cfg] = graph_time_us(lambda w, cfg=cfg: self.run(w, cfg), self.weight,
                                                replays=self.replays)
            except Exception as err:  # a config the compiler cannot fit (registers, shared memory)
                print(f"  skip {cfg}: {type(err).__name__}: {str(err)[:100]}", flush=True)
                self.timed[cfg] = math.inf

    def _warm(self, cfg: SkinnyConfig) -> None:
        try:
            self.run(self.weight, cfg)
        except Exception:  # noqa: BLE001 - reported by the timing pass, which runs it again
            pass

    @property
    def tried(self) -> int:
        """How many configs were timed."""
        return sum(not math.isinf(t) for t in self.timed.values())
