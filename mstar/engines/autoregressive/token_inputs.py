"""Per-token inputs of a sequence beyond its ids: embeddings, features, explicit positions, hidden capture.

An item may carry, besides `inputs["input_ids"]` [n]:
- `inputs["input_embeds"]` [m, H]: used instead of the embedding lookup of its tokens; m == n, or
  m == `inputs["embeds_mask"].sum()` with `embeds_mask` [n] bool marking the tokens they replace;
- model-declared features (`model.token_features`, e.g. "deepstack_embeds"), rows aligned with the
  input_embeds rows;
- `inputs["positions"]` [n] or [3, n] (int or float): the rotary positions of its tokens. Later
  tokens without positions continue from the last explicit ones (position = index + offset, with
  offset = last max position + 1 - tokens so far), as decode steps after a multimodal prompt do;
- `options["return_hidden"]`: a layer or list of layers (0 = input embeddings, k = output of decoder
  layer k, -1 = final normed states); the item's result then has `outputs["hidden"]` [L, n, H].
Everything is kept until the sequence ends, so chunked prefill and recompute after preemption see
the same inputs. Tokens from the first one with embeddings or non-default positions on are never
shared through the prefix cache (their K/V depend on more than the token ids).
"""

from __future__ import annotations

import bisect
import sys
from dataclasses import dataclass, field
from typing import Any

import torch

from mstar.engines.base import CausalLM, StepItem
from mstar.engines.cuda_graphs import to_device_async
from mstar.engines.extras import FINAL, ForwardExtras
from mstar.engines.kv_handoff import KVPositions


@dataclass
class ItemExtras:
    """The validated extras of one item (rows relative to the item's first token)."""

    embeds: torch.Tensor | None = None  # [m, H]
    rows: torch.Tensor | None = None  # [m] int64 token offsets inside the item (host)
    features: dict[str, torch.Tensor] = field(default_factory=dict)
    positions: torch.Tensor | None = None  # [R, n], R in (1, 3)
    hidden_layers: tuple[int, ...] = ()


def parse_item(item: StepItem, n: int, model: CausalLM) -> ItemExtras | None:
    """The extras of `item` (n tokens), None when it has none; ValueError names a malformed one."""
    names = model.token_features
    inputs = item.inputs
    if ("input_embeds" not in inputs and "positions" not in inputs and "return_hidden" not in item.options
            and not (names and any(name in inputs for name in names))):
        return None  # the usual decode item: its token alone
    extras = ItemExtras()
    embeds = item.inputs.get("input_embeds")
    if embeds is not None:
        extras.embeds, extras.rows = embeds, _embed_rows(item, n, embeds)
    for name in names:
        if name in item.inputs:
            value = item.inputs[name]
            if extras.rows is None or value.shape[0] != extras.rows.numel():
                raise ValueError(f"inputs[{name!r}] needs input_embeds and one row per embeddings row, "
                                 f"got shape {tuple(value.shape)}")
            extras.features[name] = value
    if (pos := item.inputs.get("positions")) is not None:
        extras.positions = _positions(pos, n, model)
    if (layers := item.options.get("return_hidden")) is not None:
        extras.hidden_layers = _hidden_layers(layers, model)
    if extras.embeds is None and extras.positions is None and not extras.hidden_layers:
        return None
    if not model.accepts_extras:
        raise ValueError(f"model {type(model).__name__} takes no input_embeds, positions or return_hidden")
    return extras


def _embed_rows(item: StepItem, n: int, embeds: torch.Tensor) -> torch.Tensor:
    """The token offsets [m] the embedding rows replace, on the host: reading them there later (which
    rows a step takes) must not wait for the device. A mask on the device costs one read per item."""
    mask = item.inputs.get("embeds_mask")
    rows = torch.arange(n) if mask is None else torch.nonzero(mask.bool()).squeeze(1).cpu()
    if embeds.dim() != 2 or embeds.shape[0] != rows.numel():
        raise ValueError(f"input_embeds of shape {tuple(embeds.shape)} must be [{rows.numel()}, hidden] "
                         f"(one row per {'masked ' if mask is not None else ''}token)")
    return rows


