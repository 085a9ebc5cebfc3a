"""Decode lookahead: step N+1's forward is launched before the host reads step N's tokens.

A decode step ends with one host sync (reading the sampled ids). Without lookahead the GPU then
idles while the host turns the tokens into results and schedules and launches the next step. The
engine appends an engine loop's samples itself (`engine.py`), so it knows step N+1 before it has
read N's tokens: once N's draw is queued on the GPU, it queues the forward of N+1 for the engine-loop
sequences that go on, fed with N's sampled ids straight from device memory (token ids: the offset of
logits over a window of ids is added on the device, with the draw); only then does it wait for N's
ids, so the host's work on them overlaps the GPU running N+1.

It is a scheduling decision (`AutoregressiveEngine._continuing`): taken only when no other work
could join step N+1 (no sequence with tokens still to compute, none waiting for a free seat, none
sampled at N by an item that is not an engine loop: its caller's next item, such as the decode loop
after a prefill, comes before step N+1), so a newly arrived item waits one step at most. Step N+1
is then that forward's sequences that are still live: one that sampled a stop at N or was released
is left out and its row dropped; the slot its row wrote lies past its tokens in a page it held, and
whoever gets the page next overwrites it (stream order keeps the writes in order).

A sequence with per-token extras (TokenInputs: a spoken answer's thinker, whose steps capture hidden
states for the talker) runs ahead through the extras graphs: a token the engine appends brings no
embedding and takes the positions after the last explicit ones (`TokenInputs.appended_positions`);
the forward keeps a copy of its captured states, which step N+1 hands to the sequences
(`Ahead.hand_over`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mstar.engines.autoregressive.batch_scheduler import Chunk
from mstar.engines.autoregressive.sequence import Sequence


@dataclass
class Ahead:
    """A forward launched ahead: its sequences, the position each computes, and its outputs (device
    tensors, valid until the next forward)."""

    seqs: list[Sequence]
    positions: list[int]
    logits: torch.Tensor
    # through the extras graph (sequences with TokenInputs): the graph's greedy ids, and a copy of the
    # captured states [L, B, H] of `layers`
    greedy_ids: torch.Tensor | None = None
    hidden: torch.Tensor | None = None
    layers: tuple[int, ...] = ()

    def hand_over(self, chunks: list[Chunk], rows: list[int]) -> None:
        """Give each of `chunks` (the live sequences, at batch rows `rows`) that asks for hidden states
        its row of the captured ones."""
        if self.hidden is None:
            return
        for row, c in zip(rows, chunks):
            if c.seq.inputs is not None and c.seq.inputs.hidden is not None:
                c.seq.inputs.store_hidden_row(c.start, self.hidden, self.layers, row)
