"""Logprobs through the unmodified openai client match transformers' log-softmax for a tiny Llama, streamed
and not, on chat and completions; a model that gives none refuses the request."""

from __future__ import annotations

import math

import openai
import pytest
import torch

from tests.e2e.server_thread import running_server
from tests.models.llm_runtime_testing import hf_greedy, make_checkpoint

PROMPT = "The capital of France is"
TOKENS = 6


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(openai client, transformers model, tokenizer) over one tiny Llama checkpoint."""
    path = tmp_path_factory.mktemp("llama")
    hf, tokenizer = make_checkpoint("llama", path)
    config = {"model": "llama", "device": "cpu", "kv_cache": {"max_num_pages": 64}}
    with running_server(config, runtime_kwargs={"model_path": str(path)}) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0), hf, tokenizer


def _reference(hf, prompt_ids: list[int], k: int) -> list[tuple[int, float, list[tuple[int, float]]]]:
    """Per greedy token of transformers: (id, log-probability, top k (id, log-probability))."""
    new = hf_greedy(hf, prompt_ids, TOKENS)
    with torch.no_grad():
        logits = hf(torch.tensor([prompt_ids + new])).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    out = []
    for j, token in enumerate(new):
        row = logp[len(prompt_ids) + j - 1]
        top = torch.topk(row, k)
        out.append((token, float(row[token]), list(zip(top.indices.tolist(), top.values.tolist(), strict=True))))
    return out


def test_completion_logprobs_match_transformers(served):
    client, hf, tokenizer = served
    ref = _reference(hf, tokenizer.encode(PROMPT, add_special_tokens=True), 3)
    resp = client.completions.create(model="llama", prompt=PROMPT, max_tokens=TOKENS, logprobs=3, temperature=0,
                                     extra_body={"ignore_eos": True})
    lp = resp.choices[0].logprobs
    assert lp.tokens == [tokenizer.decode([t]) for t, _, _ in ref]
    for got, (_, want, _top) in zip(lp.token_logprobs, ref, strict=True):
        assert math.isclose(got, want, abs_tol=1e-4)
    for got, (_, _, top) in zip(lp.top_logprobs, ref, strict=True):
        want = {tokenizer.decode([i]): v for i, v in top}
        assert got.keys() == want.keys() and all(math.isclose(got[t], want[t], abs_tol=1e-4) for t in want)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


def test_chat_logprobs_streamed_equal_unstreamed(served):
    client, hf, tokenizer = served
    args = {"model": "llama", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": TOKENS,
            "logprobs": True, "top_logprobs": 2, "temperature": 0, "extra_body": {"ignore_eos": True}}
    whole = client.chat.completions.create(**args)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens == TOKENS
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob >= t.logprob - 1e-6 for t in content)
    assert all(bytes(t.bytes).decode() == t.token for t in content)
    streamed = [t for chunk in client.chat.completions.create(**args, stream=True) for choice in chunk.choices
                if choice.logprobs and choice.logprobs.content for t in choice.logprobs.content]
    assert [t.token for t in streamed] == [t.token for t in content]
    assert all(math.isclose(a.logprob, b.logprob, abs_tol=1e-4) for a, b in zip(streamed, content, strict=True))


def test_a_model_without_logprobs_refuses_them():
    with running_server({"model": "toy"}) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="does not return logprobs"):
            client.chat.completions.create(model="toy", messages=[{"role": "user", "content": "hi"}], logprobs=True)


def test_generate_streams_each_token_logprobs_as_a_tensor_output(served):
    import httpx

    from mstar.server.protocol import TensorChunk, TextChunk, parse_chunk

    client, _, _ = served
    base = str(client.base_url).removesuffix("/v1/")
    with httpx.stream("POST", f"{base}/generate", json={"text": PROMPT, "outputs": ["text", "logprobs"], "options": {
            "max_tokens": TOKENS, "logprobs": 2, "temperature": 0, "ignore_eos": True}}) as resp:
        chunks = [parse_chunk(line) for line in resp.iter_lines() if line]
    rows = [c.to_numpy() for c in chunks if isinstance(c, TensorChunk) and c.output == "logprobs"]
    assert len(rows) == TOKENS and all(r.shape == (5,) for r in rows)  # logprob, 2 top ids, 2 top logprobs
    assert all(r[3] >= r[0] - 1e-6 for r in rows)  # the best alternative is at least as likely as the token
    assert any(isinstance(c, TextChunk) for c in chunks)
