"""Quantize on load: a model built with `quantization` holds empty FP8 linears from the start and each is
quantized as its weight is read (or drawn, for dummy weights), giving the same bytes as loading the
full-precision model and quantizing it; while loading, the full-precision tensors alive at once stay
within a few layers, where loading then quantizing holds every quantized layer in full precision."""

from __future__ import annotations

import weakref
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from mstar.layers.fp8 import FP8_DTYPE, Fp8Linear, quantize_linears
from mstar.models.llama.weights import load_model

_LAYERS = 16  # many small layers, so one layer's transient bytes are far below the whole decoder's


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    import transformers

    path = tmp_path_factory.mktemp("deep_llama")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=_LAYERS,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for param in hf.parameters():
            param.normal_(0.0, 0.3)
    hf.save_pretrained(path)
    return path


class LiveBytes(TorchDispatchMode):
    """The peak bytes of non-FP8 floating-point storages (meta tensors have none) made inside the mode and
    alive at once, each
    followed until its storage is freed (whichever tensors or parameters share it)."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}  # id of a storage's (preserved) Python object -> its bytes
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != FP8_DTYPE and not t.is_meta:
                storage = t.untyped_storage()
                if id(storage) not in self.live:
                    self.live[id(storage)] = storage.nbytes()
                    weakref.finalize(storage, self.live.pop, id(storage), None)
                    self.peak = max(self.peak, sum(self.live.values()))
        return out


def _fp8_layers(model) -> dict[str, Fp8Linear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, Fp8Linear)}


@pytest.mark.parametrize("load_format", ["auto", "dummy"])
@pytest.mark.parametrize("method,block", [("fp8", None), ("fp8_block", (128, 128))])
def test_quantized_on_load_as_loading_then_quantizing(checkpoint, load_format, method, block):
    got = load_model(checkpoint, load_format, dtype=torch.bfloat16, progress=False, quantization=method)
    want = load_model(checkpoint, load_format, dtype=torch.bfloat16, progress=False)
    quantize_linears(want.model.layers, block)
    got_layers, want_layers = _fp8_layers(got), _fp8_layers(want)
    assert sorted(got_layers) == sorted(want_layers) and len(got_layers) == 4 * _LAYERS
    for name, layer in want_layers.items():
        assert got_layers[name].block == block
        assert torch.equal(got_layers[name].weight.view(torch.uint8), layer.weight.view(torch.uint8)), name
        assert torch.equal(got_layers[name].weight_scale, layer.weight_scale), name
    assert torch.equal(got.lm_head.weight, want.lm_head.weight)


@pytest.mark.parametrize("load_format", ["auto", "dummy"])
def test_no_full_precision_decoder_is_held_while_loading(checkpoint, load_format):
    """Peak live full-precision bytes while loading with `quantization`: the unquantized parameters
    (embedding, head, norms) plus at most `layer_copies` of the largest quantized layer in bfloat16 (gate_up):
    its buffer (1), quantize_per_channel's float32 temporaries (3 float32 copies = 6) and the float32
    checkpoint tensors of its halves (2), with a little room for small tensors (measured: 9.4). Loading
    then quantizing holds every quantized layer at once (36 of them here)."""
    layer_copies = 10
    with LiveBytes() as fp8_meter:
        model = load_model(checkpoint, load_format, dtype=torch.bfloat16, progress=False, quantization="fp8")
    with LiveBytes() as bf16_meter:
        full = load_model(checkpoint, load_format, dtype=torch.bfloat16, progress=False)
        quantize_linears(full.model.layers, None)
    layers = _fp8_layers(model).values()
    kept = sum(p.numel() * p.element_size() for p in model.parameters() if p.dtype != FP8_DTYPE
               and not any(p is layer.weight_scale or p is layer.bias for layer in layers))
    quantized = sum(layer.weight.numel() * 2 for layer in layers)  # their bfloat16 bytes
    largest = max(layer.weight.numel() * 2 for layer in layers)
    assert quantized > 2 * layer_copies * largest  # the bound below can tell the two apart
    assert fp8_meter.peak <= kept + layer_copies * largest, (fp8_meter.peak, kept, largest)
    assert bf16_meter.peak >= kept + quantized, (bf16_meter.peak, kept, quantized)
