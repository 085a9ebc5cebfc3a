"""`mstar serve qwen3_omni --tiny` on CPU through the real openai client with media in: a chat with an
image_url (data URL) and an input_audio part, a video_url whose sound is heard (use_audio_in_video), and a
transcription (audio in, text out)."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import soundfile as sf
from PIL import Image

from mstar.models.qwen3_omni.encoder_components import BatchedAudioEncoder, BatchedVisionEncoder
from tests.e2e.server_thread import running_server

openai = pytest.importorskip("openai")


def _png_data_url() -> str:
    y, x = np.mgrid[0:48, 0:64]
    rgb = np.stack([x * 4, y * 5, (x + y) * 2], axis=-1).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _wav_base64(seconds: float = 1.2, rate: int = 22050) -> str:
    t = np.arange(int(seconds * rate)) / rate
    buf = io.BytesIO()
    sf.write(buf, (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32), rate, format="WAV")
    return base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def client(one_thread):
    config = {"model": "qwen3_omni", "device": "cpu"}
    with running_server(config, runtime_kwargs={"tiny": True}) as base:
        yield openai.OpenAI(base_url=f"{base}/v1", api_key="none", timeout=60)


@pytest.fixture
def encoder_calls(monkeypatch):
    calls = []
    for cls in (BatchedAudioEncoder, BatchedVisionEncoder):
        original = cls.run_batch

        def run_batch(self, walk, node, inputs, options, _original=original):
            calls.append((node, sum(("audio_features" in x) or ("pixel_values" in x) for x in inputs)))
            return _original(self, walk, node, inputs, options)

        monkeypatch.setattr(cls, "run_batch", run_batch)
    return calls


def test_chat_with_image_and_audio_answers_text(client, encoder_calls):
    content = [{"type": "image_url", "image_url": {"url": _png_data_url()}},
               {"type": "input_audio", "input_audio": {"data": _wav_base64(), "format": "wav"}},
               {"type": "text", "text": "What do you see and hear?"}]
    resp = client.chat.completions.create(model="qwen3_omni", messages=[{"role": "user", "content": content}],
                                          max_tokens=5, temperature=0)
    assert resp.choices[0].message.content and resp.usage.completion_tokens == 5
    assert ("audio_encoder", 1) in encoder_calls and ("vision_encoder", 1) in encoder_calls
    # the expanded placeholders count as prompt tokens: far more than the text alone
    text_only = client.chat.completions.create(
        model="qwen3_omni", messages=[{"role": "user", "content": "What do you see and hear?"}], max_tokens=1)
    assert resp.usage.prompt_tokens > text_only.usage.prompt_tokens + 20


def _mp4_with_sound_data_url() -> str:
    from mstar.server.media import DecodedAudio, encode_video

    frames = np.stack([np.full((32, 32, 3), 30 * k, np.uint8) for k in range(8)])
    t = np.arange(16000 * 2) / 16000
    sound = DecodedAudio((0.3 * np.sin(2 * np.pi * 330 * t)).astype(np.float32)[:, None], 16000)
    return "data:video/mp4;base64," + base64.b64encode(encode_video(frames, 4.0, audio=sound)).decode()


def test_a_video_url_is_heard_with_its_sound_unless_switched_off(client, encoder_calls):
    content = [{"type": "video_url", "video_url": {"url": _mp4_with_sound_data_url()}},
               {"type": "text", "text": "What happens?"}]
    messages = [{"role": "user", "content": content}]
    heard = client.chat.completions.create(model="qwen3_omni", messages=messages, max_tokens=4, temperature=0,
                                           modalities=["text", "audio"], audio={"voice": "Ethan", "format": "wav"},
                                           extra_body={"talker.max_tokens": 4, "talker.temperature": 0})
    assert heard.choices[0].message.audio.data and encoder_calls == [("audio_encoder", 1), ("vision_encoder", 1)]
    encoder_calls.clear()
    seen = client.chat.completions.create(model="qwen3_omni", messages=messages, max_tokens=4, temperature=0,
                                          extra_body={"use_audio_in_video": False})
    assert encoder_calls == [("audio_encoder", 0), ("vision_encoder", 1)]
    assert heard.usage.prompt_tokens > seen.usage.prompt_tokens + 20  # the track's rows and its two markers


def test_transcription_takes_the_audio(client, encoder_calls):
    audio = base64.b64decode(_wav_base64())
    result = client.audio.transcriptions.create(model="qwen3_omni", file=("a.wav", audio, "audio/wav"),
                                                extra_body={"max_tokens": 3, "temperature": 0})
    assert isinstance(result.text, str) and encoder_calls == [("audio_encoder", 1), ("vision_encoder", 0)]
