"""Token sampling shared by every engine: per-request parameters and one batched `sample` call.

Semantics (as in vLLM and the OpenAI API):
- temperature 0 is greedy (argmax after penalties); top_k 0 (or -1) and top_p 1 are off;
- repetition_penalty applies to tokens seen in the prompt or the output; presence and frequency
  penalties apply to output tokens only, from their counts;
- eos and stop_token_ids are banned while fewer than `min_tokens` tokens have been generated;
- logprobs are those of the model's raw distribution (before penalties, temperature, filtering);
- logits may cover a window of ids [offset, offset + V) (`CausalLM.logit_offset`): rows' token ids
  (seen tokens, counts, bans) map to columns id - offset, ids outside the window are left out (they
  are never sampled), and the ids handed back are token ids again. Logprobs are then normalised
  over the window, as they were over -inf logits outside it.
- a seeded request draws its random numbers from its own generator, a fixed amount per token, so
  its tokens do not depend on which other requests share the batch.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from functools import cached_property
from typing import Any

import torch

from mstar.engines import sampling_filters
from mstar.engines.cuda_graphs import to_device_async, to_host_async
from mstar.engines.grammar import canonical_spec
from mstar.engines.sampling_filters import RowTable, pick, seen_masks
from mstar.kernels.guard import KernelGuard

MAX_LOGPROBS = 20  # most top alternatives a request may ask for (the OpenAI limit)

_INT_FIELDS = {"top_k", "seed", "max_tokens", "min_tokens", "logprobs"}
_FLOAT_FIELDS = {"temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"}


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one request; validated on construction (ValueError names the field)."""

    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # keep the k most likely tokens; 0 = off
    top_p: float = 1.0  # keep the smallest set with this much probability; 1 = off
    min_p: float = 0.0  # drop tokens below min_p * the top token's probability
    repetition_penalty: float = 1.0  # >1 discourages tokens of the prompt and output
    presence_penalty: float = 0.0  # subtracted once from every token already generated
    frequency_penalty: float = 0.0  # subtracted per occurrence of a token already generated
    seed: int | None = None  # per-request generator seed; None = the engine's shared randomness
    max_tokens: int | None = None  # tokens to generate at most; None = until eos / the context limit
    min_tokens: int = 0  # eos and stop tokens are banned before this many tokens
    stop_token_ids: tuple[int, ...] = ()  # extra token ids that end generation
    ignore_eos: bool = False  # keep generating past eos
    logprobs: int | None = None  # None = none; 0 = the chosen token's; k = also the top k alternatives
    # a grammar the tokens must follow (`grammar.canonical_spec`: JSON of json_schema, json_object,
    # regex or choice); None = free text. Needs a model whose engine has `Grammars`
    structured_outputs: str | None = None

    def __post_init__(self) -> None:
        _check(self.temperature >= 0 and math.isfinite(self.temperature), "temperature", self.temperature,
               "use a finite number >= 0 (0 = greedy)")
        _check(self.top_k >= 0, "top_k", self.top_k, "use 0 or -1 (off) or a positive integer")
        _check(0 < self.top_p <= 1, "top_p", self.top_p, "use a number in (0, 1]")
        _check(0 <= self.min_p <= 1, "min_p", self.min_p, "use a number in [0, 1]")
        _check(0 < self.repetition_penalty and math.isfinite(self.repetition_penalty), "repetition_penalty",
               self.repetition_penalty, "use a finite number > 0 (1 = off)")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(-2 <= value <= 2, name, value, "use a number in [-2, 2]")
        _check(self.max_tokens is None or self.max_tokens >= 1, "max_tokens", self.max_tokens,
               "use a positive integer or leave it unset")
        _check(self.min_tokens >= 0, "min_tokens", self.min_tokens, "use an integer >= 0")
        _check(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens", self.min_tokens,
               f"it must not exceed max_tokens={self.max_tokens}")
        _check(all(t >= 0 for t in self.stop_token_ids), "stop_token_ids", self.stop_token_ids,
               "use non-negative token ids")
        _check(self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS, "logprobs", self.logprobs,
               f"use an integer in [0, {MAX_LOGPROBS}] or leave it unset")

    @cached_property
    def argmax_only(self) -> bool:
        """Whether the token is the argmax of the raw logits whenever no token is banned (`plain_greedy`)."""
        return (self.temperature == 0 and self.repetition_penalty == 1.0 and self.presence_penalty == 0.0
                and self.frequency_penalty == 0.0 and self.logprobs is None and self.structured_outputs is None)

    @cached_property
    def static_ok(self) -> bool:
        """Whether `sample_static` serves these parameters whenever no token is banned (`graphable`,
        which also needs the row to have no generator of its own). A structured-outputs row is served once
        its grammar's token mask is on its logits (`token_masks.TokenMasks`, applied by the sampler graphs)."""
        return (self.logprobs is None and self.presence_penalty == 0.0 and self.frequency_penalty == 0.0
                and self.top_k <= sampling_filters.PREFILTER_K)

    @classmethod
    def from_options(cls, options: dict[str, Any], defaults: SamplingParams) -> SamplingParams:
        """`defaults` overridden by the sampling keys of a request's options.

        Keys that are not sampling fields are left alone (options also carry other model
        options); a sampling key with a wrong type or value raises ValueError.
        """
        names = {f.name for f in fields(cls)}
        overrides = {k: _coerce(k, v) for k, v in options.items() if k in names}
        return replace(defaults, **overrides)


