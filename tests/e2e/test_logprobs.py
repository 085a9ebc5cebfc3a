"""Logprobs through the unmodified openai client (and /generate) match transformers' log-softmax for a tiny
Llama on every text route, streamed and not, up to 20 alternatives, each token's bytes exact; a model that
gives none refuses the request."""

from __future__ import annotations

import math

import httpx
import openai
import pytest
import torch

from mstar import MStarClient
from mstar.server.protocol import FinalChunk, LogprobsChunk, TextChunk, parse_chunk
from tests.e2e.server_thread import running_server
from tests.models.llm_runtime_testing import hf_greedy, make_checkpoint

PROMPT = "The capital of France is"
TOKENS = 6
TOL = 1e-4


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(openai client, transformers model, our tokenizer, transformers' tokenizer) over one tiny Llama."""
    from transformers import PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("llama")
    hf, tokenizer = make_checkpoint("llama", path)
    config = {"model": "llama", "device": "cpu", "kv_cache": {"max_num_pages": 64}}
    with running_server(config, runtime_kwargs={"model_path": str(path)}) as url:
        yield (openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0), hf, tokenizer,
               PreTrainedTokenizerFast.from_pretrained(path))


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


def _bytes(hf_tokenizer, token_id: int) -> list[int]:
    """transformers' view of a token's bytes: its byte-level BPE piece through GPT-2's byte alphabet."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_of = {c: b for b, c in bytes_to_unicode().items()}
    return [byte_of[c] for c in hf_tokenizer.convert_ids_to_tokens(token_id)]


def _check_content(content, ref, hf_tokenizer) -> None:
    """Chat-shaped entries (openai's or ours) against the reference: ids by their exact bytes, values to TOL."""
    assert len(content) == len(ref)
    for got, (token, logprob, top) in zip(content, ref, strict=True):
        assert list(got.bytes) == _bytes(hf_tokenizer, token) and math.isclose(got.logprob, logprob, abs_tol=TOL)
        want = {tuple(_bytes(hf_tokenizer, i)): v for i, v in top}
        alternatives = {tuple(t.bytes): t.logprob for t in got.top_logprobs}
        assert alternatives.keys() == want.keys()
        assert all(math.isclose(alternatives[b], want[b], abs_tol=TOL) for b in want)


def _chat_args(top: int, **more):
    return {"model": "llama", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": TOKENS,
            "logprobs": True, "top_logprobs": top, "temperature": 0, "extra_body": {"ignore_eos": True}, **more}


def _chat_prompt_ids(tokenizer) -> list[int]:
    return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}]),
                            add_special_tokens=False)


def test_completion_logprobs_match_transformers_streamed_and_not(served):
    client, hf, tokenizer, _ = served
    ref = _reference(hf, tokenizer.encode(PROMPT, add_special_tokens=True), 3)
    args = {"model": "llama", "prompt": PROMPT, "max_tokens": TOKENS, "logprobs": 3, "temperature": 0,
            "extra_body": {"ignore_eos": True}}
    resp = client.completions.create(**args)
    lp = resp.choices[0].logprobs
    assert lp.tokens == [tokenizer.decode([t]) for t, _, _ in ref]
    for got, (_, want, _top) in zip(lp.token_logprobs, ref, strict=True):
        assert math.isclose(got, want, abs_tol=TOL)
    for got, (_, _, top) in zip(lp.top_logprobs, ref, strict=True):
        want = {tokenizer.decode([i]): v for i, v in top}
        assert got.keys() == want.keys() and all(math.isclose(got[t], want[t], abs_tol=TOL) for t in want)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    pieces = [c.choices[0].logprobs for c in client.completions.create(**args, stream=True)
              if c.choices and c.choices[0].logprobs and c.choices[0].logprobs.tokens]
    assert [t for p in pieces for t in p.tokens] == lp.tokens
    assert [o for p in pieces for o in p.text_offset] == lp.text_offset
    streamed = [v for p in pieces for v in p.token_logprobs]
    assert all(math.isclose(a, b, abs_tol=TOL) for a, b in zip(streamed, lp.token_logprobs, strict=True))


