"""The OpenAI-compatible routes driven by the real `openai` client against a live toy server."""

from __future__ import annotations

import io

import httpx
import numpy as np
import pytest
import soundfile as sf
from PIL import Image

from tests.e2e.server_thread import metric_sum, running_server, scrape

openai = pytest.importorskip("openai")
KEY = "test-key"


@pytest.fixture(scope="module")
def base():
    with running_server({"model": "toy"}, api_key=KEY) as url:
        yield url


@pytest.fixture(scope="module")
def client(base):
    return openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0)


def test_models(client):
    assert [m.id for m in client.models.list().data] == ["toy"]
    card = client.models.retrieve("toy")
    assert card.id == "toy" and card.object == "model" and card.model_dump()["output_modalities"][0] == "text"
    with pytest.raises(openai.NotFoundError, match="'gpt-4o' is not served here"):
        client.models.retrieve("gpt-4o")
    samples = scrape(str(client.base_url).removesuffix("/v1/"), {"Authorization": f"Bearer {KEY}"})
    assert metric_sum(samples, "mstar_http_responses_total", route="/v1/models/{model_id}", status="404") >= 1


def test_chat_non_streaming_has_text_and_real_usage(client):
    resp = client.chat.completions.create(model="toy", messages=[{"role": "user", "content": "hello"}],
                                          max_tokens=6, extra_body={"stop_early": False})
    choice = resp.choices[0]
    assert len(choice.message.content) == 6 and choice.finish_reason == "length"
    assert resp.usage.completion_tokens == 6 and resp.usage.prompt_tokens == len(b"hello")
    assert resp.usage.total_tokens == 6 + 5


def test_chat_stream_matches_non_stream_and_includes_usage(client):
    kwargs = dict(model="toy", messages=[{"role": "user", "content": "stream me"}], max_tokens=7,
                  extra_body={"stop_early": False})
    full = client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 7


def test_chat_n_gives_n_choices(client):
    resp = client.chat.completions.create(model="toy", messages=[{"role": "user", "content": "hi"}], n=3,
                                          max_tokens=4, extra_body={"stop_early": False})
    assert sorted(c.index for c in resp.choices) == [0, 1, 2]
    assert resp.usage.completion_tokens == 12


def test_completions_stream_and_not(client):
    resp = client.completions.create(model="toy", prompt="abc", max_tokens=5, extra_body={"stop_early": False})
    assert len(resp.choices[0].text) == 5 and resp.usage.completion_tokens == 5
    parts = list(client.completions.create(model="toy", prompt="abc", max_tokens=5, stream=True,
                                           extra_body={"stop_early": False}))
    assert "".join(p.choices[0].text for p in parts if p.choices) == resp.choices[0].text


@pytest.mark.parametrize("fmt", ["wav", "flac", "mp3"])
def test_speech_container_formats_decode(client, fmt):
    data = client.audio.speech.create(model="toy", voice="alloy", input="speak", response_format=fmt).content
    samples, rate = sf.read(io.BytesIO(data))
    assert len(samples) > 0 and rate > 0
    if fmt != "mp3":  # lossless: the toy's 8 samples per token and its 8 kHz rate survive exactly
        assert rate == 8000 and len(samples) % 8 == 0


def test_speech_pcm_carries_sample_rate(client):
    resp = client.audio.speech.with_raw_response.create(model="toy", voice="alloy", input="speak",
                                                        response_format="pcm")
    assert resp.headers["x-sample-rate"] == "8000"
    pcm = np.frombuffer(resp.content, "<i2")
    assert pcm.size > 0 and np.abs(pcm).max() > 1000


def test_images_generation_returns_the_toy_image(client):
    import base64

    resp = client.images.generate(model="toy", prompt="paint", response_format="b64_json")
    img = Image.open(io.BytesIO(base64.b64decode(resp.data[0].b64_json)))
    assert img.format == "PNG" and img.size[1] == 8 and img.size[0] >= 1


def test_output_compression_sets_the_jpeg_quality_and_transparency_is_refused(client):
    import base64

    def jpeg(compression):
        b64 = client.images.generate(model="toy", prompt="paint", size="256x256", output_format="jpeg",
                                     output_compression=compression).data[0].b64_json
        return base64.b64decode(b64)

    assert len(jpeg(5)) < len(jpeg(95))
    with pytest.raises(openai.BadRequestError, match="background 'transparent'"):
        client.images.generate(model="toy", prompt="paint", background="transparent")


def test_the_toy_paints_the_size_asked_and_refuses_one_it_cannot(client):
    import base64

    resp = client.images.generate(model="toy", prompt="paint", size="40x24", response_format="b64_json")
    assert Image.open(io.BytesIO(base64.b64decode(resp.data[0].b64_json))).size == (40, 24)
    with pytest.raises(openai.BadRequestError, match=r"\[1, 4096\]"):
        client.images.generate(model="toy", prompt="paint", size="5000x8", response_format="b64_json")


