"""Per-sequence state of the autoregressive engine (one per request and KV slot)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

import torch

from mstar.engines.base import StepItem
from mstar.engines.sampling import SamplingParams, SamplingRow

if TYPE_CHECKING:
    from mstar.engines.autoregressive.token_inputs import ItemExtras, TokenInputs
    from mstar.engines.grammar import GrammarMatcher


class SeqStatus(Enum):
    """Where a sequence sits in the batch scheduler."""

    WAITING = "waiting"  # has work, holds no pages yet (new, or preempted with work pending)
    RUNNING = "running"  # holds pages; may be idle until its next item arrives
    PARKED = "parked"  # preempted while idle: holds no pages, rejoins WAITING with its next item


@dataclass(eq=False)  # identity semantics: queues find and remove sequences by object
class Sequence:
    """One KV sequence: every token the caller appended, and how much of it is in the cache.

    Token rule: the sequence is the concatenation of its items' `input_ids` and, while an engine-loop
    item runs, of the tokens the engine sampled and appended for it.
    """

    key: tuple[str, str]  # (request_id, kv_slot)
    params: SamplingParams
    token_ids: list[int]
    num_prompt: int  # tokens of the first item: penalties and min_tokens count the rest as output
    generator: torch.Generator | None = None  # seeded requests only
    status: SeqStatus = SeqStatus.WAITING
    num_computed: int = 0  # tokens whose K/V are in `pages`
    pages: list[int] = field(default_factory=list)
    page_hashes: list[int] = field(default_factory=list)  # chained hashes of full pages seen so far
    num_registered: int = 0  # leading pages already offered to the prefix cache
    num_generated: int = 0  # tokens sampled for this sequence
    item: StepItem | None = None  # the item waiting for a result
    sampling_cache: dict = field(default_factory=dict)  # sampling's per-sequence scratch (seen-token mask)
    sampling_row: SamplingRow | None = None  # what sampling reads of this sequence (set by the engine, kept)
    inputs: TokenInputs | None = None  # embeddings, explicit positions, hidden capture (token_inputs.py)
    loop_done: int = 0  # iterations of the pending engine-loop item run so far
    loop_extras: ItemExtras | None = None  # what each token appended for that item brings (hidden capture)
    matcher: GrammarMatcher | None = None  # where the sequence is in its grammar (structured outputs only)
    num_moved: int = 0  # leading tokens whose K/V arrived computed from another engine (kv_transfer.py)
    error: str | None = None  # why it was dropped while idle: its next item fails with it

    @property
    def num_pending(self) -> int:
        """Tokens appended by the caller but not yet in the cache."""
        return len(self.token_ids) - self.num_computed

    @property
    def num_shareable(self) -> int:
        """Leading tokens whose K/V depend on their ids alone: only those go to the prefix cache."""
        return len(self.token_ids) if self.inputs is None else min(len(self.token_ids), self.inputs.num_shareable)

    @property
    def num_matchable(self) -> int:
        """Leading tokens that may be taken from the prefix cache instead of computed."""
        return len(self.token_ids) if self.inputs is None else min(len(self.token_ids), self.inputs.num_matchable)

    @property
    def recomputable(self) -> bool:
        """Whether its K/V can be computed again here after its pages are freed: not so for a sequence
        moved here whose moved tokens' K/V depend on more than their ids (media rows, explicit positions
        that stayed with the sender)."""
        return self.num_shareable >= self.num_moved
