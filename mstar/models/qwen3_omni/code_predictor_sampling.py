"""Per-request sampling of the code predictor: namespaced options, batch tensors, a static-shape sampler.

Options live under the `code_predictor.` namespace of a request's options: `temperature` (0 =
greedy), `top_k` (0 = off), `top_p` (1 = off) and `seed`. A seeded request draws its noise from a
generator seeded by (seed, frame index), so its codes do not depend on which other requests share
the batch, and the component stays stateless.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

import torch
import torch.nn.functional as F

from mstar.engines.cuda_graphs import to_device_async
from mstar.kernels.guard import KernelGuard
from mstar.layers.fused import FUSED

MAX_VOCAB = 4096  # the fused sampler's limit (kernels/small_vocab_sampling.MAX_VOCAB; that module needs triton)
_SAMPLER = KernelGuard("small_vocab_sampling")

PREFIX = "code_predictor."


@dataclass(frozen=True)
class CodePredictorSampling:
    """How one request picks its residual codes. Defaults follow the reference's sampled path."""

    temperature: float = 1.0  # 0 = greedy
    top_k: int = 50  # 0 = off
    top_p: float = 0.8  # 1 = off
    seed: int | None = None  # None = shared randomness

    def __post_init__(self) -> None:
        _check(math.isfinite(self.temperature) and self.temperature >= 0, "temperature", self.temperature,
               "use a finite number >= 0 (0 = greedy)")
        _check(self.top_k >= 0, "top_k", self.top_k, "use 0 (off) or a positive integer")
        _check(0 < self.top_p <= 1, "top_p", self.top_p, "use a number in (0, 1]")

    @classmethod
    def from_options(cls, options: Mapping[str, Any], defaults: CodePredictorSampling | None = None
                     ) -> CodePredictorSampling:
        """`defaults` overridden by the request's `code_predictor.*` options; ValueError names a bad key."""
        names = {f.name for f in fields(cls)}
        overrides: dict[str, Any] = {}
        for key, value in options.items():
            if not key.startswith(PREFIX):
                continue
            name = key[len(PREFIX):]
            if name not in names:
                raise ValueError(f"unknown option {key!r}; code predictor options are "
                                 f"{sorted(PREFIX + n for n in names)}")
            overrides[name] = _coerce(name, value)
        return replace(defaults or cls(), **overrides)


def _check(ok: bool, name: str, value: Any, fix: str) -> None:
    if not ok:
        raise ValueError(f"invalid option {PREFIX}{name}={value!r}: {fix}")


def _coerce(name: str, value: Any) -> Any:
    is_int = isinstance(value, int) and not isinstance(value, bool)
    if name == "seed":
        _check(value is None or is_int, name, value, "use an integer or leave it unset")
        return value
    if name == "top_k":
        _check(is_int, name, value, "use an integer")
        return 0 if value == -1 else value
    _check(is_int or isinstance(value, float), name, value, "use a number")
    return float(value)


@dataclass
class SamplingTensors:
    """The batch's sampling parameters as tensors, so the inner loop has no host decisions.

    `noise` is None when every row is greedy; otherwise Exp(1) noise [B, steps, vocab], drawn
    before the loop (seeded rows from their own generator).
    """

    temperature: torch.Tensor  # [B] float32
    top_k: torch.Tensor  # [B] int64; vocab size when off
    top_p: torch.Tensor  # [B] float32; > 1 when off
    noise: torch.Tensor | None


