"""Tiny Wan2.2 configs for CPU tests and `--tiny` runs (HF/Diffusers config.json dicts, random weights).

The dicts use the checkpoint's own keys, so the same parsers read them as read the real folders.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mstar.models.common.unipc import UniPCConfig
from mstar.models.wan22.config import UMT5Config, Wan22Config, WanTransformerConfig

TINY_TEXT_ENCODER: dict[str, Any] = {
    "architectures": ["UMT5EncoderModel"], "model_type": "umt5", "vocab_size": 512, "d_model": 32,
    "d_kv": 8, "d_ff": 64, "num_layers": 2, "num_heads": 4, "relative_attention_num_buckets": 32,
    "relative_attention_max_distance": 128, "feed_forward_proj": "gated-gelu", "layer_norm_epsilon": 1e-6,
    "dtype": "float32", "is_encoder_decoder": False, "pad_token_id": 0, "eos_token_id": 2,
}
TINY_TRANSFORMER: dict[str, Any] = {
    "_class_name": "WanTransformer3DModel", "patch_size": [1, 2, 2], "num_attention_heads": 2,
    "attention_head_dim": 12, "in_channels": 16, "out_channels": 16, "text_dim": 32, "freq_dim": 32,
    "ffn_dim": 48, "num_layers": 2, "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads",
    "eps": 1e-6, "image_dim": None, "added_kv_proj_dim": None, "rope_max_seq_len": 1024,
}
# Wan2.2-TI2V-5B's scheduler_config.json values (flow_shift 5, order 2, bh2).
SCHEDULER: dict[str, Any] = {
    "_class_name": "UniPCMultistepScheduler", "num_train_timesteps": 1000, "flow_shift": 5.0,
    "solver_order": 2, "solver_type": "bh2", "prediction_type": "flow_prediction", "use_flow_sigmas": True,
    "predict_x0": True, "lower_order_final": True, "disable_corrector": [], "final_sigmas_type": "zero",
    "timestep_spacing": "linspace",
}
TINY_TEXT_LENGTH = 16  # the real model pads prompts to 512 tokens; tests keep it short


def tiny_config() -> Wan22Config:
    """The tiny Wan2.2 components (2-layer UMT5 d_model 32; 2-layer DiT hidden 24, 16 latent channels)."""
    return Wan22Config(
        text_encoder=UMT5Config.from_hf(TINY_TEXT_ENCODER),
        transformer=WanTransformerConfig.from_hf({**TINY_TRANSFORMER, "torch_dtype": "float32"}),
        scheduler=UniPCConfig.from_hf(SCHEDULER),
        text_length=TINY_TEXT_LENGTH,
    )


_TINY_CORPUS = (
    "A cat and a dog bake a cake in a sunny kitchen; the camera slowly pans left.",
    "Waves crash on a rocky shore at sunset, seagulls fly over the water, cinematic, 4k.",
    "Bright tones, overexposed, static, blurred details, subtitles, worst quality, low quality.",
)


def write_tiny_tokenizer(out_dir: str | Path) -> Path:
    """A T5-style tokenizer folder (`</s>` appended, `<pad>` the last id) whose ids fit TINY_TEXT_ENCODER."""
    from tokenizers import AddedToken, processors

    from mstar.models.common.tokenizer_build import train_sentencepiece_bpe, write_tokenizer_folder

    tok = train_sentencepiece_bpe(_TINY_CORPUS, vocab_size=360)
    # ids 0..2 are <unk>, <s>, </s>; UMT5 has <pad> 0, </s> 1, <unk> 2, but only self-consistency matters here
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 2)])
    tok.add_special_tokens([AddedToken("<pad>", special=True, normalized=False)])
    assert tok.get_vocab_size() <= TINY_TEXT_ENCODER["vocab_size"]
    config = {"eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>", "model_max_length": 512}
    return write_tokenizer_folder(out_dir, tok, config)


_TINY_TOKENIZER_VERSION = 1  # bump when write_tiny_tokenizer's output changes


def tiny_tokenizer_folder(cache_dir: str | Path | None = None) -> Path:
    """The tiny tokenizer folder, built once per machine (`cached_folder`)."""
    from mstar.models.common.tokenizer_build import cached_folder

    return cached_folder(f"tiny-umt5-v{_TINY_TOKENIZER_VERSION}", write_tiny_tokenizer, cache_dir)