def test_wrong_key_is_refused(base):
    bad = openai.OpenAI(base_url=f"{base}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def _refusal(call) -> tuple[str, str | None]:
    """The message and param of the OpenAI-shaped 400 that `call()` answers."""
    with pytest.raises(openai.BadRequestError) as info:
        call()
    assert info.value.status_code == 400
    return info.value.body["message"], info.value.body["param"]


HI = [{"role": "user", "content": "hi"}]


def test_a_field_neither_openai_nor_the_model_defines_is_refused_naming_the_nearest(client):
    message, param = _refusal(lambda: client.chat.completions.create(model="toy", messages=HI,
                                                                     extra_body={"stop_erly": False}))
    assert param == "stop_erly" and "unknown field 'stop_erly' (did you mean 'stop_early'?)" in message
    assert "max_completion_tokens" in message and "guidance, height" in message  # the route's and the model's
    # completions define no response_format: it was dropped unread
    message, param = _refusal(lambda: client.completions.create(model="toy", prompt="abc", max_tokens=2,
                                                                extra_body={"response_format": {"type": "text"}}))
    assert param == "response_format" and "unknown field 'response_format'" in message
    message, _ = _refusal(lambda: client.images.generate(model="toy", prompt="paint", extra_body={"guidence": 3.0}))
    assert "did you mean 'guidance'?" in message
    # the route sets modalities itself
    message, param = _refusal(lambda: client.images.generate(model="toy", prompt="paint",
                                                             extra_body={"modalities": ["text"]}))
    assert param == "modalities" and "sets 'modalities' itself" in message


def test_a_sampling_field_the_model_does_not_take_is_refused(client):
    """The toy samples nothing: a temperature it would not read is refused, and no nearest name offers one."""
    message, param = _refusal(lambda: client.chat.completions.create(model="toy", messages=HI, temperature=0.5))
    assert param == "temperature" and "model 'toy' does not take 'temperature'" in message
    for call in (lambda: client.completions.create(model="toy", prompt="abc", top_p=0.5),
                 lambda: client.chat.completions.create(model="toy", messages=HI, seed=3),
                 lambda: client.chat.completions.create(model="toy", messages=HI, extra_body={"top_k": 4}),
                 lambda: client.audio.speech.create(model="toy", voice="alloy", input="x", speed=2.0),
                 lambda: client.images.generate(model="toy", prompt="paint", extra_body={"seed": 1})):
        assert "model 'toy' does not take" in _refusal(call)[0]
    message, _ = _refusal(lambda: client.chat.completions.create(model="toy", messages=HI,
                                                                 extra_body={"temperatur": 0.5}))
    assert "unknown field 'temperatur'" in message and "did you mean" not in message


def test_openai_fields_not_built_pass_only_at_values_that_ask_for_nothing(client):
    def chat(**kwargs):
        return client.chat.completions.create(model="toy", messages=HI, max_tokens=2, **kwargs)

    answer = chat(n=1, user="u", store=False, service_tier="auto", safety_identifier="s", logit_bias={},
                  prompt_cache_key="k")
    assert len(answer.choices[0].message.content) == 2
    for kwargs, name in (({"store": True}, "store"), ({"service_tier": "flex"}, "service_tier"),
                         ({"reasoning_effort": "low"}, "reasoning_effort"), ({"metadata": {"a": "b"}}, "metadata"),
                         ({"logit_bias": {"1": 5}}, "logit_bias")):
        message, _ = _refusal(lambda kwargs=kwargs: chat(**kwargs))
        assert name in message and "not supported" in message, message
    assert client.images.generate(model="toy", prompt="paint", stream=False, partial_images=0).data
    message, param = _refusal(lambda: client.images.generate(model="toy", prompt="paint", partial_images=2))
    assert param == "partial_images" and "images are answered whole" in message


def test_stream_options_take_include_obfuscation_and_refuse_unknown_keys(base, client):
    """include_obfuscation (OpenAI's padding against reading token lengths off event sizes) was ignored, and
    an unknown key of stream_options dropped unread."""
    from mstar.server.protocol_openai import OBFUSCATION_BLOCK

    kwargs = dict(model="toy", messages=[{"role": "user", "content": "pad me"}], max_tokens=7,
                  extra_body={"stop_early": False}, stream=True)
    plain = list(client.chat.completions.create(stream_options={"include_obfuscation": False}, **kwargs))
    padded = list(client.chat.completions.create(stream_options={"include_obfuscation": True, "include_usage": True},
                                                 **kwargs))
    assert all(c.obfuscation is None for c in plain) and all(c.obfuscation is not None for c in padded)
    text = ["".join(c.choices[0].delta.content or "" for c in chunks if c.choices) for chunks in (plain, padded)]
    assert text[0] == text[1] and len(text[0]) == 7 and padded[-1].usage.completion_tokens == 7
    body = {"model": "toy", "prompt": "pad me", "max_tokens": 5, "stream": True, "stop_early": False,
            "stream_options": {"include_obfuscation": True}}
    answer = httpx.post(f"{base}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"})
    lines = answer.content.split(b"\n\n")
    events = [line.removeprefix(b"data: ") for line in lines if line and line != b"data: [DONE]"]
    assert len(events) > 1 and all(len(event) % OBFUSCATION_BLOCK == 0 for event in events)
    message, param = _refusal(lambda: client.chat.completions.create(
        stream_options={"include_usage": True, "include_usge": True}, **kwargs))
    assert param == "stream_options" and "unknown key 'include_usge'; it takes include_usage, include_obfuscation" \
        in message


@pytest.mark.parametrize("path", ["/v1/models", "/v1/models/toy", "/v1/models/gpt-4o", "/metrics"])
def test_head_answers_as_get_without_a_body(base, path):
    """`curl -I` and health checks send HEAD: it was a 405."""
    headers = {"Authorization": f"Bearer {KEY}"}
    got, head = httpx.get(f"{base}{path}", headers=headers), httpx.head(f"{base}{path}", headers=headers)
    assert head.status_code == got.status_code == (404 if "gpt" in path else 200), head.text
    assert head.headers["content-type"] == got.headers["content-type"]
    assert got.content and head.content == b""
    assert httpx.head(f"{base}{path}").status_code == httpx.get(f"{base}{path}").status_code  # keyless: the same
