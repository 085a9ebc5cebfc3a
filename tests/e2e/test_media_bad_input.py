"""Bad input on the media routes: every class answers 4xx with OpenAI's error body, never 5xx, and
the server keeps answering. A toy server with a small media size limit, and a tiny text-only model
for the "this model cannot do that" answers."""

from __future__ import annotations

import io

import httpx
import numpy as np
import pytest
import soundfile as sf

from mstar.server.media import MediaPolicy, encode_image
from tests.e2e.server_thread import running_server

LIMIT = 20_000
PNG = encode_image(np.full((6, 10, 3), 50, np.uint8))
BIG = b"\x89PNG\r\n\x1a\n" + bytes(LIMIT + 100)
CORRUPT_PNG = PNG[:30]


def _wav() -> bytes:
    buf = io.BytesIO()
    sf.write(buf, np.zeros(800, np.float32), 8000, format="WAV")
    return buf.getvalue()


@pytest.fixture(scope="module")
def toy():
    with running_server({"model": "toy"}, media_policy=MediaPolicy(max_bytes=LIMIT)) as url:
        yield url


@pytest.fixture(scope="module")
def text_only():
    config = {"model": "smollm2", "device": "cpu", "kv_cache": {"max_num_pages": 16}}
    with running_server(config, runtime_kwargs={"tiny": True}) as url:
        yield url


def check(resp: httpx.Response, status: int, words: str = "") -> None:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert error["message"] and error["type"] and error["code"] == status
    assert words.lower() in error["message"].lower(), error["message"]


EDIT_CASES = [
    ({"json": {"prompt": "x"}}, 415, "multipart"),
    ({"data": {"prompt": "x"}, "files": {"mask": ("m.png", PNG, "image/png")}}, 400, "image"),
    ({"data": {"prompt": "x"}, "files": {"image": ("a.png", CORRUPT_PNG, "image/png")}}, 400, "decode image"),
    ({"data": {"prompt": "x"}, "files": {"image": ("a.png", BIG, "image/png")}}, 413, "limit"),
    ({"data": {"prompt": "x", "image": "/etc/passwd"}}, 400, ""),  # read as (bad) base64, never as a path
    ({"data": {"prompt": "x", "image": "/tmp/cat.png"}}, 400, "local file"),
    ({"data": {"prompt": "x", "image": "file:///etc/passwd"}}, 400, "file://"),
    ({"data": {"prompt": "x", "image": "http://example.com/a.png"}}, 403, "disabled"),
    ({"data": {"prompt": "x", "size": "big"}, "files": {"image": ("a.png", PNG, "image/png")}}, 400, "size"),
    ({"data": {"prompt": "x", "n": "0"}, "files": {"image": ("a.png", PNG, "image/png")}}, 400, "n"),
    ({"data": {"prompt": "x", "model": "dall-e-9"}, "files": {"image": ("a.png", PNG, "image/png")}}, 404, "dall-e-9"),
    ({"files": {"image": ("a.png", PNG, "image/png")}}, 400, "prompt"),
    ({"data": {"prompt": "x"}, "files": [("image[]", ("a.png", PNG, "image/png"))] * 17}, 400, "at most 16"),
    ({"data": {"prompt": "x"}, "files": {"image": ("a.png", PNG, "image/png"), "extra": ("b.png", PNG, "image/png")}},
     400, "'extra'"),
]


@pytest.mark.parametrize("kwargs,status,words", EDIT_CASES)
def test_bad_image_edits(toy, kwargs, status, words):
    check(httpx.post(f"{toy}/v1/images/edits", **kwargs), status, words)
    assert httpx.get(f"{toy}/health").status_code == 200


TRANSCRIPTION_CASES = [
    ({"data": {"model": "toy"}}, 400, "file"),
    ({"files": {"file": ("a.wav", b"RIFF\x00\x00\x00\x00WAVEjunk", "audio/wav")}}, 400, "audio"),
    ({"files": {"file": ("a.wav", BIG, "audio/wav")}}, 413, "limit"),
    ({"data": {"response_format": "docx"}, "files": {"file": ("a.wav", _wav(), "audio/wav")}}, 400, "response_format"),
    ({"data": {"timestamp_granularities[]": "word"}, "files": {"file": ("a.wav", _wav(), "audio/wav")}}, 400, "word"),
    ({"data": {"temperature": "hot"}, "files": {"file": ("a.wav", _wav(), "audio/wav")}}, 400, "temperature"),
    ({"data": {"file": "data:audio/wav;base64,@@@@"}}, 400, "base64"),
    ({"content": b"--x\r\nbroken", "headers": {"content-type": "multipart/form-data; boundary=x"}}, 400, ""),
    ({"files": {"audio": ("a.wav", _wav(), "audio/wav")}}, 400, "'audio'"),
]


@pytest.mark.parametrize("kwargs,status,words", TRANSCRIPTION_CASES)
def test_bad_transcriptions(toy, kwargs, status, words):
    check(httpx.post(f"{toy}/v1/audio/transcriptions", **kwargs), status, words)


