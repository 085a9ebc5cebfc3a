"""The media routes through the mstar SDK against a live toy server whose decoder sleeps a little
per step, so video jobs can be watched (progress) and cancelled (DELETE) while they run."""

from __future__ import annotations

import asyncio
import io
import time

import av
import httpx
import numpy as np
import pytest
import soundfile as sf

from mstar.client import AsyncMStarClient, MStarClient, MStarError
from mstar.server.media import encode_image
from mstar.server.protocol import FinalChunk, ImageChunk, TextChunk
from tests.e2e.server_thread import in_flight, running_server

NO_STOP = {"stop_early": False}


def png(value: int) -> bytes:
    return encode_image(np.full((6, 10, 3), value, np.uint8))


def wav(freq: float, amp: float = 0.5) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, (np.sin(np.arange(4000) * freq) * amp).astype(np.float32), 8000, format="WAV")
    return buf.getvalue()


@pytest.fixture(scope="module")
def base():
    with running_server({"model": "toy", "model_kwargs": {"step_delay_s": 0.02}}) as url:
        yield url


@pytest.fixture(scope="module")
def sdk(base):
    with MStarClient(base, timeout=30) as c:
        yield c


def test_generate_video_reports_progress_and_returns_mp4(sdk):
    seen: list[tuple[int, str]] = []
    mp4 = sdk.generate_video("a dog", size="16x8", poll_interval_s=0.02, max_tokens=30,
                             on_progress=lambda p, s: seen.append((p, s)), **NO_STOP)
    with av.open(io.BytesIO(mp4)) as container:
        assert container.streams.video[0].codec_context.name == "h264"
    progress = [p for p, _ in seen]
    assert progress == sorted(progress) and seen[-1] == (100, "completed")
    assert any(0 < p < 100 for p in progress), seen  # 30 steps of 20 ms: polls every 20 ms see it move


def test_delete_cancels_a_running_job(base, sdk):
    job = httpx.post(f"{base}/v1/videos", json={"prompt": "long", "max_tokens": 2000, **NO_STOP}).json()
    assert httpx.get(f"{base}/v1/videos/{job['id']}").json()["status"] in ("queued", "in_progress")
    resp = httpx.delete(f"{base}/v1/videos/{job['id']}")
    assert resp.json() == {"id": job["id"], "object": "video.deleted", "deleted": True}
    deadline = time.monotonic() + 10
    while in_flight(base) > 0:
        assert time.monotonic() < deadline, "the deleted job's request is still in flight"
        time.sleep(0.05)
    assert httpx.get(f"{base}/v1/videos/{job['id']}").status_code == 404


def test_content_of_an_unfinished_job_is_409(base):
    job = httpx.post(f"{base}/v1/videos", json={"prompt": "slow", "max_tokens": 2000, **NO_STOP}).json()
    try:
        resp = httpx.get(f"{base}/v1/videos/{job['id']}/content")
        assert resp.status_code == 409 and "poll" in resp.json()["error"]["message"]
    finally:
        httpx.delete(f"{base}/v1/videos/{job['id']}")


def test_edit_image_and_transcribe(sdk):
    img = sdk.edit_image("edit", [("a.png", png(10))], mask=("m.png", png(0)), as_bytes=False, max_tokens=5,
                         **NO_STOP)
    assert img.size == (5, 8)
    both = sdk.edit_image("edit", png(10), n=2, max_tokens=5, **NO_STOP)  # PNG bytes by default
    assert len(both) == 2 and both[0][:4] == b"\x89PNG"
    text = sdk.transcribe(("a.wav", wav(0.02, 0.9)), max_tokens=5)
    assert text == sdk.transcribe(wav(0.02, 0.9), max_tokens=5) and len(text) <= 5
    assert sdk.transcribe(wav(0.02, 0.9), response_format="srt", max_tokens=5).startswith("1\n00:00:00,000")
    assert sdk.transcribe(wav(0.02, 0.9), response_format="verbose_json", max_tokens=5)["text"] == text


def test_multipart_generate_matches_json_form(sdk):
    files = [("a.png", png(40)), ("a.wav", wav(0.05))]
    as_json = sdk.generate("look", files=files, outputs=["text", "image"], max_tokens=6, **NO_STOP)
    as_form = sdk.generate("look", files=files, outputs=["text", "image"], multipart=True, max_tokens=6, **NO_STOP)
    assert as_form.text == as_json.text and len(as_form.text) == 6
    assert as_form.usage == as_json.usage
    assert np.array_equal(np.asarray(as_form.images[0]), np.asarray(as_json.images[0]))
    chunks = list(sdk.generate("look", files=files, outputs=["text", "image"], multipart=True, stream=True,
                               max_tokens=6, **NO_STOP))
    assert "".join(c.delta for c in chunks if isinstance(c, TextChunk)) == as_json.text
    assert any(isinstance(c, ImageChunk) for c in chunks) and isinstance(chunks[-1], FinalChunk)
    assert sdk.generate("look", max_tokens=6, **NO_STOP).text != as_json.text  # the media changed the answer


def test_multipart_generate_media_only_and_progress_output(sdk):
    result = sdk.generate(files=[("a.wav", wav(0.05))], outputs=["text", "progress"], multipart=True,
                          max_tokens=4, **NO_STOP)
    progress = [float(c.to_numpy()[0]) for c in result.outputs["progress"]]
    assert len(result.text) == 4 and progress == pytest.approx([0.25, 0.5, 0.75, 1.0])


def test_spoken_chat_through_the_sdk(sdk):
    resp = sdk.chat("hello", modalities=["text", "audio"], audio={"format": "flac"}, max_tokens=4, **NO_STOP)
    audio = resp.choices[0].message.audio
    samples, rate = sf.read(io.BytesIO(__import__("base64").b64decode(audio.data)))
    assert rate == 8000 and samples.size > 0 and len(audio.transcript) == 4
    pieces = [c.choices[0].delta.audio for c in sdk.chat("hello", stream=True, modalities=["text", "audio"],
                                                         max_tokens=4, **NO_STOP) if c.choices]
    assert "".join(p.transcript or "" for p in pieces if p) == audio.transcript


def test_async_client_media_calls(base):
    async def run():
        async with AsyncMStarClient(base, timeout=30) as client:
            mp4 = await client.generate_video("a bird", poll_interval_s=0.02, max_tokens=4)
            text = await client.transcribe(wav(0.02, 0.9), max_tokens=5)
            img = await client.edit_image("edit", png(10), as_bytes=False, max_tokens=3, **NO_STOP)
            return mp4, text, img

    mp4, text, img = asyncio.run(run())
    assert mp4[4:8] == b"ftyp" and text and img.size == (3, 8)


def test_sdk_raises_for_a_failed_upload(sdk):
    with pytest.raises(MStarError) as info:
        sdk.transcribe(("a.wav", b"RIFF\x00\x00\x00\x00WAVEjunk"))
    assert info.value.status == 400
