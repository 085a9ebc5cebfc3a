"""`mstar serve qwen3_omni --tiny` on CPU through the real openai client: text chat, a spoken chat
streaming text deltas and audio chunks together, and /v1/audio/speech as WAV."""

from __future__ import annotations

import base64
import io

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
