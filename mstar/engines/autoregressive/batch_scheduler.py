"""Continuous batching policy: which sequences run in the next step, and with how many tokens.

Decode steps go first, then unfinished prefills, then new sequences, all within a token budget
(chunked prefill). When pages run out the newest running sequence is preempted: its pages are
freed and it recomputes later, reusing whatever of its prefix the cache still holds. A sequence that
cannot recompute (`Sequence.recomputable`) is passed over while another victim exists; when none does,
it is dropped instead, its pages freed, and the engine fails its request (`dropped`).
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

from mstar.engines.autoregressive.sequence import SeqStatus, Sequence
from mstar.engines.kv_cache.block_pool import BlockPool
from mstar.engines.kv_cache.prefix_cache import hash_pages

logger = logging.getLogger(__name__)


@dataclass(slots=True)  # one per sequence and step
class Chunk:
    """Tokens [start, start + num_tokens) of `seq` computed in this step."""

    seq: Sequence
    start: int
    num_tokens: int

    @property
    def completes(self) -> bool:
        """Whether this chunk brings the sequence's cache up to all its tokens (so it samples)."""
        return self.start + self.num_tokens == len(self.seq.token_ids)


class BatchScheduler:
    """Owns the running/waiting queues and the pages of every sequence."""

    def __init__(self, pool: BlockPool, max_num_seqs: int, max_batch_tokens: int) -> None:
        self.pool = pool
        self.max_num_seqs = max_num_seqs
        self.max_batch_tokens = max_batch_tokens
        self.running: list[Sequence] = []  # admission order: the last is preempted first
        self.waiting: deque[Sequence] = deque()
        self.num_preemptions = 0
        self.dropped: list[Sequence] = []  # would have been preempted but cannot recompute: the engine fails them

    def add(self, seq: Sequence) -> None:
        """Note that `seq` has new tokens; sequences without pages join the waiting queue."""
        if seq.status is SeqStatus.PARKED or (seq.status is SeqStatus.WAITING and seq not in self.waiting):
            seq.status = SeqStatus.WAITING
            self.waiting.append(seq)

    def adopt(self, seq: Sequence) -> None:
        """Add a sequence that already holds pages for its computed tokens (moved from another engine)
        to the running ones; the caller checked that a seat is free."""
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)

    def free_seat(self) -> bool:
        """Whether one more sequence can run now: a seat is free or, when no running sequence has tokens
        to compute, the newest idle one gave its seat up (the progress guarantee of `_admit_waiting`)."""
        if len(self.running) < self.max_num_seqs:
            return True
        return not any(s.num_pending for s in self.running) and self._preempt_idle()

    def remove(self, seq: Sequence) -> None:
        """Forget `seq` and free its pages (cached full pages stay reusable)."""
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._free_pages(seq)

    def schedule(self) -> list[Chunk]:
        """Pick the chunks of the next step and reserve their pages."""
        budget = self.max_batch_tokens
        chunks: list[Chunk] = []
        preempted_before = self.num_preemptions
        # decode steps (one pending token) first, then the rest, each in running order
        ready = [s for s in self.running if len(s.token_ids) - s.num_computed == 1]
        if len(ready) < len(self.running):
            ready += [s for s in self.running if len(s.token_ids) - s.num_computed > 1]
        for seq in ready:
            if budget == 0:
                break
            if seq.status is not SeqStatus.RUNNING:  # preempted for an earlier sequence of this loop
                continue
            n = min(seq.num_pending, budget)
            if self._reserve(seq, n, chunks):
                chunks.append(Chunk(seq, seq.num_computed, n))
                budget -= n
        # Admitting new work right after a preemption would only thrash.
        if self.num_preemptions == preempted_before:
            self._admit_waiting(chunks, budget)
        return chunks

    def _admit_waiting(self, chunks: list[Chunk], budget: int) -> None:
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            n = self._admit(seq, budget) if len(self.running) < self.max_num_seqs else 0
            if n == 0:
                # Progress guarantee: when nothing else can run, idle sequences (waiting for their
                # caller's next item, which may depend on this one, e.g. another guidance branch)
                # give up their pages and seats.
                if chunks or not self._preempt_idle():
                    return
                continue
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            chunks.append(Chunk(seq, seq.num_computed, n))
            budget -= n

    def _preempt_idle(self) -> bool:
        """Preempt (`_victim`) one of the running sequences that have no pending tokens; False if none has."""
        victim = _victim([s for s in reversed(self.running) if s.num_pending == 0])
        if victim is not None:
            self._preempt(victim)
        return victim is not None

    def update(self, chunks: list[Chunk]) -> None:
        """After the step ran: advance each sequence and offer its new full pages to the prefix cache."""
        for chunk in chunks:
            seq = chunk.seq
            seq.num_computed = chunk.start + chunk.num_tokens
            full = min(seq.num_computed, seq.num_shareable) // self.pool.page_size
            if full > seq.num_registered:
                hashes = self._page_hashes(seq, full)
                for i in range(seq.num_registered, full):
                    self.pool.register(seq.pages[i], hashes[i])
                seq.num_registered = full

    def _reserve(self, seq: Sequence, n: int, chunks: list[Chunk]) -> bool:
        """Give a running `seq` pages for `n` more tokens, preempting newer sequences if needed.

        False when `seq` itself had to be preempted.
        """
        need = self.pool.pages_for(seq.num_computed + n) - len(seq.pages)
        if need <= 0:  # the usual decode step: its token fits in the last page
            return True
        while need > self.pool.num_free:
            scheduled = {id(c.seq) for c in chunks}
            victim = _victim([s for s in reversed(self.running) if id(s) not in scheduled])
            assert victim is not None  # `seq` itself is running and not scheduled yet
            self._preempt(victim)
            if victim is seq:
                return False
        seq.pages += self.pool.allocate(need)
        return True

    def grow_ahead(self, seqs: list[Sequence]) -> bool:
        """Give each of `seqs` (running, every token computed) the page its next token opens, from free
        pages only, never by preempting; False, giving none, when there are not enough."""
        if len(seqs) > self.pool.num_free:
            return False
        for seq in seqs:
            seq.pages += self.pool.allocate(1)
        return True

    def _admit(self, seq: Sequence, budget: int) -> int:
        """Give a waiting `seq` its cached prefix and pages for its first chunk; 0 if it does not fit."""
        # At least one token is computed, so that there are logits to sample from.
        limit = min(len(seq.token_ids) - 1, seq.num_matchable)
        cached = self.pool.match_prefix(self._page_hashes(seq, limit // self.pool.page_size))
        seq.pages, seq.num_registered = cached, len(cached)
        seq.num_computed = len(cached) * self.pool.page_size
        n = min(seq.num_pending, budget)
        need = self.pool.pages_for(seq.num_computed + n) - len(seq.pages)
        if need > self.pool.num_free:
            self._free_pages(seq)
            return 0
        seq.pages += self.pool.allocate(need)
        return n

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._free_pages(seq)
        if not seq.recomputable:
            seq.status = SeqStatus.PARKED  # out of both queues until the engine drops it
            self.dropped.append(seq)
            logger.warning("dropped %s (%d tokens): its pages were needed and it cannot recompute here",
                           seq.key, len(seq.token_ids))
            return
        self.num_preemptions += 1
        if seq.item is not None:
            seq.status = SeqStatus.WAITING
            self.waiting.appendleft(seq)
        else:
            seq.status = SeqStatus.PARKED
        logger.debug("preempted %s (%d tokens) to recompute later", seq.key, len(seq.token_ids))

    def _free_pages(self, seq: Sequence) -> None:
        self.pool.free(seq.pages)
        seq.pages, seq.num_computed, seq.num_registered = [], 0, 0

    def _page_hashes(self, seq: Sequence, num_pages: int) -> list[int]:
        """Hashes of the first `num_pages` full pages (tokens only grow, so earlier hashes stay valid)."""
        if len(seq.page_hashes) < num_pages:
            tokens = seq.token_ids[: num_pages * self.pool.page_size]
            seq.page_hashes = hash_pages(tokens, self.pool.page_size, seq.page_hashes)
        return seq.page_hashes[:num_pages]


def _victim(candidates: list[Sequence]) -> Sequence | None:
    """The first of `candidates` (newest first) that can recompute, else the first (which is dropped)."""
    return next((s for s in candidates if s.recomputable), candidates[0] if candidates else None)
