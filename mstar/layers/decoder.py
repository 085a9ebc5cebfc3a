"""The pre-norm decoder block and stack every LLM backbone here shares (Llama/Qwen2/Qwen3 dense, the
Qwen3-MoE thinker and talker of Qwen3-Omni).

A block returns its output and the residual stream before it, unsummed, so the stack adds them inside
the next norm's kernel (`RMSNorm.add_forward`); the full output is formed only where a caller keeps or
changes it (`run_layers`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from mstar.layers.attention import AttentionSpec, HeadShard, SelfAttention
from mstar.layers.norm import RMSNorm


class DecoderLayer(nn.Module):
    """Attention (with `attention_tp`, this rank's share of the heads), then `mlp`: a `GatedMLP` or a
    `SparseMoE` (which holds its own expert shard). Names follow the HF checkpoints' layers."""

    def __init__(self, spec: AttentionSpec, layer_idx: int, mlp: nn.Module, attention_tp: HeadShard | None = None
                 ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.norm_eps)
        self.self_attn = SelfAttention(spec, layer_idx, attention_tp)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.norm_eps)
        self.mlp = mlp

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                attn: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream is residual + h [T, H] (residual None: h alone); returns (block output,
        residual stream before it) for the caller to add, fused into the next norm."""
        if residual is None:
            normed, residual = self.input_layernorm(h), h
        else:
            normed, residual = self.input_layernorm.add_forward(h, residual)
        out = self.self_attn(normed, cos, sin, attn)
        normed, residual = self.post_attention_layernorm.add_forward(out, residual)
        return self.mlp(normed), residual


def run_layers(layers: nn.ModuleList, norm: RMSNorm, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               attn: Any, outputs_at: frozenset[int] = frozenset(),
               on_output: Callable[[int, torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """The decoder stack on embeddings x [T, H] -> the final normed states.

    The full output (h + residual) of layer i is formed only for the i in `outputs_at`, and handed to
    `on_output(i, out)`, whose result goes on as the residual stream (a caller keeps hidden states, or
    adds to them: the thinker's deepstack features); elsewhere each residual add runs inside the next
    norm's kernel."""
    h, residual = x, None
    for i, layer in enumerate(layers):
        h, residual = layer(h, residual, cos, sin, attn)
        if i in outputs_at:
            out = h + residual
            h, residual = (on_output(i, out) if on_output is not None else out), None
    return norm(h) if residual is None else norm.add_forward(h, residual)[0]
