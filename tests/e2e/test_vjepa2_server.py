"""`mstar serve vjepa2_ac --tiny` (and `vjepa2 --tiny`) over HTTP: the SDK's encode_video, rollout and plan,
raw /generate answers (latents as a tensor chunk with its shape, actions as an action chunk; JSON numbers or
raw bytes, float32 or bfloat16 latents, the same values either way), and bad inputs answered with a 400 that
names the problem."""

from __future__ import annotations

import base64
import io

import httpx
import numpy as np
import pytest

from mstar.client import AsyncMStarClient, MStarClient, MStarError
from tests.e2e.server_thread import running_server


@pytest.fixture(scope="module")
def base():
    with running_server({"model": "vjepa2_ac"}, runtime_kwargs={"tiny": True}) as url:
        yield url


def _frames(count: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (count, 36, 44, 3), dtype=np.uint8)


def _png(image: np.ndarray) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


STATE = [[0.1, 0.2, 0.3, 0.0, 0.0, 0.0, 0.5]]


def test_sdk_rollout_and_encode(base):
    frame = _frames(1, 1)
    with MStarClient(base) as client:
        latents = client.encode_video(frame)
        predicted = client.rollout(frame, actions=[[0.01] * 7] * 3, states=STATE)
        again = client.rollout(frame, actions=[[0.01] * 7] * 3, states=STATE)
        other = client.rollout(frame, actions=[[-0.04] * 7] * 3, states=STATE)
    assert latents.shape == (1, 16, 64) and latents.dtype == np.float32
    assert predicted.shape == (3, 16, 64) and predicted.dtype == np.float32
    np.testing.assert_array_equal(predicted, again)  # the same request gives the same rollout
    assert np.abs(predicted - other).max() > 1e-3  # the actions steer it


def test_sdk_plan_is_reproducible_with_a_seed(base):
    frame, goal = _frames(1, 2), _frames(1, 3)[0]
    search = {"samples": 16, "topk": 4, "cem_iterations": 2, "seed": 5}
    with MStarClient(base) as client:
        first = client.plan(frame, goal, states=STATE, **search)
        plan = client.plan(frame, goal, states=STATE, return_sequence=True, horizon=3, **search)
        again = client.plan(frame, goal, states=STATE, return_sequence=True, horizon=3, **search)
    assert first.shape == (1, 7) and plan.shape == (3, 7)
    np.testing.assert_array_equal(plan, again)
    assert np.all(plan[:, 3:6] == 0) and np.abs(plan[:, :3]).max() <= 0.05  # no rotation; moves within maxnorm


def test_async_sdk_plans_too(base):
    import asyncio

    async def main():
        async with AsyncMStarClient(base) as client:
            return await client.plan(_frames(1, 2), _frames(1, 3)[0], states=STATE, samples=16, topk=4,
                                     cem_iterations=2, seed=5)

    with MStarClient(base) as client:
        expected = client.plan(_frames(1, 2), _frames(1, 3)[0], states=STATE, samples=16, topk=4, cem_iterations=2,
                               seed=5)
    np.testing.assert_array_equal(asyncio.run(main()), expected)


