"""Constrained decoding's contract with the autoregressive engine.

A model that supports structured outputs hands its engine `Grammars` (in `AutoregressiveSpec.grammars`);
for each sequence whose request sets `structured_outputs`, the engine asks it for a `GrammarMatcher`,
masks that row's logits with the matcher's allowed tokens before sampling (on the device:
`token_masks.TokenMasks`), and feeds the matcher each token it samples. A component that samples text
itself (BAGEL's LLM, a stateless component) does the same with the `Grammars` its model gives it (`constrain`). The engine knows no grammar library: `mstar.models.common.grammar` implements these
with xgrammar over the model's tokenizer.

A request's `structured_outputs` is a JSON object with exactly one of: "json_schema" (a JSON schema),
"json_object" (true: any JSON object), "regex" (a pattern), "choice" (a list of strings), "tagged_json"
({"begin": text, "schema": a JSON schema, "end": text}: a JSON value between two literal texts, as a chat
model's tool call is written; with "separator": text as well, one or more such tagged values separated by it,
as parallel tool calls are written).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Protocol

import torch

STRUCTURED_KINDS = ("json_schema", "json_object", "regex", "choice", "tagged_json")


class GrammarMatcher(Protocol):
    """One sequence's position in its grammar."""

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into row `row` of a packed int32 bitmask [rows, ceil(V / 32)] on the
        host (bit i of word w: token 32 * w + i)."""

    def accept(self, token_id: int) -> bool:
        """Advance past `token_id`; False (and no change) when the grammar does not allow it."""

    def is_finished(self) -> bool:
        """Whether the grammar is complete and took its end token."""


class Grammars(Protocol):
    """Makes matchers over one model's vocabulary."""

    def matcher(self, spec: str) -> GrammarMatcher:
        """A fresh matcher for `spec` (`canonical_spec`'s form); ValueError naming what cannot be compiled."""


def start_matcher(grammars: Grammars | None, spec: str | None, generated: Sequence[int] = ()) -> GrammarMatcher | None:
    """The matcher of a sequence whose request asks for structured outputs `spec` (None: it does not), past
    the tokens it already generated (a sequence resumed on this worker); ValueError when the model has no
    grammars or a generated token breaks the grammar."""
    if spec is None:
        return None
    if grammars is None:
        raise ValueError("structured_outputs: this model does not constrain its output to a grammar")
    matcher = grammars.matcher(spec)
    for token in generated:
        if not matcher.accept(token):
            raise ValueError(f"structured_outputs: generated token {token} breaks the grammar")
    return matcher


def canonical_spec(value: Any) -> str:
    """A request's `structured_outputs` option checked and written as JSON (a string: hashable, and what
    `Grammars` compile); ValueError naming the fault."""
    if not isinstance(value, dict) or len(value) != 1 or next(iter(value)) not in STRUCTURED_KINDS:
        raise ValueError(f"invalid sampling option structured_outputs={value!r}: use an object with exactly one "
                         f"of {list(STRUCTURED_KINDS)}")
    kind, body = next(iter(value.items()))
    ok = {"json_schema": isinstance(body, dict), "json_object": body is True,
          "regex": isinstance(body, str) and bool(body),
          "choice": isinstance(body, list) and bool(body) and all(isinstance(c, str) and c for c in body),
          "tagged_json": isinstance(body, dict) and set(body) - {"separator"} == {"begin", "schema", "end"}
          and isinstance(body["schema"], dict) and isinstance(body["begin"], str) and isinstance(body["end"], str)
          and isinstance(body.get("separator", ""), str)}[kind]
    if not ok:
        want = {"json_schema": "a JSON schema object", "json_object": "true", "regex": "a non-empty pattern",
                "choice": "a non-empty list of non-empty strings",
                "tagged_json": '{"begin": text, "schema": a JSON schema object, "end": text[, "separator": text]}'}[kind]
        raise ValueError(f"invalid sampling option structured_outputs.{kind}={body!r}: use {want}")
    return json.dumps(value)  # keys keep their order: a schema's properties are generated in it


def constrain(logits: torch.Tensor, matchers: Sequence[GrammarMatcher | None], offset: int = 0) -> torch.Tensor:
    """`logits` [N, V] (columns = token ids offset .. offset + V - 1) with row i limited to the tokens
    `matchers[i]` allows (a row without a matcher as it is); `logits` itself when no row has one. Whoever
    samples a row then feeds its matcher the token (`GrammarMatcher.accept`)."""
    rows = [i for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return logits
    bitmask = torch.zeros(len(rows), -(-(offset + logits.shape[1]) // 32), dtype=torch.int32)
    for j, i in enumerate(rows):
        matchers[i].fill_bitmask(bitmask, j)
    return mask_logits(logits, rows, bitmask, offset)


def mask_logits(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor, offset: int = 0) -> torch.Tensor:
    """`logits` [N, V] (columns = token ids offset .. offset + V - 1) with the tokens that row j of the host
    `bitmask` forbids set to -inf in row `rows[j]`; a new tensor. Ids past the bitmask are forbidden."""
    shifts = torch.arange(32, dtype=torch.int32)
    allowed = ((bitmask[:, :, None] >> shifts) & 1).reshape(bitmask.shape[0], -1).bool()
    width = logits.shape[1]
    window = allowed[:, offset:offset + width]
    if window.shape[1] < width:
        window = torch.cat([window, window.new_zeros(window.shape[0], width - window.shape[1])], dim=1)
    index = torch.tensor(rows, dtype=torch.long)
    out = logits.clone()
    out[index.to(logits.device)] = logits[index.to(logits.device)].masked_fill(~window.to(logits.device), float("-inf"))
    return out
