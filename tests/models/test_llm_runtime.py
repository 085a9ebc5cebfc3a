"""Dense LLMs through the offline runtime (MStar, in-process, CPU) vs transformers' greedy generate."""

from __future__ import annotations

import pytest
import torch

from mstar.runtime.offline import MStar
from tests.models.llm_runtime_testing import PROMPTS, hf_greedy, make_checkpoint, token_ids

NEW = 48
GREEDY = {"temperature": 0.0, "ignore_eos": True, "max_tokens": NEW}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """arch -> (checkpoint folder, HF model, tokenizer), built on first use."""
    made = {}

    def get(arch: str):
        if arch not in made:
            path = tmp_path_factory.mktemp(arch)
            hf, tok = make_checkpoint(arch, path)
            made[arch] = (path, hf, tok)
        return made[arch]
    return get


def _mstar(arch: str, path, kv: dict | None = None, engine: dict | None = None, **model_kwargs) -> MStar:
    config = {"model": arch, "device": "cpu", "kv_cache": kv or {"max_num_pages": 256},
              "model_kwargs": model_kwargs, "engines": {"llm": engine or {}}}
    return MStar(arch, config=config, model_path=str(path))


def _references(hf, tok, prompts: list[str]) -> list[list[int]]:
    return [hf_greedy(hf, tok.encode(p), NEW) for p in prompts]


def _run_all(m: MStar, prompts: list[str], **options) -> list[list[int]]:
    handles = [m.submit({"text": p}, **options) for p in prompts]  # submitted together: batched
    return [token_ids(h) for h in handles]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_one_request_matches_transformers(checkpoints, arch):
    path, hf, tok = checkpoints(arch)
    with _mstar(arch, path) as m:
        handle = m.submit({"text": PROMPTS[1]}, **GREEDY)
        assert token_ids(handle) == _references(hf, tok, PROMPTS[1:2])[0]
        assert handle.finish.finish_reason == "length"


def test_mixed_batch_and_chunked_prefill_match_transformers(checkpoints):
    path, hf, tok = checkpoints("qwen3")
    expected = _references(hf, tok, PROMPTS)
    with _mstar("qwen3", path) as m:
        assert _run_all(m, PROMPTS, **GREEDY) == expected
    with _mstar("qwen3", path, engine={"max_batch_tokens": 7}) as m:  # prompts split into many chunks per step
        assert _run_all(m, PROMPTS, **GREEDY) == expected


def test_prefix_cache_hits_give_the_same_tokens(checkpoints):
    path, hf, tok = checkpoints("llama")
    prompt = PROMPTS[3]  # several full pages of 16 tokens
    expected = _references(hf, tok, [prompt])[0]
    with _mstar("llama", path) as m:
        pool = m.runtime.workers[0].engines["llm"].pool
        hits = []
        original = pool.match_prefix
        pool.match_prefix = lambda hashes: hits.append(len(r := original(hashes))) or r
        assert _run_all(m, [prompt], **GREEDY)[0] == expected
        assert _run_all(m, [prompt], **GREEDY)[0] == expected
    assert hits[0] == 0 and max(hits) >= len(tok.encode(prompt)) // 16, hits


def test_seeded_sampling_alone_equals_in_a_batch(checkpoints):
    path, _hf, _tok = checkpoints("qwen2")
    opts = {"temperature": 1.0, "top_p": 0.9, "max_tokens": 24, "ignore_eos": True}
    with _mstar("qwen2", path) as m:
        alone = [token_ids(m.submit({"text": p}, seed=10 + i, **opts)) for i, p in enumerate(PROMPTS[:4])]
        batch = [m.submit({"text": p}, seed=10 + i, **opts) for i, p in enumerate(PROMPTS[:4])]
        assert [token_ids(h) for h in batch] == alone
        assert len(set(map(tuple, alone))) == 4


def test_tiny_kv_pool_preempts_and_returns_to_all_free(checkpoints):
    path, hf, tok = checkpoints("llama")
    prompts = PROMPTS * 2  # 16 requests of up to 177 tokens each; the pool holds 224 tokens in all
    expected = _references(hf, tok, PROMPTS) * 2
    with _mstar("llama", path, kv={"max_num_pages": 14, "page_size": 16}) as m:
        assert _run_all(m, prompts, **GREEDY) == expected
        pool = m.runtime.workers[0].engines["llm"].pool
        assert pool.num_free == pool.num_pages


def test_max_tokens_unset_runs_to_the_end_of_the_context(checkpoints):
    path, hf, tok = checkpoints("qwen2")
    prompt = tok.encode(PROMPTS[0])
    with _mstar("qwen2", path, max_model_len=40) as m:
        handle = m.submit({"text": PROMPTS[0]}, temperature=0.0, ignore_eos=True)
        ids = token_ids(handle)
    assert handle.finish.finish_reason == "length"
    assert len(prompt) + len(ids) == 40
    assert ids == hf_greedy(hf, prompt, len(ids))


def test_errors_name_the_option(checkpoints):
    path, _hf, _tok = checkpoints("qwen2")
    with _mstar("qwen2", path, max_model_len=40) as m:
        with pytest.raises(ValueError, match="max_tokens=100 plus the"):
            m.submit({"text": "hello"}, max_tokens=100)
        with pytest.raises(ValueError, match="temperature"):
            m.processor.validate_options({"temperature": -1})
        with pytest.raises(ValueError, match="stop="):
            m.processor.validate_options({"stop": "x"})
        with pytest.raises(ValueError, match="messages"):
            m.submit({}, max_tokens=2)
        with pytest.raises(ValueError, match="temperature"):  # validated before admission
            m.generate({"text": "hello"}, temperature=-1.0, max_tokens=2)


def test_chat_messages_and_stop_strings(checkpoints):
    path, hf, tok = checkpoints("llama")
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)
    expected = hf_greedy(hf, prompt, NEW)
    text = tok.decode(expected, skip_special_tokens=True)
    stop = text[len(text) // 2:][:3]
    with _mstar("llama", path) as m:
        handle = m.submit({"messages": messages}, **GREEDY, stop=[stop])
        decoder = m.processor.output_decoder({**GREEDY, "stop": [stop]}, {"prompt_ids": torch.tensor(prompt)})
        pieces = []
        for event in handle:
            pieces += [v for _, v in decoder.push(event.name, event.value)]
        pieces += [v for _, v in decoder.flush()]
    assert "".join(pieces) == text[: text.index(stop)]
    assert decoder.finish_reason == "stop" and decoder.prompt_tokens == len(prompt)
    assert 0 < decoder.completion_tokens <= NEW
