"""Decode steps with per-token extras (input embeddings, explicit positions, hidden capture) replayed
from CUDA graphs.

Plain decode graphs take token ids and positions only, so a step where some sequence brings input
embeddings, explicit rotary positions or asks for hidden states would run eagerly: for Qwen3-Omni
that is every talker step (its input is an embedding) and every thinker step of a spoken answer
(the talker reads the thinker's hidden states), each paying all its layers' kernel launches.

A model that declares `graph_hidden_layers` (the layers its decode items ask for; 0 = embeddings,
-1 = final) and `hidden_size` gets a second set of decode graphs. Their static inputs also hold one
embedding row per sequence with a mask saying which rows use it (the others look their token up),
and positions as float32 rows ([B, 3] for models with `multirow_positions`; rotary modules compute
in float32, so integral positions give the same angles); their outputs add the declared layers'
states. A decode batch replays them when every sequence computes one token without per-token
features (e.g. deepstack rows, which only prompts carry) and asks for declared layers only; any
other batch runs eagerly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mstar.engines.autoregressive.batch_scheduler import Chunk
from mstar.engines.autoregressive.sequence import Sequence
from mstar.engines.base import CausalLM
from mstar.engines.cuda_graphs import BatchGraphs, to_device_async
from mstar.engines.extras import ForwardExtras
from mstar.engines.sampling import greedy_ids


@dataclass
class _StaticExtras(ForwardExtras):
    """ForwardExtras over fixed-shape buffers: every row has an embedding slot, `use_embeds` picks."""

    use_embeds: torch.Tensor | None = None  # [B] bool

    def embed(self, table: nn.Embedding, input_ids: torch.Tensor) -> torch.Tensor:
        x = table(input_ids)
        assert self.embeds is not None and self.use_embeds is not None
        return torch.where(self.use_embeds[:, None], self.embeds.to(x.dtype), x)


class ExtrasGraphs:
    """Decode graphs of a model's forward with static embedding, position and hidden-capture buffers."""

    def __init__(self, model: CausalLM, attn: Any, device: torch.device) -> None:
        self.model, self.attn, self.device = model, attn, device
        self.layers = tuple(model.graph_hidden_layers)
        self.offset = model.logit_offset  # greedy ids are token ids
        self.rows = 3 if model.multirow_positions else 1
        self._zero_row = torch.zeros(model.hidden_size, dtype=model.kv_layout.dtype, device=device)
        self.graphs: BatchGraphs | None = None

    @torch.inference_mode()
    def capture(self, sizes: list[int], describe_dummy_batch: Callable[[int], None]) -> None:
        """Capture `step` at `sizes` (CUDA only); `describe_dummy_batch` prepares the attention backend."""
        example = [((), torch.long), ((self.rows,), torch.float32), ((self.model.hidden_size,), self._zero_row.dtype),
                   ((), torch.bool)]
        self.graphs = BatchGraphs(self.step, sizes, example, self.device, before_capture=describe_dummy_batch)

    def step(self, ids: torch.Tensor, positions: torch.Tensor, embeds: torch.Tensor,
             use_embeds: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The captured function: (logits, greedy token ids, *states of the declared layers) of one
        decode row per sequence; the attention backend must have been prepared for the batch."""
        extras = _StaticExtras(embeds=embeds, capture=frozenset(self.layers), use_embeds=use_embeds)
        pos = positions.t() if self.rows == 3 else positions[:, 0]
        logits = self.model.compute_logits(self.model.forward(ids, pos, self.attn, extras), ids)
        return (logits, greedy_ids(logits, self.offset), *(extras.captured[k] for k in self.layers))

    def accepts(self, chunks: list[Chunk]) -> bool:
        """Whether this decode batch can replay: one token per sequence, no features, declared layers."""
        if self.graphs is None or len(chunks) > self.graphs.max_batch:
            return False
        for c in chunks:
            if c.num_tokens != 1 or not c.completes or not self._fits(c.seq):
                return False
            if c.seq.inputs is not None and c.seq.inputs.decode_row(c.start).has_features:
                return False
        return True

    def _fits(self, seq: Sequence) -> bool:
        """Whether the graphs serve the sequence's TokenInputs: their position rows, the layers they ask for."""
        inputs = seq.inputs
        if inputs is None:
            return True
        if inputs.multi_row and self.rows == 1:
            return False
        return inputs.hidden is None or set(inputs.hidden.layers) <= set(self.layers)

    def inputs(self, chunks: list[Chunk]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(positions [n, rows] float32, embeddings [n, H], use-embedding mask [n]) on the device."""
        positions, rows, mask = [], [], []
        for c in chunks:
            inputs, embedding = c.seq.inputs, None
            if inputs is None:
                positions.append([float(c.start)] * self.rows)
            else:
                row = inputs.decode_row(c.start)
                positions.append(row.positions * self.rows if len(row.positions) == 1 else row.positions)
                embedding = row.embed
            mask.append(embedding is not None)
            rows.append(self._zero_row if embedding is None else embedding.to(self.device, self._zero_row.dtype))
        return (to_device_async(torch.tensor(positions, dtype=torch.float32), self.device), torch.stack(rows),
                to_device_async(torch.tensor(mask, dtype=torch.bool), self.device))

    def accepts_ahead(self, seqs: list[Sequence]) -> bool:
        """Whether a lookahead forward of `seqs` (each fed the token the engine appends) can replay."""
        if self.graphs is None or len(seqs) > self.graphs.max_batch:
            return False
        return all(self._fits(seq) for seq in seqs)

    def appended_inputs(self, seqs: list[Sequence], positions: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The graph's (positions, embeddings, use-embedding mask) for a lookahead forward: each sequence
        at `positions` fed the token the engine appends (no embedding row)."""
        rows = []
        for seq, pos in zip(seqs, positions):
            values = [float(pos)] if seq.inputs is None else seq.inputs.appended_positions(pos)
            rows.append(values * self.rows if len(values) == 1 else values)
        n = len(seqs)
        return (to_device_async(torch.tensor(rows, dtype=torch.float32), self.device),
                self._zero_row.expand(n, -1), to_device_async(torch.zeros(n, dtype=torch.bool), self.device))

    def store_hidden(self, chunks: list[Chunk], hidden: tuple[torch.Tensor, ...]) -> None:
        """Hand each sequence's captured rows to its pending capture: one copy of the static graph
        outputs (the next replay overwrites them) for the whole batch, a view of it per sequence."""
        wanting = [(i, c) for i, c in enumerate(chunks) if c.seq.inputs is not None and c.seq.inputs.hidden is not None]
        if not wanting:
            return
        states = torch.stack(hidden)  # [L, B, H]
        for i, c in wanting:
            c.seq.inputs.store_hidden_row(c.start, states, self.layers, i)
