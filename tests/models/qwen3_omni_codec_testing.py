"""Tiny transformers references of Qwen3-Omni's code predictor and Code2Wav, saved in the HF layout."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from mstar.models.qwen3_omni.code2wav_config import Code2WavConfig
from mstar.models.qwen3_omni.code_predictor_config import CodePredictorConfig


def hf_talker_config(cfg: CodePredictorConfig) -> dict[str, Any]:
    """The HF `talker_config` dict (only what the code predictor reads) describing `cfg`."""
    return {
        "num_code_groups": cfg.num_code_groups,
        "text_config": {"vocab_size": cfg.talker_vocab_size, "hidden_size": cfg.hidden_size},
        "code_predictor_config": {
            "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
            "head_dim": cfg.head_dim, "rms_norm_eps": cfg.rms_norm_eps, "num_code_groups": cfg.num_code_groups,
            "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        },
    }


def hf_code2wav_config(cfg: Code2WavConfig) -> dict[str, Any]:
    """The HF `code2wav_config` dict describing `cfg`."""
    return {
        "codebook_size": cfg.codebook_size, "num_quantizers": cfg.num_quantizers, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
        "sliding_window": cfg.sliding_window, "rms_norm_eps": cfg.rms_norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "upsampling_ratios": list(cfg.upsampling_ratios), "upsample_rates": list(cfg.upsample_rates),
        "decoder_dim": cfg.decoder_dim,
    }


@torch.no_grad()
def randomize(module: nn.Module, seed: int, matrix_std: float, vector_std: float) -> None:
    """Weights far from init so outputs have clear margins: matrices N(0, std), vectors 1-centred or small."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in module.named_parameters():
        noise = torch.randn(p.shape, generator=gen)
        if p.ndim >= 2:
            p.copy_(noise * matrix_std)
        elif name.endswith(("alpha", "beta", "bias")):
            p.copy_(noise * vector_std)
        else:  # norm weights, layer scales, ConvNeXt gamma
            p.copy_(1.0 + noise * vector_std if "norm" in name else 0.5 + noise * vector_std)


def make_hf_code_predictor(cfg: CodePredictorConfig, seed: int = 0) -> tuple[nn.Module, nn.Embedding]:
    """(transformers code predictor, the talker's codec embedding), random weights."""
    from transformers.models.qwen3_omni_moe import configuration_qwen3_omni_moe as hf_cfg
    from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as hf

    config = hf_cfg.Qwen3OmniMoeTalkerCodePredictorConfig(**hf_talker_config(cfg)["code_predictor_config"])
    config._attn_implementation = "eager"
    model = hf.Qwen3OmniMoeTalkerCodePredictorModelForConditionalGeneration(config).eval()
    talker_embedding = nn.Embedding(cfg.talker_vocab_size, cfg.hidden_size)
    randomize(model, seed, matrix_std=0.3, vector_std=0.1)
    randomize(talker_embedding, seed + 1, matrix_std=1.0, vector_std=0.0)
    return model, talker_embedding


def make_hf_code2wav(cfg: Code2WavConfig, seed: int = 0) -> nn.Module:
    """A transformers Code2Wav with random weights whose audio mostly stays inside the [-1, 1] clamp."""
    from transformers.models.qwen3_omni_moe import configuration_qwen3_omni_moe as hf_cfg
    from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as hf

    config = hf_cfg.Qwen3OmniMoeCode2WavConfig(**hf_code2wav_config(cfg))
    config._attn_implementation = "eager"
    model = hf.Qwen3OmniMoeCode2Wav(config).eval()
    randomize(model, seed, matrix_std=0.1, vector_std=0.1)
    return model


def save_checkpoint(tensors: dict[str, torch.Tensor], path: Path) -> Path:
    """Write `tensors` as path/model.safetensors (plus an unrelated tensor the loaders must skip)."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().contiguous() for k, v in tensors.items()}
    tensors["thinker.model.norm.weight"] = torch.ones(4)
    save_file(tensors, str(path / "model.safetensors"))
    return path
