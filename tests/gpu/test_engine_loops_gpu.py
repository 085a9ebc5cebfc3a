"""Engine loops on CUDA (CUDA graphs, lookahead, the vocoder on its side stream): tiny Orpheus and tiny
Llama in float32 give each request the same outputs with the decode loop run by the engine (with
lookahead and step graphs) and run iteration by iteration by the walk interpreter (without them).

On a GPU the vocoder's results come out once their host copies are done, so the steps of the two
runs may interleave requests differently: each request's own events are compared (tokens exactly,
audio within float tolerance), not the global order (the CPU test, tests/models/test_engine_loops.py,
compares that too)."""

from __future__ import annotations

import pytest
import torch

from tests.models.test_engine_loops import CASES, run_tiny

pytestmark = pytest.mark.gpu


def _per_request(events: list[tuple]) -> dict[str, dict[str, list]]:
    out: dict[str, dict[str, list]] = {}
    for event in events:
        rid, name = event[0], event[1]
        out.setdefault(rid, {}).setdefault(name, []).append(event[2:])
    return out


@pytest.mark.parametrize("model_name", sorted(CASES))
def test_engine_loops_give_each_request_the_same_outputs_on_cuda(model_name):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    kwargs = {"dtype": "float32"}
    engine = _per_request(run_tiny(model_name, True, "cuda", kwargs))
    generic = _per_request(run_tiny(model_name, False, "cuda", kwargs))
    assert engine.keys() == generic.keys()
    for rid in engine:
        if rid == "cancelled":  # where it was cut depends on timing
            assert engine[rid]["finish"][0][0] == generic[rid]["finish"][0][0] == "cancelled"
            continue
        assert engine[rid]["finish"] == generic[rid]["finish"], rid
        assert engine[rid].keys() == generic[rid].keys(), rid
        for name in engine[rid]:
            if name == "audio":
                assert len(engine[rid][name]) == len(generic[rid][name]), rid
                for (seq_a, a), (seq_b, b) in zip(engine[rid][name], generic[rid][name], strict=True):
                    assert seq_a == seq_b
                    torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-3, rtol=1e-3)
            elif name != "finish":
                assert engine[rid][name] == generic[rid][name], (rid, name)
