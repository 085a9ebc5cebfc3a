"""`cuda_graphs.compile_eager`: the engine's eager forwards go through torch.compile; outputs unchanged.
The "eager" dynamo backend keeps this fast on CPU: what is tested is that the compiled callable serves
the steps (dynamo compiled frames) and that prefill and decode keep their tokens."""

import pytest
import torch

from mstar.config import CudaGraphConfig
from tests.unit.test_ar_engine import TinyLM, drive, item, make_engine, prompts, reference, tokens_of


@pytest.fixture(scope="module")
def model():
    return TinyLM()


def test_compiled_eager_forward_serves_and_matches_reference(model):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    engine = make_engine(model, cuda_graphs=CudaGraphConfig(compile_eager=True, compile_backend="eager"))
    ps = prompts(8)[2:5]
    out = drive(engine, [item(f"r{i}", p, max_tokens=5) for i, p in enumerate(ps)])
    for i, p in enumerate(ps):
        assert tokens_of(out[(f"r{i}", "main")]) == reference(model, p, 5)
    assert counters["frames"]["ok"] > 0  # dynamo compiled the forward (graph breaks are fine)
    torch._dynamo.reset()


def test_unknown_compile_backend_is_a_config_error(model):
    with pytest.raises(ValueError, match="compile_backend='nope'"):
        make_engine(model, cuda_graphs=CudaGraphConfig(compile_eager=True, compile_backend="nope"))