def _positions(pos: torch.Tensor, n: int, model: CausalLM) -> torch.Tensor:
    pos = pos if pos.dim() == 2 else pos.unsqueeze(0)
    if pos.shape[-1] != n or pos.shape[0] not in (1, 3):
        raise ValueError(f"positions of shape {tuple(pos.shape)} must be [{n}] or [3, {n}]")
    if pos.shape[0] == 3 and not model.multirow_positions:
        raise ValueError(f"model {type(model).__name__} takes 1-D positions, got [3, {n}]")
    return pos


def _hidden_layers(layers: Any, model: CausalLM) -> tuple[int, ...]:
    layers = (layers,) if isinstance(layers, int) else tuple(layers)
    num = model.kv_layout.num_layers
    bad = [k for k in layers if not isinstance(k, int) or not (k == FINAL or 0 <= k <= num)]
    if bad or not layers:
        raise ValueError(f"return_hidden={list(layers)}: layers must be ints in [0, {num}] or -1 (final)")
    return layers


@dataclass(frozen=True)
class DecodeRow:
    """What one token of a sequence brings to a decode step, read without tensor work on the host."""

    positions: list[float]  # its rotary positions, one per position row (3 once positions had 3 rows)
    embed: torch.Tensor | None  # [H] its input embedding, or None (the token's own embedding)
    has_features: bool  # it carries model-declared per-token features (deepstack rows ...)


@dataclass
class _Rows:
    start: int  # absolute index of the first token the rows belong to
    index: torch.Tensor  # [m] absolute token indices, increasing, on the host
    embeds: torch.Tensor
    features: dict[str, torch.Tensor]


@dataclass
class _Hidden:
    layers: tuple[int, ...]
    start: int
    num_tokens: int
    buffer: torch.Tensor | None = None  # [L, n, H], filled chunk by chunk


