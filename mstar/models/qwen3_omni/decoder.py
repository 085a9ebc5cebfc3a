"""The Qwen3-MoE decoder layer shared by Qwen3-Omni's thinker and talker."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from mstar.engines.extras import FINAL, ForwardExtras
from mstar.layers.attention import AttentionSpec, HeadShard, SelfAttention
from mstar.layers.mlp import GatedMLP
from mstar.layers.moe import ExpertShard, SparseMoE
from mstar.layers.norm import RMSNorm
from mstar.models.qwen3_omni.config import MoETextConfig


class MoEDecoderLayer(nn.Module):
    """Pre-norm residual block: qk-normed GQA attention, then a sparse MoE (or dense MLP) block.

    With `tp` (rank `tp.index` of `tp.size`), the MoE block holds this rank's share of the experts and,
    with `split_attention`, the attention its share of the heads, each summed over the group by one
    all-reduce; otherwise attention and a dense MLP run whole on every rank. The residual stream is the
    same on every rank."""

    def __init__(self, config: MoETextConfig, layer_idx: int, sparse: bool, tp: HeadShard | None = None,
                 split_attention: bool = True) -> None:
        super().__init__()
        spec = AttentionSpec(
            hidden_size=config.hidden_size, num_heads=config.num_heads, num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim, qkv_bias=config.attention_bias, o_bias=config.attention_bias,
            qk_norm=True, norm_eps=config.rms_norm_eps,
        )
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = SelfAttention(spec, layer_idx, tp if split_attention else None)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if sparse:
            moe = config.moe_spec()
            experts = None if tp is None else ExpertShard(tp.index, tp.size, moe.num_experts, tp.group)
            self.mlp: nn.Module = SparseMoE(moe, experts)
        else:
            self.mlp = GatedMLP(config.hidden_size, config.intermediate_size)

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                attn: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream is residual + h [T, H] (residual None: h alone); returns (block output,
        residual stream before it), so the caller's add runs fused into the next norm (`run_layers`)."""
        if residual is None:
            normed, residual = self.input_layernorm(h), h
        else:
            normed, residual = self.input_layernorm.add_forward(h, residual)
        attn_out = self.self_attn(normed, cos, sin, attn)
        normed, residual = self.post_attention_layernorm.add_forward(attn_out, residual)
        return self.mlp(normed), residual


def run_layers(layers: nn.ModuleList, norm: RMSNorm, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               attn: Any, extras: ForwardExtras, after_layer: Callable[[int, torch.Tensor], torch.Tensor] | None = None,
               touched: frozenset[int] = frozenset()) -> torch.Tensor:
    """The decoder stack on embeddings x [T, H] -> the final normed states, keeping what `extras` asks for.

    A layer's full output (h + residual) is formed only where it is kept (`extras.capture`, numbered
    from 1) or changed (`after_layer(i, x)` for the layers i in `touched`, e.g. the thinker's
    deepstack additions); elsewhere each residual add runs inside the next norm's kernel."""
    h, residual = x, None
    for i, layer in enumerate(layers):
        h, residual = layer(h, residual, cos, sin, attn)
        if i + 1 in extras.capture or i in touched:
            out = h + residual
            extras.keep(i + 1, out)
            h, residual = (after_layer(i, out) if after_layer is not None and i in touched else out), None
    out = norm(h) if residual is None else norm.add_forward(h, residual)[0]
    extras.keep(FINAL, out)
    return out

