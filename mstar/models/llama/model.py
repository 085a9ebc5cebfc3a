"""The dense decoder family (Llama, Qwen2, Qwen3) as plain single-device PyTorch.

Implements the `CausalLM` contract of `mstar.engines.base`: tokens of several requests are packed
along T; positions say where each token sits in its own sequence; the attention backend knows the
batch structure and owns the KV cache.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from mstar.engines.base import CausalLMBase, KVLayout
from mstar.engines.extras import FINAL, ForwardExtras
from mstar.layers.attention import AttentionSpec, SelfAttention
from mstar.layers.fused import FUSED
from mstar.layers.linear import linear, linear_weight
from mstar.layers.logit_windows import LogitWindows, head_logits
from mstar.layers.mlp import GatedMLP
from mstar.layers.norm import PendingNorm, RMSNorm
from mstar.layers.rope import RotaryEmbedding
from mstar.models.common.meta import build_on_meta
from mstar.models.llama.config import LlamaConfig


class DecoderLayer(nn.Module):
    """Pre-norm residual block: attention then gated MLP."""

    def __init__(self, config: LlamaConfig, layer_idx: int) -> None:
        super().__init__()
        spec = AttentionSpec(
            hidden_size=config.hidden_size,
            num_heads=config.num_heads,
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            qkv_bias=config.qkv_bias,
            o_bias=config.o_bias,
            qk_norm=config.qk_norm,
            norm_eps=config.rms_norm_eps,
        )
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = SelfAttention(spec, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                attn: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """(block output, residual stream before it): the caller adds them, fused into the next norm."""
        if FUSED.norm_linear and FUSED.ops_for(x) is not None and x.dim() == 2 and x.shape[0] <= 4:  # GEMV rows
            # Each norm goes to the next projection un-applied; its skinny GEMV may fold it in.
            pending = PendingNorm(self.input_layernorm, x, residual)
            h = self.self_attn(pending, cos, sin, attn)
            pending = PendingNorm(self.post_attention_layernorm, h, pending.summed())
            return self.mlp(pending), pending.summed()
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm.add_forward(x, residual)
        h = self.self_attn(h, cos, sin, attn)
        h, residual = self.post_attention_layernorm.add_forward(h, residual)
        return self.mlp(h), residual


class DecoderBody(nn.Module):
    """Embedding, decoder layers and final norm (the `model.` prefix of HF checkpoints)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(CausalLMBase, nn.Module):
    """A Llama/Qwen2/Qwen3 decoder: `forward` -> hidden [T, H], `compute_logits` -> float32 [N, V]
    (or [N, hi - lo] over a span, see `restrict_logits`)."""

    accepts_extras = True  # forward takes ForwardExtras (input embeddings, hidden capture)

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.kv_layout = KVLayout(config.num_layers, config.num_kv_heads, config.head_dim, config.dtype)
        self.hidden_size = config.hidden_size
        self.model = DecoderBody(config)
        self.rotary = RotaryEmbedding(config.rope)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.logit_span: tuple[int, int] | None = None  # `restrict_logits`; None: every row of the head
        self.blocked_ids: tuple[int, int] | None = None  # ids inside the span that get -inf too
        self.logit_windows: LogitWindows | None = None  # per-row windows of the span's columns, if any
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding with the output head when the config says so (idempotent)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: Any,
                extras: ForwardExtras | None = None) -> torch.Tensor:
        """input_ids, positions [T] -> final hidden states [T, H] (after the last norm)."""
        cos, sin = self.rotary(positions)  # shared by every layer
        if extras is None:
            x, residual = self.model.embed_tokens(input_ids), None
            for layer in self.model.layers:
                x, residual = layer(x, residual, cos, sin, attn)
            return self.model.norm.add_forward(x, residual)[0]
        x = extras.embed(self.model.embed_tokens, input_ids)
        extras.keep(0, x)
        for i, layer in enumerate(self.model.layers):
            h, residual = layer(x, None, cos, sin, attn)
            x = h + residual  # each layer's full output is kept, so the residual add is not fused
            extras.keep(i + 1, x)
        x = self.model.norm(x)
        extras.keep(FINAL, x)
        return x

    def restrict_logits(self, span: tuple[int, int] | None, blocked: tuple[int, int] | None = None,
                        windows: LogitWindows | None = None) -> None:
        """From now on `compute_logits` reads only rows [lo, hi) = `span` of the head and returns their
        logits alone, [N, hi - lo] (`logit_offset` = lo): the other ids are never sampled; the ids
        [a, b) = `blocked` inside the span get -inf. `windows` (columns of the span) narrows each row
        further to the window its input token picks (`LogitWindows`; blocked ids must lie outside every
        window): the head reads those rows alone where it can. `span` None: the whole head again. Call
        it before the engine is built (its graphs capture at the logits' width)."""
        vocab = self.config.vocab_size
        if span is None:
            if blocked is not None or windows is not None:
                raise ValueError(f"restrict_logits: blocked={blocked}, windows: each needs a span; pass span=(lo, hi) too")
            self.logit_span = self.blocked_ids = self.logit_windows = None
            return
        lo, hi = span
        if not 0 <= lo < hi <= vocab:
            raise ValueError(f"restrict_logits: span={span} is not a non-empty id range [lo, hi) inside the "
                             f"vocabulary [0, {vocab})")
        if blocked is not None and not lo <= blocked[0] < blocked[1] <= hi:
            raise ValueError(f"restrict_logits: blocked={blocked} is not a non-empty id range [a, b) inside "
                             f"span={span}")
        if windows is not None:
            windows = windows.to(self.lm_head.weight.device)
            windows.check(hi - lo, vocab)
            if blocked is not None and _window_columns(windows, hi - lo)[blocked[0] - lo:blocked[1] - lo].any():
                raise ValueError(f"restrict_logits: blocked={blocked} overlaps a window")
        self.logit_span = (int(lo), int(hi))
        self.blocked_ids = None if blocked is None else (int(blocked[0]), int(blocked[1]))
        self.logit_windows = windows

    @property
    def logit_offset(self) -> int:
        """The token id of the logits' column 0 (`CausalLM`): the span's lo, 0 without a span."""
        return 0 if self.logit_span is None else self.logit_span[0]

    @property
    def logit_width(self) -> int:
        """Columns of the logits (`CausalLM`): the span's width, the vocabulary without a span."""
        return self.config.vocab_size if self.logit_span is None else self.logit_span[1] - self.logit_span[0]

    def compute_logits(self, hidden: torch.Tensor, input_ids: torch.Tensor | None = None,
                       out: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [N, H] -> float32 logits [N, logit_width] of ids logit_offset.. (the whole vocabulary,
        or `restrict_logits`' span with its blocked ids -inf, and, with windows, -inf outside the window
        each row's input token, `input_ids` [N], picks). `out` (float32 [N, logit_width]): where the
        window head writes them when it serves the rows (`CausalLM`: a hint; check what is returned)."""
        if self.logit_span is None:
            return linear(hidden, self.lm_head).float()
        lo, hi = self.logit_span
        # A view taken now always reads the loaded weight; its rows are contiguous, so the skinny GEMV serves it.
        weight = self.lm_head.weight[lo:hi]
        if self.logit_windows is not None:
            if input_ids is None:
                raise ValueError("compute_logits: this head scores per-row windows; pass the rows' input_ids")
            # blocked ids lie outside the windows
            return head_logits(hidden, weight, input_ids, self.logit_windows, out=out)
        logits = linear_weight(hidden, weight).float()
        if self.blocked_ids is not None:
            a, b = self.blocked_ids
            logits[:, a - lo:b - lo].fill_(-math.inf)  # a kernel argument: no host scalar copied
        return logits


def _window_columns(windows: LogitWindows, columns: int) -> torch.Tensor:
    """Bool [columns] (host): the columns some window or `always` covers."""
    covered = torch.zeros(columns + windows.width, dtype=torch.bool)
    for start in windows.starts.unique().tolist():
        covered[start:start + windows.width] = True
    covered[list(windows.always)] = True
    return covered[:columns]


def build_model(
    config: LlamaConfig, dtype: torch.dtype | None = None, device: str | torch.device = "cpu"
) -> LlamaForCausalLM:
    """A model in `dtype` (the config's by default) on `device` with UNINITIALISED weights; load next."""
    dtype = dtype or config.dtype
    model = build_on_meta(lambda: LlamaForCausalLM(config), dtype, device)
    assert isinstance(model, LlamaForCausalLM)
    model.tie_weights()  # to_empty replaces parameters, which unties them
    model.kv_layout = KVLayout(config.num_layers, config.num_kv_heads, config.head_dim, dtype)
    return model
