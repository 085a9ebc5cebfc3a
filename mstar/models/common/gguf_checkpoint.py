"""GGUF checkpoints: dequantized tensors under HF names, the HF config and the embedded tokenizer.

Only the llama architecture is mapped. llama.cpp's converter permutes the rows of Llama q/k weights
(interleaved rotary pairs); `iter_gguf_tensors` undoes it so tensors match HF checkpoints.
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

logger = logging.getLogger(__name__)

SUPPORTED_GGUF_ARCHS = ("llama",)

# GGUF tensor name (after "blk.N.") -> HF name (after "model.layers.N.").
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def open_gguf(path: Path) -> Any:
    """A `gguf.GGUFReader` for `path`, after checking the architecture is supported.

    Readers are kept per file and modification time, since parsing a large vocabulary's metadata is
    slow and the config, the tokenizer and the weights each read the same file.
    """
    path = Path(path).resolve()
    return _open_gguf(str(path), path.stat().st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _open_gguf(path: str, mtime_ns: int) -> Any:
    try:
        import gguf
    except ImportError as exc:
        raise ImportError("reading GGUF files needs the gguf package: pip install gguf") from exc
    logger.info("reading GGUF metadata of %s", path)
    try:
        reader = gguf.GGUFReader(path)
    except ValueError as exc:  # gguf's own message ("GGUF magic invalid") does not say which file
        raise ValueError(f"{path} is not a readable GGUF file ({exc}); pass a llama GGUF or a safetensors "
                         "checkpoint folder") from None
    arch = metadata(reader, "general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHS:
        raise ValueError(
            f"GGUF architecture {arch!r} of {path} is not supported; supported: {SUPPORTED_GGUF_ARCHS}"
        )
    if any(t.name == "rope_freqs.weight" for t in reader.tensors):
        raise ValueError(
            f"{path} carries rope_freqs (Llama-3.1 rope scaling), which is not mapped; use the HF checkpoint"
        )
    return reader


def metadata(reader: Any, key: str, default: Any = None) -> Any:
    """The decoded value of GGUF metadata `key`, or `default` when absent."""
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def gguf_to_hf_name(name: str) -> str:
    """HF checkpoint name of GGUF tensor `name`; KeyError for names outside the llama mapping."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    match = _LAYER_RE.fullmatch(name)
    if match is None or match.group(2) not in _LAYER_NAMES:
        raise KeyError(f"GGUF tensor {name!r} has no HF name in the llama mapping")
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"


def unpermute_qk(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (per head: pairs interleaved -> rotate-half halves)."""
    half = weight.shape[0] // num_heads // 2
    w = weight.reshape(num_heads, half, 2, *weight.shape[1:])
    return w.swapaxes(1, 2).reshape(weight.shape)


def iter_gguf_tensors(path: Path, progress: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, float32 tensor) for every tensor of a llama GGUF file, dequantized."""
    from gguf.quants import dequantize
    from tqdm import tqdm

    reader = open_gguf(path)
    num_heads = metadata(reader, "llama.attention.head_count")
    num_kv_heads = metadata(reader, "llama.attention.head_count_kv", num_heads)
    for tensor in tqdm(reader.tensors, desc="Dequantizing GGUF", unit="tensor", disable=not progress):
        values = dequantize(tensor.data, tensor.tensor_type)
        if ".attn_q." in tensor.name:
            values = unpermute_qk(values, num_heads)
        elif ".attn_k." in tensor.name:
            values = unpermute_qk(values, num_kv_heads)
        yield gguf_to_hf_name(tensor.name), torch.from_numpy(np.array(values, dtype=np.float32))


def gguf_hf_config(path: Path) -> dict[str, Any]:
    """The HF config.json dict (LlamaForCausalLM) described by a llama GGUF file's metadata."""
    reader = open_gguf(path)

    def get(key: str, default: Any = None) -> Any:
        return metadata(reader, f"llama.{key}", default)

    tokens = metadata(reader, "tokenizer.ggml.tokens") or []
    num_heads = get("attention.head_count")
    hidden = get("embedding_length")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": get("vocab_size", len(tokens)),
        "hidden_size": hidden,
        "intermediate_size": get("feed_forward_length"),
        "num_hidden_layers": get("block_count"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": get("attention.head_count_kv", num_heads),
        "head_dim": get("rope.dimension_count", hidden // num_heads),
        # GGUF stores eps as float32 (9.9999997e-06); print it back as the decimal it was (1e-05).
        "rms_norm_eps": float(f"{get('attention.layer_norm_rms_epsilon', 1e-5):.7g}"),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": get("context_length", 2048),
        "tie_word_embeddings": not any(t.name == "output.weight" for t in reader.tensors),
        "hidden_act": "silu",
        "bos_token_id": metadata(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": metadata(reader, "tokenizer.ggml.eos_token_id"),
        "pad_token_id": metadata(reader, "tokenizer.ggml.padding_token_id"),
    }
