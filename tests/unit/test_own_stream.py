"""`own_stream` engine option (engines/own_stream.py): taken out of the options before the engine is made,
and a no-op off CUDA. `tests/gpu/test_own_stream_gpu.py` serves Qwen3-Omni with it on a GPU."""

from __future__ import annotations

import torch

from mstar.config import config_from_dict
from mstar.engines.own_stream import own_stream_engine
from mstar.engines.stateless import StatelessEngine
from mstar.models.base import BuiltComponent
from mstar.runtime.build import _engine


class _Double(torch.nn.Module):
    def run_batch(self, items):
        return [{"y": item.inputs["x"] * 2} for item in items]


def test_own_stream_option_is_taken_out_and_cpu_engines_stay_plain():
    built = BuiltComponent(_Double(), {"max_batch_size": 4, "own_stream": True})
    engine = _engine("stateless", built, config_from_dict({"model": "toy"}), torch.device("cpu"))
    assert type(engine) is StatelessEngine and engine.max_batch_size == 4
    assert built.engine_options == {"max_batch_size": 4, "own_stream": True}  # the component's dict is untouched
    assert own_stream_engine(engine, torch.device("cpu")) is engine