# the request options an autoregressive engine reads (`SamplingParams.from_options`)
SAMPLING_OPTIONS = frozenset(f.name for f in fields(SamplingParams))


def _check(ok: bool, name: str, value: Any, fix: str) -> None:
    if not ok:
        raise ValueError(f"invalid sampling option {name}={value!r}: {fix}")


def _coerce(name: str, value: Any) -> Any:
    """Type-check one option and normalise it (lists -> tuples, top_k -1 -> 0)."""
    is_int = isinstance(value, int) and not isinstance(value, bool)
    if name in _INT_FIELDS:
        _check(is_int or (value is None and name in ("seed", "max_tokens", "logprobs")), name, value,
               "use an integer")
        return 0 if name == "top_k" and value == -1 else value
    if name in _FLOAT_FIELDS:
        _check(is_int or isinstance(value, float), name, value, "use a number")
        return float(value)
    if name == "structured_outputs":
        return None if value is None else canonical_spec(json.loads(value) if isinstance(value, str) else value)
    if name == "ignore_eos":
        _check(isinstance(value, bool), name, value, "use true or false")
        return value
    # stop_token_ids
    ok = isinstance(value, list | tuple) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    _check(ok, name, value, "use a list of integer token ids")
    return tuple(value)


@dataclass
class SamplingRow:
    """Everything `sample` needs about one row of the logits."""

    params: SamplingParams
    token_ids: Sequence[int]  # prompt + output so far
    num_prompt: int  # how many of token_ids are the prompt
    generator: torch.Generator | None = None  # the request's own generator (seeded requests)
    eos_token_ids: tuple[int, ...] = ()  # banned, with stop_token_ids, while under min_tokens
    cache: dict | None = None  # the sequence's scratch across steps (its seen-token mask), if it keeps one


@dataclass
class SampleOutput:
    """Sampled tokens and, when any row asked, logprobs (rows with fewer alternatives slice)."""

    token_ids: torch.Tensor  # [N] int64
    logprobs: torch.Tensor | None = None  # [N] float32: log-probability of the chosen token
    top_ids: torch.Tensor | None = None  # [N, K] int64, K = the largest `logprobs` asked in the batch
    top_logprobs: torch.Tensor | None = None  # [N, K] float32

    def _map(self, f) -> SampleOutput:
        return SampleOutput(*(None if t is None else f(t) for t in
                              (self.token_ids, self.logprobs, self.top_ids, self.top_logprobs)))

    def to_host(self) -> SampleOutput:
        """Host copies, on CPU too: sampled ids may be a view of a buffer the next step rewrites."""
        return self._map(lambda t: t.cpu() if t.device.type != "cpu" else t.clone())

    def to_host_async(self, copied: torch.cuda.Event | None) -> tuple[SampleOutput, torch.cuda.Event | None]:
        """Queue copies into pinned host memory and record `copied` after them; the host copies, and the
        event that marks them done (None off CUDA: copied already)."""
        if self.token_ids.device.type != "cuda" or copied is None:
            return self.to_host(), None
        result = self._map(to_host_async)
        copied.record()
        return result, copied

    def row(self, i: int, params: SamplingParams) -> dict[str, torch.Tensor]:
        """Row `i` as item outputs: its token, and the logprobs its `params` asked for."""
        outputs = {"token": self.token_ids[i : i + 1]}
        if params.logprobs is not None and self.logprobs is not None:
            outputs["logprob"] = self.logprobs[i : i + 1]
            if params.logprobs > 0 and self.top_ids is not None and self.top_logprobs is not None:
                outputs["top_ids"] = self.top_ids[i, : params.logprobs]
                outputs["top_logprobs"] = self.top_logprobs[i, : params.logprobs]
        return outputs


