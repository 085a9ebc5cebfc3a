"""`mstar serve pi05 --tiny` to robots (#39): the real `openpi_client.WebsocketClientPolicy` connects unchanged,
reads the metadata, builds observations from its example and receives action chunks of the right shape;
the same observation over /generate (as JSON numbers or raw float32 bytes, bit-equal) and through the SDK's
predict_actions gives the same chunk; bad observations get a clear error
(a text message over the websocket, a 400 over HTTP); the websocket checks the API key."""

from __future__ import annotations

import base64
import io

import httpx
import numpy as np
import pytest

from tests.e2e.server_thread import running_server

websocket_client_policy = pytest.importorskip("openpi_client.websocket_client_policy")
pytest.importorskip("websockets")


@pytest.fixture(scope="module")
def base():
    with running_server({"model": "pi05"}, tiny=True) as url:
        yield url


def _client(base: str, **kwargs):
    return websocket_client_policy.WebsocketClientPolicy(base.replace("http://", "ws://"), **kwargs)


def _observation(metadata: dict, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    example = metadata["example_observation"]
    images = {name: rng.integers(0, 256, image.shape, dtype=np.uint8) for name, image in example["images"].items()}
    return {"images": images, "state": rng.uniform(-1, 1, example["state"].shape).astype(np.float32),
            "prompt": "pick up the red cube", "seed": seed}


def test_openpi_client_receives_action_chunks(base) -> None:
    policy = _client(base)
    metadata = policy.get_server_metadata()
    assert metadata["cameras"] == ["base_0_rgb", "left_wrist_0_rgb", "right_wrist_0_rgb"]
    assert metadata["image_size"] == [32, 32] and metadata["state_dim"] == 8 and metadata["action_shape"] == [10, 7]
    first = policy.infer(_observation(metadata, 1))
    again = policy.infer(_observation(metadata, 1))
    other = policy.infer(_observation(metadata, 2))
    assert first["actions"].shape == (10, 7) and first["actions"].dtype == np.float32
    assert first["server_timing"]["infer_ms"] > 0
    np.testing.assert_array_equal(first["actions"], again["actions"])  # same observation and seed
    assert np.abs(first["actions"] - other["actions"]).max() > 1e-3


def _png(image: np.ndarray) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def test_generate_answers_the_same_chunk(base) -> None:
    policy = _client(base)
    observation = _observation(policy.get_server_metadata(), 3)
    over_ws = policy.infer(observation)["actions"]
    body = {"text": observation["prompt"], "outputs": ["actions"], "stream": False, "seed": 3,
            "media": [{"type": "image", "name": name, "data": _png(image)} for name, image in
                      observation["images"].items()],
            "options": {"state": observation["state"].tolist()}}
    answer = httpx.post(f"{base}/generate", json=body, timeout=60).json()
    chunk = answer["outputs"]["actions"][0]
    assert chunk["type"] == "action" and chunk["shape"] == [10, 7] and chunk["dtype"] == "float32"
    numbers = np.asarray(chunk["values"], np.float32).reshape(10, 7)
    np.testing.assert_allclose(numbers, over_ws, atol=1e-6, rtol=0)
    raw = httpx.post(f"{base}/generate", json={**body, "encoding": "binary"}, timeout=60).json()
    chunk = raw["outputs"]["actions"][0]
    assert "values" not in chunk and chunk["shape"] == [10, 7]
    np.testing.assert_array_equal(np.frombuffer(base64.b64decode(chunk["data"]), "<f4").reshape(10, 7), numbers)


@pytest.mark.parametrize(("change", "fault"), [
    (lambda o: o["images"].update(top_cam=o["images"]["base_0_rgb"]), "unknown camera 'top_cam'"),
    (lambda o: o.update(state=np.zeros(5, np.float32)), "state must hold 8"),
    (lambda o: o["images"].update(base_0_rgb=np.zeros((4, 4), np.float32)), "uint8"),
    (lambda o: o.update(joints=np.zeros(3)), "unknown observation keys"),
])
def test_bad_observations_are_a_protocol_error(base, change, fault) -> None:
    policy = _client(base)
    observation = _observation(policy.get_server_metadata(), 4)
    change(observation)
    with pytest.raises(RuntimeError, match=fault):
        policy.infer(observation)
    assert policy.infer(_observation(policy.get_server_metadata(), 4))["actions"].shape == (10, 7)  # still open


def test_a_text_frame_is_answered_and_the_connection_stays_open(base) -> None:
    import asyncio

    import websockets

    async def talk() -> tuple[str, bytes]:
        async with websockets.connect(base.replace("http://", "ws://"), max_size=None) as ws:
            await ws.recv()  # the metadata
            await ws.send("hello")
            answer = await asyncio.wait_for(ws.recv(), 10)
            await ws.send(b"\x00\x01garbage")
            return answer, await asyncio.wait_for(ws.recv(), 10)

    answer, after = asyncio.run(talk())
    assert answer.startswith("bad observation: ") and "binary" in answer
    assert after.startswith("bad observation: the message is not openpi msgpack")


def test_generate_refuses_a_wrong_state_size(base) -> None:
    body = {"text": "pick", "outputs": ["actions"], "stream": False,
            "media": [{"type": "image", "data": _png(np.zeros((8, 8, 3), np.uint8))}], "options": {"state": [0.0] * 3}}
    answer = httpx.post(f"{base}/generate", json=body, timeout=60)
    assert answer.status_code == 400 and "state must hold 8" in answer.text


def test_generate_refuses_an_option_pi05_does_not_take(base) -> None:
    body = {"text": "pick", "outputs": ["actions"], "stream": False,
            "media": [{"type": "image", "data": _png(np.zeros((8, 8, 3), np.uint8))}],
            "options": {"state": [0.0] * 8, "chunk_size": 3}}
    answer = httpx.post(f"{base}/generate", json=body, timeout=60)
    assert answer.status_code == 400 and "'chunk_size'" in answer.text and "num_steps" in answer.text


def test_the_websocket_checks_the_api_key() -> None:
    with running_server({"model": "pi05"}, tiny=True, api_key="k3y") as url:
        with pytest.raises(Exception, match="1008|403|rejected"):
            _client(url)
        assert _client(url, api_key="k3y").get_server_metadata()["policy"] == "pi05"


def test_sdk_predict_actions_gives_the_websocket_chunk(base) -> None:
    from mstar.client import MStarClient

    policy = _client(base)
    observation = _observation(policy.get_server_metadata(), 5)
    over_ws = policy.infer(observation)["actions"]
    frames = [observation["images"][c] for c in ("base_0_rgb", "left_wrist_0_rgb", "right_wrist_0_rgb")]
    with MStarClient(base) as client:  # unnamed images fill the cameras in order
        chunk = client.predict_actions(frames, observation["prompt"], state=observation["state"].tolist(), seed=5)
    assert chunk.shape == (10, 7)
    np.testing.assert_allclose(chunk, over_ws, atol=1e-6, rtol=0)
