"""Rebuild a Hugging Face tokenizer (tokenizer.json + tokenizer_config.json) from GGUF metadata.

Covers byte-level BPE vocabularies (`tokenizer.ggml.model == "gpt2"`), which SmolLM2, Llama-3 style
and Qwen GGUFs use; the pre-tokenizer follows llama.cpp's `tokenizer.ggml.pre` name.
"""

from __future__ import annotations

from typing import Any

from mstar.models.common.gguf_checkpoint import metadata

_CONTROL_TOKEN = 3  # llama.cpp token type of special tokens (<|im_start|>, ...)
SUPPORTED_PRE_TOKENIZERS = ("smollm", "gpt2", "default")


def _pre_tokenizer(pre: str) -> Any:
    from tokenizers import pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if pre == "smollm":  # every digit is its own word before the GPT-2 split
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in ("gpt2", "default"):
        return byte_level
    raise ValueError(
        f"GGUF tokenizer pre-tokenizer {pre!r} is not supported; supported: {SUPPORTED_PRE_TOKENIZERS}"
    )


def gguf_tokenizer(reader: Any) -> tuple[str, dict[str, Any]]:
    """(tokenizer.json text, tokenizer_config.json dict with the chat template) of a GGUF file."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    kind = metadata(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"GGUF tokenizer model {kind!r} is not supported; only byte-level BPE ('gpt2')")
    tokens: list[str] = metadata(reader, "tokenizer.ggml.tokens")
    types: list[int] = metadata(reader, "tokenizer.ggml.token_type")
    merges = [tuple(m.split(" ", 1)) for m in metadata(reader, "tokenizer.ggml.merges")]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tokenizer.pre_tokenizer = _pre_tokenizer(metadata(reader, "tokenizer.ggml.pre", "default"))
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    specials = [tokens[i] for i, t in enumerate(types) if t == _CONTROL_TOKEN]
    tokenizer.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])

    def token(key: str) -> str | None:
        idx = metadata(reader, f"tokenizer.ggml.{key}_token_id")
        return None if idx is None else tokens[idx]

    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos"),
        "eos_token": token("eos"),
        "unk_token": token("unknown"),
        "pad_token": token("padding"),
        "add_bos_token": bool(metadata(reader, "tokenizer.ggml.add_bos_token", False)),
        "additional_special_tokens": specials,
        "model_max_length": metadata(reader, f"{metadata(reader, 'general.architecture')}.context_length"),
        "chat_template": metadata(reader, "tokenizer.chat_template"),
    }
    return tokenizer.to_str(), config
