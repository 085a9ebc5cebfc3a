"""Qwen3-Omni's thinker text model as a `CausalLM` for the autoregressive engine.

A Qwen3-MoE decoder with interleaved M-RoPE. Besides token ids it takes, through the engine's
`ForwardExtras`: audio/image/video embeddings replacing the embedding rows of placeholder tokens,
3-row positions from `positions.mrope_positions`, and the deepstack visual features
(item input "deepstack_embeds" [m, num_deepstack, H], rows aligned with the input_embeds rows, zero
for non-visual rows) added to the hidden states after each of the first `num_deepstack` layers.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from mstar.engines.base import CausalLMBase, KVLayout
from mstar.engines.extras import FINAL, ForwardExtras
from mstar.layers.attention import HeadShard
from mstar.layers.decoder import run_layers
from mstar.layers.moe import MoEGraphCapture
from mstar.layers.norm import RMSNorm
from mstar.models.common.meta import build_on_meta
from mstar.models.qwen3_omni.config import ThinkerConfig
from mstar.models.qwen3_omni.decoder import empty_fp8_layers, moe_decoder_layer
from mstar.models.qwen3_omni.mrope import MRotaryEmbedding

DEEPSTACK = "deepstack_embeds"  # item input: deepstack visual features, [m, num_deepstack, H]


class ThinkerBody(nn.Module):
    """Embedding, decoder layers and final norm (the `thinker.model.` prefix of the checkpoint)."""

    def __init__(self, config: ThinkerConfig, tp: HeadShard | None = None, split_attention: bool = True) -> None:
        super().__init__()
        text = config.text
        self.embed_tokens = nn.Embedding(text.vocab_size, text.hidden_size)
        self.layers = nn.ModuleList(moe_decoder_layer(text, i, text.is_sparse(i), tp, split_attention)
                                    for i in range(text.num_layers))
        self.norm = RMSNorm(text.hidden_size, text.rms_norm_eps)


class Qwen3OmniThinker(MoEGraphCapture, CausalLMBase, nn.Module):
    """`forward` -> final hidden [T, H]; `compute_logits` -> float32 [N, vocab].

    With `tp` the thinker is one rank of a tensor-parallel group (`decoder.moe_decoder_layer`): its share
    of every layer's experts and, with `split_attention`, heads (and of the KV cache: `kv_layout` counts
    its KV heads); the embedding, norms, routers and head are whole on every rank, and so are its outputs."""

    accepts_extras = True
    multirow_positions = True  # positions may be [3, T] (M-RoPE)
    token_features = (DEEPSTACK,)

    def __init__(self, config: ThinkerConfig, tp: HeadShard | None = None, split_attention: bool = True) -> None:
        super().__init__()
        self.config = config
        self.tp = tp
        self.split_attention = tp is not None and split_attention  # heads split over the ranks
        text = config.text
        self.kv_layout = KVLayout(text.num_layers, self.local_kv_heads, text.head_dim, text.dtype)
        self.model = ThinkerBody(config, tp, split_attention)
        self.rotary = MRotaryEmbedding(text.rope)
        self.lm_head = nn.Linear(text.hidden_size, text.vocab_size, bias=False)
        self.hidden_size = text.hidden_size
        self.logit_width = text.vocab_size
        # hidden-state layers decode items may ask for, captured in the engine's decode graphs
        # (engines/autoregressive/extras_graph.py); the builder sets (0, talker accept layer)
        self.graph_hidden_layers: tuple[int, ...] = ()
        self.tie_weights()

    @property
    def local_kv_heads(self) -> int:
        """KV heads this rank caches (all of them without tensor parallelism)."""
        return self.config.text.num_kv_heads // (self.tp.size if self.split_attention else 1)

    def tie_weights(self) -> None:
        """Share the embedding with the output head when the config says so (idempotent)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: Any,
                extras: ForwardExtras | None = None) -> torch.Tensor:
        """input_ids [T], positions [T] or [3, T] -> final hidden states [T, H]."""
        cos, sin = self.rotary(positions)
        extras = extras or ForwardExtras()
        x = extras.embed(self.model.embed_tokens, input_ids)
        extras.record(0, x)
        deepstack = extras.features.get(DEEPSTACK)
        if deepstack is None:
            outputs_at, on_output = extras.layer_outputs()
        else:
            def add_deepstack(i: int, out: torch.Tensor) -> torch.Tensor:
                # after the layer's recorded output, as the reference's hidden_states
                assert extras.embeds_rows is not None
                return out.index_add(0, extras.embeds_rows, deepstack[:, i].to(out.dtype))

            outputs_at, on_output = extras.layer_outputs(add_deepstack, frozenset(range(deepstack.shape[1])))
        out = run_layers(self.model.layers, self.model.norm, x, cos, sin, attn, outputs_at, on_output)
        extras.record(FINAL, out)
        return out

    def compute_logits(self, hidden: torch.Tensor, input_ids: torch.Tensor | None = None,
                       out: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [N, H] -> float32 logits [N, vocab] (the head does not depend on `input_ids`; `out` unused)."""
        return self.lm_head(hidden).float()


def build_thinker(config: ThinkerConfig, dtype: torch.dtype | None = None, device: str | torch.device = "cpu",
                  tp: HeadShard | None = None, split_attention: bool = True,
                  quantization: str | None = None) -> Qwen3OmniThinker:
    """A thinker in `dtype` (the config's by default) on `device` with UNINITIALISED weights (with `tp`,
    one rank's share); load next. With `quantization`, the decoder layers' linears and routed experts are FP8
    (`decoder.empty_fp8_layers` says which), quantized as they load."""
    dtype = dtype or config.text.dtype

    def make() -> Qwen3OmniThinker:
        model = Qwen3OmniThinker(config, tp, split_attention)
        if quantization is not None:
            empty_fp8_layers(model.model.layers, quantization)
        return model

    model = build_on_meta(make, dtype, device)
    assert isinstance(model, Qwen3OmniThinker)
    model.tie_weights()
    t = config.text
    model.kv_layout = KVLayout(t.num_layers, model.local_kv_heads, t.head_dim, dtype)
    return model
