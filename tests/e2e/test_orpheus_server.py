"""`mstar serve orpheus --tiny` over HTTP: /v1/audio/speech in every container, streaming, the SDK's tts()."""

from __future__ import annotations

import io
import time

import numpy as np
import pytest
import soundfile as sf

from mstar import MStarClient
from mstar.server.protocol import AudioChunk, FinalChunk
from tests.e2e.server_thread import running_server

openai = pytest.importorskip("openai")

RATE = 24000
TOKENS = 70  # 10 frames of 2048 samples (the tiny LM speaks only audio tokens, never end-of-speech)
SAMPLES = TOKENS // 7 * 2048


@pytest.fixture(scope="module")
def base():
    config = {"model": "orpheus", "device": "cpu", "kv_cache": {"max_num_pages": 256, "page_size": 16}}
    with running_server(config, tiny=True) as url:
        yield url


@pytest.fixture(scope="module")
def client(base):
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)


def _speech(client, fmt: str) -> bytes:
    return client.audio.speech.create(model="orpheus", voice="tara", input="Hello there.", response_format=fmt,
                                      extra_body={"max_tokens": TOKENS, "seed": 1}).content


@pytest.mark.parametrize("fmt", ["wav", "flac"])
def test_lossless_formats_hold_every_sample(client, fmt):
    samples, rate = sf.read(io.BytesIO(_speech(client, fmt)), dtype="float32")
    assert rate == RATE and samples.shape == (SAMPLES,) and np.abs(samples).max() > 0.01


@pytest.mark.parametrize("fmt", ["mp3", "opus"])
def test_lossy_formats_decode_to_the_same_duration(client, fmt):
    import av

    with av.open(io.BytesIO(_speech(client, fmt))) as container:
        stream = container.streams.audio[0]
        frames = [f.to_ndarray() for f in container.decode(stream)]
        rate = stream.rate
    decoded = np.concatenate([f.reshape(-1) for f in frames])
    assert container.format.name.split(",")[0] == {"mp3": "mp3", "opus": "ogg"}[fmt]
    # encoders add a priming delay and pad to their frame size: allow one codec frame either way
    assert abs(decoded.size / rate - SAMPLES / RATE) < 0.07, (decoded.size, rate)


def test_unknown_voice_is_a_400_naming_the_voices(client):
    with pytest.raises(openai.BadRequestError, match="tara, leah"):
        client.audio.speech.create(model="orpheus", voice="bob", input="hi", response_format="wav")


def test_streaming_delivers_audio_before_the_request_ends(base):
    """SSE pcm chunks: the first arrives long before the last (the LM makes 700 tokens after it starts)."""
    sdk = MStarClient(base, model="orpheus")
    start = time.monotonic()
    arrivals, pieces = [], []
    for piece in sdk.tts("A long sentence to speak.", voice="mia", stream=True, max_tokens=700, seed=2):
        arrivals.append(time.monotonic() - start)
        pieces.append(piece.to_numpy())
    total = time.monotonic() - start
    assert sum(p.size for p in pieces) == 700 // 7 * 2048 and len(pieces) > 20
    # 28 of 700 tokens make the first window: its audio should come in the first half of the request
    assert arrivals[0] < 0.5 * total, (arrivals[0], total)


def test_sdk_tts_whole_wav(base, tmp_path):
    audio = MStarClient(base, model="orpheus").tts("Hi from the SDK.", voice="leo", max_tokens=TOKENS, seed=3)
    assert audio.sample_rate == RATE and audio.samples.shape[0] == SAMPLES
    audio.to_wav(tmp_path / "hi.wav")
    samples, rate = sf.read(tmp_path / "hi.wav", dtype="float32")
    assert rate == RATE and samples.shape[0] == SAMPLES


def test_generate_usage_counts_the_audio_tokens_the_lm_sampled(base):
    """/generate's usage: completion_tokens are the LM's sampled tokens (audio codes), streamed or not."""
    sdk = MStarClient(base, model="orpheus")
    chunks = list(sdk.generate("Hello there.", outputs=["audio"], stream=True, max_tokens=TOKENS, seed=4))
    final = chunks[-1]
    assert isinstance(final, FinalChunk) and final.finish_reason == "length"
    assert sum(c.to_numpy().size for c in chunks if isinstance(c, AudioChunk)) == SAMPLES
    assert final.usage.completion_tokens == TOKENS and final.usage.prompt_tokens > 0
    whole = sdk.generate("Hello there.", outputs=["audio"], max_tokens=TOKENS // 2, seed=4)
    assert whole.usage.completion_tokens == TOKENS // 2
