"""The printed summary of profile_omni.py: one row per timed case, then the top kernels of each profile."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, TextIO

_COLUMNS = (("host", "host_ms"), ("gpu", "gpu_ms"), ("wall", "wall_ms"), ("first", "first_ms"),
            ("kernel", "kernel_ms"), ("peakGiB", "peak_gib"))


def timed_rows(doc: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(dotted case name, numbers) for every timed case in the document, in document order."""
    def walk(prefix: str, node: Any) -> Iterator[tuple[str, dict[str, Any]]]:
        if not isinstance(node, dict):
            return
        if any(k in node for k in ("wall_ms", "frame_ms")):
            yield prefix, _row(node)
            return
        for key, value in node.items():
            yield from walk(f"{prefix}.{key}" if prefix else key, value)
    yield from walk("", doc.get("cases", {}))


def _row(node: dict[str, Any]) -> dict[str, Any]:
    if "frame_ms" in node:  # the talk loop: per-frame host split
        return {"wall_ms": node["frame_ms"], "note": " ".join(f"{k}={v}" for k, v in node["host_ms_split"].items())}
    row = {k: node.get(k) for _, k in _COLUMNS}
    if "forward_gpu_ms" in node:  # a decode case: host = submit + step, GPU = the graph replayed alone
        row["host_ms"], row["gpu_ms"] = node.get("wall_ms"), node.get("forward_gpu_ms")
        paths = node.get("paths", {})
        row["note"] = " ".join(f"{k}={v}" for k, v in paths.items() if v) + f" submit={node.get('submit_ms')}"
    row["kernel_ms"] = (node.get("kernels") or {}).get("kernel_ms")
    return row


def print_table(doc: dict[str, Any], out: TextIO) -> None:
    """The rows of `timed_rows`, the per-component build numbers and the top kernels (5 per profile)."""
    out.write(f"\n{doc.get('device')}  torch {doc.get('torch')}  total {doc.get('total_s')} s\n")
    out.write(f"{'case':44}" + "".join(f"{title:>9}" for title, _ in _COLUMNS) + "  note\n")
    for name, row in timed_rows(doc):
        cells = "".join(f"{_fmt(row.get(key)):>9}" for _, key in _COLUMNS)
        out.write(f"{name[:44]:44}{cells}  {row.get('note', '')}\n")
    for name, info in doc.get("components", {}).items():
        out.write(f"{name:16} " + " ".join(f"{k}={v}" for k, v in info.items()) + "\n")
    for name, kernels in _kernel_profiles(doc.get("cases", {}), ""):
        out.write(f"\n{name}: {kernels['kernels']} kernels, {kernels['kernel_ms']} ms  {kernels['categories_ms']}"
                  f"  sdpa={kernels['sdpa_backends']}\n")
        for k in kernels["top"][:5]:
            out.write(f"  {k['ms']:>9.3f} ms x{k['count']:<6} {k['category']:17} {k['name'][:80]}\n")
    for name, variant in doc.get("cases", {}).get("code2wav", {}).items():
        if isinstance(variant, dict) and "stages_chunk_b1_ms" in variant:
            stages = variant["stages_chunk_b1_ms"]
            out.write(f"\ncode2wav {name} stages (chunk, b1) ms: " + " ".join(f"{k}={v}" for k, v in stages.items()))
            lengths = " ".join(f"{r['frames']}f:{r['first_ms']}/{r['again_ms']}" for r in variant["new_length_b1_ms"])
            out.write(f"\n  new lengths (frames: first/again ms): {lengths}\n")


def _kernel_profiles(node: Any, prefix: str) -> Iterator[tuple[str, dict[str, Any]]]:
    if not isinstance(node, dict):
        return
    for key, value in node.items():
        name = f"{prefix}.{key}" if prefix else key
        if isinstance(value, dict) and "top" in value and "kernel_ms" in value:
            yield name, value
        else:
            yield from _kernel_profiles(value, name)


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    return f"{value:.3f}" if isinstance(value, float) else str(value)
