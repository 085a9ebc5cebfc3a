"""Executes one scheduled step: packs the chunks, runs the model once, returns logits to sample."""

from __future__ import annotations

import torch

from mstar.engines.attention.base import AttentionBackend, AttentionMetadata
from mstar.engines.autoregressive.scheduler import Chunk
from mstar.engines.base import CausalLM, KVLayout

ATTENTION_BACKENDS = ("auto", "sdpa")


def make_attention_backend(name: str, layout: KVLayout, num_pages: int, page_size: int,
                           device: torch.device) -> AttentionBackend:
    """The attention backend called `name` (`kv_cache.attention_backend`), owning a fresh KV pool."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown kv_cache.attention_backend {name!r}; available: {list(ATTENTION_BACKENDS)}")
    from mstar.engines.attention.sdpa import SDPABackend

    return SDPABackend(layout, num_pages, page_size, device)


class ModelRunner:
    """Turns chunks into model inputs and attention metadata; owns no scheduling state."""

    def __init__(self, model: CausalLM, attn: AttentionBackend, page_size: int, device: torch.device) -> None:
        self.model = model
        self.attn = attn
        self.page_size = page_size
        self.device = device

    @torch.inference_mode()
    def run(self, chunks: list[Chunk]) -> torch.Tensor | None:
        """One packed forward over all chunks; float32 logits [N, V] for the chunks that complete
        (None when none does)."""
        if any(c.seq.inputs is not None for c in chunks):
            return self._run_with_extras(chunks)
        input_ids, positions, slots = [], [], []
        for c in chunks:
            pos = range(c.start, c.start + c.num_tokens)
            input_ids.extend(c.seq.token_ids[c.start : c.start + c.num_tokens])
            positions.extend(pos)
            slots.extend(c.seq.pages[p // self.page_size] * self.page_size + p % self.page_size for p in pos)
        self.attn.prepare(self._metadata(chunks, slots))
        hidden = self.model.forward(self._tensor(input_ids), self._tensor(positions), self.attn)
        ends = torch.cumsum(torch.tensor([c.num_tokens for c in chunks]), 0) - 1
        last = [int(e) for c, e in zip(chunks, ends) if c.completes]
        return self.model.compute_logits(hidden[self._tensor(last)]) if last else None

    def _run_with_extras(self, chunks: list[Chunk]) -> torch.Tensor | None:
        """`run` for batches where a sequence has input embeddings, explicit positions or hidden capture."""
        from mstar.engines.autoregressive.token_inputs import collect_hidden, pack_extras

        input_ids, slots = [], []
        for c in chunks:
            input_ids.extend(c.seq.token_ids[c.start : c.start + c.num_tokens])
            slots.extend(c.seq.pages[p // self.page_size] * self.page_size + p % self.page_size
                         for p in range(c.start, c.start + c.num_tokens))
        positions, extras = pack_extras(chunks, self.device)
        self.attn.prepare(self._metadata(chunks, slots))
        hidden = self.model.forward(self._tensor(input_ids), positions, self.attn, extras)  # type: ignore[call-arg]
        collect_hidden(chunks, extras)
        ends = torch.cumsum(torch.tensor([c.num_tokens for c in chunks]), 0) - 1
        last = [int(e) for c, e in zip(chunks, ends) if c.completes]
        return self.model.compute_logits(hidden[self._tensor(last)]) if last else None

    def _metadata(self, chunks: list[Chunk], slots: list[int]) -> AttentionMetadata:
        max_pages = max(len(c.seq.pages) for c in chunks)
        tables = torch.zeros(len(chunks), max_pages, dtype=torch.int32)
        for i, c in enumerate(chunks):
            tables[i, : len(c.seq.pages)] = torch.tensor(c.seq.pages, dtype=torch.int32)
        return AttentionMetadata(
            query_lens=[c.num_tokens for c in chunks],
            seq_lens=[c.start + c.num_tokens for c in chunks],
            slot_mapping=self._tensor(slots),
            block_tables=tables.to(self.device),
        )

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long).to(self.device, non_blocking=True)
