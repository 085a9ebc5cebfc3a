"""Summaries of benchmark records: percentiles per concurrency level and a plain-text table."""

from __future__ import annotations

import math
from collections.abc import Sequence

from mstar.cli.bench_requests import RequestRecord

PERCENTILES = (50, 95, 99)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile with linear interpolation (numpy's default); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    low, high = math.floor(pos), math.ceil(pos)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def latency_stats(values_s: Sequence[float]) -> dict[str, float | None]:
    """mean and p50/p95/p99 in milliseconds."""
    ms = [v * 1000.0 for v in values_s]
    stats: dict[str, float | None] = {"mean": sum(ms) / len(ms) if ms else None}
    stats.update({f"p{q}": percentile(ms, q) for q in PERCENTILES})
    return stats


def summarize(records: Sequence[RequestRecord], wall_s: float, concurrency: int, workload: str,
              sample_rate: int) -> dict:
    """One concurrency level's numbers. Rates divide by `wall_s`, the time from the first request sent to
    the last one finished; failed requests count only as errors."""
    ok = [r for r in records if r.ok]
    wall = max(wall_s, 1e-9)
    out = {"concurrency": concurrency, "requests": len(records), "completed": len(ok),
           "errors": len(records) - len(ok), "wall_s": wall_s, "requests_per_s": len(ok) / wall,
           "e2e_ms": latency_stats([r.e2e_s for r in ok]),
           "error_samples": sorted({r.error for r in records if r.error})[:5]}
    first = [r.first_output_s for r in ok if r.first_output_s is not None]
    gaps = [g for r in ok for g in r.gaps_s]
    if workload == "chat":
        tokens = sum(r.output_tokens for r in ok)
        out.update({"output_tokens": tokens, "output_tokens_per_s": tokens / wall,
                    "ttft_ms": latency_stats(first), "itl_ms": latency_stats(gaps)})
    else:
        seconds = [r.audio_bytes / (2.0 * sample_rate) for r in ok]  # 16-bit mono PCM
        rtf = [r.e2e_s / s for r, s in zip(ok, seconds) if s > 0]
        out.update({"audio_bytes": sum(r.audio_bytes for r in ok), "audio_s": sum(seconds),
                    "audio_s_per_s": sum(seconds) / wall, "time_to_first_audio_ms": latency_stats(first),
                    "chunk_gap_ms": latency_stats(gaps),
                    "rtf": {"mean": sum(rtf) / len(rtf) if rtf else None,
                            **{f"p{q}": percentile(rtf, q) for q in PERCENTILES}}})
    return out


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def format_table(results: Sequence[dict], workload: str) -> str:
    """A fixed-width text table, one row per concurrency level."""
    if workload == "chat":
        head = ["conc", "done", "err", "req/s", "tok/s", "ttft p50", "ttft p99", "itl p50", "itl p99",
                "e2e p50", "e2e p99"]
        rows = [[r["concurrency"], r["completed"], r["errors"], _fmt(r["requests_per_s"], 2),
                 _fmt(r["output_tokens_per_s"]), _fmt(r["ttft_ms"]["p50"]), _fmt(r["ttft_ms"]["p99"]),
                 _fmt(r["itl_ms"]["p50"]), _fmt(r["itl_ms"]["p99"]), _fmt(r["e2e_ms"]["p50"]),
                 _fmt(r["e2e_ms"]["p99"])] for r in results]
    else:
        head = ["conc", "done", "err", "req/s", "audio s/s", "rtf p50", "ttfa p50", "ttfa p99", "e2e p50",
                "e2e p99"]
        rows = [[r["concurrency"], r["completed"], r["errors"], _fmt(r["requests_per_s"], 2),
                 _fmt(r["audio_s_per_s"], 2), _fmt(r["rtf"]["p50"], 3), _fmt(r["time_to_first_audio_ms"]["p50"]),
                 _fmt(r["time_to_first_audio_ms"]["p99"]), _fmt(r["e2e_ms"]["p50"]),
                 _fmt(r["e2e_ms"]["p99"])] for r in results]
    cells = [head] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(head))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
    unit = "latencies in ms" if workload == "chat" else "latencies in ms; ttfa = time to first audio"
    return "\n".join(lines + [f"({unit})"]) + "\n"
