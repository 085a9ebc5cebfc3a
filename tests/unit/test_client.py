"""The SDK against a fake server over real HTTP: results, streams, and errors that must raise."""

import asyncio
import io

import numpy as np
import pytest

from mstar.client import AsyncMStarClient, AudioBuffer, MStarClient, MStarError, collect
from mstar.server.media import encode_image
from mstar.server.protocol import AudioChunk, FinalChunk, ImageChunk, TextChunk
from tests.unit.fake_mstar_server import API_KEY, RATE, FakeServer


@pytest.fixture(scope="module")
def server():
    srv = FakeServer().start()
    yield srv
    srv.stop()


@pytest.fixture
def client(server):
    with MStarClient(server.url, api_key=API_KEY, timeout=20) as c:
        yield c


def test_generate_stream_yields_typed_chunks_in_order(client, tmp_path):
    png = tmp_path / "cat.png"
    png.write_bytes(encode_image(np.zeros((4, 4, 3), np.uint8)))
    chunks = list(client.generate(text="hello there", files=[png], outputs=["text", "audio", "image"], stream=True))
    assert isinstance(chunks[-1], FinalChunk) and chunks[-1].usage.total_tokens == 5
    text = [c for c in chunks if isinstance(c, TextChunk)]
    assert "".join(c.delta for c in text) == "".join(c.text for c in text) == "[image] hello there "
    assert [c.seq for c in text] == [0, 1, 2]
    assert [type(c) for c in chunks if not isinstance(c, TextChunk)] == [AudioChunk, AudioChunk, ImageChunk, FinalChunk]
    result = collect(chunks)
    assert result.audio.sample_rate == RATE and result.audio.samples.shape == (2 * RATE // 10, 1)
    assert result.images[0].size == (12, 8)


def test_generate_non_stream_and_media_kinds(client):
    wav = AudioBuffer(np.zeros((100, 1), np.float32), 8000).wav_bytes()
    result = client.generate(text="one two", files=[wav, ("clip.mp4", b"\x00" * 8)], request_id="r-7")
    assert result.text == "[audio,video] one two " and result.request_id == "r-7"
    assert result.finish_reason == "stop" and result.usage.prompt_tokens == 2


def test_in_band_error_raises_never_returns_text(client):
    stream = client.generate(text="please fail-late now", stream=True)
    seen = []
    with pytest.raises(MStarError) as info:
        for chunk in stream:
            seen.append(chunk)
    assert info.value.status == 500 and "worker 1 died" in info.value.message
    assert all(isinstance(c, TextChunk) and "died" not in c.delta for c in seen)
    with pytest.raises(MStarError) as info:
        client.generate(text="fail-late")
    assert info.value.status == 500 and "died" in info.value.message


def test_http_errors_carry_the_server_message(client, server):
    with pytest.raises(MStarError) as info:
        list(client.generate(text="fail-early", stream=True))
    assert (info.value.status, info.value.message) == (503, "no worker is ready")
    with pytest.raises(MStarError) as info:
        client.chat("hi", max_tokens=0)
    assert info.value.status == 400 and "max_tokens" in info.value.message
    with MStarClient(server.url) as anonymous, pytest.raises(MStarError) as info:
        anonymous.chat("hi")
    assert info.value.status == 401 and "API key" in info.value.message
    with pytest.raises(MStarError) as info:
        client.generate(text="x", outputs=[])
    assert info.value.status == 400 and "outputs" in info.value.message


def test_unreachable_server_raises_status_0():
    with MStarClient("http://127.0.0.1:9", timeout=2) as c, pytest.raises(MStarError) as info:
        c.chat("hi")
    assert info.value.status == 0
    assert MStarClient("http://127.0.0.1:9", timeout=2).health() is False


def test_chat_plain_and_streamed(client):
    assert client.health()
    done = client.chat([{"role": "user", "content": "hi you"}], temperature=0.1)
    assert done.text == "echo: hi you" and done.usage.total_tokens == 5
    chunks = list(client.chat("hi you", stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices).strip() == "echo: hi you"
    assert "".join(c.text for c in chunks) == "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].usage.total_tokens == 5 and not chunks[-1].choices
    with pytest.raises(MStarError) as info:
        list(client.chat("fail-late", stream=True))
    assert info.value.status == 500 and "decode step failed" in info.value.message


def test_tts_buffer_and_stream(client, tmp_path):
    audio = client.tts("hello", voice="tara")
    assert audio.sample_rate == RATE and audio.to_numpy().shape == (RATE // 4,)
    path = audio.to_wav(tmp_path / "out.wav")
    assert AudioBuffer.from_file_bytes(path.read_bytes()).samples.shape == (RATE // 4, 1)
    pieces = list(client.tts("hello", stream=True))
    joined = AudioBuffer.concat(pieces)
    assert len(pieces) == 4 and joined.samples.shape[0] == RATE // 4
    np.testing.assert_allclose(joined.to_numpy(), audio.to_numpy(), atol=1e-4)
    with pytest.raises(MStarError, match="vocoder crashed"):
        list(client.tts("fail-late", stream=True))
    assert client.tts("x", response_format="flac").samples.shape == (RATE // 4, 1)


def test_images_and_videos(client, server):
    img = client.generate_image("a cat", size="24x10", as_bytes=False)
    assert img.size == (24, 10)
    raw = client.generate_image("a cat", n=2)  # PNG bytes by default
    assert len(raw) == 2 and raw[0].startswith(b"\x89PNG")
    assert client.generate_image("a cat", size="24x10").startswith(b"\x89PNG")
    mp4 = client.generate_video("waves", size="16x16", poll_interval_s=0.01, input_reference=raw[0])
    from mstar.server.media import decode_video

    assert decode_video(io.BytesIO(mp4).getvalue()).frames.shape[0] == 5
    assert any((e["ref"] or "").startswith("data:image/png;base64,") for e in server.app.state.jobs.values())
    with pytest.raises(MStarError, match="denoiser diverged"):
        client.generate_video("fail-late", poll_interval_s=0.01)


def test_async_client(server):
    async def scenario():
        async with AsyncMStarClient(server.url, api_key=API_KEY, timeout=20) as c:
            assert await c.health()
            result = await c.generate(text="a b c")
            chunks = [ch async for ch in await c.generate(text="a b", outputs=["text", "audio"], stream=True)]
            chat = await c.chat("yo")
            audio = await c.tts("hi")
            with pytest.raises(MStarError) as info:
                async for _ in await c.generate(text="fail-late", stream=True):
                    pass
            return result, chunks, chat, audio, info.value

    result, chunks, chat, audio, err = asyncio.run(scenario())
    assert result.text == "[] a b c "
    assert isinstance(chunks[-1], FinalChunk) and collect(chunks).audio.sample_rate == RATE
    assert chat.text == "echo: yo" and audio.samples.shape == (RATE // 4, 1)
    assert err.status == 500


def test_a_server_that_does_not_answer_in_time_is_a_timeout_not_unreachable():
    """A request the server took but did not answer within the client's timeout says so; it said
    'cannot reach' (as for a server that is down)."""
    import socket

    with socket.socket() as listener:  # accepts connections (the kernel's backlog) and never answers
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        with MStarClient(url, timeout=0.3) as c:
            for call in (lambda: c.chat("hi"), lambda: list(c.chat("hi", stream=True))):
                with pytest.raises(MStarError, match=r"no answer .* within 0.3 s") as info:
                    call()
                assert info.value.status == 0

        async def run_async():
            async with AsyncMStarClient(url, timeout=0.3) as c:
                with pytest.raises(MStarError, match=r"no answer .* within 0.3 s"):
                    await c.chat("hi")
                with pytest.raises(MStarError, match=r"no answer .* within 0.3 s"):
                    async for _ in await c.chat("hi", stream=True):
                        pass
        asyncio.run(run_async())
