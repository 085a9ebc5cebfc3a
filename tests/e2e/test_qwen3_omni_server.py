"""`mstar serve qwen3_omni --tiny` on CPU through the real openai client: text chat, a spoken chat
streaming text deltas and audio chunks together, /v1/audio/speech as WAV, and the text's logprobs (spoken or
not, streamed or not, on chat and /generate; their values against transformers are tests/models'
test_qwen3_omni_model.py)."""

from __future__ import annotations

import base64
import io
import math

import httpx
import numpy as np
import pytest
import soundfile as sf

from tests.e2e.server_thread import running_server

openai = pytest.importorskip("openai")
SHORT = {"talker.temperature": 0.0, "talker.max_tokens": 12}  # greedy, short speech
MESSAGES = [{"role": "user", "content": "Hello, how are you today?"}]


@pytest.fixture(scope="module")
def client(one_thread):
    config = {"model": "qwen3_omni", "device": "cpu", "model_kwargs": {"code2wav_chunk": 4}}
    with running_server(config, runtime_kwargs={"tiny": True}) as base:
        yield openai.OpenAI(base_url=f"{base}/v1", api_key="none", timeout=60)


def test_text_chat(client):
    resp = client.chat.completions.create(model="qwen3_omni", messages=MESSAGES, max_tokens=5, temperature=0)
    assert resp.choices[0].message.content and resp.usage.completion_tokens == 5
    assert resp.choices[0].message.audio is None


def test_spoken_chat_streams_text_and_audio_together(client):
    kwargs = dict(model="qwen3_omni", messages=MESSAGES, max_tokens=5, temperature=0, extra_body=SHORT,
                  modalities=["text", "audio"], audio={"voice": "Ethan", "format": "pcm16"})
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    deltas = [c.choices[0].delta.audio for c in chunks if c.choices and c.choices[0].delta.audio]
    kinds = ["text" if getattr(d, "transcript", None) else "audio" for d in deltas if
             getattr(d, "transcript", None) or getattr(d, "data", None)]
    assert kinds.count("audio") > 1 and "text" in kinds  # one SSE stream carries both
    pcm = b"".join(base64.b64decode(getattr(d, "data", None) or "") for d in deltas)
    transcript = "".join(getattr(d, "transcript", None) or "" for d in deltas)
    text = client.chat.completions.create(model="qwen3_omni", messages=MESSAGES, max_tokens=5,
                                          temperature=0).choices[0].message.content
    assert transcript == text and len(pcm) > 0
    with pytest.raises(openai.BadRequestError, match="voices"):
        client.chat.completions.create(**{**kwargs, "audio": {"voice": "Zed", "format": "wav"}})


def test_speech_returns_wav(client):
    data = client.audio.speech.create(model="qwen3_omni", voice="Chelsie", input="Read this.", response_format="wav",
                                      extra_body={"max_tokens": 4, "temperature": 0, **SHORT}).content
    samples, rate = sf.read(io.BytesIO(data))
    assert rate == 24000 and samples.size > 0 and np.isfinite(samples).all()


@pytest.mark.parametrize("option,match", [({"speed": 1.5}, "speed"), ({"instructions": "whisper"}, "instructions")])
def test_speech_refuses_what_the_talker_cannot_do(client, option, match):
    with pytest.raises(openai.BadRequestError, match=match):
        client.audio.speech.create(model="qwen3_omni", voice="Chelsie", input="Read this.", response_format="wav",
                                   extra_body=SHORT, **option)


LOGPROBS = dict(model="qwen3_omni", messages=MESSAGES, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3)


def _streamed_logprobs(chunks) -> list:
    return [t for c in chunks for choice in c.choices if choice.logprobs and choice.logprobs.content
            for t in choice.logprobs.content]


def _same(content, want) -> None:
    """Each token's entry as `want`'s, its 3 alternatives best first, the greedy token the best of them."""
    assert [t.token for t in content] == [t.token for t in want] and len(want) == 5
    for got, ref in zip(content, want, strict=True):
        values = [a.logprob for a in got.top_logprobs]
        assert len(values) == 3 and values == sorted(values, reverse=True) and values[0] <= 0
        assert (got.top_logprobs[0].token, got.top_logprobs[0].logprob) == (got.token, got.logprob)
        assert math.isclose(got.logprob, ref.logprob, abs_tol=1e-4)


def test_chat_gives_the_text_tokens_logprobs_spoken_or_not_streamed_or_not(client):
    # the model refused logprobs: its thinker emitted none
    whole = client.chat.completions.create(**LOGPROBS)
    want = whole.choices[0].logprobs.content
    assert len(want) == whole.usage.completion_tokens == 5
    _same(want, want)
    _same(_streamed_logprobs(client.chat.completions.create(**LOGPROBS, stream=True)), want)
    spoken = dict(LOGPROBS, extra_body=SHORT, modalities=["text", "audio"], audio={"voice": "Ethan", "format": "wav"})
    answer = client.chat.completions.create(**spoken).choices[0]
    assert answer.message.audio.data
    _same(answer.logprobs.content, want)  # the transcript's tokens
    _same(_streamed_logprobs(client.chat.completions.create(**{**spoken, "audio": {"voice": "Ethan",
                                                                                 "format": "pcm16"}}, stream=True)), want)
    with pytest.raises(openai.BadRequestError, match="talker samples codec codes, not text"):
        client.chat.completions.create(**{**LOGPROBS, "extra_body": {"talker.logprobs": 1}})


def test_generate_sends_the_texts_logprobs_beside_its_audio(client):
    want = client.chat.completions.create(**LOGPROBS).choices[0].logprobs.content
    body = {"text": MESSAGES[0]["content"], "outputs": ["text", "audio", "logprobs"], "stream": False,
            "options": {"max_tokens": 5, "temperature": 0, "logprobs": 3, **SHORT}}
    resp = httpx.post(str(client.base_url).removesuffix("/v1/") + "/generate", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    outputs = resp.json()["outputs"]
    assert outputs["audio"]
    _same([openai.types.chat.ChatCompletionTokenLogprob.model_validate(c["content"][0]) for c in outputs["logprobs"]],
          want)
