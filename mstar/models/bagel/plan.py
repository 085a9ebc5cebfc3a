"""What a BAGEL request's context is made of: its segments, and which guidance branch sees which.

A context is a sequence of segments: text (`<|im_start|> text <|im_end|>`, causal), a ViT image
(`<|vision_start|> patches <|vision_end|>`) and a VAE image (the same markers around latent patches);
an image's tokens see each other whole and share one rope position, after which the position moves by
one. Image generation keeps three contexts (guidance branches), as the upstream inferencer builds them:
  full      every segment (and, in thinking mode, the thought after them);
  no_text   the full context without its last text segment (no thought);
  no_image  the text segments only (no thought).
Where a guidance context is a prefix of the full one (`shared_prefix`), it can be a view of the full one's
keys and values. The processor sends the segments as one int64 tensor [S, 5] (`encode_segments`): kind, branch mask,
tokens, grid rows, grid columns; the text ids, ViT patches and VAE pixels of every segment travel
packed in segment order, so each branch finds its pieces by walking the segments.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

TEXT, VIT, VAE = 0, 1, 2  # segment kinds
BRANCH_BITS = {"full": 1, "no_text": 2, "no_image": 4}
BRANCHES = tuple(BRANCH_BITS)


@dataclass(frozen=True)
class Segment:
    """One segment; `start` indexes its kind's packed source (text ids, ViT rows or VAE latent rows)."""

    kind: int
    branches: int  # bit mask of BRANCH_BITS
    tokens: int  # text: ids including the markers; images: patches (the two markers come on top)
    rows: int = 0  # image patch grid
    cols: int = 0
    start: int = 0

    def in_branch(self, branch: str) -> bool:
        return bool(self.branches & BRANCH_BITS[branch])


def encode_segments(segments: list[Segment]) -> torch.Tensor:
    """[S, 5] int64: kind, branch mask, tokens, rows, cols (starts are implied by the order)."""
    return torch.tensor([[s.kind, s.branches, s.tokens, s.rows, s.cols] for s in segments], dtype=torch.long)


def decode_segments(table: torch.Tensor) -> list[Segment]:
    """The segments of an `encode_segments` tensor, each with its start in its kind's packed source."""
    starts = {TEXT: 0, VIT: 0, VAE: 0}
    out = []
    for kind, branches, tokens, rows, cols in table.tolist():
        out.append(Segment(kind, branches, tokens, rows, cols, starts[kind]))
        starts[kind] += tokens
    return out


def branch_masks(kinds: list[int], think: bool) -> list[int]:
    """Branch masks of segments of `kinds` in context order (the upstream inferencer's three contexts):
    every segment is in `full`; `no_text` lacks the last segment when it is text; `no_image` lacks the
    images. A thinking request's system prompt (its first segment) is in all three."""
    full, no_text, no_image = BRANCH_BITS["full"], BRANCH_BITS["no_text"], BRANCH_BITS["no_image"]
    masks = []
    for i, kind in enumerate(kinds):
        mask = full
        if not (i == len(kinds) - 1 and kind == TEXT) or (think and i == 0):
            mask |= no_text
        if kind == TEXT:
            mask |= no_image
        masks.append(mask)
    return masks


def shared_prefix(segments: list[Segment], branch: str) -> int | None:
    """How many leading segments of the full context make up `branch`'s context, when it is such a prefix
    (the no-text context always is; the no-image one when there are no images); else None."""
    mine = [i for i, s in enumerate(segments) if s.in_branch(branch)]
    return len(mine) if mine == list(range(len(mine))) else None


def extent(segments: list[Segment]) -> tuple[int, int]:
    """(tokens, rope positions) the segments take: text one position per token, an image its tokens and
    two markers at one position."""
    tokens = sum(s.tokens + (0 if s.kind == TEXT else 2) for s in segments)
    return tokens, sum(s.tokens if s.kind == TEXT else 1 for s in segments)


def pages_held(segments: list[Segment], branches: list[str], answer: int, page_size: int) -> int:
    """Pages of `page_size` tokens a request's contexts of `branches` take at most in one pool: the full
    context with `answer` tokens decoded into it, and each other branch's unless it is a prefix of the full
    one (a view of its pages)."""
    def pages(tokens: int) -> int:
        return -(-tokens // page_size)

    total = pages(extent(segments)[0] + answer)
    for branch in branches:
        if branch != "full" and shared_prefix(segments, branch) is None:
            total += pages(extent([s for s in segments if s.in_branch(branch)])[0])
    return total