def test_generate_answers_typed_chunks(base):
    body = {"media": [{"type": "image", "data": _png(_frames(1, 4)[0])},
                      {"type": "image", "data": _png(_frames(1, 5)[0]), "name": "goal"}],
            "outputs": ["actions", "energy"], "stream": False,
            "options": {"states": STATE, "samples": 8, "topk": 2, "cem_iterations": 2, "seed": 1}}
    resp = httpx.post(f"{base}/generate", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    outputs = resp.json()["outputs"]
    action = outputs["actions"][0]
    assert action["type"] == "action" and action["shape"] == [1, 7] and len(action["values"]) == 7
    assert [c["type"] for c in outputs["energy"]] == ["tensor", "tensor"]
    body = {"media": body["media"][:1], "outputs": ["predicted"], "stream": True, "encoding": "binary",
            "options": {"states": STATE, "actions": [[0.0] * 7] * 2}}
    with httpx.stream("POST", f"{base}/generate", json=body, timeout=60) as stream:
        lines = [line for line in stream.iter_lines() if line]
    import json

    chunks = [json.loads(line) for line in lines]
    assert [c["type"] for c in chunks] == ["tensor", "final"]
    assert chunks[0]["dtype"] == "float32" and chunks[0]["shape"] == [2, 16, 64]
    assert len(base64.b64decode(chunks[0]["data"])) == 2 * 16 * 64 * 4


def _latents(base: str, **fields) -> dict:
    body = {"media": [{"type": "image", "data": _png(_frames(1, 8)[0])}], "outputs": ["latents"], "stream": False,
            **fields}
    resp = httpx.post(f"{base}/generate", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()["outputs"]["latents"][0]


def test_latents_are_the_same_as_numbers_bytes_and_bfloat16(base):
    import torch

    from mstar.server.protocol import TensorChunk

    numbers, raw, half = _latents(base, encoding="json"), _latents(base), \
        _latents(base, encoding="binary", tensor_dtype="bfloat16")  # by default ("auto") tensors come as bytes
    assert "values" in numbers and "data" not in numbers and "data" in raw and "values" not in raw
    assert half["dtype"] == "bfloat16" and len(base64.b64decode(half["data"])) * 2 == len(base64.b64decode(raw["data"]))
    exact = np.asarray(numbers["values"], np.float32).reshape(numbers["shape"])
    np.testing.assert_array_equal(TensorChunk.model_validate(raw).to_numpy(), exact)
    rounded = torch.from_numpy(exact).to(torch.bfloat16)
    np.testing.assert_array_equal(TensorChunk.model_validate(half).to_numpy(), rounded.float().numpy())
    with MStarClient(base) as client:  # the SDK asks for bytes and gives the same arrays
        np.testing.assert_array_equal(client.encode_video(_frames(1, 8)), exact)
        bf16 = client.encode_video(_frames(1, 8), latent_dtype="bfloat16", as_torch=True)
        predicted = client.rollout(_frames(1, 8), actions=[[0.01] * 7] * 2, states=STATE)
        as_numbers = client.generate(files=[_png(_frames(1, 8)[0])], outputs=["predicted"], encoding="json",
                                     states=STATE, actions=[[0.01] * 7] * 2)
    assert bf16.dtype == torch.bfloat16 and torch.equal(bf16, rounded)
    np.testing.assert_array_equal(predicted, as_numbers.outputs["predicted"][0].to_numpy())


@pytest.mark.parametrize(("fields", "field"), [({"encoding": "msgpack"}, "encoding"),
                                             ({"encoding": "binary", "tensor_dtype": "int8"}, "tensor_dtype")])
def test_a_bad_encoding_is_a_400(base, fields, field):
    image = _png(_frames(1, 9)[0])
    body = {"media": [{"type": "image", "data": image}], "outputs": ["latents"], **fields}
    resp = httpx.post(f"{base}/generate", json=body, timeout=30)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == field, resp.text
    png = base64.b64decode(image.split(",", 1)[1])
    resp = httpx.post(f"{base}/generate", data={"outputs": "latents", **fields},
                      files={"files": ("f.png", png, "image/png")}, timeout=30)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == field, resp.text


@pytest.mark.parametrize("options,message", [
    ({"actions": [[0.0] * 7]}, "states must have shape [1, 7]"),
    ({"task": "rollout", "states": STATE}, "actions must have shape [n, 7]"),
    ({"actions": [[0.0] * 5], "states": STATE}, "actions must have shape [n, 7], got [1, 5]"),
    ({"task": "plan", "states": STATE}, "a plan needs a goal image"),
    ({"actions": "left", "states": STATE}, "option 'actions' must be a list"),
    ({"actions": [], "states": STATE}, "actions must have shape [n, 7]"),  # asking for `predicted` rolls out
    ({"task": "encode"}, "'predicted' comes from task rollout"),
])
def test_bad_input_is_a_400_naming_it(base, options, message):
    body = {"media": [{"type": "image", "data": _png(_frames(1, 6)[0])}], "outputs": ["predicted"],
            "stream": False, "options": options}
    resp = httpx.post(f"{base}/generate", json=body, timeout=30)
    assert resp.status_code == 400 and message in resp.json()["error"]["message"], resp.text
    with MStarClient(base) as client, pytest.raises(MStarError) as err:
        client.rollout(_frames(1, 6), actions=[[0.0] * 7] * 2, states=[[0.0] * 7] * 3)
    assert err.value.status == 400 and "states must have shape [1, 7], got [3, 7]" in str(err.value)


def test_clip_model_encodes_pooled_and_labels():
    with running_server({"model": "vjepa2"}, runtime_kwargs={"tiny": True}) as url, MStarClient(url) as client:
        video = _frames(4, 7)
        latents = client.encode_video(video)
        pooled = client.encode_video(video, pooled=True)
        labels = client.generate(files=[_png(f) for f in video], outputs=["label", "logits"])
    assert latents.shape == (32, 64) and pooled.shape == (64,)
    np.testing.assert_allclose(pooled, latents.mean(0), atol=1e-5)
    assert labels.text in ("reach", "push", "grasp", "wave", "idle") and labels.outputs["logits"][0].shape == [5]
