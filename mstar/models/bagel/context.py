"""The KV context of one branch of one request, and attention over a packed batch of such branches.

A context holds, for every layer, the keys and values of the tokens a branch has seen (its prompt,
images, and generated text) and the next rope position. A forward runs new tokens of several
sequences at once: each sequence attends over its context (all of it) and its own new tokens under one
of three rules: causal (text), causal with bidirectional blocks (an image's tokens see each other
whole), or fully bidirectional (a denoising step's query block). Its new keys and values are
appended to the context only when the sequence stores them (prefill, decode); a denoising step
reads its context and leaves it unchanged, so every step of a request reuses one prefill.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


class KVContext:
    """Keys and values per layer ([length, kv heads, head dim], grown in place) and the next rope position."""

    def __init__(self, num_layers: int) -> None:
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.length = 0  # tokens every layer holds
        self.rope = 0  # position id of the next token
        self.view = False  # a prefix of another context, sharing its buffers: never written

    def prefix(self, length: int, rope: int) -> KVContext:
        """A read-only context of this one's first `length` tokens (next position `rope`), sharing its keys
        and values: this one's later writes land beyond `length` (or in new buffers when it grows)."""
        assert length <= self.length, f"a prefix of {length} tokens of a {self.length}-token context"
        out = KVContext(len(self.keys))
        out.keys, out.values, out.length, out.rope, out.view = list(self.keys), list(self.values), length, rope, True
        return out

    def layer(self, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(keys, values) [length, Hkv, D] of `layer`; (None, None) while empty."""
        k, v = self.keys[layer], self.values[layer]
        if k is None or v is None:
            return None, None
        return k[: self.length], v[: self.length]

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Stage `layer`'s new keys and values after the current length (visible once `commit`ted)."""
        assert not self.view, "a prefix view is read-only: its buffers belong to the context it was taken from"
        end = self.length + k.shape[0]
        buf_k, buf_v = self.keys[layer], self.values[layer]
        if buf_k is None or buf_v is None or buf_k.shape[0] < end:
            capacity = max(end, 2 * (0 if buf_k is None else buf_k.shape[0]), 16)
            new_k, new_v = k.new_empty((capacity, *k.shape[1:])), v.new_empty((capacity, *v.shape[1:]))
            if buf_k is not None and buf_v is not None:
                new_k[: self.length], new_v[: self.length] = buf_k[: self.length], buf_v[: self.length]
            buf_k, buf_v = self.keys[layer], self.values[layer] = new_k, new_v
        buf_k[self.length:end] = k
        buf_v[self.length:end] = v

    def commit(self, tokens: int, rope: int) -> None:
        """Make the staged `tokens` part of the context; the next token sits at position `rope`."""
        self.length += tokens
        self.rope = rope

    def nbytes(self) -> int:
        """Bytes of the buffers this context holds (a view's are its source's)."""
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values) if t is not None)


@dataclass
class QuerySpec:
    """The new tokens of one sequence in a packed forward."""

    context: KVContext | None  # what it attends over besides its own tokens (None: nothing)
    num_tokens: int
    # how its new tokens see each other: None is causal; a tensor [num_tokens] of block ids is causal
    # except that tokens of one block see each other whole; "full" is bidirectional
    blocks: torch.Tensor | str | None = None
    store: bool = False  # append the new keys and values to `context`

    def mask(self, past: int, device: torch.device) -> torch.Tensor | None:
        """Bool [num_tokens, past + num_tokens], True where a query may attend a key; None: everywhere."""
        if isinstance(self.blocks, str):
            return None
        n = self.num_tokens
        rows = torch.arange(n, device=device)
        new = rows[None, :] <= rows[:, None]
        if self.blocks is not None:
            blocks = self.blocks.to(device)
            new = new | (blocks[None, :] == blocks[:, None])
        return torch.cat([new.new_ones((n, past)), new], dim=1)


class PackedAttention:
    """`attend(layer, q, k, v)` for a packed batch of sequences (`QuerySpec`s, their tokens one after another):
    each attends over its context and its own new tokens; stored tokens are staged in the context, and
    `commit(ropes)` makes them part of it after the last layer."""

    def __init__(self, specs: list[QuerySpec], scale: float) -> None:
        self.specs, self.scale = specs, scale
        self.bounds = [0]
        for spec in specs:
            self.bounds.append(self.bounds[-1] + spec.num_tokens)
        self._masks: dict[int, torch.Tensor | None] = {}

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D]."""
        out = torch.empty_like(q)
        groups = q.shape[1] // k.shape[1]
        for i, spec in enumerate(self.specs):
            lo, hi = self.bounds[i], self.bounds[i + 1]
            keys, values = k[lo:hi], v[lo:hi]
            past = 0
            if spec.context is not None:
                old_k, old_v = spec.context.layer(layer)
                if old_k is not None and old_v is not None:
                    past = old_k.shape[0]
                    keys, values = torch.cat([old_k, keys.to(old_k.dtype)]), torch.cat([old_v, values.to(old_v.dtype)])
                if spec.store:
                    spec.context.write(layer, k[lo:hi], v[lo:hi])
            if i not in self._masks:
                self._masks[i] = spec.mask(past, q.device)
            out[lo:hi] = _sdpa(q[lo:hi], keys, values, self._masks[i], groups, self.scale)
        return out

    def commit(self, ropes: list[int]) -> None:
        """After the forward: each storing sequence's context takes its tokens; `ropes[i]` is its next position."""
        for spec, rope in zip(self.specs, ropes, strict=True):
            if spec.store and spec.context is not None:
                spec.context.commit(spec.num_tokens, rope)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, groups: int,
          scale: float) -> torch.Tensor:
    """One sequence: q [n, Hq, D] over k/v [m, Hkv, D] (GQA: each kv head serves `groups` query heads)."""
    k = k.to(q.dtype).repeat_interleave(groups, dim=1)
    v = v.to(q.dtype).repeat_interleave(groups, dim=1)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                         attn_mask=mask, scale=scale)
    return out.transpose(0, 1)
