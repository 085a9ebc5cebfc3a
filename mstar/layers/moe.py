"""Sparse mixture-of-experts feed-forward block (Qwen3-MoE / Qwen3-Omni thinker and talker).

A router picks the top-k experts of each token from a softmax over `num_experts`; the token's output
is the routing-weighted sum of those experts' gated SiLU MLPs, plus (talker) a shared expert scaled
by a sigmoid gate. Expert weights are stored stacked (`experts.gate_up_proj` [E, 2I, H],
`experts.down_proj` [E, H, I]) so a checkpoint loads with one copy per tensor and the GPU path can
run all experts as two grouped matmuls.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mstar.layers.mlp import GatedMLP

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class MoESpec:
    """Shape and routing options of one sparse MoE block."""

    hidden_size: int
    num_experts: int
    top_k: int
    intermediate_size: int  # per expert
    norm_topk_prob: bool = True  # renormalise the top-k weights to sum to 1
    shared_intermediate_size: int = 0  # > 0: a shared expert with a sigmoid gate (Qwen3-Omni talker)

    def __post_init__(self) -> None:
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.top_k} must be in [1, num_experts={self.num_experts}]")
        if self.intermediate_size <= 0 or self.hidden_size <= 0:
            raise ValueError(f"moe sizes must be positive: hidden={self.hidden_size}, "
                             f"moe_intermediate={self.intermediate_size}")


class StackedExperts(nn.Module):
    """The weights of all experts, stacked on dim 0 (HF transformers 5 names: gate_up_proj, down_proj)."""

    def __init__(self, spec: MoESpec) -> None:
        super().__init__()
        e, h, i = spec.num_experts, spec.hidden_size, spec.intermediate_size
        self.intermediate_size = i
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))  # rows [0, I): gate, [I, 2I): up
        self.down_proj = nn.Parameter(torch.empty(e, h, i))


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights [T, k] in the logits' dtype, expert ids [T, k]).

    Softmax and top-k run in float32 as in the reference, so ties and rounding match it.
    """
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), ids


def experts_loop(x: torch.Tensor, experts: StackedExperts, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Simple path: one gated MLP per expert that received tokens. Syncs the host (not graph-capturable)."""
    out = torch.zeros_like(x)
    top_k = ids.shape[1]
    flat = ids.flatten()
    for e in torch.unique(flat).tolist():
        slots = torch.nonzero(flat == e).squeeze(1)
        tokens = slots // top_k
        gate, up = F.linear(x[tokens], experts.gate_up_proj[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, experts.down_proj[e])
        out.index_add_(0, tokens, (y * weights.flatten()[slots, None]).to(out.dtype))
    return out


def experts_grouped(x: torch.Tensor, experts: StackedExperts, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Sorted path: tokens sorted by expert, two `torch._grouped_mm` calls over all experts.

    No host synchronisation and only fixed-shape tensors ([T*k] rows), so it can be captured in a
    CUDA graph. Needs `torch._grouped_mm` (on CUDA: bfloat16, sm90+).
    """
    t, top_k = ids.shape
    num_experts = experts.gate_up_proj.shape[0]
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)
    sorted_ids = flat[order]
    # ends[e] = rows of experts 0..e in the sorted order (searchsorted: no bincount, no host sync)
    ends = torch.searchsorted(sorted_ids, torch.arange(num_experts, device=x.device), right=True).to(torch.int32)
    rows = x[order // top_k]
    h = torch._grouped_mm(rows, experts.gate_up_proj.transpose(1, 2), offs=ends)
    gate, up = h.chunk(2, dim=-1)
    y = torch._grouped_mm(F.silu(gate) * up, experts.down_proj.transpose(1, 2), offs=ends)
    y = y * weights.flatten()[order, None]
    unsorted = torch.empty_like(y)
    unsorted[order] = y
    return unsorted.view(t, top_k, -1).sum(dim=1).to(x.dtype)


def grouped_mm_usable(x: torch.Tensor) -> bool:
    """Whether `experts_grouped` should serve `x`: CUDA bfloat16 with torch._grouped_mm available."""
    return x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")


def moe_graph_capturable(model: nn.Module) -> bool:
    """Whether every SparseMoE inside `model` takes the grouped (capturable) path for its own weights'
    dtype and device; the per-expert loop syncs the host, so a CUDA-graph capture of it would fail."""
    for moe in (m for m in model.modules() if isinstance(m, SparseMoE)):
        w = moe.experts.gate_up_proj
        forced = moe.force_path
        if forced == "loop" or (forced is None and not grouped_mm_usable(w)):
            return False
    return True


class MoEGraphCapture:
    """Mixin for a decoder with SparseMoE layers: `supports_cuda_graphs` (the engine's question) is
    `moe_graph_capturable` of the model itself."""

    def supports_cuda_graphs(self) -> bool:
        """Decode is capturable only where every MoE layer takes the grouped path (CUDA bf16)."""
        assert isinstance(self, nn.Module)
        return moe_graph_capturable(self)


class SparseMoE(nn.Module):
    """x [T, H] -> [T, H]; `gate` is the router (HF name), `experts` the stacked expert weights.

    On CUDA bfloat16 it uses the grouped path (graph-capturable), otherwise the per-expert loop;
    `force_path` ("loop" | "grouped") overrides the choice, for tests and benchmarks.
    """

    def __init__(self, spec: MoESpec) -> None:
        super().__init__()
        self.spec = spec
        self.gate = nn.Linear(spec.hidden_size, spec.num_experts, bias=False)
        self.experts = StackedExperts(spec)
        if spec.shared_intermediate_size:
            self.shared_expert = GatedMLP(spec.hidden_size, spec.shared_intermediate_size)
            self.shared_expert_gate = nn.Linear(spec.hidden_size, 1, bias=False)
        self.force_path: str | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.spec.top_k, self.spec.norm_topk_prob)
        path = self.force_path or ("grouped" if grouped_mm_usable(x) else "loop")
        if path == "grouped":
            out = experts_grouped(x, self.experts, ids, weights)
        elif path == "loop":
            out = experts_loop(x, self.experts, ids, weights)
        else:
            raise ValueError(f"unknown MoE path {path!r}; use 'loop' or 'grouped'")
        if self.spec.shared_intermediate_size:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out
