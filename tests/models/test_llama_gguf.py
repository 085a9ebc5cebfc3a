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


def _add_tokenizer(writer, folder) -> None:
    """The tiny ChatML tokenizer folder's vocabulary, merges, specials and chat template, as llama.cpp writes them."""
    import json

    raw = json.loads((folder / "tokenizer.json").read_text())
    config = json.loads((folder / "tokenizer_config.json").read_text())
    vocab = raw["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    specials = {t["content"] for t in raw["added_tokens"] if t["special"]}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in specials else 1 for t in tokens])  # 3: control (special) tokens
    writer.add_token_merges([" ".join(m) for m in raw["model"]["merges"]])
    writer.add_bos_token_id(vocab["<|im_start|>"])  # transformers' GGUF converter reads one
    writer.add_add_bos_token(False)
    writer.add_eos_token_id(vocab[config["eos_token"]])
    writer.add_pad_token_id(vocab[config["pad_token"]])
    writer.add_chat_template(config["chat_template"])


def _write_gguf(hf, path, tokenizer_folder=None):
    cfg = hf.config
    writer = gguf.GGUFWriter(str(path), arch="llama")
    if tokenizer_folder is not None:
        _add_tokenizer(writer, tokenizer_folder)
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


def test_gguf_file_serves_with_its_embedded_tokenizer_and_chat_template(tmp_path):
    """A .gguf `model_path` needs no tokenizer.json: the served chat prompt and greedy answer are
    transformers' on the same file (its GGUF tokenizer, template and weights)."""
    import transformers

    from mstar.models.llama.tiny import TINY_TOKENIZER_VOCAB, tiny_tokenizer_folder
    from mstar.runtime.offline import MStar

    hf = save_hf_model("llama", tmp_path / "hf")
    hf.resize_token_embeddings(TINY_TOKENIZER_VOCAB)
    gguf_file = tmp_path / "gguf" / "tiny.gguf"
    gguf_file.parent.mkdir()
    _write_gguf(hf, gguf_file, tiny_tokenizer_folder())
    assert [p.name for p in gguf_file.parent.iterdir()] == ["tiny.gguf"]
    ref_tok = transformers.AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32
    ).eval()
    messages = [{"role": "user", "content": "Hello, how are you today?"}]
    prompt = ref_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = ref_tok(prompt, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        expected = ref.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, eos_token_id=None)
    expected_text = ref_tok.decode(expected[0, len(ids):], skip_special_tokens=True)
    with MStar("llama", config={"model": "llama", "device": "cpu"}, model_path=str(gguf_file)) as m:
        tokenizer = m.runtime.model.tokenizer
        assert tokenizer.apply_chat_template(messages) == prompt and "<|im_start|>user\nHello" in prompt
        assert tokenizer.encode(prompt, add_special_tokens=False) == ids
        result = m.generate({"messages": messages}, temperature=0.0, max_tokens=8, ignore_eos=True)
    assert "".join(result.outputs["text"]) == expected_text


def test_default_conversion_keeps_gguf_values_and_is_keyed_by_dtype(tmp_path, monkeypatch):
    """The default model's conversion writes float32 (every dequantized value exact) into a folder named by
    its dtype; a folder whose config.json declares another dtype is converted again, never reused."""
    import json

    from safetensors.torch import load_file

    from mstar.models.common import smollm2
    from mstar.models.common.gguf_checkpoint import iter_gguf_tensors
    from mstar.models.llama.tiny import TINY_TOKENIZER_VOCAB, tiny_tokenizer_folder

    hf = save_hf_model("llama", tmp_path / "hf")
    hf.resize_token_embeddings(TINY_TOKENIZER_VOCAB)
    gguf_file = tmp_path / "tiny.gguf"
    _write_gguf(hf, gguf_file, tiny_tokenizer_folder())
    monkeypatch.setattr(smollm2, "smollm2_gguf_path", lambda: gguf_file)
    cache = tmp_path / "cache"
    folder = smollm2.ensure_smollm2_checkpoint(cache)
    assert folder.name == "smollm2-135m-instruct-float32"
    saved = load_file(folder / "model.safetensors")
    for name, tensor in iter_gguf_tensors(gguf_file, progress=False):
        assert saved[name].dtype == torch.float32 and torch.equal(saved[name], tensor), name
    bf16 = smollm2.ensure_smollm2_checkpoint(cache, dtype=torch.bfloat16)
    assert bf16.name == "smollm2-135m-instruct-bfloat16" and bf16 != folder
    assert load_file(bf16 / "model.safetensors")["model.norm.weight"].dtype == torch.bfloat16
    # a float32-named folder holding bfloat16 weights (copied by hand, say) is not taken for float32
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "torch_dtype": "bfloat16"}))
    assert smollm2.ensure_smollm2_checkpoint(cache) == folder
    assert json.loads((folder / "config.json").read_text())["torch_dtype"] == "float32"
