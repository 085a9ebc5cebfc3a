"""The media routes (images.edit, audio.transcriptions, videos, spoken chat) driven by the real
`openai` client against a live toy server."""

from __future__ import annotations

import base64
import io
import warnings

import av
import numpy as np
import pytest
import soundfile as sf
from PIL import Image

from mstar.server.media import encode_image
from tests.e2e.server_thread import running_server

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the client marks Sora calls deprecated
KEY = "media-key"
NO_STOP = {"stop_early": False}


def png(value: int, size=(6, 10)) -> bytes:
    return encode_image(np.full((*size, 3), value, np.uint8))


def wav(freq: float, amp: float = 0.5) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, (np.sin(np.arange(4000) * freq) * amp).astype(np.float32), 8000, format="WAV")
    return buf.getvalue()


@pytest.fixture(scope="module")
def client():
    with running_server({"model": "toy"}, api_key=KEY) as base:
        yield openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0)


def _pil(b64: str) -> Image.Image:
    return Image.open(io.BytesIO(base64.b64decode(b64)))


def test_image_edit_multi_image_mask_and_n(client):
    resp = client.images.edit(image=[("a.png", png(10), "image/png"), ("b.png", png(200), "image/png")],
                              mask=("m.png", png(0), "image/png"), prompt="edit", n=2, model="toy",
                              response_format="b64_json", extra_body=NO_STOP)
    assert len(resp.data) == 2
    img = _pil(resp.data[0].b64_json)
    assert img.format == "PNG" and img.size == (16, 8)  # the toy paints one column per token (max_tokens 16)


def test_image_edit_depends_on_the_input_image(client):
    def edit(value: int) -> bytes:
        return base64.b64decode(client.images.edit(image=("a.png", png(value), "image/png"), prompt="same",
                                                   model="toy", extra_body=NO_STOP).data[0].b64_json)

    assert edit(10) == edit(10) and edit(10) != edit(250)


def test_transcription_json_text_and_determinism(client):
    first = client.audio.transcriptions.create(file=("a.wav", wav(0.02, 0.9), "audio/wav"), model="toy")
    again = client.audio.transcriptions.create(file=("a.wav", wav(0.02, 0.9), "audio/wav"), model="toy")
    other = client.audio.transcriptions.create(file=("b.wav", wav(0.2, 0.1), "audio/wav"), model="toy")
    assert first.text and first.text == again.text and first.text != other.text
    text = client.audio.transcriptions.create(file=("a.wav", wav(0.02, 0.9), "audio/wav"), model="toy",
                                              response_format="text")
    assert text.strip() == first.text


@pytest.mark.parametrize("fmt,head", [("srt", "1\n00:00:00,000 --> 00:00:00,500\n"),
                                      ("vtt", "WEBVTT\n\n00:00:00.000 --> 00:00:00.500\n")])
def test_transcription_subtitles(client, fmt, head):
    out = client.audio.transcriptions.create(file=("a.wav", wav(0.02), "audio/wav"), model="toy",
                                             response_format=fmt)
    assert out.startswith(head) and len(out) > len(head)


def test_transcription_verbose_json_and_stream(client):
    verbose = client.audio.transcriptions.create(file=("a.wav", wav(0.02), "audio/wav"), model="toy",
                                                 response_format="verbose_json")
    assert verbose.duration == pytest.approx(0.5) and verbose.language == "unknown"
    assert verbose.segments[0].end == pytest.approx(0.5) and verbose.segments[0].text == verbose.text
    events = list(client.audio.transcriptions.create(file=("a.wav", wav(0.02), "audio/wav"), model="toy",
                                                     stream=True))
    deltas = "".join(e.delta for e in events if e.type == "transcript.text.delta")
    assert events[-1].type == "transcript.text.done" and events[-1].text == deltas == verbose.text


