"""Decode lookahead: step N+1's forward is launched before the host reads step N's tokens.

A decode step ends with one host sync (reading the sampled ids). Without lookahead the GPU then
idles while the host turns the tokens into results, the walk feeds them back as the next items and
the next step is scheduled and launched. With lookahead, once step N's sampling is queued on the
GPU, the engine queues the forward of N+1 for the sequences expected to continue, fed with N's
sampled ids straight from device memory (token ids: the offset of logits over a window of ids is
added on the device, with the draw); only then does it wait for N's ids, so all of that host
work overlaps the GPU running N+1.

The forward of N+1 is a guess about the next items: it is used only if the next step schedules
exactly those sequences, each with one new token at the guessed position, and that token is the
one sampled (the walk fed it back). Otherwise it is dropped and the step runs as usual; the
slots it wrote lie past every sequence's computed length in pages the sequence already held, so
the real step overwrites them (stream order keeps the writes in order even if a page changes
hands). It never changes what is computed, only when.

Sequences with per-token extras (TokenInputs) launch ahead too when the next token is guessed to bring
only its id (`TokenInputs.next_plain_row`: default positions, no embedding; a spoken answer's thinker
steps, whose items ask for hidden states): the forward replays the extras graph with the guessed
positions and keeps a copy of its captured states, and the item that claims it must bring exactly
that (`Ahead.matches`), then gets its row of the states (`Ahead.hand_over`). A talker step, whose
embedding comes from another component, never launches ahead.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mstar.engines.autoregressive.scheduler import Chunk, Scheduler
from mstar.engines.autoregressive.sequence import Sequence


@dataclass
class Ahead:
    """A forward launched ahead: its sequences, the position fed for each, and its outputs (device
    tensors, valid until the next forward). `tokens` (host ints) are filled in once N's ids are read."""

    seqs: list[Sequence]
    positions: list[int]
    logits: torch.Tensor
    tokens: list[int] | None = None
    # through the extras graph (sequences with TokenInputs): the graph's greedy ids, each row's guessed
    # rotary positions, and a copy of the captured states [L, B, H] of `layers`
    greedy_ids: torch.Tensor | None = None
    rows: list[list[float] | None] | None = None
    hidden: torch.Tensor | None = None
    layers: tuple[int, ...] = ()

    def matches(self, chunks: list[Chunk]) -> bool:
        """Whether the scheduled `chunks` are exactly the step this forward computed."""
        if self.tokens is None or len(chunks) != len(self.seqs):
            return False
        for i, (c, seq, pos, token) in enumerate(zip(chunks, self.seqs, self.positions, self.tokens)):
            if c.seq is not seq or c.start != pos or c.num_tokens != 1 or not c.completes \
                    or seq.token_ids[pos] != token:
                return False
            if seq.inputs is not None and not self._guessed(i, seq, pos):
                return False
        return True

    def _guessed(self, i: int, seq: Sequence, pos: int) -> bool:
        """Whether the item of a sequence with TokenInputs brought what the forward assumed: no embedding
        or features, the guessed positions, and hidden layers the forward captured."""
        guess = self.rows[i] if self.rows is not None else None
        if guess is None:
            return False
        row = seq.inputs.decode_row(pos)
        if row.embed is not None or row.has_features or row.positions != guess:
            return False
        hidden = seq.inputs.hidden
        return hidden is None or (self.hidden is not None and set(hidden.layers) <= set(self.layers))

    def hand_over(self, chunks: list[Chunk]) -> None:
        """Give each claiming item that asks for hidden states its row of the captured ones."""
        if self.hidden is None:
            return
        for i, c in enumerate(chunks):
            if c.seq.inputs is not None and c.seq.inputs.hidden is not None:
                c.seq.inputs.store_hidden_row(c.start, self.hidden, self.layers, i)


def continuing(seqs: list[Sequence], scheduler: Scheduler, page_size: int, max_model_len: int,
               extras_ahead: bool = False) -> list[int] | None:
    """Indexes (into `seqs`, the step's sampled sequences) of those a lookahead forward should run,
    or None when lookahead should be skipped this step.

    Skipped when the next step is unlikely to be exactly these sequences (new sequences could be
    admitted). A sequence whose next token opens a page it does not hold yet gets that page now
    (`Scheduler.grow_ahead`, from free pages only: it needs the page for its next token anyway);
    when there are not enough free pages the lookahead is skipped and the scheduler decides as usual.
    Sequences sure to stop on length are left out; stops on a sampled EOS cannot be known yet and
    simply drop the lookahead at the next step. A sequence with TokenInputs continues only with
    `extras_ahead` (the runner can replay its extras graph ahead) and when its next token is guessed to
    bring nothing but its id (`TokenInputs.next_plain_row`; a spoken answer's thinker tokens).
    """
    if scheduler.waiting and len(scheduler.running) < scheduler.max_num_seqs:
        return None
    keep, grow = [], []
    for i, seq in enumerate(seqs):
        p = seq.params
        pos = len(seq.token_ids)  # where the token sampled now will sit
        if (p.max_tokens is not None and seq.num_generated + 1 >= p.max_tokens) or pos + 1 >= max_model_len:
            continue
        if seq.num_computed != pos:
            return None
        if seq.inputs is not None and (not extras_ahead or seq.inputs.next_plain_row(pos) is None):
            return None
        if pos // page_size >= len(seq.pages):
            grow.append(seq)
        keep.append(i)
    if not keep or (grow and not scheduler.grow_ahead(grow)):
        return None
    return keep
