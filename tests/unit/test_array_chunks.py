"""Action and tensor chunks in both encodings (#38, #39, #40): JSON numbers and raw little-endian bytes give
the same float32 values exactly, bfloat16 is float32 rounded to nearest even with the top halves as its
bytes, numpy and torch decoders agree, and malformed chunks are refused."""

import base64

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from mstar.server.protocol import ActionChunk, GenerateResponse, TensorChunk, chunk_line, parse_chunk

RNG = np.random.default_rng(0)
LATENTS = (RNG.standard_normal((3, 5, 8)) * 10.0 ** RNG.integers(-30, 30, (3, 5, 8))).astype(np.float32)
LATENTS.flat[:4] = [np.nan, np.inf, -np.inf, -0.0]


def _through_the_wire(chunk):
    return parse_chunk(chunk_line(chunk))


@pytest.mark.parametrize("binary", [False, True])
def test_float32_is_exact_in_both_encodings(binary):
    chunk = _through_the_wire(TensorChunk.from_array("latents", 0, LATENTS, binary))
    assert (chunk.data is not None) == binary and (chunk.values is not None) != binary
    got = chunk.to_numpy()
    assert got.dtype == np.float32 and got.shape == LATENTS.shape
    np.testing.assert_array_equal(got.view(np.uint32), LATENTS.view(np.uint32))  # bit for bit, -0.0 and NaN too
    assert chunk.to_torch().dtype == torch.float32
    np.testing.assert_array_equal(chunk.to_torch().numpy().view(np.uint32), LATENTS.view(np.uint32))


@pytest.mark.parametrize("binary", [False, True])
def test_bfloat16_is_torch_rounding_and_half_the_bytes(binary):
    chunk = _through_the_wire(TensorChunk.from_array("latents", 0, LATENTS, binary, "bfloat16"))
    expected = torch.from_numpy(LATENTS).to(torch.bfloat16)
    assert chunk.dtype == "bfloat16"
    np.testing.assert_array_equal(chunk.to_numpy(), expected.float().numpy())
    tensor = chunk.to_torch()
    assert tensor.dtype == torch.bfloat16 and torch.equal(tensor.view(torch.int16), expected.view(torch.int16))
    finite = np.isfinite(LATENTS)
    rel = np.abs(chunk.to_numpy()[finite] - LATENTS[finite]) / np.maximum(np.abs(LATENTS[finite]), 1e-38)
    assert rel.max() <= 2.0**-8  # within bfloat16 rounding (8 significant bits)
    if binary:
        raw = base64.b64decode(chunk.data)
        assert len(raw) == LATENTS.size * 2
        top_halves = (expected.float().numpy().view("<u4") >> 16).astype("<u2")
        assert raw == top_halves.tobytes()


def test_actions_are_float32_in_both_encodings_and_in_a_whole_answer():
    actions = RNG.standard_normal((10, 7)).astype(np.float32)
    for binary in (False, True):
        chunk = ActionChunk.from_array("actions", 0, actions, binary, "float32")
        answer = GenerateResponse.model_validate_json(
            GenerateResponse(outputs={"actions": [chunk]}, finish_reason="stop").model_dump_json())
        np.testing.assert_array_equal(answer.outputs["actions"][0].to_numpy(), actions)
    numbers = ActionChunk.from_array("actions", 0, actions, False, "float32")
    assert all(isinstance(v, float) for v in numbers.values)


def test_integer_and_bool_tensors_keep_their_values():
    big = np.array([2**62 + 1, -3], np.int64)
    for binary in (False, True):
        np.testing.assert_array_equal(_through_the_wire(TensorChunk.from_array("ids", 0, big, binary)).to_numpy(), big)
        flags = _through_the_wire(TensorChunk.from_array("m", 0, np.array([True, False]), binary)).to_numpy()
        assert flags.dtype == np.bool_ and flags.tolist() == [True, False]


@pytest.mark.parametrize("line", [
    '{"type": "tensor", "output": "l", "seq": 0, "dtype": "float32", "shape": [2]}',  # neither form
    '{"type": "tensor", "output": "l", "seq": 0, "dtype": "float32", "shape": [1], "values": [1.0], "data": "AACAPw=="}',
    '{"type": "tensor", "output": "l", "seq": 0, "dtype": "float32", "shape": [2], "data": "AACAPw=="}',  # 1 value
    '{"type": "tensor", "output": "l", "seq": 0, "dtype": "bfloat16", "shape": [1], "data": "AACAPw=="}',  # 4 bytes
    '{"type": "action", "output": "a", "seq": 0, "dtype": "bfloat16", "shape": [1], "values": [1.0]}',
    '{"type": "tensor", "output": "l", "seq": 0, "dtype": "float32", "shape": [-1], "values": []}',
])
def test_malformed_array_chunks_are_refused(line):
    with pytest.raises(ValidationError):
        parse_chunk(line)


def test_bfloat16_model_outputs_go_out_as_their_own_bytes():
    """A bf16 tensor a worker emits becomes float32 numpy in the API process (numpy has no bfloat16) and goes
    out as exactly its bf16 bits when the request asks for tensor_dtype bfloat16."""
    from mstar.models.base import Processor

    emitted = torch.from_numpy(LATENTS).to(torch.bfloat16)
    decoded = Processor().decode_output("latents", emitted, {})
    assert decoded.dtype == np.float32
    chunk = _through_the_wire(TensorChunk.from_array("latents", 0, decoded, True, "bfloat16"))
    assert torch.equal(chunk.to_torch().view(torch.int16), emitted.view(torch.int16))
