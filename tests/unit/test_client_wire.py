"""SDK helpers without a server: media parts, stream parsing, error bodies, result collection."""

import base64

import numpy as np
import pytest

from mstar.client import AudioBuffer, MStarError, collect, wire
from mstar.client.errors import error_from_body
from mstar.server.media import encode_audio, encode_image, encode_video
from mstar.server.protocol import FinalChunk, TextChunk


def test_media_parts_from_paths_bytes_and_urls(tmp_path):
    png = encode_image(np.zeros((2, 2, 3), np.uint8))
    noext = tmp_path / "blob"
    noext.write_bytes(encode_audio(np.zeros(10, np.float32), 8000, "wav"))
    assert wire.media_part(png)["type"] == "image"
    assert wire.media_part(png)["data"].startswith("data:image/png;base64,")
    assert wire.media_part(noext)["type"] == "audio"  # sniffed: no extension
    assert wire.media_part(("x.mp3", b"??"))["type"] == "audio"
    assert wire.media_part(encode_video(np.zeros((1, 2, 2, 3), np.uint8), 1))["type"] == "video"
    assert wire.media_part("https://h/a.flac?sig=1") == {"type": "audio", "data": "https://h/a.flac?sig=1"}
    assert wire.media_part("data:video/mp4;base64,AA")["type"] == "video"
    with pytest.raises(MStarError, match="file not found"):
        wire.media_part(tmp_path / "missing.png")
    with pytest.raises(MStarError, match="cannot tell"):
        wire.media_part(b"plain text bytes")


def test_sse_parsing():
    assert wire.sse_event(": keep-alive") is None
    assert wire.sse_event("data: [DONE]") is wire.DONE
    assert wire.sse_event('data: {"a": 1}') == {"a": 1}
    with pytest.raises(MStarError) as info:
        wire.sse_event('data: {"error": {"message": "boom", "code": 429}}')
    assert (info.value.status, info.value.message) == (429, "boom")


def test_error_bodies_of_every_shape():
    assert error_from_body(400, b'{"error": {"message": "bad n", "type": "x"}}').message == "bad n"
    assert error_from_body(422, b'{"detail": "nope"}').message == "nope"
    assert error_from_body(502, b"Bad Gateway").message == "Bad Gateway"
    assert error_from_body(500, b"").message == "HTTP 500"


def test_collect_checks_sequence_and_final():
    final = FinalChunk(finish_reason="stop")
    ok = collect([TextChunk(output="t", seq=1, delta="b"), TextChunk(output="t", seq=0, delta="a"), final])
    assert ok.text == "ab"
    with pytest.raises(MStarError, match="missing or repeated"):
        collect([TextChunk(output="t", seq=1, delta="b"), final])
    with pytest.raises(MStarError, match="without a final chunk"):
        collect([TextChunk(output="t", seq=0, delta="a")])


def test_audio_buffer_wav_roundtrip_and_pcm():
    samples = np.linspace(-0.5, 0.5, 300, dtype=np.float32).reshape(150, 2)
    buf = AudioBuffer(samples, 22050)
    back = AudioBuffer.from_file_bytes(buf.wav_bytes())
    assert back.sample_rate == 22050 and back.channels == 2
    np.testing.assert_allclose(back.samples, samples, atol=1e-4)
    pcm = base64.b64decode(base64.b64encode(encode_audio(samples, 22050, "pcm")))
    np.testing.assert_allclose(AudioBuffer.from_pcm16(pcm, 22050, 2).samples, samples, atol=1e-4)
    with pytest.raises(ValueError, match="sample rates"):
        AudioBuffer.concat([buf, AudioBuffer(samples, 16000)])


@pytest.mark.parametrize("messages", [5, None, ["hi"]])
def test_chat_messages_of_the_wrong_shape_are_a_type_error_naming_the_shapes(messages):
    """They were "'int' object is not iterable" or "'str' object has no attribute 'model_dump'"."""
    from mstar.client.wire import chat_messages

    with pytest.raises(TypeError, match="messages is a prompt string or a list of message dicts"):
        chat_messages(messages)