def sample(logits: torch.Tensor, rows: Sequence[SamplingRow], offset: int = 0) -> SampleOutput:
    """Pick one token per row of float32 `logits` [N, V] over the ids [offset, offset + V), on the
    logits' device; the output holds token ids (column + offset).

    No host sync: per-row parameters travel in one pinned, non-blocking copy (a plain
    `torch.tensor(..., device=cuda)` would wait for the whole stream, i.e. for the decode step).
    """
    assert logits.shape[0] == len(rows), f"{logits.shape[0]} logits rows for {len(rows)} sampling rows"
    if all(plain_greedy(r) for r in rows):  # the common serving case: one argmax kernel
        return SampleOutput(greedy_ids(logits, offset))
    out = _sample_columns(logits, rows, offset)
    if offset:
        out.token_ids = out.token_ids + offset
        out.top_ids = None if out.top_ids is None else out.top_ids + offset
    return out


def _sample_columns(logits: torch.Tensor, rows: Sequence[SamplingRow], offset: int) -> SampleOutput:
    """`sample` past its greedy shortcut; the output holds columns of `logits`."""
    table = RowTable(rows, logits.shape[1], logits.device)
    x = _processed_logits(logits, rows, table, offset)
    if table.all_greedy:
        return _with_logprobs(SampleOutput(x.argmax(dim=-1)), logits, rows)
    sampled_ids = pick(x, rows, table, _exponential_noise(x, rows))
    token_ids = torch.where(table.greedy, x.argmax(dim=-1), sampled_ids) if table.any_greedy else sampled_ids
    return _with_logprobs(SampleOutput(token_ids), logits, rows)


def greedy_ids(logits: torch.Tensor, offset: int = 0) -> torch.Tensor:
    """Token ids [N] of the argmax of `logits` [N, V] over the ids [offset, offset + V) (one kernel
    at offset 0)."""
    ids = logits.argmax(dim=-1)
    return ids + offset if offset else ids


def plain_greedy(row: SamplingRow) -> bool:
    """Whether the row's token is the argmax of its raw logits (no penalties, bans or logprobs)."""
    return row.params.argmax_only and not _banning(row)


def graphable(row: SamplingRow) -> bool:
    """Whether `sample_static` serves the row: no own generator, logprobs, presence or frequency
    penalty, token bans (min_tokens) or top_k wider than the prefilter."""
    return row.generator is None and row.params.static_ok and not _banning(row)


def _banning(row: SamplingRow) -> bool:
    p = row.params
    return (p.min_tokens > 0 and len(row.token_ids) - row.num_prompt < p.min_tokens
            and bool(row.eos_token_ids or p.stop_token_ids))


def sample_static(logits: torch.Tensor, table: torch.Tensor, seen: torch.Tensor, filtered: bool = False,
                  mark: tuple[torch.Tensor, torch.Tensor] | None = None, out: torch.Tensor | None = None,
                  offset: int = 0, rng: torch.Tensor | None = None) -> torch.Tensor:
    """`sample` for `graphable` rows with no branch on their values, so that it can be captured in a
    CUDA graph: [N] ids from float32 `logits` [N, V], the rows' `RowTable.columns` (on the device)
    and their seen-token masks `seen` [N, V] (read only where the repetition penalty is not 1); the
    ids are columns of `logits` (the caller adds a window's offset).
    Every stage runs for every row; for the same noise each row gets the token `sample` gives it.
    `filtered`: the caller promises that every row samples (temperature > 0) under top-k or top-p,
    so the stages for greedy and unfiltered rows are left out.
    `mark` (flat, new): first mark each row's new token, as `flat.index_fill_(0, new, True)` does, where
    `flat` is the masks' storage from seen[0, 0] on and `new` [N] holds flat indexes (row * V + column;
    past the masks: none); the fused kernels do it as they read the masks.
    `out` (int64 [N]): the ids go there instead, each clamped into [0, V) (a padding row may draw no
    valid column) plus `offset`; `out` is returned.
    `rng` (int64 [2] on the device: a seed and the draws made under it): with the fused kernels and
    `filtered`, the noise is philox's, keyed by the seed plus the draw count, which the kernels advance,
    instead of the default generator's (a CUDA graph that draws from that generator is preceded at
    every replay by two fill kernels refreshing its seed and offset); otherwise unused."""
    fused = (logits.is_cuda and logits.shape[1] <= FUSED_MAX_VOCAB and _FUSED_SAMPLER.usable
             and sampling_filters.triton_available())  # Triton kernels: kernels/fused_sampling.py
    new = None
    if mark is not None:
        flat, new = mark
        if not (fused and seen.is_contiguous() and seen.data_ptr() == flat.data_ptr()):
            flat.index_fill_(0, new, True)
            new = None
    if fused:
        seeded = rng is not None and filtered
        noise = None if seeded else torch.empty(logits.shape, dtype=torch.float32, device=logits.device).exponential_()
        ids = _FUSED_SAMPLER.run(lambda: _fused_sample(logits, table, seen, noise, filtered, new, out, offset,
                                                       rng if seeded else None), lambda: None)
        if ids is not None:
            return ids
        if new is not None:  # the kernels failed (marking twice is harmless)
            mark[0].index_fill_(0, new, True)
    t = RowTable.general(table, logits.shape[1], filtered)
    # as _processed_logits computes it: unpenalised rows get 1 * inv_temp, i.e. inv_temp exactly
    factor = torch.where(seen, torch.where(logits > 0, t.inv_penalty * t.inv_temp, t.penalty * t.inv_temp),
                         t.inv_temp)
    x = logits.float() * factor
    sampled = pick(x, None, t, torch.empty_like(x).exponential_())
    drawn = sampled if filtered else torch.where(t.greedy, x.argmax(dim=-1), sampled)
    if out is None:
        return drawn
    return torch.add(drawn.clamp_(0, logits.shape[1] - 1), offset, out=out)


