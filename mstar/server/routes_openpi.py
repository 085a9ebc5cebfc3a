"""The openpi policy protocol: a websocket at `/` that `openpi_client.WebsocketClientPolicy` talks to unchanged.

On connect the server sends the policy's metadata; then each binary message is one observation and gets
one binary answer, `{"actions": array, "server_timing": {"infer_ms": ...}}`. Messages are msgpack with
numpy arrays as maps of `__ndarray__`, `data`, `dtype`, `shape` (bytes keys; openpi's msgpack_numpy). An
observation the policy refuses, or a request that fails, is answered with a text message (the client
raises it) and the connection stays open. The key, when the server has one, comes as
`Authorization: Api-Key <key>` (what the client sends) or `Bearer <key>`.

A model serves this route when its processor is a `RobotPolicy`; any other closes the socket at once.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Protocol, runtime_checkable

import msgspec
import numpy as np
from fastapi import APIRouter, WebSocket, WebSocketDisconnect

from mstar.server.adapters import RequestError, start_request

logger = logging.getLogger(__name__)
router = APIRouter()
_ARRAY = (b"__ndarray__", b"data", b"dtype", b"shape")


@runtime_checkable
class RobotPolicy(Protocol):
    """What a processor provides to serve robots over the openpi protocol."""

    def policy_metadata(self) -> dict[str, Any]:
        """Sent on connect: cameras, image size, state size, action shape and an `example_observation`."""

    def observation_request(self, observation: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """One openpi observation -> (the processor's request, its options); ValueError naming the fault."""


def pack(value: Any) -> bytes:
    """msgpack with numpy arrays (and numpy scalars) in openpi's layout."""
    return msgspec.msgpack.encode(value, enc_hook=_encode)


def _encode(value: Any) -> Any:
    if isinstance(value, np.ndarray) and value.dtype.kind not in "VOc":
        array = np.ascontiguousarray(value)
        return {b"__ndarray__": True, b"data": array.tobytes(), b"dtype": array.dtype.str, b"shape": array.shape}
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"cannot send a {type(value).__name__} over the openpi protocol")


def unpack(data: bytes) -> Any:
    """The inverse of `pack` (and of openpi's msgpack_numpy.packb); ValueError for anything else."""
    try:
        return _arrays(msgspec.msgpack.decode(data))
    except (msgspec.DecodeError, TypeError) as exc:
        raise ValueError(f"the message is not openpi msgpack: {exc}") from None


def _arrays(value: Any) -> Any:
    if isinstance(value, dict):
        if b"__ndarray__" in value:
            if not all(key in value for key in _ARRAY):
                raise ValueError("an array without data, dtype or shape")
            return np.frombuffer(value[b"data"], dtype=np.dtype(value[b"dtype"])).reshape(value[b"shape"])
        if b"__npgeneric__" in value:
            return np.dtype(value[b"dtype"]).type(value[b"data"])
        return {key: _arrays(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_arrays(item) for item in value]
    return value


def _authorized(websocket: WebSocket, api_key: str | None) -> bool:
    import hmac

    if not api_key:
        return True
    scheme, _, token = websocket.headers.get("authorization", "").partition(" ")
    return scheme.lower() in ("api-key", "bearer") and hmac.compare_digest(token.strip().encode(), api_key.encode())


@router.websocket("/")
async def openpi_policy(websocket: WebSocket) -> None:
    """openpi's policy server protocol (module docstring)."""
    state = websocket.app.state.mstar
    processor = state.runtime.processor
    if not _authorized(websocket, websocket.app.state.api_key):
        await websocket.close(code=1008, reason="missing or wrong API key: send 'Authorization: Api-Key <key>'")
        return
    if not isinstance(processor, RobotPolicy):
        await websocket.close(code=1003, reason=f"{state.model_name} is not a robot policy")
        return
    await websocket.accept()
    await websocket.send_bytes(pack(processor.policy_metadata()))
    try:
        while True:
            message = await websocket.receive()
            if message["type"] == "websocket.disconnect":
                return
            if message.get("bytes") is None:  # a text frame: answered like any bad observation, the socket kept
                await websocket.send_text("bad observation: openpi observations are msgpack in binary frames, "
                                          "got a text frame")
                continue
            answer = await _infer(state, processor, message["bytes"])
            if isinstance(answer, str):
                await websocket.send_text(answer)
            else:
                await websocket.send_bytes(answer)
    except WebSocketDisconnect:
        return


async def _infer(state, processor: RobotPolicy, message: bytes) -> bytes | str:
    """One observation's answer: packed actions, or the text of what went wrong."""
    start = time.perf_counter()
    try:
        request, options = processor.observation_request(unpack(message))
        # A chunk's inputs (one observation: a few cameras at the policy's size, a short prompt) cost less
        # than handing them to a thread and back, and a robot waits on every chunk.
        stream = await start_request(state, request, options, inputs_on_loop=True)
        outputs = await stream.collect()
    except ValueError as exc:
        return f"bad observation: {exc}"
    except RequestError as exc:
        return f"request failed ({exc.status}): {exc}"
    actions = outputs["actions"][0].value
    return pack({"actions": actions, "server_timing": {"infer_ms": 1e3 * (time.perf_counter() - start)}})
