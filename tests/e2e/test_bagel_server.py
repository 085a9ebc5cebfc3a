"""`mstar serve bagel --tiny` over HTTP with the unmodified openai client: a chat with an image part answers in
text; /v1/images/generations and /v1/images/edits return decodable PNGs (the edit at its input's size); the
SDK's generate_image gives the same PNG bytes for the same seed; /generate streams a thought, then the image."""

from __future__ import annotations

import base64
import io
import json

import httpx
import numpy as np
import pytest

from tests.e2e.server_thread import running_server

openai = pytest.importorskip("openai")
Image = pytest.importorskip("PIL.Image")
FAST = {"num_inference_steps": 3}


@pytest.fixture(scope="module")
def base():
    with running_server({"model": "bagel"}, runtime_kwargs={"tiny": True}) as url:
        yield url


def _png(width: int, height: int, seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def test_chat_with_an_image_part(base):
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
    url = "data:image/png;base64," + base64.b64encode(_png(56, 40, 1)).decode()
    resp = client.chat.completions.create(
        model="bagel", max_tokens=5, temperature=0,
        messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                               {"type": "text", "text": "What is in this picture?"}]}])
    choice = resp.choices[0]
    assert choice.finish_reason in ("stop", "length") and isinstance(choice.message.content, str)
    assert resp.usage.completion_tokens >= 1 and resp.usage.prompt_tokens > 0


def test_images_generation_returns_a_png(base):
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
    resp = client.images.generate(model="bagel", prompt="a lighthouse at dusk", size="64x32",
                                  response_format="b64_json", extra_body={**FAST, "seed": 1})
    data = base64.b64decode(resp.data[0].b64_json)
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    image = Image.open(io.BytesIO(data))
    assert image.size == (64, 32) and image.mode == "RGB"


def test_images_edit_returns_a_png_at_the_input_size(base):
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
    resp = client.images.edit(model="bagel", image=("in.png", _png(64, 48, 2), "image/png"),
                              prompt="make it purple", response_format="b64_json", extra_body={**FAST, "seed": 2})
    image = Image.open(io.BytesIO(base64.b64decode(resp.data[0].b64_json)))
    assert image.size == (64, 48)
    assert np.asarray(image).std() > 0


def test_sdk_generate_image_is_reproducible_by_seed(base):
    from mstar import MStarClient

    with MStarClient(base) as client:
        first = client.generate_image("a red fox", size="32x32", seed=5, as_bytes=True, **FAST)
        again = client.generate_image("a red fox", size="32x32", seed=5, as_bytes=True, **FAST)
        other = client.generate_image("a red fox", size="32x32", seed=6, as_bytes=True, **FAST)
    assert first[:8] == b"\x89PNG\r\n\x1a\n" and first == again and first != other


def test_generate_streams_a_thought_then_the_image(base):
    body = {"text": "a boat on a lake", "outputs": ["text", "image"], "stream": True, "seed": 3,
            "options": {**FAST, "modalities": ["text", "image"], "max_tokens": 4, "size": "32x32"}}
    with httpx.stream("POST", f"{base}/generate", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        chunks = [json.loads(line) for line in resp.iter_lines() if line]
    kinds = [c["type"] for c in chunks]
    assert kinds[-1] == "final" and "text" in kinds and kinds.count("image") == 1, kinds
    assert kinds.index("text") < kinds.index("image")


def test_bad_size_is_a_400_naming_it(base):
    body = {"text": "x", "outputs": ["image"], "stream": False, "options": {"modalities": ["image"], "size": "40x32"}}
    resp = httpx.post(f"{base}/generate", json=body, timeout=30)
    assert resp.status_code == 400 and "width=40 must be a multiple of 16" in resp.text


def test_too_many_steps_or_too_large_an_image_is_a_400_naming_it(base):
    body = {"prompt": "x", "size": "64x64", "n": 2, "num_inference_steps": 1000}
    resp = httpx.post(f"{base}/v1/images/generations", json=body, timeout=30)
    assert resp.status_code == 400 and "num_inference_steps must be an integer in [2, 200], got 1000" in resp.text
    resp = httpx.post(f"{base}/v1/images/generations", json={**body, "num_inference_steps": 2, "size": "4096x4096"},
                      timeout=30)
    assert resp.status_code == 400 and "width must be an integer in [16, " in resp.text, resp.text


def test_a_request_larger_than_the_kv_pool_is_a_400_naming_it(base):
    """--tiny's pool holds 16,384 tokens: an answer of up to 20,000 tokens (within the 32,768 positions) never fits."""
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="model_kwargs.kv_tokens"):
        client.chat.completions.create(model="bagel", max_tokens=20_000, messages=[{"role": "user", "content": "hi"}])


def test_chat_streams_text_deltas(base):
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
    stream = client.chat.completions.create(model="bagel", max_tokens=4, temperature=0, stream=True,
                                            messages=[{"role": "user", "content": "Tell me about foxes."}])
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length") and isinstance(text, str)
    whole = client.chat.completions.create(model="bagel", max_tokens=4, temperature=0,
                                           messages=[{"role": "user", "content": "Tell me about foxes."}])
    assert whole.choices[0].message.content == text  # greedy: the stream spells the same answer


def test_generate_and_chat_give_a_logprob_per_text_token(base):
    # BAGEL took option logprobs and sent none; output "logprobs" was refused as a modality
    body = {"text": "hi", "outputs": ["text", "logprobs"], "stream": False,
            "options": {"max_tokens": 4, "temperature": 0, "ignore_eos": True}}
    resp = httpx.post(f"{base}/generate", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    entries = [c["content"][0] for c in resp.json()["outputs"]["logprobs"]]
    assert len(entries) == resp.json()["usage"]["completion_tokens"] == 4
    assert all(e["logprob"] <= 0 and e["top_logprobs"] == [] for e in entries)
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
    chat = client.chat.completions.create(model="bagel", max_tokens=4, temperature=0, logprobs=True, top_logprobs=2,
                                          messages=[{"role": "user", "content": "hi"}], extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens == 4
    assert all(t.top_logprobs[0].logprob == t.logprob and len(t.top_logprobs) == 2 for t in content)  # greedy
