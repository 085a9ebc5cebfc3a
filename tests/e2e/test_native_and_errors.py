"""/generate through the mstar SDK, and bad input answered 4xx with a message (never 5xx)."""

from __future__ import annotations

import httpx
import pytest

from mstar.client import MStarClient
from mstar.client.errors import MStarError
from mstar.server.protocol import AudioChunk, FinalChunk, ImageChunk, TextChunk
from tests.e2e.server_thread import running_server


@pytest.fixture(scope="module")
def base():
    with running_server({"model": "toy"}, max_body_bytes=200_000) as url:
        yield url


@pytest.fixture(scope="module")
def sdk(base):
    with MStarClient(base) as c:
        yield c


def test_generate_stream_has_typed_chunks_seq_and_final(sdk):
    chunks = list(sdk.generate("hello", outputs=["text", "audio", "image"], stream=True, max_tokens=6,
                               stop_early=False))
    final = chunks[-1]
    assert isinstance(final, FinalChunk) and final.finish_reason == "length" and final.usage.completion_tokens == 6
    for kind, name in ((TextChunk, "text"), (AudioChunk, "audio"), (ImageChunk, "image")):
        seqs = [c.seq for c in chunks if isinstance(c, kind)]
        assert seqs == list(range(len(seqs))) and seqs, name
    assert not any(c.output == "video" for c in chunks[:-1])  # not asked for
    audio = [c for c in chunks if isinstance(c, AudioChunk)]
    assert audio[0].sample_rate == 8000 and audio[0].to_numpy().shape[1] == 1


def test_generate_non_stream_matches_stream(sdk):
    streamed = "".join(c.delta for c in sdk.generate("same", stream=True, max_tokens=5) if isinstance(c, TextChunk))
    result = sdk.generate("same", max_tokens=5)
    assert result.text == streamed and result.finish_reason in ("stop", "length")


@pytest.mark.parametrize("body", [
    b"{not json",
    b'{"messages": "hi"}',
    b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": -3}',
    b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 99999999999}',
    b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": "ten"}',
    b'{"messages": [{"role": "user", "content": "x"}], "model": "gpt-17"}',
    b'{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "/etc/passwd"}}]}]}',
    b'{"messages": [{"role": "user", "content": ""}]}',
])
def test_bad_chat_input_is_4xx_with_message(base, body):
    resp = httpx.post(f"{base}/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert 400 <= resp.status_code < 500, resp.text
    assert resp.json()["error"]["message"]
    assert httpx.get(f"{base}/health").status_code == 200


def test_local_path_as_generate_media_is_refused(base):
    resp = httpx.post(f"{base}/generate", json={"text": "x", "media": [{"type": "image", "data": "file:///etc/passwd"}]})
    assert resp.status_code == 400 and "file" in resp.json()["error"]["message"].lower()


@pytest.mark.parametrize("stream", [False, True])
def test_generate_output_the_model_lacks_is_400_naming_its_outputs(base, stream):
    resp = httpx.post(f"{base}/generate", json={"text": "x", "outputs": ["text", "smell"], "stream": stream,
                                               "options": {"max_tokens": 2}}, timeout=10)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == "outputs" and "'smell'" in error["message"] and "progress" in error["message"]
    resp = httpx.post(f"{base}/generate", json={"text": "x", "stream": stream, "options": {"modalities": ["smell"]}},
                      timeout=10)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "modalities", resp.text
    ok = httpx.post(f"{base}/generate", json={"text": "x", "outputs": ["text", "progress"], "stream": False,
                                             "options": {"max_tokens": 2}}, timeout=10)
    assert ok.status_code == 200 and set(ok.json()["outputs"]) == {"text", "progress"}


def test_generate_reads_raw_pcm16_audio_as_chat_does(base):
    import base64

    import numpy as np

    pcm = (np.sin(np.arange(2400) / 5) * 10000).astype("<i2").tobytes()  # 0.1 s of 24 kHz s16le
    part = {"type": "audio", "data": base64.b64encode(pcm).decode(), "format": "pcm16"}
    body = {"text": "x", "media": [part], "stream": False, "options": {"max_tokens": 2}}
    assert httpx.post(f"{base}/generate", json=body, timeout=10).status_code == 200
    chat = {"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {
        "data": part["data"], "format": "pcm16"}}, {"type": "text", "text": "x"}]}], "max_tokens": 2}
    assert httpx.post(f"{base}/v1/chat/completions", json=chat, timeout=10).status_code == 200


def test_unknown_route_and_body_limit(base):
    resp = httpx.post(f"{base}/v1/no/such/route", json={})
    assert resp.status_code == 404 and resp.json()["error"]["message"]
    resp = httpx.post(f"{base}/generate", json={"text": "x" * 300_000})
    assert resp.status_code == 413 and "limit" in resp.json()["error"]["message"]


@pytest.mark.parametrize("stream", [True, False])
def test_an_option_the_model_does_not_take_is_a_400_naming_it_and_its_options(base, stream):
    resp = httpx.post(f"{base}/generate", json={"text": "x", "stream": stream, "options": {"max_tokenz": 8}},
                      timeout=10)
    error = resp.json()["error"]
    assert resp.status_code == 400 and error["param"] == "max_tokenz", resp.text
    assert "did you mean 'max_tokens'" in error["message"] and "stop_early" in error["message"]


def test_sdk_raises_on_bad_option(sdk):
    with pytest.raises(MStarError) as info:
        sdk.generate("x", max_tokens=0)
    assert info.value.status == 400 and "max_tokens" in str(info.value)


def test_ready_and_metrics_count_requests(base):
    assert httpx.get(f"{base}/ready").json() == {"status": "ready"}
    text = httpx.get(f"{base}/metrics").text
    assert "mstar_time_to_first_output_seconds_count" in text and 'mstar_http_responses_total{route="/generate"' in text


def test_route_needing_an_output_the_model_lacks_is_404():
    from types import SimpleNamespace

    from mstar.server.adapters import RequestError
    from mstar.server.app import ServerState
    from mstar.server.media import MediaPolicy

    text_only = SimpleNamespace(model=SimpleNamespace(output_modalities=("text",)))
    state = ServerState(text_only, metrics=None, media_policy=MediaPolicy(), model_name="llm")
    with pytest.raises(RequestError) as info:
        state.check_model("llm", "audio", "/v1/audio/speech")
    assert info.value.status == 404 and "/v1/audio/speech" in info.value.message


def test_sdk_tts_streams_sse_pcm_and_whole_wav(sdk):
    pieces = list(sdk.tts("speak", stream=True))
    assert pieces and all(p.sample_rate == 8000 for p in pieces)
    whole = sdk.tts("speak", response_format="wav")
    assert whole.sample_rate == 8000
    assert sum(len(p.samples) for p in pieces) == len(whole.samples)


@pytest.mark.parametrize("path", ["/health", "/ready"])
def test_head_on_a_probe_answers_the_get_status_without_a_body(base, path, monkeypatch):
    from mstar.runtime.launcher import Runtime

    for status in (200, 503):  # load balancers and `curl -I` probe with HEAD; it was a 405
        if status == 503:
            monkeypatch.setattr(Runtime, "health_problem", lambda self: "no progress for 60 s")
        got, head = httpx.get(f"{base}{path}"), httpx.head(f"{base}{path}")
        assert got.status_code == head.status_code == status, head.text
        assert got.content and head.content == b""