_FUSED_SAMPLER = KernelGuard("fused sampling")
FUSED_MAX_VOCAB = 262_144  # wider rows: the PyTorch form (the fused kernels' slices stay <= 8,192 ids up to here)


def _fused_sample(logits: torch.Tensor, table: torch.Tensor, seen: torch.Tensor, noise: torch.Tensor | None,
                  filtered: bool, new: torch.Tensor | None = None, out: torch.Tensor | None = None,
                  offset: int = 0, rng: torch.Tensor | None = None) -> torch.Tensor:
    from mstar.kernels.fused_sampling import sample_rows

    # `new` comes only with contiguous masks, which contiguous() returns as they are (the kernels mark them)
    return sample_rows(logits.float().contiguous(), table.contiguous(), seen.contiguous(), noise, filtered, new=new,
                       out=out, offset=offset, rng=rng)


def _processed_logits(logits: torch.Tensor, rows: Sequence[SamplingRow], table: RowTable,
                      offset: int = 0) -> torch.Tensor:
    """Logits (of ids offset..) after bans, penalties and temperature (a new tensor). The common case
    (repetition penalty and temperature only) is four kernels: one factor per element, one multiply."""
    counted = [i for i, r in enumerate(rows) if r.params.presence_penalty != 0.0 or r.params.frequency_penalty != 0.0]
    if table.any_repetition:
        seen = seen_masks(rows, logits.shape[1], logits.device, offset)
        # seen tokens: divide positive logits by the penalty, multiply negative ones (then the temperature)
        scale = table.inv_temp if not counted else torch.ones_like(table.inv_temp)
        factor = torch.where(seen, torch.where(logits > 0, table.inv_penalty * scale, table.penalty * scale), scale)
        x = logits.float() * factor
    else:
        x = logits.float() * (table.inv_temp if not counted else 1.0)
    if counted:  # rare: presence/frequency penalties come before the temperature
        _apply_counts(x, rows, counted, offset)
        x = x * table.inv_temp
    for i, row in enumerate(rows):
        p = row.params
        if len(row.token_ids) - row.num_prompt < p.min_tokens:
            banned = [t - offset for t in (*row.eos_token_ids, *p.stop_token_ids)
                      if 0 <= t - offset < x.shape[1]]
            if banned:  # index_fill_: no host scalar copied to the device (that copy would sync)
                x[i].index_fill_(0, to_device_async(torch.tensor(banned, dtype=torch.long), x.device), -math.inf)
    return x


def _apply_counts(x: torch.Tensor, rows: Sequence[SamplingRow], picked: list[int], offset: int = 0) -> None:
    vocab = x.shape[1]
    for i in picked:
        p, row = rows[i].params, rows[i]
        columns = [t - offset for t in row.token_ids[row.num_prompt:] if 0 <= t - offset < vocab]
        out = torch.tensor(columns, dtype=torch.long).to(x.device, non_blocking=True)
        counts = torch.bincount(out, minlength=vocab).to(x.dtype)
        x[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(x.dtype)


def _exponential_noise(probs: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Exp(1) noise; seeded rows draw from their own generator, a whole row each time."""
    noise = torch.empty_like(probs).exponential_()
    for i, row in enumerate(rows):
        if row.generator is not None:
            noise[i] = torch.empty_like(probs[i]).exponential_(generator=row.generator)
    return noise


def _with_logprobs(out: SampleOutput, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SampleOutput:
    wanted = [r.params.logprobs for r in rows if r.params.logprobs is not None]
    if not wanted:
        return out
    logp = logits.float().log_softmax(dim=-1)
    out.logprobs = logp.gather(1, out.token_ids[:, None])[:, 0]
    k = max(wanted)
    out.top_logprobs, out.top_ids = logp.topk(k, dim=-1) if k else (logp[:, :0], out.token_ids[:, None][:, :0])
    return out
