"""What the server tells its operator: each ended request counted with its tokens in /metrics and logged on
one line (id, route, model, status, finish reason, prompt and output tokens, time to first output, total
time), and the model's context length and voices in /v1/models."""

from __future__ import annotations

import logging
import re

import httpx

from tests.e2e.server_thread import metric_sum, running_server, scrape


def test_token_counters_and_one_log_line_per_request(caplog):
    caplog.set_level(logging.INFO, logger="mstar.server.requests")
    with running_server({"model": "toy"}) as url:
        before = scrape(url)
        chat = httpx.post(f"{url}/v1/chat/completions", json={
            "model": "toy", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 5}).json()
        bad = httpx.post(f"{url}/generate", json={"text": "x", "options": {"guidance": "abc"}})
        after = scrape(url)
    usage = chat["usage"]
    for name, tokens in (("mstar_prompt_tokens_total", usage["prompt_tokens"]),
                         ("mstar_generation_tokens_total", usage["completion_tokens"])):
        assert metric_sum(after, name) - (metric_sum(before, name) or 0) == tokens > 0, name
    lines = [r.getMessage() for r in caplog.records if r.name == "mstar.server.requests"]
    assert len(lines) == 1 and bad.status_code == 400  # refused before submission: no request to log
    assert re.fullmatch(rf"\w+ POST /v1/chat/completions model=toy status=200 finish=\w+ "
                        rf"prompt_tokens={usage['prompt_tokens']} output_tokens={usage['completion_tokens']} "
                        r"first_output=\d+\.\d{3}s total=\d+\.\d{3}s", lines[0]), lines[0]


def test_models_lists_the_context_length_of_a_token_model():
    with running_server({"model": "llama", "device": "cpu", "kv_cache": {"max_num_pages": 64}}, tiny=True) as url:
        (card,) = httpx.get(f"{url}/v1/models").json()["data"]
        too_long = httpx.post(f"{url}/v1/completions", json={"prompt": "word " * 2000, "max_tokens": 4})
    assert card["id"] == "llama" and card["max_model_len"] == 512  # the tiny checkpoint's context
    assert too_long.status_code == 400 and "context of 512 tokens" in too_long.json()["error"]["message"]
    with running_server({"model": "toy"}) as url:
        card = httpx.get(f"{url}/v1/models").json()["data"][0]
    assert card["max_model_len"] is None and card["voices"] == []  # no token context, no voices


def test_the_kv_pool_capacity_is_the_one_limit_every_answer_quotes():
    # 16 pages of 16 tokens hold 256 tokens, under the tiny checkpoint's 512: the engine's limit wins everywhere
    with running_server({"model": "llama", "device": "cpu", "kv_cache": {"max_num_pages": 16}}, tiny=True) as url:
        (card,) = httpx.get(f"{url}/v1/models").json()["data"]
        long_prompt = httpx.post(f"{url}/v1/completions", json={"prompt": "word " * 60, "max_tokens": 4})
        many_tokens = httpx.post(f"{url}/v1/completions", json={"prompt": "word", "max_tokens": 400})
    assert card["max_model_len"] == 256
    assert long_prompt.status_code == 400, long_prompt.text
    assert re.search(r"the prompt has \d+ tokens, .* context of 256 tokens", long_prompt.json()["error"]["message"])
    assert many_tokens.status_code == 400 and re.search(
        r"max_tokens=400 plus the \d+-token prompt exceeds the model's context of 256 tokens; use max_tokens <= \d+",
        many_tokens.json()["error"]["message"])


def test_models_lists_the_voices_of_a_speaking_model():
    from mstar.models.orpheus.tokens import VOICES
    from mstar.models.registry import get_model_class

    with running_server({"model": "orpheus", "device": "cpu", "kv_cache": {"max_num_pages": 64}}, tiny=True) as url:
        (card,) = httpx.get(f"{url}/v1/models").json()["data"]
        wrong = httpx.post(f"{url}/v1/audio/speech", json={"model": "orpheus", "input": "hi", "voice": "nobody"})
    assert card["voices"] == list(VOICES) and wrong.status_code == 400 and "tara" in wrong.text
    assert get_model_class("orpheus").voices == VOICES  # what `mstar models` lists


def test_served_model_name_is_the_name_clients_use():
    with running_server({"model": "toy"}, model_name="my-assistant") as url:
        assert [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]] == ["my-assistant"]
        ok = httpx.post(f"{url}/v1/chat/completions", json={
            "model": "my-assistant", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        other = httpx.post(f"{url}/v1/chat/completions", json={
            "model": "toy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["model"] == "my-assistant" and other.status_code == 404