class TokenInputs:
    """The extras of every token of one sequence (see the module doc)."""

    def __init__(self) -> None:
        self._rows: list[_Rows] = []
        self._row_ends: list[int] = []  # last token index + 1 of each _Rows, increasing
        self._pos: list[tuple[int, torch.Tensor]] = []  # (start, [R, n]) explicit positions
        self._pos_ends: list[int] = []
        self._offsets: list[tuple[int, int | float]] = [(0, 0)]  # (from token index, implicit offset)
        self.multi_row = False  # some explicit positions have 3 rows
        self._float = False  # some explicit positions are fractional (video timing)
        self.num_shareable = sys.maxsize  # tokens before the first one whose K/V depend on more than ids
        self.hidden: _Hidden | None = None
        self._step: tuple[int, DecodeRow] | None = None  # the last one-token item's row, made as it arrived

    def continuation(self) -> KVPositions:
        """What later tokens without explicit positions continue from (a sequence moved elsewhere)."""
        start, offset = self._offsets[-1]
        return KVPositions(start, float(offset), self.multi_row, self._float, min(self.num_shareable, sys.maxsize))

    @classmethod
    def resumed(cls, state: KVPositions) -> TokenInputs:
        """The inputs of a sequence moved here with its tokens computed: later tokens continue as
        `state` says. Earlier tokens' embeddings and explicit positions stay with the sender, so such
        a sequence is never recomputed from here correctly unless its tokens alone describe it."""
        inputs = cls()
        offset = state.offset if state.fractional else int(state.offset)
        inputs._offsets.append((state.start, offset))
        inputs.multi_row, inputs._float = state.multi_row, state.fractional
        inputs.num_shareable = state.num_shareable
        return inputs

    @property
    def num_matchable(self) -> int:
        """Tokens that may come from the prefix cache (a pending hidden capture needs its tokens run)."""
        return min(self.num_shareable, self.hidden.start if self.hidden else sys.maxsize)

    def add(self, start: int, n: int, extras: ItemExtras) -> None:
        """Record the extras of an item whose n tokens start at token index `start`."""
        explicit = len(self._pos)
        if extras.embeds is not None and extras.rows is not None:
            index = extras.rows + start
            self._rows.append(_Rows(start, index, extras.embeds, extras.features))
            self._row_ends.append(start + n)
            self.num_shareable = min(self.num_shareable, int(extras.rows[0]) + start if len(index) else start + n)
        if extras.positions is not None:
            self._add_positions(start, n, extras.positions)
        self.hidden = _Hidden(extras.hidden_layers, start, n) if extras.hidden_layers else None
        self._step = (start, self._one_token_row(start, extras, len(self._pos) > explicit)) if n == 1 else None

    def _one_token_row(self, start: int, extras: ItemExtras, explicit: bool) -> DecodeRow:
        """The DecodeRow of a one-token item just recorded at `start` (what `positions` and `rows_in`
        would say, from the values at hand: each decode step of each sequence asks for it)."""
        rows = 3 if self.multi_row else 1
        first, offset = self._offsets[-1]
        if explicit:  # non-default positions, [R, 1] on the host
            values = [float(v) for v in self._pos[-1][1][:, 0].tolist()]
            positions = values * rows if len(values) == 1 else values
        elif first <= start:  # the default: continue from the last explicit positions
            positions = [float(start + offset)] * rows
        else:  # an offset that starts after this token cannot happen for appended tokens; be exact anyway
            positions = [float(v) for v in self.positions(start, 1)[:, 0].tolist()]
        embed, has_features = None, False
        if extras.embeds is not None and extras.rows is not None and extras.rows.numel():
            embed = extras.embeds[0]
            has_features = any(v.numel() for v in extras.features.values())
        return DecodeRow(positions, embed, has_features)

    def appended_positions(self, start: int) -> list[float]:
        """The rotary positions of a token the engine appends at `start` (an engine loop's next input):
        after the last explicit ones, on every position row."""
        first, offset = self._offsets[-1]
        assert start >= first, (start, first)
        return [float(start + offset)] * (3 if self.multi_row else 1)

    def decode_row(self, start: int) -> DecodeRow:
        """The DecodeRow of token `start` (as made when it arrived for the last one-token item, else
        from `positions` and `rows_in`)."""
        if self._step is not None and self._step[0] == start:
            return self._step[1]
        positions = [float(v) for v in self.positions(start, 1)[:, 0].tolist()]
        embed, has_features = None, False
        for offsets, values, features in self.rows_in(start, 1):
            if len(offsets):
                embed, has_features = values[0], any(v.numel() for v in features.values())
        return DecodeRow(positions, embed, has_features)

    def _add_positions(self, start: int, n: int, pos: torch.Tensor) -> None:
        pos = pos.to("cpu")
        first, offset = self._offsets[-1]
        if n == 1 and start >= first and not (self._float or pos.is_floating_point()):
            # a decode step's one token (the common case, each step of each sequence): its default
            # position is start + the last offset on every row, checked on the host in Python
            if all(v == start + offset for v in pos.reshape(-1).tolist()):
                return
        default = self.positions(start, n)
        if bool((pos.to(default.dtype) == default).all()):
            return  # what the sequence would use anyway: keep the fast path and the prefix cache
        self._float |= pos.is_floating_point()
        self._pos.append((start, pos))
        self._pos_ends.append(start + n)
        self.multi_row |= pos.shape[0] == 3
        self.num_shareable = min(self.num_shareable, start)
        top = pos.max().item()
        self._offsets.append((start + n, top + 1 - (start + n)))

    def positions(self, start: int, n: int) -> torch.Tensor:
        """CPU positions [R, n] of tokens [start, start + n): R = 3 once explicit positions had 3 rows."""
        dtype = torch.float32 if self._float else torch.long
        pos = torch.arange(start, start + n, dtype=dtype)
        for k, (first, offset) in enumerate(self._offsets):
            end = self._offsets[k + 1][0] if k + 1 < len(self._offsets) else sys.maxsize
            lo, hi = max(first, start), min(end, start + n)
            if offset and lo < hi:
                pos[lo - start : hi - start] += offset
        pos = pos.unsqueeze(0).expand(3 if self.multi_row else 1, -1).clone()
        for i in range(bisect.bisect_right(self._pos_ends, start), len(self._pos)):
            first, explicit = self._pos[i]
            if first >= start + n:
                break
            lo, hi = max(first, start), min(first + explicit.shape[1], start + n)
            pos[:, lo - start : hi - start] = explicit[:, lo - first : hi - first].to(dtype)
        return pos

    def rows_in(self, start: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]]:
        """(token offsets within [start, start + n) on the host, embeds rows, feature rows) of the stored
        rows there. Indexes increase, so the rows are one slice, found on the host: no device read."""
        found = []
        for i in range(bisect.bisect_right(self._row_ends, start), len(self._rows)):
            r = self._rows[i]
            if r.start >= start + n:
                break
            lo, hi = (int(k) for k in torch.searchsorted(r.index, torch.tensor([start, start + n])))
            found.append((r.index[lo:hi] - start, r.embeds[lo:hi], {k: v[lo:hi] for k, v in r.features.items()}))
        return found

    def store_hidden(self, start: int, n: int, captured: dict[int, torch.Tensor], base: int) -> None:
        """Copy captured states of tokens [start, start + n) (batch rows from `base`) into the pending capture."""
        h = self.hidden
        if h is None:
            return
        lo, hi = max(start, h.start), min(start + n, h.start + h.num_tokens)
        if lo >= hi:
            return
        if h.buffer is None:
            sample = captured[h.layers[0]]
            h.buffer = sample.new_zeros(len(h.layers), h.num_tokens, sample.shape[-1])
        for i, layer in enumerate(h.layers):
            h.buffer[i, lo - h.start : hi - h.start] = captured[layer][base + lo - start : base + hi - start]

    def store_hidden_row(self, start: int, states: torch.Tensor, layers: tuple[int, ...], row: int) -> None:
        """Like `store_hidden` for one decode token: `states` [len(layers), B, H] (the step's own copy)
        holds it at batch row `row`; a capture of exactly that token and those layers keeps a view."""
        h = self.hidden
        if h is None:
            return
        if h.start == start and h.num_tokens == 1 and h.layers == layers:
            h.buffer = states[:, row : row + 1]
        else:
            self.store_hidden(start, 1, dict(zip(layers, states.unbind(0))), row)

    def take_hidden(self) -> torch.Tensor | None:
        """The finished capture [L, n, H] of the item that just completed (None if it asked for none)."""
        h, self.hidden = self.hidden, None
        return None if h is None else h.buffer