VIDEO_CASES = [
    ({"json": {"prompt": "x", "size": "huge"}}, 400, "size"),
    ({"json": {"prompt": "x", "seconds": -1}}, 400, "seconds"),
    ({"json": {"seconds": 4}}, 400, "prompt"),
    ({"json": {"prompt": "x", "input_reference": "/etc/hosts.png"}}, 400, "local file"),
    ({"json": {"prompt": "x", "input_reference": "https://example.com/a.png"}}, 403, "disabled"),
    ({"json": {"prompt": "x", "input_reference": {"file_id": "file-1"}}}, 400, "file ids"),
    ({"data": {"prompt": "x"}, "files": {"input_reference": ("r.png", CORRUPT_PNG, "image/png")}}, 400, "decode"),
    ({"data": {"prompt": "x"}, "files": {"input_reference": ("r.png", BIG, "image/png")}}, 413, "limit"),
    ({"content": b"{not json", "headers": {"content-type": "application/json"}}, 400, "json"),
    ({"content": b"<video/>", "headers": {"content-type": "application/xml"}}, 415, "multipart"),
    ({"json": ["prompt"]}, 400, "object"),
    ({"data": {"prompt": "x"}, "files": {"image": ("r.png", PNG, "image/png")}}, 400, "'image'"),  # not dropped
]


@pytest.mark.parametrize("kwargs,status,words", VIDEO_CASES)
def test_bad_video_creates(toy, kwargs, status, words):
    check(httpx.post(f"{toy}/v1/videos", **kwargs), status, words)


def test_unknown_video_ids_and_bad_list_queries(toy):
    check(httpx.get(f"{toy}/v1/videos/video-nope"), 404, "no video job")
    check(httpx.get(f"{toy}/v1/videos/video-nope/content"), 404, "no video job")
    check(httpx.delete(f"{toy}/v1/videos/video-nope"), 404, "no video job")
    check(httpx.get(f"{toy}/v1/videos", params={"after": "video-nope"}), 404, "after")
    check(httpx.get(f"{toy}/v1/videos", params={"limit": 0}), 400, "limit")
    check(httpx.get(f"{toy}/v1/videos", params={"order": "sideways"}), 400, "order")


GENERATE_CASES = [
    ({"data": {"text": "x"}, "files": {"files": ("a.txt", b"hello", "text/plain")}}, 415, "text/plain"),
    ({"data": {"text": "x"}, "files": {"files": ("a.bin", b"\x00\x01", "application/octet-stream")}}, 415, "a.bin"),
    ({"data": {"text": "x"}, "files": {"files": ("a.png", CORRUPT_PNG, "image/png")}}, 400, "decode image"),
    ({"data": {"text": "x"}, "files": {"files": ("a.png", BIG, "image/png")}}, 413, "limit"),
    ({"data": {"text": "x"}, "files": {"files": ("a.png", b"", "image/png")}}, 400, "empty"),
    ({"data": {"text": "x"}, "files": {"goal": ("a.png", PNG, "image/png")}}, 400, "'goal'"),
    ({"data": {"text": "x", "options": "{max_tokens: 3"}}, 400, "options"),
    ({"data": {"text": "x", "options": "[1]"}}, 400, "options"),
    ({"data": {"text": "x", "outputs": "text,text"}}, 400, "distinct"),
    ({"data": {"seed": "7"}}, 400, "text"),
    ({"data": {"text": "x", "seed": "-1"}}, 400, "seed"),
    ({"data": {"text": "x", "options": '{"max_tokens": 0}'}}, 400, "max_tokens"),
    ({"content": b"x=1", "headers": {"content-type": "text/csv"}}, 415, "text/csv"),
]


@pytest.mark.parametrize("kwargs,status,words", GENERATE_CASES)
def test_bad_multipart_generate(toy, kwargs, status, words):
    check(httpx.post(f"{toy}/generate", **kwargs), status, words)


def test_bad_spoken_chat_format_is_400(toy):
    body = {"messages": [{"role": "user", "content": "x"}], "modalities": ["text", "audio"],
            "audio": {"format": "midi"}}
    check(httpx.post(f"{toy}/v1/chat/completions", json=body), 400, "format")


def test_text_only_model_refuses_media_routes(text_only):
    image = {"image": ("a.png", PNG, "image/png")}
    check(httpx.post(f"{text_only}/v1/images/edits", data={"prompt": "x"}, files=image), 404, "image output")
    check(httpx.post(f"{text_only}/v1/videos", json={"prompt": "x"}), 404, "video output")
    check(httpx.post(f"{text_only}/v1/audio/transcriptions", files={"file": ("a.wav", _wav(), "audio/wav")}),
          404, "no audio input")
    chat = {"messages": [{"role": "user", "content": "x"}], "modalities": ["text", "audio"]}
    check(httpx.post(f"{text_only}/v1/chat/completions", json=chat), 400, "not audio")
    check(httpx.post(f"{text_only}/generate", data={"text": "x"}, files={"files": ("a.png", PNG, "image/png")}),
          400, "text only")
    assert httpx.get(f"{text_only}/health").status_code == 200
