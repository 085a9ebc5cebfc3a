"""The KV context of one branch of one request, and attention over a packed batch of such branches.

A context holds, for every layer, the keys and values of the tokens a branch has seen (its prompt,
images, and generated text) and the next rope position. A forward runs new tokens of several
sequences at once: each sequence attends over its context (all of it) and its own new tokens under one
of three rules: causal (text), causal with bidirectional blocks (an image's tokens see each other
whole), or fully bidirectional (a denoising step's query block). Its new keys and values are
appended to the context only when the sequence stores them (prefill, decode); a denoising step
reads its context and leaves it unchanged, so every step of a request reuses one prefill.

A storing sequence writes its keys and values into its context's buffer first and attends over that
buffer, so nothing is copied per layer. Decoding sequences (one stored token each) attend together in
one call per layer; prefills and denoising blocks keep one call each, already large.
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
        slot_k, slot_v = self.slots(layer, k, v)
        slot_k.copy_(k)
        slot_v.copy_(v)

    def slots(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows of `layer`'s buffers where keys and values shaped as `k`, `v` are staged (after the current
        length; the buffers grow as needed), for the caller to fill."""
        assert not self.view, "a prefix view is read-only: its buffers belong to the context it was taken from"
        end = self.length + k.shape[0]
        buf_k, buf_v = self.keys[layer], self.values[layer]
        if buf_k is None or buf_v is None or buf_k.shape[0] < end:
            capacity = max(end, 2 * (0 if buf_k is None else buf_k.shape[0]), 16)
            new_k, new_v = k.new_empty((capacity, *k.shape[1:])), v.new_empty((capacity, *v.shape[1:]))
            if buf_k is not None and buf_v is not None:
                new_k[: self.length], new_v[: self.length] = buf_k[: self.length], buf_v[: self.length]
            buf_k, buf_v = self.keys[layer], self.values[layer] = new_k, new_v
        return buf_k[self.length:end], buf_v[self.length:end]

    def staged(self, layer: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, values) [length + tokens, Hkv, D] of `layer` after `write` staged `tokens` there."""
        k, v = self.keys[layer], self.values[layer]
        assert k is not None and v is not None, "staged before write"
        return k[: self.length + tokens], v[: self.length + tokens]

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
        if isinstance(self.blocks, str) or self.num_tokens == 1:  # one token sees its whole context and itself
            return None
        n = self.num_tokens
        rows = torch.arange(n, device=device)
        new = rows[None, :] <= rows[:, None]
        if self.blocks is not None:
            blocks = self.blocks.to(device, non_blocking=True)
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
        self.decoding = [i for i, spec in enumerate(specs) if _decodes(spec)]
        self.others = [i for i, spec in enumerate(specs) if not _decodes(spec)]
        self._decoders = [c for c in (specs[i].context for i in self.decoding) if c is not None]
        self._keys = [c.length + 1 for c in self._decoders]  # each decoding row's keys, its new one included
        self._masks: dict[int, torch.Tensor | None] = {}
        self._rows: torch.Tensor | None = None  # the decoding rows, when other sequences share the batch
        self._key_mask: torch.Tensor | None = None  # [B, 1, 1, longest]: each decoding row's real keys

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D]."""
        if not self.others:
            return self._decode(layer, q, k, v)
        out = torch.empty_like(q)
        if self.decoding:
            if self._rows is None:
                rows = torch.tensor([self.bounds[i] for i in self.decoding])
                self._rows = rows.to(q.device, non_blocking=True)  # without waiting for the queued layers
            out[self._rows] = self._decode(layer, q[self._rows], k, v)
        for i in self.others:
            lo, hi = self.bounds[i], self.bounds[i + 1]
            out[lo:hi] = self._one(i, layer, q[lo:hi], k[lo:hi], v[lo:hi])
        return out

    def _decode(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The decoding sequences' rows q [B, Hq, D] (k/v: the whole packed batch's) in one call: a kv head's
        query heads are the query rows of one problem, each sequence's keys padded to the longest."""
        new_k, new_v, slots, news = k.split(1), v.split(1), [], []
        for context, i in zip(self._decoders, self.decoding, strict=True):
            row_k, row_v = new_k[self.bounds[i]], new_v[self.bounds[i]]
            slots += context.slots(layer, row_k, row_v)
            news += (row_k, row_v)
        torch._foreach_copy_(slots, news)  # every row's new key and value in one launch
        keys, values = zip(*(c.staged(layer, 1) for c in self._decoders), strict=True)
        uniform = len(set(self._keys)) == 1
        if self._key_mask is None and not uniform:
            lengths = torch.tensor(self._keys).to(q.device, non_blocking=True)
            real = torch.arange(max(self._keys), device=q.device) < lengths[:, None]
            self._key_mask = _additive(real, q.dtype)[:, None, None]
        b, hkv, d = q.shape[0], keys[0].shape[1], q.shape[2]
        kb, vb = _batch(keys, uniform), _batch(values, uniform)  # [B, longest, Hkv, D]
        out = F.scaled_dot_product_attention(q.reshape(b, hkv, -1, d), kb.transpose(1, 2).to(q.dtype),
                                             vb.transpose(1, 2).to(q.dtype), attn_mask=self._key_mask,
                                             scale=self.scale)
        return out.reshape(q.shape)

    def _one(self, i: int, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Sequence `i` alone: q [n, Hq, D] over its context and its k/v [n, Hkv, D]."""
        spec, keys, values, past = self.specs[i], k, v, 0
        if spec.context is not None:
            past = spec.context.length
            if spec.store:  # attend where the keys will stay: no copy of the context
                spec.context.write(layer, k, v)
                keys, values = spec.context.staged(layer, spec.num_tokens)
            elif past:
                old_k, old_v = spec.context.layer(layer)
                assert old_k is not None and old_v is not None
                keys, values = torch.cat([old_k, k.to(old_k.dtype)]), torch.cat([old_v, v.to(old_v.dtype)])
        if i not in self._masks:
            mask = spec.mask(past, q.device)
            self._masks[i] = None if mask is None else _additive(mask, q.dtype)
        return _sdpa(q, keys, values, self._masks[i], self.scale)

    def commit(self, ropes: list[int]) -> None:
        """After the forward: each storing sequence's context takes its tokens; `ropes[i]` is its next position."""
        for spec, rope in zip(self.specs, ropes, strict=True):
            if spec.store and spec.context is not None:
                spec.context.commit(spec.num_tokens, rope)


def _decodes(spec: QuerySpec) -> bool:
    """One stored token over a context of its own: it joins the batched decode call."""
    return spec.num_tokens == 1 and spec.store and spec.context is not None and not spec.context.view


def _batch(parts: tuple[torch.Tensor, ...], uniform: bool) -> torch.Tensor:
    """[B, longest, ...] of B tensors [L_i, ...], zero-padded past each one's length (finite, as masked
    values still meet a zero weight)."""
    if len(parts) == 1:
        return parts[0][None]
    if uniform:
        return torch.stack(parts)
    out = parts[0].new_zeros((len(parts), max(len(p) for p in parts), *parts[0].shape[1:]))
    torch._foreach_copy_([row[: len(p)] for row, p in zip(out, parts, strict=True)], list(parts))
    return out


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool mask as the additive one SDPA would make of it in every call (0 where True, -inf elsewhere),
    its rows 16-element aligned, else the memory-efficient kernel copies it in every call."""
    width = -(-mask.shape[-1] // 16) * 16
    out = torch.zeros((*mask.shape[:-1], width), dtype=dtype, device=mask.device)[..., : mask.shape[-1]]
    return out.masked_fill_(~mask, float("-inf"))


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
          scale: float) -> torch.Tensor:
    """One sequence: q [n, Hq, D] over k/v [m, Hkv, D] (GQA: each kv head serves Hq / Hkv query heads)."""
    k, v = k.to(q.dtype), v.to(q.dtype)
    if mask is not None:  # the fused kernels that take a mask take no grouped heads: give each query head its own
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    # a batch of one: the fused kernels take only 4-D inputs (3-D ones fall back to the unfused math kernel)
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                         attn_mask=mask, scale=scale, enable_gqa=mask is None)
    return out[0].transpose(0, 1)
