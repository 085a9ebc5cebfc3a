"""The dense decoder family (Llama, Qwen2, Qwen3) as plain single-device PyTorch.

Implements the `CausalLM` contract of `mstar.engines.base`: tokens of several requests are packed
along T; positions say where each token sits in its own sequence; the attention backend knows the
batch structure and owns the KV cache.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from mstar.engines.base import CausalLMBase, KVLayout
from mstar.engines.extras import FINAL, ForwardExtras
from mstar.layers.attention import AttentionSpec
from mstar.layers.decoder import DecoderLayer, run_layers
from mstar.layers.fp8 import empty_fp8_decoder, method_block
from mstar.layers.linear import linear
from mstar.layers.mlp import GatedMLP
from mstar.layers.norm import RMSNorm
from mstar.layers.rope import RotaryEmbedding
from mstar.models.common.meta import build_on_meta
from mstar.models.llama.config import LlamaConfig


def decoder_layer(config: LlamaConfig, layer_idx: int) -> DecoderLayer:
    """Layer `layer_idx`: the shared pre-norm block (`layers.decoder`) with attention and a gated MLP."""
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
    return DecoderLayer(spec, layer_idx, GatedMLP(config.hidden_size, config.intermediate_size, bias=config.mlp_bias))


class DecoderBody(nn.Module):
    """Embedding, decoder layers and final norm (the `model.` prefix of HF checkpoints)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(decoder_layer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(CausalLMBase, nn.Module):
    """A Llama/Qwen2/Qwen3 decoder: `forward` -> hidden [T, H], `compute_logits` -> float32 [N, V]."""

    accepts_extras = True  # forward takes ForwardExtras (input embeddings, hidden capture)

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.kv_layout = KVLayout(config.num_layers, config.num_kv_heads, config.head_dim, config.dtype)
        self.hidden_size = config.hidden_size
        self.logit_width = config.vocab_size
        self.model = DecoderBody(config)
        self.rotary = RotaryEmbedding(config.rope)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding with the output head when the config says so (idempotent)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: Any,
                extras: ForwardExtras | None = None) -> torch.Tensor:
        """input_ids, positions [T] -> final hidden states [T, H] (after the last norm)."""
        cos, sin = self.rotary(positions)  # shared by every layer
        body = self.model
        if extras is None:
            return run_layers(body.layers, body.norm, body.embed_tokens(input_ids), cos, sin, attn)
        x = extras.embed(body.embed_tokens, input_ids)
        extras.record(0, x)
        out = run_layers(body.layers, body.norm, x, cos, sin, attn, *extras.layer_outputs())
        extras.record(FINAL, out)
        return out

    def compute_logits(self, hidden: torch.Tensor, input_ids: torch.Tensor | None = None,
                       out: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [N, H] -> float32 logits [N, vocab] (`input_ids` and `out` unused)."""
        return linear(hidden, self.lm_head).float()


def build_model(
    config: LlamaConfig, dtype: torch.dtype | None = None, device: str | torch.device = "cpu",
    quantization: str | None = None,
) -> LlamaForCausalLM:
    """A model in `dtype` (the config's by default) on `device` with UNINITIALISED weights; load next.
    With `quantization` ("fp8", "fp8_block") every decoder-layer linear is an empty `Fp8Linear`, which
    loading or `fill_dummy_weights` quantizes as its weight arrives; the embedding, norms and head stay."""
    dtype = dtype or config.dtype

    def make() -> LlamaForCausalLM:
        model = LlamaForCausalLM(config)
        if quantization is not None:
            empty_fp8_decoder(model.model.layers, method_block(quantization))
        return model

    model = build_on_meta(make, dtype, device)
    assert isinstance(model, LlamaForCausalLM)
    model.tie_weights()  # to_empty replaces parameters, which unties them
    model.kv_layout = KVLayout(config.num_layers, config.num_kv_heads, config.head_dim, dtype)
    return model
