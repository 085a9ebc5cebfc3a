"""Sparse mixture-of-experts feed-forward block (Qwen3-MoE / Qwen3-Omni thinker and talker).

A router picks the top-k experts of each token from a softmax over `num_experts`; the token's output
is the routing-weighted sum of those experts' gated SiLU MLPs, plus (talker) a shared expert scaled
by a sigmoid gate. Expert weights are stored stacked (`experts.gate_up_proj` [E, 2I, H],
`experts.down_proj` [E, H, I]) so a checkpoint loads with one copy per tensor and the GPU path can
run all experts as two grouped matmuls.

Four paths compute the experts: "small" (`kernels/moe_small.py`, two GEMV-like Triton launches that
read each slot's expert through the ids; decode batches of a few tokens), "tiled" (`kernels/moe_tiled.py`,
each routed expert's weights read once against all its tokens on the tensor cores; decode batches of
tens of tokens), "grouped" (tokens sorted by expert, two `torch._grouped_mm`; CUDA bf16) and "loop"
(one gated MLP per routed expert; the reference, syncs the host). `pick_path` chooses;
`SparseMoE.force_path` overrides. FP8 experts (`StackedExperts.to_fp8`) run the small and tiled kernels
(row scales applied to their float32 sums) and, where "grouped" would serve, the tiled kernels over
chunks of tokens (there is no FP8 grouped matmul here); the loop dequantizes one expert at a time.

Expert parallelism (`ExpertShard`): each rank of a group holds an equal, contiguous share of the experts;
the router runs whole on every rank, each rank computes its own experts' share of every token (slots
routed elsewhere are skipped by the tiled kernels and run at weight 0 on the other paths), the shared
expert runs on the group's first rank only, and one
all-reduce sums the shares.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mstar import envs
from mstar.kernels.guard import KernelGuard
from mstar.layers.fused import FUSED
from mstar.layers.linear import linear
from mstar.layers.mlp import GatedMLP

PATHS = ("small", "tiled", "grouped", "loop")
# Which of the Triton paths serves a batch of T * top_k (token, expert) slots. "small" reads an expert once
# per slot routed to it; "tiled" once per batch, for two more launches and tensor-core tiles of 16 slots;
# "grouped" once per batch too, after a sort of ~20 kernels, with cuBLAS tiles made for many rows. The
# bounds follow `benchmarks/moe_micro.py --sweep` on the Qwen3-Omni thinker and talker blocks in CUDA
# graphs: "small" while few slots share an expert, "tiled" once many do, "grouped" behind both up to the
# largest batch swept (128 tokens), so it only serves beyond TILED_MAX_SLOTS.
TILED_MIN_SLOTS = 128  # fewer slots: "small"
TILED_MAX_SLOTS = 1024  # more slots: "grouped" (CUDA bf16) or "loop"
SMALL_MAX_SLOTS = 256  # where "tiled" cannot serve, "small" still serves up to this many
SMALL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # what kernels/moe_small.py and moe_tiled.py compute in


ROUTE_MAX_EXPERTS = 1024  # kernels/moe_route.MAX_EXPERTS (that module imports triton)
_ROUTE = KernelGuard("moe_route")

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


@dataclass(frozen=True)
class ExpertShard:
    """Rank `index` of `size` in an expert-parallel group (`group`, a torch.distributed process group):
    it holds experts [first, first + count) of `num_experts`."""

    index: int
    size: int
    num_experts: int
    group: Any

    def __post_init__(self) -> None:
        if not 0 <= self.index < self.size or self.num_experts % self.size:
            raise ValueError(f"expert parallelism over {self.size} ranks needs num_experts={self.num_experts} "
                             f"divisible by it and 0 <= index={self.index} < {self.size}")

    @property
    def count(self) -> int:
        return self.num_experts // self.size

    @property
    def first(self) -> int:
        return self.index * self.count

    def take(self, stacked: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a tensor stacked over all experts on dim 0 (a checkpoint's)."""
        if stacked.shape[0] != self.num_experts:
            raise ValueError(f"expected {self.num_experts} experts stacked on dim 0, got shape {tuple(stacked.shape)}")
        return stacked[self.first : self.first + self.count]

    def localize(self, ids: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Global expert ids [T, k] -> ids into this rank's experts; slots routed to another rank go to
        local expert 0 with weight 0 (a finite product, zero: no branch, no shape change)."""
        local = ids - self.first
        mine = (local >= 0) & (local < self.count)
        zero = torch.zeros((), dtype=weights.dtype, device=weights.device)
        return torch.where(mine, local, 0), torch.where(mine, weights, zero)


class StackedExperts(nn.Module):
    """The weights of all experts, stacked on dim 0 (HF transformers 5 names: gate_up_proj, down_proj);
    with `num_experts`, only that many (an expert-parallel rank's share).

    After `to_fp8` the weights are E4M3 with one float32 scale per output row of each expert
    (`gate_up_scale` [E, 2I], `down_scale` [E, H]; W ~ q * s as `layers/fp8.quantize_per_channel` gives
    them): loading quantizes them row by row as they arrive (`models/common/loading`); the Triton paths
    apply the scale to their float32 sums, the loop path dequantizes one expert at a time."""

    def __init__(self, spec: MoESpec, num_experts: int | None = None) -> None:
        super().__init__()
        e, h, i = num_experts or spec.num_experts, spec.hidden_size, spec.intermediate_size
        self.intermediate_size = i
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))  # rows [0, I): gate, [I, 2I): up
        self.down_proj = nn.Parameter(torch.empty(e, h, i))
        self.register_parameter("gate_up_scale", None)
        self.register_parameter("down_scale", None)
        self.source_dtype = self.gate_up_proj.dtype  # the dtype the FP8 weights stand for

    @property
    def fp8(self) -> bool:
        return self.gate_up_scale is not None

    def to_fp8(self) -> None:
        """Replace the weights by empty E4M3 ones and add their row scales (on the meta device, before the
        module is materialised and loaded)."""
        from mstar.layers.fp8 import FP8_DTYPE

        self.source_dtype = self.gate_up_proj.dtype
        for name in ("gate_up_proj", "down_proj"):
            weight = getattr(self, name)
            setattr(self, name, nn.Parameter(torch.empty(weight.shape, dtype=FP8_DTYPE, device=weight.device),
                                             requires_grad=False))
            setattr(self, name.removesuffix("_proj") + "_scale", nn.Parameter(
                torch.empty(weight.shape[:-1], dtype=torch.float32, device=weight.device), requires_grad=False))

    def row_scales(self) -> dict[str, str]:
        """FP8 weight name -> its scale's name (empty before `to_fp8`)."""
        return {"gate_up_proj": "gate_up_scale", "down_proj": "down_scale"} if self.fp8 else {}

    def expert(self, e: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert e's (gate_up [2I, H], down [H, I]) in `dtype` (FP8: q * s in float32, rounded once)."""
        if not self.fp8:
            return self.gate_up_proj[e], self.down_proj[e]
        gate_up = self.gate_up_proj[e].float() * self.gate_up_scale[e, :, None]
        return gate_up.to(dtype), (self.down_proj[e].float() * self.down_scale[e, :, None]).to(dtype)


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights [T, k] in the logits' dtype, expert ids [T, k]).

    Softmax and top-k run in float32 as in the reference, so ties and rounding match it. Where the fused
    kernels serve (CUDA) it is one launch, `kernels/moe_route.route_topk` (among tied probabilities it
    takes the lower expert id first; torch.topk's order among ties is its own).
    """
    if FUSED.ops_for(logits) is not None and logits.shape[1] <= ROUTE_MAX_EXPERTS and logits.stride(1) == 1:
        from mstar.kernels.moe_route import route_topk

        return _ROUTE.run(lambda: route_topk(logits, top_k, renormalize),
                          lambda: _route_reference(logits, top_k, renormalize))
    return _route_reference(logits, top_k, renormalize)


def _route_reference(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
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
        gate_up_proj, down_proj = experts.expert(e, x.dtype)
        gate, up = F.linear(x[tokens], gate_up_proj).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, down_proj)
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


# The Triton paths serve where the fused kernels serve x (`FUSED.ops_for`: CUDA, or CPU under
# TRITON_INTERPRET=1; not with MSTAR_FUSED_KERNELS=0); if a kernel ever fails to build or launch, the
# next path serves from then on (logged once) rather than a step failing.
_SMALL = KernelGuard("small-batch MoE")
_TILED = KernelGuard("tiled MoE")
_TILED.usable = envs.moe_tiled()  # MSTAR_MOE_TILED=0: never


def pick_path(x: torch.Tensor, top_k: int) -> str:
    """The path `SparseMoE.forward` takes for x [T, H] unless forced: by the number of slots T * top_k,
    "small" below TILED_MIN_SLOTS, "tiled" up to TILED_MAX_SLOTS (or "small" up to SMALL_MAX_SLOTS where
    the tiled kernels have failed), where their kernels serve x; else "grouped" on CUDA bfloat16, else "loop".

    A CUDA call outside a graph capture (a prefill) takes "small" up to SMALL_MAX_SLOTS: issuing the tiled
    path's four launches costs the host more than its GPU time saves there (`moe_micro.py --eager`)."""
    slots = x.shape[0] * top_k
    if x.dtype in SMALL_DTYPES and FUSED.ops_for(x) is not None:
        eager = x.is_cuda and not torch.cuda.is_current_stream_capturing()
        below = slots <= SMALL_MAX_SLOTS if eager else slots < TILED_MIN_SLOTS
        if below and slots <= SMALL_MAX_SLOTS and _SMALL.usable:
            return "small"
        if slots <= TILED_MAX_SLOTS and _TILED.usable:
            return "tiled"
        if slots <= SMALL_MAX_SLOTS and _SMALL.usable:
            return "small"
    return "grouped" if grouped_mm_usable(x) else "loop"


def moe_graph_capturable(model: nn.Module) -> bool:
    """Whether every SparseMoE inside `model` takes capturable paths at every batch size for its own
    weights' dtype and device: "small", "tiled" and "grouped" are, the per-expert loop syncs the host. Unforced,
    the grouped path must serve (the small path serves only small batches, or may have failed)."""
    for moe in (m for m in model.modules() if isinstance(m, SparseMoE)):
        w = moe.experts.gate_up_proj
        forced = moe.force_path
        # FP8 experts take the tiled kernels where grouped_mm would serve (`SparseMoE._on_path`)
        large = (w.is_cuda and _TILED.usable) if moe.experts.fp8 else grouped_mm_usable(w)
        if forced == "loop" or (forced is None and not large):
            return False
    return True


class MoEGraphCapture:
    """Mixin for a decoder with SparseMoE layers: `supports_cuda_graphs` (the engine's question) is
    `moe_graph_capturable` of the model itself."""

    def supports_cuda_graphs(self) -> bool:
        """Decode is capturable only where every MoE layer takes capturable paths (CUDA bf16)."""
        assert isinstance(self, nn.Module)
        return moe_graph_capturable(self)


class SparseMoE(nn.Module):
    """x [T, H] -> [T, H]; `gate` is the router (HF name), `experts` the stacked expert weights.

    `pick_path` chooses how the experts run (decode batches: the small or the tiled kernels; larger ones
    on CUDA bfloat16: the grouped path; otherwise the per-expert loop); `force_path` ("small" | "tiled" |
    "grouped" | "loop") overrides the choice, for tests and benchmarks (a forced Triton path never falls back).
    """

    def __init__(self, spec: MoESpec, shard: ExpertShard | None = None) -> None:
        super().__init__()
        if shard is not None and shard.num_experts != spec.num_experts:
            raise ValueError(f"expert shard of {shard.num_experts} experts for a block of {spec.num_experts}")
        self.spec = spec
        self.shard = shard  # expert parallelism (module docstring); None: every expert here
        self.gate = nn.Linear(spec.hidden_size, spec.num_experts, bias=False)
        self.experts = StackedExperts(spec, shard.count if shard is not None else None)
        if spec.shared_intermediate_size:
            self.shared_expert = GatedMLP(spec.hidden_size, spec.shared_intermediate_size)
            self.shared_expert_gate = nn.Linear(spec.hidden_size, 1, bias=False)
        self.force_path: str | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._local(x)
        if self.shard is not None and self.shard.size > 1:
            torch.distributed.all_reduce(out, group=self.shard.group)  # the ranks' shares summed
        return out

    def _local(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of the block's output (all of it without expert parallelism)."""
        # the router and the shared expert's gate through `linear`: the skinny GEMV where timing picks it;
        # split over ranks, the router must pick the same experts on every rank, so it runs the one
        # kernel every rank runs (timing may pick differently per rank)
        split = self.shard is not None and self.shard.size > 1
        logits = F.linear(x, self.gate.weight) if split else linear(x, self.gate)
        weights, ids = route(logits, self.spec.top_k, self.spec.norm_topk_prob)
        out = self.run_experts(x, ids, weights)
        if self.spec.shared_intermediate_size and (self.shard is None or self.shard.index == 0):
            gate, shared = linear(x, self.shared_expert_gate), self.shared_expert(x)
            ops = FUSED.ops_for(out)
            if (ops is not None and out.dim() == 2 and out.dtype == shared.dtype == gate.dtype
                    and out.stride(1) == 1 and shared.stride(1) == 1):
                return ops.sigmoid_gate_add(out, gate, shared)  # one PDL-chained launch for three PyTorch ones
            out = out + torch.sigmoid(gate) * shared
        return out

    def run_experts(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The routed experts' weighted sum [T, H] on the forced or picked path, for global expert ids
        (an expert-parallel rank's share: the tiled kernels skip other ranks' slots, the other paths
        take them localized, as weight-0 slots on local expert 0)."""
        path = self.force_path or pick_path(x, self.spec.top_k)
        if path not in PATHS:
            raise ValueError(f"unknown MoE path {path!r}; use one of {PATHS} (or None: picked per batch)")
        if path == "grouped" and self.experts.fp8:  # no FP8 grouped_mm here: the tiled kernels, in chunks
            path = "tiled" if _TILED.usable and FUSED.ops_for(x) is not None else "loop"
        if path == "tiled":
            if self.force_path == "tiled":
                return self._tiled(x, ids, weights)
            return _TILED.run(lambda: self._tiled(x, ids, weights),
                              lambda: self.run_experts(x, ids, weights))  # picked anew: not "tiled"
        if self.shard is not None:
            ids, weights = self.shard.localize(ids, weights)
        if path == "small":
            def small() -> torch.Tensor:
                from mstar.kernels.moe_small import experts_small

                e = self.experts
                return experts_small(x, e.gate_up_proj, e.down_proj, ids, weights,
                                     gate_up_scale=e.gate_up_scale, down_scale=e.down_scale)

            if self.force_path == "small":
                return small()
            path = "grouped" if grouped_mm_usable(x) else "loop"  # where the kernel has failed
            return _SMALL.run(small, lambda: self._on_path(path, x, ids, weights))
        return self._on_path(path, x, ids, weights)

    def _tiled(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The tiled kernels over x's tokens, as many at a time as one call takes (FP8 experts run
        batches larger than TILED_MAX_SLOTS here too)."""
        from mstar.kernels.moe_tiled import MAX_SLOTS, experts_tiled

        first = self.shard.first if self.shard is not None else 0
        e, step = self.experts, max(1, MAX_SLOTS // self.spec.top_k)
        parts = [experts_tiled(x[i:i + step], e.gate_up_proj, e.down_proj, ids[i:i + step], weights[i:i + step],
                               first, gate_up_scale=e.gate_up_scale, down_scale=e.down_scale)
                 for i in range(0, max(x.shape[0], 1), step)]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _on_path(self, path: str, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if path == "grouped" and not self.experts.fp8:
            return experts_grouped(x, self.experts, ids, weights)
        return experts_loop(x, self.experts, ids, weights)
