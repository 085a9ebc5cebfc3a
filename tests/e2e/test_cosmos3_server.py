"""`mstar serve cosmos3 --tiny` and `mstar serve cosmos3_droid --tiny` over HTTP: /v1/images/generations
(real openai client and the SDK) returns a PNG, /v1/videos jobs a playable MP4 with stereo sound, chat
answers through the reasoner, and the policy's /generate
an action chunk (typed NDJSON chunk as JSON numbers or raw float32, SDK predict_actions), the same for the same
seed."""

from __future__ import annotations

import base64
import io
import json

import httpx
import numpy as np
import pytest

from mstar.client import MStarClient, wire
from tests.e2e.server_thread import running_server

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the SDK flags its videos API
av = pytest.importorskip("av")

FRAMES = np.random.default_rng(0).integers(0, 256, (3, 48, 64, 3), dtype=np.uint8)  # a small camera clip


@pytest.fixture(scope="module")
def base():
    with running_server({"model": "cosmos3"}, runtime_kwargs={"tiny": True}) as url:
        yield url


@pytest.fixture(scope="module")
def droid():
    with running_server({"model": "cosmos3_droid"}, runtime_kwargs={"tiny": True}) as url:
        yield url


def test_images_generation_returns_a_png(base):
    from PIL import Image

    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
    resp = client.images.generate(model="cosmos3", prompt="a lighthouse at dusk", size="64x32",
                                  response_format="b64_json", extra_body={"num_inference_steps": 2, "seed": 1})
    data = base64.b64decode(resp.data[0].b64_json)
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    image = Image.open(io.BytesIO(data))
    assert image.size == (64, 32) and image.mode == "RGB"
    sdk = MStarClient(base, model="cosmos3").generate_image("a lighthouse at dusk", size="64x32", seed=1,
                                                            as_bytes=True, num_inference_steps=2)
    assert sdk == data  # same seed, same picture, whichever client asked


def test_videos_resource_with_the_openai_client_and_the_sdk(base):
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
    extra = {"num_frames": 5, "num_inference_steps": 2, "seed": 4}
    job = client.videos.create(model="cosmos3", prompt="a kite over the sea", size="64x32", extra_body=extra)
    done = client.videos.poll(job.id, poll_interval_ms=20)
    assert done.status == "completed" and done.progress == 100, done.error
    mp4 = client.videos.download_content(done.id).content
    with av.open(io.BytesIO(mp4)) as container:
        stream, sound = container.streams.video[0], container.streams.audio[0]
        assert stream.codec_context.name == "h264" and float(stream.average_rate) == pytest.approx(24)
        assert sound.codec_context.name == "aac" and sound.rate == 8000 and sound.channels == 2  # stereo sound muxed
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    assert len(frames) == 5 and frames[0].shape == (32, 64, 3)
    assert np.std(np.stack(frames).astype(np.float32)) > 1.0  # real content, not a blank clip
    sdk = MStarClient(base, model="cosmos3").generate_video("a kite over the sea", size="64x32", **extra)
    assert sdk == mp4


def test_synchronous_video_route_answers_the_mp4(base):
    """POST /v1/videos/generations: the same body as /v1/videos, the MP4 in the answer; the same clip as a job."""
    body = {"prompt": "a kite over the sea", "size": "64x32", "num_frames": 5, "num_inference_steps": 2, "seed": 4}
    resp = httpx.post(f"{base}/v1/videos/generations", json=body, timeout=60)
    assert resp.status_code == 200 and resp.headers["content-type"] == "video/mp4"
    assert resp.content == MStarClient(base, model="cosmos3").generate_video("a kite over the sea", size="64x32",
                                                                             num_frames=5, num_inference_steps=2, seed=4)
    bad = httpx.post(f"{base}/v1/videos/generations", json={**body, "size": "100x64"}, timeout=30)
    assert bad.status_code == 400 and "width=100 must be a multiple of 16" in bad.text


def test_a_clip_longer_than_the_model_makes_is_a_400_not_a_stalled_server(base):
    """5 frames at 0.001 fps are 5,000 s: their sound track alone would keep the worker busy for hours."""
    body = {"prompt": "a kite", "size": "64x32", "num_frames": 5, "num_inference_steps": 1, "fps": 0.001}
    resp = httpx.post(f"{base}/v1/videos/generations", json=body, timeout=30)
    assert resp.status_code == 400 and "fps" in resp.json()["error"]["message"], resp.text
    ok = httpx.post(f"{base}/v1/videos/generations", json={**body, "fps": 12}, timeout=30)
    assert ok.status_code == 200 and ok.headers["content-type"] == "video/mp4"


