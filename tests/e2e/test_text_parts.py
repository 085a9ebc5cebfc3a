"""Chat content as a list of text parts (OpenAI's array form, which many clients send for every message) on
text-only models, whose chat templates concatenate `content` as a string: the parts are joined as vLLM joins
them, so the prompt is the one the same text as a string gives; media parts are refused by name."""

from __future__ import annotations

import httpx
import pytest

from tests.e2e.server_thread import running_server


@pytest.fixture(scope="module", params=["smollm2", "qwen3"])
def base(request):
    with running_server({"model": request.param, "device": "cpu", "kv_cache": {"max_num_pages": 64}},
                        tiny=True) as url:
        yield url


def _usage(base: str, messages: list) -> httpx.Response:
    return httpx.post(f"{base}/v1/chat/completions", json={"messages": messages, "max_tokens": 2, "temperature": 0},
                      timeout=30)


def test_text_parts_give_the_prompt_of_the_joined_string(base):
    as_string = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello\nthere"},
                 {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "Again"}]
    as_parts = [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
                {"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]},
                {"role": "assistant", "content": [{"type": "text", "text": "Hi."}]},
                {"role": "user", "content": [{"type": "text", "text": "Again"}]}]
    want, got = _usage(base, as_string), _usage(base, as_parts)
    assert got.status_code == 200, got.text
    assert got.json()["usage"]["prompt_tokens"] == want.json()["usage"]["prompt_tokens"]
    assert got.json()["choices"][0]["message"]["content"] == want.json()["choices"][0]["message"]["content"]


def test_an_image_part_is_refused_naming_text_only(base):
    png = ("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGP4z8AAAAMBAQDJ/pLvAAAAAElFTkSuQmCC")
    resp = _usage(base, [{"role": "user", "content": [{"type": "text", "text": "what?"}, {
        "type": "image_url", "image_url": {"url": f"data:image/png;base64,{png}"}}]}])
    assert resp.status_code == 400 and "text only" in resp.json()["error"]["message"], resp.text
