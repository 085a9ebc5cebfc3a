"""float32 CPU linears through oneDNN with weights packed once (`layers.linear.pack_cpu_linears`)."""

import gc

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mstar.engines.autoregressive import AutoregressiveEngine
from mstar.engines.kv_cache.config import KVCacheConfig
from mstar.layers.linear import CPU_PACKED, linear, pack_cpu_linears
from mstar.models.llama.model import build_model
from mstar.models.llama.tiny import tiny_config

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


@pytest.mark.parametrize("rows", [1, 8, 32])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear(rows, bias):
    torch.manual_seed(0)
    layer = nn.Linear(96, 160, bias=bias)
    x = torch.randn(rows, 96)
    assert CPU_PACKED.get(layer.weight) is None
    assert pack_cpu_linears(layer) == 1
    assert CPU_PACKED.get(layer.weight) is not None
    torch.testing.assert_close(linear(x, layer), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)


def test_only_float32_cpu_weights_are_packed_and_shared_ones_once():
    tied = nn.Linear(8, 8, bias=False)
    model = nn.Sequential(tied, nn.Linear(8, 8).to(torch.bfloat16), nn.Linear(8, 8, bias=False))
    model[2].weight = tied.weight  # a tied head: one weight, one packed copy
    assert pack_cpu_linears(model) == 1
    assert CPU_PACKED.get(model[1].weight) is None


def test_a_freed_weight_leaves_no_packed_copy():
    layer = nn.Linear(8, 8)
    pack_cpu_linears(layer)
    key = id(layer.weight)
    assert key in CPU_PACKED._packed
    del layer
    gc.collect()
    assert key not in CPU_PACKED._packed


def test_the_engine_packs_its_model_on_cpu():
    model = build_model(tiny_config("llama"), torch.float32)
    for p in model.parameters():
        nn.init.normal_(p, std=0.02)
    AutoregressiveEngine(model, KVCacheConfig(max_num_pages=8), "cpu")
    assert CPU_PACKED.get(model.lm_head.weight) is not None
    assert CPU_PACKED.get(model.model.layers[0].mlp.down_proj.weight) is not None