def test_video_job_lifecycle(client):
    job = client.videos.create(prompt="a cat", model="toy", size="16x8")
    assert job.object == "video" and job.status in ("queued", "in_progress", "completed")
    assert job.size == "16x8" and 0 <= job.progress <= 100
    done = client.videos.poll(job.id, poll_interval_ms=20)
    assert done.status == "completed" and done.progress == 100 and done.completed_at >= done.created_at
    mp4 = client.videos.download_content(done.id).content
    with av.open(io.BytesIO(mp4)) as container:
        assert container.streams.video[0].codec_context.name == "h264"
        assert (container.streams.video[0].width, container.streams.video[0].height) == (16, 8)  # the size asked
        assert container.streams.audio and container.streams.audio[0].codec_context.name == "aac"
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    assert len(frames) == 2 and done.size == f"{frames[0].shape[1]}x{frames[0].shape[0]}"
    thumb = client.videos.download_content(done.id, variant="thumbnail").content
    assert Image.open(io.BytesIO(thumb)).format == "PNG"
    assert done.id in [v.id for v in client.videos.list()]
    deleted = client.videos.delete(done.id)
    assert deleted.deleted and deleted.id == done.id
    with pytest.raises(openai.NotFoundError) as info:
        client.videos.retrieve(done.id)
    assert "no video job" in info.value.message


def test_video_input_reference_changes_the_clip(client):
    def clip(ref: bytes | None) -> bytes:
        kwargs = {"input_reference": ("r.png", ref, "image/png")} if ref is not None else {}
        job = client.videos.create_and_poll(prompt="same prompt", model="toy", poll_interval_ms=20, **kwargs)
        assert job.status == "completed", job.error
        return client.videos.download_content(job.id).content

    plain = clip(None)
    assert plain == clip(None) and clip(png(99)) != plain


def test_spoken_chat_non_streaming(client):
    resp = client.chat.completions.create(model="toy", messages=[{"role": "user", "content": "speak"}],
                                          modalities=["text", "audio"], audio={"voice": "alloy", "format": "wav"},
                                          max_tokens=6, extra_body=NO_STOP)
    message = resp.choices[0].message
    assert message.content is None and len(message.audio.transcript) == 6 and message.audio.id
    samples, rate = sf.read(io.BytesIO(base64.b64decode(message.audio.data)))
    assert rate == 8000 and samples.size > 0 and np.abs(samples).max() > 0.01
    text = client.chat.completions.create(model="toy", messages=[{"role": "user", "content": "speak"}],
                                          max_tokens=6, extra_body=NO_STOP).choices[0].message.content
    assert message.audio.transcript == text


def test_spoken_chat_streaming_sends_pcm16_and_transcript(client):
    kwargs = dict(model="toy", messages=[{"role": "user", "content": "speak"}], max_tokens=6, extra_body=NO_STOP,
                  modalities=["text", "audio"], audio={"voice": "alloy", "format": "pcm16"})
    whole = client.chat.completions.create(**kwargs).choices[0].message.audio
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    audio = [c.choices[0].delta.audio for c in chunks if c.choices and c.choices[0].delta.audio]
    transcript = "".join(getattr(a, "transcript", None) or "" for a in audio)
    pcm = b"".join(base64.b64decode(getattr(a, "data", None) or "") for a in audio)
    assert transcript == whole.transcript
    assert pcm == base64.b64decode(whole.data)  # pcm16 whole == the streamed pieces joined
    assert len({getattr(a, "id", None) for a in audio}) == 1
    assert chunks[-1].usage.completion_tokens == 6


def test_deprecation_warnings_do_not_hide_errors(client):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(openai.BadRequestError):
            client.videos.create(prompt="x", model="toy", size="big")


