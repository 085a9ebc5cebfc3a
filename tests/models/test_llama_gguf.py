"""GGUF loading on a tiny llama file written here: names, config, q/k permutation, dequantization."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mstar.models.common.gguf_checkpoint import gguf_hf_config, unpermute_qk
from mstar.models.llama.weights import load_model
from tests.models.llama_testing import DenseAttention, save_hf_model

gguf = pytest.importorskip("gguf")

HF_TO_GGUF = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter order for q/k rows (rotate-half halves -> interleaved pairs)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_name(name: str) -> str:
    globals_ = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if name in globals_:
        return globals_[name]
    _, _, layer, rest = name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{HF_TO_GGUF[module]}.{kind}"


def _write_gguf(hf, path):
    cfg = hf.config
    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(cfg.vocab_size)
    for name, tensor in hf.state_dict().items():
        w = tensor.numpy()
        if ".q_proj." in name:
            w = _permute(w, cfg.num_attention_heads)
        elif ".k_proj." in name:
            w = _permute(w, cfg.num_key_value_heads)
        if w.ndim == 2:  # exercise dequantization: Q8_0 blocks of 32 along rows
            writer.add_tensor(
                _gguf_name(name),
                gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0),
                raw_dtype=gguf.GGMLQuantizationType.Q8_0,
            )
        else:
            writer.add_tensor(_gguf_name(name), w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_unpermute_inverts_llama_cpp_permutation():
    w = np.arange(8 * 4 * 3, dtype=np.float32).reshape(8 * 4, 3)
    assert np.array_equal(unpermute_qk(_permute(w, 4), 4), w)
    assert not np.array_equal(_permute(w, 4), w)


@torch.no_grad()
def test_tiny_gguf_matches_transformers_gguf_loading(tmp_path):
    import transformers

    hf = save_hf_model("llama", tmp_path / "hf")
    gguf_file = tmp_path / "gguf" / "tiny.gguf"
    gguf_file.parent.mkdir()
    _write_gguf(hf, gguf_file)
    config = gguf_hf_config(gguf_file)
    assert (
        config["num_key_value_heads"] == 2 and config["head_dim"] == 16 and not config["tie_word_embeddings"]
    )
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32
    ).eval()
    prompt = [5, 17, 99, 3, 42, 250, 8, 77]
    expected = ref(torch.tensor([prompt])).logits[0]
    for source in (gguf_file, gguf_file.parent):  # the file itself, or the folder holding it
        ours = load_model(source, dtype=torch.float32, progress=False)
        logits = ours.compute_logits(ours(torch.tensor(prompt), torch.arange(len(prompt)), DenseAttention()))
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
    # Q8_0 rounding moved the weights: the original model must differ, else nothing was dequantized
    assert not torch.allclose(hf(torch.tensor([prompt])).logits[0], expected, atol=1e-4)