def test_chat_logprobs_with_20_alternatives_match_transformers_streamed_and_not(served):
    client, hf, tokenizer, hf_tokenizer = served
    ref = _reference(hf, _chat_prompt_ids(tokenizer), 20)
    whole = client.chat.completions.create(**_chat_args(20))
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens == TOKENS
    assert all(len(t.top_logprobs) == 20 for t in content)
    assert [t.token for t in content] == [tokenizer.decode([i]) for i, _, _ in ref]
    _check_content(content, ref, hf_tokenizer)
    streamed = [t for chunk in client.chat.completions.create(**_chat_args(20), stream=True)
                for choice in chunk.choices if choice.logprobs and choice.logprobs.content
                for t in choice.logprobs.content]
    _check_content(streamed, ref, hf_tokenizer)
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        client.chat.completions.create(**_chat_args(21))


def test_generate_gives_chat_shaped_logprobs_streamed_and_not(served):
    client, hf, tokenizer, hf_tokenizer = served
    ref = _reference(hf, tokenizer.encode(PROMPT, add_special_tokens=True), 2)
    base = str(client.base_url).removesuffix("/v1/")
    body = {"text": PROMPT, "outputs": ["text", "logprobs"],
            "options": {"max_tokens": TOKENS, "logprobs": 2, "temperature": 0, "ignore_eos": True}}
    with httpx.stream("POST", f"{base}/generate", json=body) as resp:
        chunks = [parse_chunk(line) for line in resp.iter_lines() if line]
    assert isinstance(chunks[-1], FinalChunk)
    streamed = [c for c in chunks if isinstance(c, LogprobsChunk)]
    assert [c.seq for c in streamed] == list(range(TOKENS)) and {c.output for c in streamed} == {"logprobs"}
    _check_content([t for c in streamed for t in c.content], ref, hf_tokenizer)
    text = "".join(c.delta for c in chunks if isinstance(c, TextChunk))
    assert text == "".join(t.token for c in streamed for t in c.content)
    whole = httpx.post(f"{base}/generate", json={**body, "stream": False}).json()
    _check_content([LogprobsChunk.model_validate(c).content[0] for c in whole["outputs"]["logprobs"]], ref,
                   hf_tokenizer)
    with MStarClient(base) as sdk:
        result = sdk.generate(PROMPT, outputs=["text", "logprobs"], **body["options"])
    _check_content(result.logprobs, ref, hf_tokenizer)


@pytest.mark.parametrize("stream", [True, False])
def test_generate_sends_logprobs_asked_by_the_option_or_the_output_alone(served, stream):
    """Option logprobs without output "logprobs" computed them and sent none; output "logprobs" without the
    option sent none either: the option now sends them, and the output alone asks for each token's own."""
    client, hf, tokenizer, hf_tokenizer = served
    ref = _reference(hf, tokenizer.encode(PROMPT, add_special_tokens=True), 2)
    base = str(client.base_url).removesuffix("/v1/")
    greedy = {"max_tokens": TOKENS, "temperature": 0, "ignore_eos": True}
    for outputs, options, top in ((["text"], {"logprobs": 2}, 2), (["text", "logprobs"], {}, 0)):
        body = {"text": PROMPT, "outputs": outputs, "options": {**greedy, **options}, "stream": stream}
        resp = httpx.post(f"{base}/generate", json=body, timeout=60)
        assert resp.status_code == 200, resp.text
        if stream:
            chunks = [parse_chunk(line) for line in resp.text.splitlines() if line]
            content = [t for c in chunks if isinstance(c, LogprobsChunk) for t in c.content]
        else:
            content = [LogprobsChunk.model_validate(c).content[0] for c in resp.json()["outputs"]["logprobs"]]
        _check_content(content, [(t, lp, alternatives[:top]) for t, lp, alternatives in ref], hf_tokenizer)


def test_a_model_without_logprobs_refuses_them():
    with running_server({"model": "toy"}) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="does not return logprobs"):
            client.chat.completions.create(model="toy", messages=[{"role": "user", "content": "hi"}], logprobs=True)
