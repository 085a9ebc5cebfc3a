"""The Cosmos3 reasoner: the understanding tower with its own head and final norm, as a Qwen3 decoder.

The reasoner is a Qwen3-VL language model. For text its interleaved 3D mRoPE places every token at the
same position on all three axes, which is plain RoPE, so the dense decoder of `models/llama` runs it on
the autoregressive engine. Its weights are the checkpoint's understanding-tower tensors (flat
`layers.*` with the Diffusers attention names) plus `lm_head` and `norm`; the generator's are skipped.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

import torch

from mstar.models.common import loading
from mstar.models.cosmos3.config import Cosmos3TransformerConfig
from mstar.models.llama.config import LlamaConfig

_GENERATOR_ONLY = re.compile(r"\.(add_[qkv]_proj|to_add_out|norm_added_[qk])\.|moe_gen|^(proj_in|proj_out|time_embedder|"
                             r"audio_proj_in|audio_proj_out|action_proj_in|action_proj_out)\.|_modality_embed$")
_RENAMES = (("self_attn.to_q.", "self_attn.q_proj."), ("self_attn.to_k.", "self_attn.k_proj."),
            ("self_attn.to_v.", "self_attn.v_proj."), ("self_attn.to_out.", "self_attn.o_proj."),
            ("self_attn.norm_q.", "self_attn.q_norm."), ("self_attn.norm_k.", "self_attn.k_norm."))


def reasoner_config(t: Cosmos3TransformerConfig, eos_token_ids: Sequence[int], max_model_len: int) -> LlamaConfig:
    """The Qwen3 decoder config of the understanding tower of `t`."""
    return LlamaConfig.from_hf({
        "model_type": "qwen3", "vocab_size": t.vocab_size, "hidden_size": t.hidden_size,
        "intermediate_size": t.intermediate_size, "num_hidden_layers": t.num_layers,
        "num_attention_heads": t.num_heads, "num_key_value_heads": t.num_kv_heads, "head_dim": t.head_dim,
        "rms_norm_eps": t.rms_norm_eps, "rope_theta": t.rope_theta, "attention_bias": t.attention_bias,
        "max_position_embeddings": max_model_len, "tie_word_embeddings": False,
        "dtype": str(t.dtype).removeprefix("torch."), "eos_token_id": list(eos_token_ids)})


def reasoner_mapper(config: LlamaConfig) -> loading.NameMapper:
    """Maps a Cosmos3 checkpoint tensor name onto the decoder's parameters; None for the generator's."""
    from mstar.models.llama.weights import name_mapper

    inner = name_mapper(config)

    def mapper(name: str):
        if _GENERATOR_ONLY.search(name):
            return None
        if name.startswith(("layers.", "embed_tokens.", "norm.")):
            name = "model." + name
            for old, new in _RENAMES:
                name = name.replace(old, new)
        return inner(name)

    return mapper


def load_reasoner(transformer_folder: Path | None, config: LlamaConfig, load_format: str, dtype: torch.dtype,
                  device: torch.device, seed: int = 0, std: float = 0.02):
    """The reasoner from the checkpoint's transformer/ folder, or seeded random weights (folder None, dummy)."""
    from mstar.models.llama.model import build_model

    model = build_model(config, dtype=dtype, device=device)
    if transformer_folder is None or load_format == "dummy":
        loading.fill_dummy_weights(model, seed=seed, std=std)
    else:
        loading.load_named_tensors(model, loading.iter_component_tensors(transformer_folder), reasoner_mapper(config))
    return model