def test_chat_media_parts_reach_the_model(client):
    def ask(content) -> str:
        return client.chat.completions.create(model="toy", messages=[{"role": "user", "content": content}],
                                              max_tokens=6, extra_body=NO_STOP).choices[0].message.content

    url = "data:image/png;base64," + base64.b64encode(png(200)).decode()
    with_image = ask([{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": url}}])
    audio = {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav(0.05)).decode(), "format": "wav"}}
    with_audio = ask([{"type": "text", "text": "look"}, audio])
    assert len({ask("look"), with_image, with_audio}) == 3
    with pytest.raises(openai.BadRequestError):
        ask([{"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(b"junk").decode()}}])


def test_transcription_fields_no_model_here_reads_are_refused(client):
    """No model serving transcriptions reads a language (it was passed on and ignored), the toy samples nothing,
    and OpenAI's `include` asks for logprobs transcripts do not carry."""
    def refused(**kwargs) -> tuple[str, str]:
        with pytest.raises(openai.BadRequestError) as info:
            client.audio.transcriptions.create(file=("a.wav", wav(0.02), "audio/wav"), model="toy", **kwargs)
        return info.value.body["message"], info.value.body["param"]

    message, param = refused(language="en")
    assert param == "language" and "model 'toy' does not take 'language'" in message
    assert refused(temperature=0.2)[1] == "temperature"
    message, param = refused(include=["logprobs"])
    assert param == "include" and "not supported by /v1/audio/transcriptions" in message
    message, param = refused(extra_body={"max_tokenz": "3"})
    assert param == "max_tokenz" and "did you mean 'max_tokens'?" in message


def test_video_and_speech_fields_the_toy_does_not_read_are_refused(client):
    with pytest.raises(openai.BadRequestError, match="model 'toy' does not take 'seconds'"):
        client.videos.create(prompt="a cat", model="toy", seconds="4", size="16x8")
    with pytest.raises(openai.BadRequestError, match="model 'toy' does not take 'instructions'"):
        client.audio.speech.create(model="toy", voice="alloy", input="x", instructions="whisper")


def test_the_openai_client_streams_usage_and_an_image_at_high_detail(client):
    """What the openai client sends as a rule (stream_options include_usage, an image part at detail "high")
    keeps working; detail low (a small copy for few tokens) was accepted and the image read whole."""
    url = "data:image/png;base64," + base64.b64encode(png(90)).decode()

    def chat(detail, **kwargs):
        image = {"url": url} if detail is None else {"url": url, "detail": detail}
        content = [{"type": "text", "text": "look"}, {"type": "image_url", "image_url": image}]
        return client.chat.completions.create(model="toy", messages=[{"role": "user", "content": content}],
                                              max_tokens=6, extra_body=NO_STOP, **kwargs)

    chunks = list(chat("high", stream=True, stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == chat(None).choices[0].message.content == chat("auto").choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    for detail in ("low", "original"):
        with pytest.raises(openai.BadRequestError, match=f"detail '{detail}'.*not built") as info:
            chat(detail)
        assert info.value.body["param"] == "messages.0.content.1.image_url.detail"


def test_unknown_keys_of_image_url_and_audio_are_refused_and_a_stream_speaks_pcm16(client):
    """Keys OpenAI does not define inside `image_url` and `audio` were dropped unread, and a streamed spoken
    answer sent pcm16 whatever `audio.format` said; OpenAI refuses another format when streaming."""
    url = "data:image/png;base64," + base64.b64encode(png(90)).decode()
    speak = dict(model="toy", messages=[{"role": "user", "content": "speak"}], max_tokens=4, extra_body=NO_STOP,
                 modalities=["text", "audio"])
    content = [{"type": "image_url", "image_url": {"url": url, "detial": "high"}}]
    with pytest.raises(openai.BadRequestError, match="unknown key 'detial'; it takes url, detail"):
        client.chat.completions.create(model="toy", messages=[{"role": "user", "content": content}], max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="audio: unknown key 'speed'; it takes voice, format") as info:
        client.chat.completions.create(**speak, audio={"voice": "alloy", "format": "wav", "speed": 1.5})
    assert info.value.body["param"] == "audio"
    with pytest.raises(openai.BadRequestError, match="audio.format 'wav' with stream true"):
        client.chat.completions.create(**speak, audio={"voice": "alloy", "format": "wav"}, stream=True)
    whole = client.chat.completions.create(**speak, audio={"voice": {"id": "alloy"}}).choices[0].message.audio
    samples, rate = sf.read(io.BytesIO(base64.b64decode(whole.data)))  # no format: a wav, as before
    assert rate == 8000 and samples.size > 0
