"""The UMT5 text encoder of Wan: token ids -> last hidden states, padded positions zeroed.

UMT5 differs from T5 in one way that matters here: every layer owns its relative position bias (T5
shares layer 0's). Attention is unscaled (T5 folds the 1/sqrt(d) into the weights), norms are RMS
without mean subtraction, and the FFN is gated GELU (tanh approximation).
"""

from __future__ import annotations

import html
import logging
import math
import re
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from mstar.models.wan22.config import TEXT_LENGTH, UMT5Config

logger = logging.getLogger(__name__)


class T5RMSNorm(nn.Module):
    """x / rms(x) * weight with the variance in float32 (T5 layer norm: no mean, no bias)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.float().pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.eps)
        return self.weight * x.to(self.weight.dtype)


def relative_position_buckets(length: int, num_buckets: int, max_distance: int, device: torch.device) -> torch.Tensor:
    """[length, length] bucket ids of (key - query) for bidirectional T5 attention."""
    position = torch.arange(length, device=device)
    relative = position[None, :] - position[:, None]
    half = num_buckets // 2  # one half for keys after the query, one for keys before
    buckets = (relative > 0).long() * half
    distance = relative.abs()
    exact = half // 2  # small distances get one bucket each, larger ones share log-spaced buckets
    log_ratio = torch.log(distance.float().clamp(min=1) / exact) / math.log(max_distance / exact)
    far = (exact + (log_ratio * (half - exact)).long()).clamp(max=half - 1)
    return buckets + torch.where(distance < exact, distance, far)


class UMT5Layer(nn.Module):
    """Pre-norm self-attention with this layer's relative position bias, then a gated-GELU FFN."""

    def __init__(self, config: UMT5Config) -> None:
        super().__init__()
        inner = config.num_heads * config.d_kv
        self.config = config
        self.attn_norm = T5RMSNorm(config.d_model, config.layer_norm_epsilon)
        self.qkv = nn.Linear(config.d_model, 3 * inner, bias=False)
        self.o = nn.Linear(inner, config.d_model, bias=False)
        self.rel_bias = nn.Embedding(config.relative_attention_num_buckets, config.num_heads)
        self.ffn_norm = T5RMSNorm(config.d_model, config.layer_norm_epsilon)
        self.gate_up = nn.Linear(config.d_model, 2 * config.d_ff, bias=False)
        self.down = nn.Linear(config.d_ff, config.d_model, bias=False)

    def forward(self, x: torch.Tensor, buckets: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """x [B, L, D]; buckets [L, L]; keep [B, L] bool, False on padded keys."""
        batch, length, _ = x.shape
        heads, d_kv = self.config.num_heads, self.config.d_kv
        q, k, v = self.qkv(self.attn_norm(x)).view(batch, length, 3, heads, d_kv).permute(2, 0, 3, 1, 4)
        bias = self.rel_bias(buckets).permute(2, 0, 1).unsqueeze(0)  # [1, H, L, L]
        # a finite floor, not -inf: an all-padding prompt must give zeros, not NaN
        mask = bias.to(q.dtype).masked_fill(~keep[:, None, None, :], torch.finfo(q.dtype).min)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0)
        x = x + self.o(out.transpose(1, 2).reshape(batch, length, heads * d_kv))
        gate, up = self.gate_up(self.ffn_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.gelu(gate, approximate="tanh") * up)


class UMT5Encoder(nn.Module):
    """UMT5 encoder: `forward(input_ids, attention_mask)` -> [B, L, d_model], padded rows zeroed."""

    def __init__(self, config: UMT5Config) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.layers = nn.ModuleList(UMT5Layer(config) for _ in range(config.num_layers))
        self.final_norm = T5RMSNorm(config.d_model, config.layer_norm_epsilon)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Encode a batch of padded prompts.

        Wan trims each prompt's states to its real length and pads with zeros, so positions where
        `attention_mask` is 0 come back as exact zeros (the DiT cross-attends to all of them unmasked).
        """
        length = input_ids.shape[1]
        buckets = relative_position_buckets(
            length, self.config.relative_attention_num_buckets, self.config.relative_attention_max_distance,
            input_ids.device,
        )
        keep = attention_mask.to(torch.bool)
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x, buckets, keep)
        x = self.final_norm(x)
        return x * keep.unsqueeze(-1).to(x.dtype)


def clean_prompt(text: str) -> str:
    """Wan's prompt cleaning: ftfy text repair when installed, HTML unescaped twice, whitespace collapsed."""
    try:
        import ftfy
    except ImportError:  # optional: only changes mojibake, which well-formed prompts do not contain
        ftfy = None
    if ftfy is not None:
        text = ftfy.fix_text(text)
    text = html.unescape(html.unescape(text)).strip()
    return re.sub(r"\s+", " ", text).strip()


def tokenize_prompts(
    backend, prompts: Sequence[str], pad_id: int = 0, max_length: int = TEXT_LENGTH
) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask), both [len(prompts), max_length] int64, as Wan tokenizes.

    `backend` is a `tokenizers.Tokenizer` (the checkpoint's tokenizer/tokenizer.json): special tokens
    added (UMT5 appends `</s>`), truncated to `max_length` keeping them, right-padded with `pad_id`.
    """
    ids = torch.full((len(prompts), max_length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), max_length), dtype=torch.long)
    tok = backend.__class__.from_str(backend.to_str())  # a copy: truncation settings are stateful
    tok.no_padding()
    tok.enable_truncation(max_length)
    for row, encoding in enumerate(tok.encode_batch([clean_prompt(p) for p in prompts])):
        n = len(encoding.ids)
        ids[row, :n] = torch.tensor(encoding.ids, dtype=torch.long)
        mask[row, :n] = 1
    return ids, mask
