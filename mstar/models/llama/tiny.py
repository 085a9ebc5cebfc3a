"""Tiny configs of the dense decoder family for CPU tests (HF config.json dicts, random weights)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mstar.models.llama.config import LlamaConfig

_BASE: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": {**_BASE, "model_type": "llama", "architectures": ["LlamaForCausalLM"], "rope_theta": 10000.0},
    "llama3": {
        **_BASE,
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    },
    "qwen2": {
        **_BASE,
        "model_type": "qwen2",
        "architectures": ["Qwen2ForCausalLM"],
        "tie_word_embeddings": True,
    },
    "qwen3": {
        **_BASE,
        "model_type": "qwen3",
        "architectures": ["Qwen3ForCausalLM"],
        "head_dim": 32,  # != hidden / heads: the config value must win
        "attention_bias": True,
    },
}


def tiny_hf_config(name: str) -> dict[str, Any]:
    """A copy of the tiny HF config.json dict `name` (one of TINY_CONFIGS)."""
    if name not in TINY_CONFIGS:
        raise ValueError(f"unknown tiny config {name!r}; choose one of {sorted(TINY_CONFIGS)}")
    return dict(TINY_CONFIGS[name])


def tiny_config(name: str) -> LlamaConfig:
    """The tiny `LlamaConfig` `name`, for tests and `--tiny` runs."""
    return LlamaConfig.from_hf(tiny_hf_config(name))


_TINY_CORPUS = (
    "The capital of France is Paris. The capital of Italy is Rome. Hello, how are you today?",
    "def add(a, b):\n    return a + b  # numbers 0 1 2 3 4 5 6 7 8 9",
    "A quick brown fox jumps over the lazy dog; the user asks and the assistant answers.",
)
TINY_TOKENIZER_VOCAB = 320  # byte-level BPE: 256 bytes, 3 specials, the rest merges
_TINY_TOKENIZER_VERSION = 1  # bump when the tiny tokenizer changes, so cached folders are rebuilt


def tiny_tokenizer_folder(cache_dir: str | Path | None = None) -> Path:
    """A ChatML byte-level BPE tokenizer folder (eos `<|im_end|>`), trained offline in well under a second
    and built once per machine (`cached_folder`). Ids are below `TINY_TOKENIZER_VOCAB`."""
    from mstar.models.common.tokenizer_build import cached_folder

    return cached_folder(f"tiny-chatml-v{_TINY_TOKENIZER_VERSION}", _write_tiny_tokenizer, cache_dir)


def _write_tiny_tokenizer(out_dir: Path) -> None:
    from mstar.models.common.chat_templates import CHATML_TEMPLATE
    from mstar.models.common.tokenizer_build import train_byte_level_bpe, write_tokenizer_folder

    tok = train_byte_level_bpe(_TINY_CORPUS, vocab_size=TINY_TOKENIZER_VOCAB)
    config = {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
              "chat_template": CHATML_TEMPLATE, "clean_up_tokenization_spaces": False}
    write_tokenizer_folder(out_dir, tok, config)
