"""The Cosmos3 generator: a Mixture-of-Transformers over [text | vision | sound | action] tokens.

Every layer holds two towers of the same shape: the understanding tower runs the text causally, the
generation tower runs the generated tokens with full attention over the text's keys and values and
their own. The text never reads the generated tokens, so its keys and values are computed once per
prompt (`text_kv`) and every denoising step runs the generation tower alone (`forward`), for a batch
of rows of different requests, guidance branches and lengths packed into one token matrix.
`forward_padded` runs the same tower over rows of one length with their prompts padded to one length
and masked: fixed shapes, device work only, what the DiT component captures in CUDA graphs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mstar.layers.attention import normed_rotated_qk
from mstar.layers.embedders import MLP, timestep_features
from mstar.layers.linear import linear
from mstar.layers.mlp import GatedMLP
from mstar.layers.norm import RMSNorm
from mstar.models.cosmos3.config import Cosmos3TransformerConfig
from mstar.models.cosmos3.positions import rope_tables, text_positions

TIME_FEATURES = 256  # sinusoidal timestep features


class Tower(nn.Module):
    """One tower of one layer: pre-norm attention projections (qk-normed) and a gated SiLU MLP."""

    def __init__(self, config: Cosmos3TransformerConfig) -> None:
        super().__init__()
        c = config
        self.num_q, self.num_kv, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.attn_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.qkv = nn.Linear(c.hidden_size, (c.num_heads + 2 * c.num_kv_heads) * c.head_dim, bias=c.attention_bias)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.o = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=c.attention_bias)
        self.mlp_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = GatedMLP(c.hidden_size, c.intermediate_size)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [T, D] -> q [T, Hq, d], k [T, Hk, d] (normed, rotated) and v [T, Hk, d]."""
        qkv = linear(self.attn_norm(x), self.qkv).view(x.shape[0], -1, self.head_dim)
        qk = normed_rotated_qk(qkv[:, : self.num_q + self.num_kv], self.q_norm, self.k_norm, self.num_q, cos, sin)
        return qk[:, : self.num_q], qk[:, self.num_q :], qkv[:, self.num_q + self.num_kv :]

    def finish(self, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """The residual stream after the attention output [T, Hq, d] and the MLP."""
        x = x + linear(attended.flatten(1), self.o)
        return x + self.mlp(self.mlp_norm(x))


class MoTLayer(nn.Module):
    """The understanding (`und`) and generation (`gen`) towers of one layer."""

    def __init__(self, config: Cosmos3TransformerConfig) -> None:
        super().__init__()
        self.und = Tower(config)
        self.gen = Tower(config)


class DomainLinear(nn.Module):
    """A linear map with one weight and bias per embodiment domain (checkpoint names `fc`, `bias`)."""

    def __init__(self, in_dim: int, out_dim: int, domains: int) -> None:
        super().__init__()
        self.in_dim, self.out_dim = in_dim, out_dim
        self.fc = nn.Embedding(domains, in_dim * out_dim)
        self.bias = nn.Embedding(domains, out_dim)

    def forward(self, x: torch.Tensor, domain: int) -> torch.Tensor:
        """x [T, in] -> [T, out] with domain `domain`'s weights (stored as [in, out])."""
        weight = self.fc.weight[domain].view(self.in_dim, self.out_dim)
        return x @ weight + self.bias.weight[domain]


@dataclass
class TextKV:
    """A prompt's understanding-tower keys and values: `packed` [2, layers, L, Hk, d] (keys, then values),
    one block so a step can copy a prompt into a graph's buffer in one launch; `keys[i]` and `values[i]`
    are layer i's views of it."""

    packed: torch.Tensor

    def __post_init__(self) -> None:
        self.keys: list[torch.Tensor] = list(self.packed[0])
        self.values: list[torch.Tensor] = list(self.packed[1])

    @property
    def length(self) -> int:
        """Prompt tokens."""
        return self.packed.shape[2]


@dataclass
class GenRow:
    """One row of a generator step: a request's noisy latents under one prompt (a guidance branch)."""

    text: TextKV
    cos: torch.Tensor  # [N, d] rotary tables of the row's generated tokens
    sin: torch.Tensor
    vision: torch.Tensor  # [C, T, H, W] noisy latents
    vision_noisy: torch.Tensor  # [T] bool: frames the model denoises (the others condition it)
    timestep: torch.Tensor | int  # the step's timestep: the scheduler's integer value (int64 on any device)
    sound: torch.Tensor | None = None  # [sound_dim, S]
    action: torch.Tensor | None = None  # [A, action_dim]
    action_noisy: torch.Tensor | None = None  # [A] bool
    domain: int = 0  # embodiment domain of the action tower

    @property
    def num_tokens(self) -> int:
        """Generated tokens of this row (vision, sound, action)."""
        return self.cos.shape[0]


@dataclass
class GenOut:
    """One row's velocities (zero where the row conditions): vision [C, T, H, W], sound, action."""

    vision: torch.Tensor
    sound: torch.Tensor | None = None
    action: torch.Tensor | None = None


class Cosmos3Generator(nn.Module):
    """The generator network; parameter names are ours, mapped from diffusers' in weights.py."""

    def __init__(self, config: Cosmos3TransformerConfig) -> None:
        super().__init__()
        c = self.config = config
        self.embed = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(MoTLayer(c) for _ in range(c.num_layers))
        self.gen_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.proj_in = nn.Linear(c.patch_dim, c.hidden_size)
        self.proj_out = nn.Linear(c.hidden_size, c.patch_dim)
        self.time_embedder = MLP(TIME_FEATURES, c.hidden_size, "silu")
        if c.sound_dim is not None:
            self.audio_proj_in = nn.Linear(c.sound_dim, c.hidden_size)
            self.audio_proj_out = nn.Linear(c.hidden_size, c.sound_dim)
            self.audio_modality_embed = nn.Parameter(torch.zeros(c.hidden_size))
        if c.action_dim is not None:
            self.action_proj_in = DomainLinear(c.action_dim, c.hidden_size, c.num_embodiment_domains)
            self.action_proj_out = DomainLinear(c.hidden_size, c.action_dim, c.num_embodiment_domains)
            self.action_modality_embed = nn.Parameter(torch.zeros(c.hidden_size))

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the towers' weights."""
        return self.proj_in.weight.dtype

    @torch.no_grad()
    def text_kv(self, input_ids: torch.Tensor) -> TextKV:
        """The understanding tower over one prompt [L]: every layer's keys and values (the last layer's
        attention output and MLP are never read, so they are skipped)."""
        c = self.config
        x = self.embed(input_ids)
        positions = text_positions(input_ids.shape[0], c.enable_fps_modulation)
        cos, sin = rope_tables(c, positions, x.dtype, x.device)
        packed = x.new_empty(2, c.num_layers, input_ids.shape[0], c.num_kv_heads, c.head_dim)
        for i, layer in enumerate(self.layers):
            q, k, v = layer.und.project(x, cos, sin)
            packed[0, i], packed[1, i] = k, v
            if i + 1 < len(self.layers):
                x = layer.und.finish(x, _attend(q, k, v, causal=True))
        return TextKV(packed)

    @torch.no_grad()
    def forward(self, rows: list[GenRow], sp_group: Any = None) -> list[GenOut]:
        """One denoising step of every row: the generation tower over all rows' tokens packed together.
        With `sp_group` (every rank of it calling with the same rows) each rank runs 1/P of every row's
        tokens, attention as Ulysses attention over the group (sequence_parallel.py), and every rank
        returns every row's velocities."""
        x = torch.cat([self.embed_row(row) for row in rows])
        cos = torch.cat([row.cos for row in rows])
        sin = torch.cat([row.sin for row in rows])
        lengths = [row.num_tokens for row in rows]
        bounds = _bounds(lengths)
        shards = None
        if sp_group is not None:
            from mstar.models.cosmos3.sequence_parallel import RowShards

            shards = RowShards(sp_group, lengths, x.device)
            x, cos, sin = shards.split(x), shards.split(cos), shards.split(sin)
        for i, layer in enumerate(self.layers):
            q, k, v = layer.gen.project(x, cos, sin)
            if shards is not None:
                attended = shards.attend(q, k, v, [r.text.keys[i] for r in rows], [r.text.values[i] for r in rows])
            else:
                attended = torch.cat([
                    _attend(q[a:b], torch.cat([row.text.keys[i], k[a:b]]), torch.cat([row.text.values[i], v[a:b]]))
                    for row, (a, b) in zip(rows, bounds, strict=True)])
            x = layer.gen.finish(x, attended)
        x = self.gen_norm(x)
        if shards is not None:
            x = shards.gather(x)
        return [self.heads(row, x[a:b]) for row, (a, b) in zip(rows, bounds, strict=True)]

    @torch.no_grad()
    def forward_padded(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, text: torch.Tensor,
                       text_lengths: torch.Tensor) -> torch.Tensor:
        """The generation tower over B rows of N tokens each, fixed shapes and device work only (a CUDA
        graph may hold it): embedded tokens x [B, N, D] (`embed_row`) with their rotary tables cos, sin
        [B, N, d]; each row's prompt keys and values `text` [B, 2, layers, Lb, Hk, d] of which the first
        `text_lengths` [B] (int64) are real and the rest are masked out (they must be finite).
        -> normed hidden states [B, N, D] (`heads` reads a row's). Each row gets what `forward` gives it."""
        b, n, d = x.shape
        keep = torch.arange(text.shape[3], device=x.device)[None, :] < text_lengths[:, None]
        keep = torch.cat([keep, keep.new_ones(b, n)], dim=1)[:, None, None]  # [B, 1, 1, Lb + N]
        x, cos, sin = x.reshape(b * n, d), cos.reshape(b * n, -1), sin.reshape(b * n, -1)
        for i, layer in enumerate(self.layers):
            q, k, v = layer.gen.project(x, cos, sin)
            keys = torch.cat([text[:, 0, i], k.view(b, n, *k.shape[1:])], dim=1)
            values = torch.cat([text[:, 1, i], v.view(b, n, *v.shape[1:])], dim=1)
            attended = _attend_masked(q.view(b, n, *q.shape[1:]), keys, values, keep)
            x = layer.gen.finish(x, attended.reshape(b * n, *q.shape[1:]))
        return self.gen_norm(x).view(b, n, d)

    def embed_row(self, row: GenRow) -> torch.Tensor:
        """The row's generated tokens [N, D]: projected latents plus, on noisy ones, the timestep embedding."""
        c, dtype = self.config, self.dtype
        temb = self._time_embedding(row.timestep).to(dtype)
        vision = self.proj_in(patchify(row.vision.to(dtype), c.latent_patch_size))
        per_frame = vision.shape[0] // row.vision.shape[1]
        noisy = row.vision_noisy.repeat_interleave(per_frame)
        parts = [torch.where(noisy[:, None], vision + temb, vision)]
        if row.sound is not None:
            sound = self.audio_proj_in(row.sound.t().to(dtype)) + self.audio_modality_embed
            parts.append(sound + temb)
        if row.action is not None:
            action = self.action_proj_in(row.action.to(dtype), row.domain) + self.action_modality_embed
            parts.append(torch.where(row.action_noisy[:, None], action + temb, action))
        return torch.cat(parts)

    def _time_embedding(self, timestep: torch.Tensor | int) -> torch.Tensor:
        """[1, D] embedding of the step's integer timestep, in the embedder's (float32) dtype; a tensor is read
        where it lives (no host sync)."""
        device = self.proj_in.weight.device
        steps = torch.as_tensor(timestep, dtype=torch.int64).reshape(1).to(device)
        scaled = steps * self.config.timestep_scale  # int64 times a float: float32, as the reference scales it
        features = timestep_features(scaled, TIME_FEATURES)
        return self.time_embedder(features.to(self.time_embedder.linear_1.weight.dtype))

    def heads(self, row: GenRow, x: torch.Tensor) -> GenOut:
        """The row's velocities from its normed hidden states x [N, D]."""
        c = self.config
        num_vision = x.shape[0] - (row.sound.shape[1] if row.sound is not None else 0) \
            - (row.action.shape[0] if row.action is not None else 0)
        vision = unpatchify(self.proj_out(x[:num_vision]), row.vision.shape, c.latent_patch_size)
        out = GenOut(vision=vision * row.vision_noisy.to(vision.dtype)[None, :, None, None])
        rest = x[num_vision:]
        if row.sound is not None:
            out.sound = self.audio_proj_out(rest[: row.sound.shape[1]]).t()
            rest = rest[row.sound.shape[1]:]
        if row.action is not None:
            action = self.action_proj_out(rest, row.domain)
            out.action = action * row.action_noisy.to(action.dtype)[:, None]
        return out


def patchify(latents: torch.Tensor, p: int) -> torch.Tensor:
    """[C, T, H, W] -> [T * ceil(H/p) * ceil(W/p), p * p * C] tokens, zero-padding H and W to multiples of p."""
    c, t, h, w = latents.shape
    hp, wp = math.ceil(h / p), math.ceil(w / p)
    if (hp * p, wp * p) != (h, w):
        latents = F.pad(latents, (0, wp * p - w, 0, hp * p - h))
    x = latents.reshape(c, t, hp, p, wp, p).permute(1, 2, 4, 3, 5, 0)
    return x.reshape(t * hp * wp, p * p * c)


def unpatchify(tokens: torch.Tensor, shape: torch.Size | tuple[int, ...], p: int) -> torch.Tensor:
    """The inverse of `patchify` for latents of `shape` [C, T, H, W] (padding dropped)."""
    c, t, h, w = shape
    hp, wp = math.ceil(h / p), math.ceil(w / p)
    x = tokens.reshape(t, hp, wp, p, p, c).permute(5, 0, 1, 3, 2, 4).reshape(c, t, hp * p, wp * p)
    return x[:, :, :h, :w]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False) -> torch.Tensor:
    """Attention of q [N, Hq, d] over k, v [M, Hk, d] (grouped heads) -> [N, Hq, d]."""
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                         is_causal=causal, enable_gqa=q.shape[1] != k.shape[1])
    return out[0].transpose(0, 1)


def _attend_masked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Attention of q [B, N, Hq, d] over the kept keys of k, v [B, M, Hk, d] (`keep` [B, 1, 1, M] bool)
    -> [B, N, Hq, d]. Each key head's query heads go along the sequence axis ([B, Hk, g * N, d]), so the
    masked kernel needs no grouped-head support and the mask broadcasts over heads."""
    b, n, hq, d = q.shape
    hk = k.shape[2]
    g = hq // hk
    q = q.view(b, n, hk, g, d).permute(0, 2, 3, 1, 4).reshape(b, hk, g * n, d)
    out = F.scaled_dot_product_attention(q, k.transpose(1, 2), v.transpose(1, 2), attn_mask=keep)
    return out.view(b, hk, g, n, d).permute(0, 3, 1, 2, 4).reshape(b, n, hq, d)


def _bounds(lengths: list[int]) -> list[tuple[int, int]]:
    ends = torch.tensor(lengths).cumsum(0).tolist()
    return [(end - n, end) for n, end in zip(lengths, ends, strict=True)]
