"""`mstar serve wan22 --tiny` over HTTP: /generate streams a playable MP4 (NDJSON video chunk at the
requested fps); /v1/images/generations (real openai client) returns a PNG of a one-frame request;
/v1/videos jobs (real openai client) complete with progress 100 and a playable MP4."""

from __future__ import annotations

import base64
import io
import json

import httpx
import numpy as np
import pytest

from tests.e2e.server_thread import running_server

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the SDK flags its videos API
av = pytest.importorskip("av")


@pytest.fixture(scope="module")
def base():
    with running_server({"model": "wan22"}, runtime_kwargs={"tiny": True}) as url:
        yield url


def test_generate_streams_a_playable_mp4(base):
    body = {"text": "a cat bakes a cake", "outputs": ["video", "progress"], "stream": True, "seed": 3,
            "options": {"num_inference_steps": 3, "size": "96x64", "num_frames": 9, "fps": 12}}
    with httpx.stream("POST", f"{base}/generate", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        chunks = [json.loads(line) for line in resp.iter_lines() if line]
    kinds = [c["type"] for c in chunks]
    assert kinds[-1] == "final" and kinds.count("video") == 1, kinds
    video = next(c for c in chunks if c["type"] == "video")
    assert video["fps"] == 12 and video["frames"] == 9
    with av.open(io.BytesIO(base64.b64decode(video["data"]))) as container:
        stream = container.streams.video[0]
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(stream)]
        assert stream.codec_context.name == "h264" and float(stream.average_rate) == pytest.approx(12)
    assert len(frames) == 9 and frames[0].shape == (64, 96, 3)
    assert np.std(np.stack(frames).astype(np.float32)) > 1.0  # real content, not a blank clip


def test_images_generation_returns_a_png(base):
    from PIL import Image

    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
    resp = client.images.generate(model="wan22", prompt="a lighthouse at dusk", size="64x32",
                                  response_format="b64_json", extra_body={"num_inference_steps": 2, "seed": 1})
    data = base64.b64decode(resp.data[0].b64_json)
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    image = Image.open(io.BytesIO(data))
    assert image.size == (64, 32) and image.mode == "RGB"


def test_bad_size_is_a_400_naming_it(base):
    # `size` is snapped to the multiple (tests/unit/test_video_sizes.py); an explicit width is refused
    body = {"text": "x", "outputs": ["video"], "stream": False, "options": {"width": 100, "height": 64}}
    resp = httpx.post(f"{base}/generate", json=body, timeout=30)
    assert resp.status_code == 400 and "width=100 must be a multiple of 32" in resp.text


def test_the_qa_request_beyond_the_model_is_a_400_naming_the_field(base):
    """4096x4096, 1025 frames, 1000 steps would hold a worker for hours: each is refused before submitting."""
    body = {"prompt": "a kite", "size": "64x32", "num_frames": 5, "num_inference_steps": 1}
    for field, message in (({"size": "4096x4096"}, "more than the 901120"),
                           ({"num_frames": 1025}, "num_frames must be an integer in [1, 121], got 1025"),
                           ({"num_inference_steps": 1000}, "num_inference_steps must be an integer in [1, 200]")):
        resp = httpx.post(f"{base}/v1/videos/generations", json={**body, **field}, timeout=30)
        assert resp.status_code == 400 and message in resp.json()["error"]["message"], resp.text


def _png(width: int, height: int, seed: int) -> bytes:
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def test_videos_resource_with_the_openai_client(base):
    """Text-to-video and image-to-video jobs: create, poll (progress to 100), download a playable MP4."""
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
    extra = {"num_frames": 5, "num_inference_steps": 2, "seed": 4}  # fps: the model's default, 24

    def clip(**kwargs) -> bytes:
        job = client.videos.create(model="wan22", prompt="a kite over the sea", size="64x32", extra_body=extra,
                                   **kwargs)
        done = client.videos.poll(job.id, poll_interval_ms=20)
        assert done.status == "completed" and done.progress == 100, done.error
        assert client.videos.retrieve(job.id).size == "64x32"
        return client.videos.download_content(done.id).content

    mp4 = clip()
    with av.open(io.BytesIO(mp4)) as container:
        stream = container.streams.video[0]
        assert stream.codec_context.name == "h264" and float(stream.average_rate) == pytest.approx(24)
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    assert len(frames) == 5 and frames[0].shape == (32, 64, 3)
    assert clip() == mp4  # same seed, same clip
    assert clip(input_reference=("ref.png", _png(64, 32, 1), "image/png")) != mp4  # the image conditions it