def build_sampling_tensors(params: Sequence[CodePredictorSampling], frame_index: Sequence[int | None],
                           steps: int, vocab: int, device: torch.device) -> SamplingTensors:
    """Batch tensors for `params` (one per row); `frame_index` seeds the rows that have a seed."""
    # one host tensor, one copy: a tensor made from a list straight on the GPU is a blocking copy each
    rows = torch.tensor([[p.temperature, p.top_k or vocab, p.top_p if p.top_p < 1 else 2.0] for p in params],
                        dtype=torch.float64)
    rows = to_device_async(rows, device)
    temperature, top_k, top_p = rows[:, 0].float(), rows[:, 1].long(), rows[:, 2].float()
    if all(p.temperature == 0 for p in params):
        return SamplingTensors(temperature, top_k, top_p, None)
    noise = torch.empty(len(params), steps, vocab, device=device).exponential_()
    for row, (p, frame) in enumerate(zip(params, frame_index)):
        if p.seed is None or p.temperature == 0:
            continue
        if frame is None:
            raise ValueError(f"{PREFIX}seed is set but the step has no frame_index input: the talker must "
                             "pass the frame index so seeded sampling is reproducible")
        gen = torch.Generator(device=device).manual_seed(_mix(p.seed, frame))
        noise[row] = torch.empty(steps, vocab, device=device).exponential_(generator=gen)
    return SamplingTensors(temperature, top_k, top_p, noise)


def _mix(seed: int, frame: int) -> int:
    # One distinct 63-bit seed per (request seed, frame).
    return (seed * 1_000_003 + frame * 7_919 + 0x9E3779B9) % (2**63 - 1)


def sample_step(logits: torch.Tensor, st: SamplingTensors, step: int) -> torch.Tensor:
    """One code per row of float32 `logits` [B, V]: greedy rows argmax, the others temperature, top-k,
    top-p, then the exponential race with the pre-drawn noise. Static shapes, no host syncs."""
    if st.noise is None:
        return logits.argmax(dim=-1)
    vocab = logits.shape[-1]
    if FUSED.ops_for(logits) is not None and vocab <= MAX_VOCAB:  # one launch instead of ~15 (CUDA)
        from mstar.models.qwen3_omni.small_vocab_sampling import sample_rows

        noise = st.noise
        return _SAMPLER.run(lambda: sample_rows(logits.float(), st.temperature, st.top_k, st.top_p, noise[:, step]),
                            lambda: _sample_reference(logits, st, step))
    return _sample_reference(logits, st, step)


def sample_and_embed(logits: torch.Tensor, st: SamplingTensors, step: int, table: torch.Tensor,
                     embed_sum: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`sample_step` on a step's head output `logits` [B, V] (any float dtype), then each code's row of
    the codebook's embedding `table` [V, H] and `embed_sum` [B, H] plus it: (codes [B], rows [B, H], new
    sums [B, H]). One launch where the fused kernels serve (`small_vocab_sampling.sample_embed_rows`),
    else the PyTorch sampler, an embedding lookup and an add."""

    def unfused() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        code = sample_step(logits.float(), st, step)
        x = F.embedding(code, table)
        return code, x, embed_sum + x

    if FUSED.ops_for(logits) is None or logits.shape[-1] > MAX_VOCAB or not embed_sum.is_contiguous() \
            or table.stride(1) != 1 or embed_sum.dtype != table.dtype:
        return unfused()
    from mstar.models.qwen3_omni.small_vocab_sampling import sample_embed_rows

    noise = None if st.noise is None else st.noise[:, step]
    return _SAMPLER.run(lambda: sample_embed_rows(logits, st.temperature, st.top_k, st.top_p, noise, table, embed_sum),
                        unfused)


def _sample_reference(logits: torch.Tensor, st: SamplingTensors, step: int) -> torch.Tensor:
    assert st.noise is not None
    vocab = logits.shape[-1]
    greedy = logits.argmax(dim=-1)
    x = logits.float() / torch.where(st.temperature > 0, st.temperature, 1.0)[:, None]
    sorted_x, order = x.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=x.device)[None, :]
    sorted_x = sorted_x.masked_fill(ranks >= st.top_k[:, None], -math.inf)
    probs = sorted_x.softmax(dim=-1)
    # Keep a code while the mass strictly before it is below top_p: the top code always stays.
    probs = probs.masked_fill(probs.cumsum(dim=-1) - probs >= st.top_p[:, None], 0.0)
    # Exponential race (Gumbel-max): argmax(p / E), E ~ Exp(1), draws from p renormalised.
    picked = (probs / st.noise[:, step].gather(1, order)).argmax(dim=-1, keepdim=True)
    sampled = order.gather(1, picked)[:, 0]
    return torch.where(st.temperature == 0, greedy, sampled)