def pack_extras(chunks: list[Any], device: torch.device) -> tuple[torch.Tensor, ForwardExtras]:
    """Positions ([T] or [3, T]) and the ForwardExtras of a packed batch of chunks."""
    multi = any(c.seq.inputs is not None and c.seq.inputs.multi_row for c in chunks)
    positions, rows, embeds, capture = [], [], [], set()
    group_features: list[dict[str, torch.Tensor]] = []  # per embedding group, aligned with `embeds`
    base = 0
    for c in chunks:
        inputs: TokenInputs | None = c.seq.inputs
        pos = inputs.positions(c.start, c.num_tokens) if inputs else torch.arange(c.start, c.start + c.num_tokens)[None]
        positions.append(pos.expand(3, -1) if multi else pos)
        if inputs is not None:
            for offsets, values, feats in inputs.rows_in(c.start, c.num_tokens):
                rows.append(offsets + base)
                embeds.append(values)
                group_features.append(feats)
            if inputs.hidden is not None:
                capture.update(inputs.hidden.layers)
        base += c.num_tokens
    extras = ForwardExtras(capture=frozenset(capture))
    if embeds:
        extras.embeds = torch.cat(embeds).to(device)
        extras.embeds_rows = to_device_async(torch.cat(rows), device)
        extras.features = _join_features(embeds, group_features, device)
    pos_all = torch.cat(positions, dim=1)
    return to_device_async(pos_all if multi else pos_all[0], device), extras


def _join_features(embeds: list[torch.Tensor], group_features: list[dict[str, torch.Tensor]],
                   device: torch.device) -> dict[str, torch.Tensor]:
    """Each per-row feature over all embedding rows of the batch; groups without it get zeros, so
    rows stay aligned when a batch mixes sequences that carry a feature with ones that do not."""
    templates = {name: value for feats in group_features for name, value in feats.items()}
    return {name: torch.cat([feats.get(name, template.new_zeros((len(values), *template.shape[1:])))
                             for values, feats in zip(embeds, group_features)]).to(device)
            for name, template in templates.items()}


def collect_hidden(chunks: list[Any], extras: ForwardExtras) -> None:
    """Hand each chunk's captured states to its sequence's pending capture."""
    base = 0
    for c in chunks:
        if c.seq.inputs is not None and c.seq.inputs.hidden is not None:
            c.seq.inputs.store_hidden(c.start, c.num_tokens, extras.captured, base)
        base += c.num_tokens
