"""Steps with prompt tokens replayed from CUDA graphs captured at token buckets.

A step that is not decode-only (a prefill chunk, alone or beside decode rows) runs the model eagerly:
every kernel of every layer is launched from Python, which on a slow host takes far longer than the
GPU work, and every running sequence waits for that step (served Orpheus has one per admitted
request, so it sets the tail of the gaps between audio chunks).

`PrefillGraphs` captures `model.forward` over T tokens for each T of `cuda_graphs.prefill_tokens`. A
step of n <= max(T) tokens over at most `max_num_seqs` sequences replays the smallest T >= n: the
token ids and positions go into the graphs' static inputs (tokens past n: id 0, position 0), and the
attention backend's `prepare_graphed_prefill` describes the batch in its persistent buffers with the
grids of T query tokens over all of its sequence rows (rows past the batch have no queries and length
0; tokens past n have slot -1, so nothing is written for them and no query block computes them; their
hidden rows are never read). The replay returns the hidden states [T, H]; the caller takes the rows
it samples from and computes their logits eagerly (a few launches), so the graph does not depend on
how many rows complete.

Steps with input embeddings, explicit positions or hidden capture (`seq.inputs`) are not served here.
"""

from __future__ import annotations

import torch

from mstar.engines.attention.base import AttentionMetadata, GraphedPrefillAttention
from mstar.engines.autoregressive.batch_scheduler import Chunk
from mstar.engines.base import CausalLM
from mstar.engines.cuda_graphs import BatchGraphs


class PrefillGraphs:
    """`model.forward` captured at token buckets `tokens` (see the module docstring)."""

    def __init__(self, model: CausalLM, attn: GraphedPrefillAttention, device: torch.device,
                 tokens: list[int]) -> None:
        self.model, self.attn = model, attn
        self.tokens = sorted(set(tokens))
        self.max_tokens = self.tokens[-1]
        self.max_seqs: int = attn.max_num_seqs
        with torch.inference_mode(False):  # normal tensors: the replay updates them in place
            self.ids = torch.zeros(self.max_tokens, dtype=torch.long, device=device)
            self.positions = torch.zeros(self.max_tokens, dtype=torch.long, device=device)
        attn.reserve_graphed_prefill(self.max_tokens)
        self.replays = 0
        self.graphs = BatchGraphs(self._forward, self.tokens, [((), torch.long), ((), torch.long)], device,
                                  before_capture=self._describe_dummy_batch,
                                  static_inputs=[self.ids, self.positions])

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model.forward(input_ids, positions, self.attn)

    def _describe_dummy_batch(self, tokens: int) -> None:
        """`tokens` tokens spread over as many sequences as the backend holds (each attending over
        itself, so none is longer than a sequence may be), written nowhere (slots -1). A graph depends
        on the bucket alone, not on how its tokens are split."""
        seqs = min(self.max_seqs, tokens)
        lens = [tokens // seqs + (i < tokens % seqs) for i in range(seqs)]
        meta = AttentionMetadata(lens, lens, torch.full((tokens,), -1, dtype=torch.long),
                                 torch.zeros(seqs, 1, dtype=torch.int32))
        self.attn.prepare_graphed_prefill(meta, tokens)

    def accepts(self, chunks: list[Chunk]) -> bool:
        """Whether this step fits a captured bucket (plain tokens, few enough of them and of sequences)."""
        return (len(chunks) <= self.max_seqs and sum(c.num_tokens for c in chunks) <= self.max_tokens
                and all(c.seq.inputs is None for c in chunks))

    def run(self, chunks: list[Chunk], metadata: AttentionMetadata, input_ids: list[int],
            positions: list[int]) -> torch.Tensor:
        """Replay the step whose packed tokens are `input_ids` at `positions` (described by `metadata`,
        slots included); hidden states [T, H] of the bucket T (rows past the step's tokens are padding),
        a view valid until the next replay."""
        n = len(input_ids)
        bucket = self.graphs.bucket(n)
        assert bucket is not None and self.accepts(chunks), (n, len(chunks))
        pad = bucket - n
        host = torch.tensor([input_ids + [0] * pad, positions + [0] * pad], dtype=torch.long)
        self.ids[:bucket].copy_(host[0], non_blocking=True)
        self.positions[:bucket].copy_(host[1], non_blocking=True)
        self.attn.prepare_graphed_prefill(metadata, bucket)
        self.replays += 1
        return self.graphs(self.ids[:bucket], self.positions[:bucket], bucket=bucket)[0]
