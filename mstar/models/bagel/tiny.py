"""Tiny BAGEL for CPU tests and `--tiny` runs: configs in the checkpoint's own keys, and a small tokenizer.

The dicts are what llm_config.json and vit_config.json would hold, so the parsers that read a real folder
read them too. The tokenizer is a byte-level BPE with BAGEL's special tokens (and `<think>` tags).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mstar.models.bagel.config import BagelConfig, LLMConfig, VAEConfig, vit_from_hf

TINY_LLM: dict[str, Any] = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 640, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "torch_dtype": "float32",
}
TINY_VIT: dict[str, Any] = {
    "model_type": "siglip_vision_model", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3,
    "num_attention_heads": 2, "patch_size": 14, "image_size": 112, "layer_norm_eps": 1e-6,
}
TINY_VAE = VAEConfig(ch=32, ch_mult=(1, 1, 2, 2), num_res_blocks=1, z_channels=16)
TINY_MAX_LATENT = 8  # latent patches per side: images up to 128 px


def tiny_config() -> BagelConfig:
    """2-layer MoT LLM (hidden 64), 2-layer ViT (hidden 32, patch 14, 8x8 grid), a 32/64-channel FLUX VAE."""
    vit = vit_from_hf(TINY_VIT)
    return BagelConfig(llm=LLMConfig.from_hf(TINY_LLM), vit=vit, vae=TINY_VAE, max_latent_size=TINY_MAX_LATENT,
                       vit_max_patches_per_side=vit.grid_side)


SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                  "<think>", "</think>")
_CORPUS = (
    "A photo of a red fox sitting in the snow, golden light, detailed fur.",
    "What is in this picture? Describe the colors and the objects you see.",
    "Make the sky purple and add a small boat on the lake; keep the trees.",
    "You should first think about the planning process in the mind and then generate the image.",
    "The answer is a cat. There are two cups on the table and a window behind them.",
)


def write_tiny_tokenizer(out_dir: str | Path) -> Path:
    """A byte-level BPE folder whose ids fit TINY_LLM's vocabulary, eos `<|im_end|>`, with Qwen2.5's ChatML template
    (BAGEL-7B-MoT ships Qwen2.5's tokenizer files, whose template lists tools)."""
    from tokenizers import AddedToken

    from mstar.models.common.chat_templates import CHATML_TEMPLATE
    from mstar.models.common.tokenizer_build import train_byte_level_bpe, write_tokenizer_folder

    tok = train_byte_level_bpe(_CORPUS, vocab_size=560, special_tokens=SPECIAL_TOKENS[:3])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS[3:5]])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in SPECIAL_TOKENS[5:]])
    assert tok.get_vocab_size() <= TINY_LLM["vocab_size"]
    config = {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
              "chat_template": CHATML_TEMPLATE, "clean_up_tokenization_spaces": False}
    return write_tokenizer_folder(out_dir, tok, config)


_TINY_TOKENIZER_VERSION = 2  # bump when write_tiny_tokenizer's output changes


def tiny_tokenizer_folder(cache_dir: str | Path | None = None) -> Path:
    """The tiny tokenizer folder, built once per machine (`cached_folder`)."""
    from mstar.models.common.tokenizer_build import cached_folder

    return cached_folder(f"tiny-bagel-v{_TINY_TOKENIZER_VERSION}", write_tiny_tokenizer, cache_dir)
