"""The new tokens BAGEL's LLM runs for a branch: a prefill of segments, a decoded token, a denoising step.

A `Query` is one sequence's part of a packed forward: its input embeddings, rope positions, which rows
the generation expert takes, how its tokens see each other, whether it is stored in its context, and
the rope position after it. `run` packs queries of any kinds and requests into one LLM forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mstar.models.bagel.config import BagelConfig, TokenIds
from mstar.models.bagel.context import KVContext, PackedAttention, QuerySpec
from mstar.models.bagel.embeddings import grid_positions
from mstar.models.bagel.llm import BagelLLM, Routing
from mstar.models.bagel.plan import TEXT, VAE, VIT, Segment


@dataclass
class Query:
    """One sequence of a packed forward (see the module docstring)."""

    embeds: torch.Tensor  # [n, H]
    positions: torch.Tensor  # [n] int64
    is_gen: torch.Tensor  # [n] bool: rows of the generation expert
    blocks: torch.Tensor | str | None  # QuerySpec.blocks
    store: bool
    next_rope: int

    @property
    def num_tokens(self) -> int:
        return self.embeds.shape[0]


class QueryBuilder:
    """Builds queries for one LLM (its embeddings and generation heads) and one set of special tokens."""

    def __init__(self, llm: BagelLLM, cfg: BagelConfig, ids: TokenIds) -> None:
        self.llm, self.cfg, self.ids = llm, cfg, ids

    def _embed(self, ids: list[int] | torch.Tensor) -> torch.Tensor:
        table = self.llm.language_model.embed_tokens
        return table(torch.as_tensor(ids, dtype=torch.long).to(table.weight.device, non_blocking=True))

    def prefill(self, segments: list[Segment], branch: str, rope: int, text_ids: torch.Tensor,
                vit_embeds: torch.Tensor | None, vae_latents: torch.Tensor | None) -> Query | None:
        """The segments of `branch`, stored: text causal, each image one bidirectional block at one position;
        None when the branch has none (its context stays empty: a prompt-only request's no-text branch)."""
        parts, positions, gen, blocks, count = [], [], [], [], 0
        for seg in segments:
            if not seg.in_branch(branch):
                continue
            if seg.kind == TEXT:
                parts.append(self._embed(text_ids[seg.start:seg.start + seg.tokens]))
                n = seg.tokens
                positions.append(torch.arange(rope, rope + n))
                blocks.append(torch.arange(count, count + n))
                gen.append(torch.zeros(n, dtype=torch.bool))
                rope += n
            else:
                rows = self._image_rows(seg, vit_embeds, vae_latents)
                n = seg.tokens + 2
                parts += [self._embed([self.ids.start_of_image]), rows, self._embed([self.ids.end_of_image])]
                positions.append(torch.full((n,), rope))
                blocks.append(torch.full((n,), count))
                is_gen = torch.zeros(n, dtype=torch.bool)
                is_gen[1:-1] = seg.kind == VAE
                gen.append(is_gen)
                rope += 1
            count += n
        if not parts:
            return None
        dtype = self.llm.language_model.embed_tokens.weight.dtype
        return Query(torch.cat([p.to(dtype) for p in parts]), torch.cat(positions), torch.cat(gen), torch.cat(blocks),
                     True, rope)

    def _image_rows(self, seg: Segment, vit_embeds: torch.Tensor | None,
                    vae_latents: torch.Tensor | None) -> torch.Tensor:
        if seg.kind == VIT:
            if vit_embeds is None:
                raise ValueError("a ViT image segment without vit_embeds (the vit node did not run)")
            return vit_embeds[seg.start:seg.start + seg.tokens]
        assert seg.kind == VAE
        if vae_latents is None:
            raise ValueError("a VAE image segment without vae_latents (the vae encode node did not run)")
        latents = vae_latents[seg.start:seg.start + seg.tokens]
        t = torch.zeros(seg.tokens, device=latents.device)
        return self.llm.latent_embeds(latents, t, self._latent_positions(seg.rows, seg.cols, latents.device))

    def _latent_positions(self, rows: int, cols: int, device: torch.device) -> torch.Tensor:
        if max(rows, cols) > self.cfg.max_latent_size:
            raise ValueError(f"an image of {rows}x{cols} latent patches exceeds the model's "
                             f"{self.cfg.max_latent_size}x{self.cfg.max_latent_size} grid")
        return grid_positions(rows, cols, self.cfg.max_latent_size).to(device, non_blocking=True)

    def text(self, ids: list[int], rope: int) -> Query:
        """Tokens appended causally (a decode step, or closing a thought), stored."""
        n = len(ids)
        return Query(self._embed(ids), torch.arange(rope, rope + n), torch.zeros(n, dtype=torch.bool), None, True,
                     rope + n)

    def denoise(self, latents: torch.Tensor, t: float, rows: int, cols: int, rope: int) -> Query:
        """A denoising step: the noisy latent patches between the image markers, all at `rope`, attending
        their context and each other; not stored."""
        n = latents.shape[0]
        body = self.llm.latent_embeds(latents, torch.full((n,), t, device=latents.device),
                                      self._latent_positions(rows, cols, latents.device))
        markers = self._embed([self.ids.start_of_image, self.ids.end_of_image])
        embeds = torch.cat([markers[:1], body.to(markers.dtype), markers[1:]])
        is_gen = torch.ones(n + 2, dtype=torch.bool)
        is_gen[0] = is_gen[-1] = False
        return Query(embeds, torch.full((n + 2,), rope), is_gen, "full", False, rope)


def run(llm: BagelLLM, items: list[tuple[KVContext, Query]]) -> torch.Tensor:
    """One packed forward of every (context, query): final hidden states [sum n, H]; stored queries join
    their contexts."""
    device = llm.language_model.embed_tokens.weight.device
    queries = [q for _, q in items]
    embeds = torch.cat([q.embeds for q in queries])
    # host tensors go over with non_blocking: a blocking copy would wait for all work queued on the device
    positions = torch.cat([q.positions for q in queries]).to(device, non_blocking=True)
    routing = Routing.of(torch.cat([q.is_gen for q in queries]), device)  # the masks are on the host
    attn = PackedAttention([QuerySpec(c, q.num_tokens, q.blocks, q.store) for c, q in items],
                           llm.language_model.attention_scale)
    hidden = llm.language_model(embeds, positions, routing, attn)
    attn.commit([q.next_rope for q in queries])
    return hidden
