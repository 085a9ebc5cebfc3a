"""The Qwen3-MoE decoder layer shared by Qwen3-Omni's thinker and talker."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from mstar.layers.attention import AttentionSpec, SelfAttention
from mstar.layers.mlp import GatedMLP
from mstar.layers.moe import SparseMoE
from mstar.layers.norm import RMSNorm
from mstar.models.qwen3_omni.config import MoETextConfig


class MoEDecoderLayer(nn.Module):
    """Pre-norm residual block: qk-normed GQA attention, then a sparse MoE (or dense MLP) block."""

    def __init__(self, config: MoETextConfig, layer_idx: int, sparse: bool) -> None:
        super().__init__()
        spec = AttentionSpec(
            hidden_size=config.hidden_size, num_heads=config.num_heads, num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim, qkv_bias=config.attention_bias, o_bias=config.attention_bias,
            qk_norm=True, norm_eps=config.rms_norm_eps,
        )
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = SelfAttention(spec, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp: nn.Module = (SparseMoE(config.moe_spec()) if sparse
                               else GatedMLP(config.hidden_size, config.intermediate_size))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: Any) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attn)
        return x + self.mlp(self.post_attention_layernorm(x))


def build_on_meta(factory: Any, dtype: torch.dtype, device: str | torch.device) -> nn.Module:
    """`factory()` built on the meta device in `dtype`, then materialised UNINITIALISED on `device`."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            module = factory()
    finally:
        torch.set_default_dtype(previous)
    module.to_empty(device=device)
    return module.eval()