@pytest.mark.parametrize(("field", "message"), [
    ({"size": "4096x4096"}, "size=4096x4096 has 16777216 pixels per frame, more than the 921600"),
    ({"num_frames": 1025}, "num_frames must be an integer in [1, 189], got 1025"),
    ({"num_inference_steps": 1000}, "num_inference_steps must be an integer in [1, 200], got 1000"),
])
def test_the_qa_request_beyond_the_model_is_a_400_naming_the_field(base, field, message):
    """Schema-valid but hours of work (the QA pass's 4096x4096, 1025 frames, 1000 steps): refused before submitting."""
    body = {"prompt": "a kite", "size": "64x32", "num_frames": 5, "num_inference_steps": 1, **field}
    resp = httpx.post(f"{base}/v1/videos/generations", json=body, timeout=30)
    assert resp.status_code == 400 and message in resp.json()["error"]["message"], resp.text


def test_policy_answers_typed_action_chunks(droid):
    """NDJSON: one `action` chunk of shape [chunk_size, 10] (DROID), values as JSON numbers; the SDK's
    predict_actions, which asks for raw float32 bytes, gives the same values exactly."""
    client = MStarClient(droid)
    chunks = list(client.generate("pick up the red cube", files=wire.frame_parts(FRAMES), outputs=["actions"], stream=True, seed=5,
                                  modalities=["actions"], chunk_size=8, num_inference_steps=2, encoding="json"))
    actions = [c for c in chunks if c.type == "action"]
    assert chunks[-1].type == "final" and len(actions) == 1
    assert actions[0].shape == [8, 10] and actions[0].dtype == "float32" and actions[0].data is None
    assert all(isinstance(v, float) for v in actions[0].values)
    chunk = actions[0].to_numpy()
    assert np.isfinite(chunk).all() and chunk.std() > 0.01
    again = client.predict_actions(FRAMES, "pick up the red cube", seed=5, chunk_size=8, num_inference_steps=2)
    assert again.dtype == np.float32
    np.testing.assert_array_equal(again, chunk)
    raw = client.generate("pick up the red cube", files=wire.frame_parts(FRAMES), outputs=["actions"], seed=5,
                          modalities=["actions"], chunk_size=8, num_inference_steps=2).outputs["actions"][0]
    assert raw.values is None and len(base64.b64decode(raw.data)) == 8 * 10 * 4
    np.testing.assert_array_equal(np.frombuffer(base64.b64decode(raw.data), "<f4").reshape(8, 10), chunk)
    other = client.predict_actions(FRAMES, "open the drawer", seed=5, chunk_size=8, num_inference_steps=2)
    assert np.abs(other - chunk).max() > 1e-3  # the task conditions the actions


def test_policy_with_the_predicted_video(droid):
    actions, mp4 = MStarClient(droid).predict_actions(FRAMES[:1], "push the block left", with_video=True, seed=2,
                                                      chunk_size=4, num_inference_steps=2)
    assert actions.shape == (4, 10)
    with av.open(io.BytesIO(mp4)) as container:
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    assert len(frames) == 5 and frames[0].shape == (48, 64, 3)  # chunk_size + 1 frames of the camera's size


def test_policy_errors_are_400s_naming_the_option(droid):
    body = {"text": "x", "outputs": ["actions"], "stream": False, "options": {"embodiment": "spaceship"}}
    resp = httpx.post(f"{droid}/generate", json=body, timeout=30)
    assert resp.status_code == 400 and "embodiment 'spaceship' is not supported" in resp.text
    resp = httpx.post(f"{droid}/generate", json={**body, "options": {}}, timeout=30)
    assert resp.status_code == 400 and "needs the camera video" in json.dumps(resp.json())


def test_chat_goes_to_the_reasoner(base):
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
    answer = client.chat.completions.create(model="cosmos3", messages=[{"role": "user", "content": "What is here?"}],
                                            max_tokens=6, temperature=0)
    again = client.chat.completions.create(model="cosmos3", messages=[{"role": "user", "content": "What is here?"}],
                                           max_tokens=6, temperature=0)
    assert answer.choices[0].message.content and answer.choices[0].message.content == again.choices[0].message.content
    assert answer.usage.completion_tokens == 6 and answer.choices[0].finish_reason == "length"
