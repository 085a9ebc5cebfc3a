"""FP8 weights for the dense decoder: FP8 checkpoints in the Hugging Face formats (fine-grained block
scales, compressed-tensors per channel), written here from a tiny float32 checkpoint with the reference
formulas, load to the same weights as quantizing the float32 one on load; a quantized model's logits stay
close to the unquantized one's; a tiny Llama served with FP8 weights answers as its module does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mstar.layers.fp8 import Fp8Linear, quantize_linears
from mstar.models.llama.weights import load_model
from tests.models.llama_testing import greedy, save_hf_model

_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _quantize(w: torch.Tensor, block: tuple[int, int] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference E4M3 quantization: s = amax / 448 per row or per block, q = saturate(w / s)."""
    w = w.float()
    if block is None:
        scale = w.abs().amax(dim=1, keepdim=True) / 448.0
        full = scale
    else:
        bn, bk = block
        n, k = w.shape
        scale = w.reshape(n // bn, bn, k // bk, bk).abs().amax(dim=(1, 3)) / 448.0
        full = torch.kron(scale, torch.ones(bn, bk))
    return (w / full).clamp(-448.0, 448.0).to(torch.float8_e4m3fn), scale


def _write_fp8_checkpoint(src: Path, dst: Path, quantization_config: dict, scale_name: str,
                          block: tuple[int, int] | None) -> None:
    dst.mkdir()
    tensors = {}
    for name, tensor in load_file(src / "model.safetensors").items():
        if name.endswith(".weight") and name.split(".")[-2] in _LINEARS:
            q, scale = _quantize(tensor, block)
            tensors[name] = q
            tensors[name.removesuffix("weight") + scale_name] = scale
        else:
            tensors[name] = tensor
    save_file(tensors, dst / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, "quantization_config": quantization_config}))


FORMATS = {
    "fp8": ({"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 32],
             "modules_to_not_convert": ["lm_head"]}, "weight_scale_inv", (32, 32)),
    "compressed-tensors": ({"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
                            "config_groups": {"group_0": {
                                "targets": ["Linear"],
                                "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True,
                                            "dynamic": False},
                                "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                                                      "dynamic": True}}}},
                           "weight_scale", None),
}


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny_llama")
    save_hf_model("llama", path)
    return path


def _fp8_layers(model) -> dict[str, Fp8Linear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, Fp8Linear)}


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_an_fp8_checkpoint_loads_as_quantizing_the_float32_one(tiny_checkpoint, tmp_path, fmt):
    qc, scale_name, block = FORMATS[fmt]
    _write_fp8_checkpoint(tiny_checkpoint, tmp_path / "fp8", qc, scale_name, block)
    loaded = load_model(tmp_path / "fp8", dtype=torch.float32, progress=False)
    quantized = load_model(tiny_checkpoint, dtype=torch.float32, progress=False)
    quantize_linears(quantized.model.layers, block)  # as --quantization does, at the checkpoint's block size
    got, want = _fp8_layers(loaded), _fp8_layers(quantized)
    assert sorted(got) == sorted(want) and len(got) == 4 * 2  # qkv, o, gate_up, down of both layers
    for name in want:
        assert got[name].block == want[name].block == block
        assert torch.equal(got[name].weight.view(torch.uint8), want[name].weight.view(torch.uint8)), name
        assert torch.equal(got[name].weight_scale, want[name].weight_scale), name
    assert type(loaded.lm_head) is torch.nn.Linear and torch.equal(loaded.lm_head.weight, quantized.lm_head.weight)


def test_static_activation_scales_and_misaligned_blocks_are_refused(tiny_checkpoint, tmp_path):
    qc, scale_name, block = FORMATS["compressed-tensors"]
    static = json.loads(json.dumps(qc))
    static["config_groups"]["group_0"]["input_activations"]["dynamic"] = False
    _write_fp8_checkpoint(tiny_checkpoint, tmp_path / "static", static, scale_name, block)
    with pytest.raises(ValueError, match="static activation scales"):
        load_model(tmp_path / "static", progress=False)
    wide = {**FORMATS["fp8"][0], "weight_block_size": [64, 32]}  # k_proj starts at row 64, v_proj at 96
    _write_fp8_checkpoint(tiny_checkpoint, tmp_path / "wide", wide, "weight_scale_inv", (32, 32))
    with pytest.raises(ValueError, match="not on a 64-row scale block"):
        load_model(tmp_path / "wide", progress=False)


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    from tests.models.llama_testing import DenseAttention

    with torch.no_grad():
        return model.compute_logits(model(ids, torch.arange(len(ids)), DenseAttention()))


@pytest.mark.parametrize("method", ["fp8", "fp8_block"])
def test_fp8_logits_stay_close_to_float32(tiny_checkpoint, method):
    """FP8 keeps 3 mantissa bits to bfloat16's 7: its logit error is bfloat16 weights' error times about 16
    (measured 22x per channel, 18x in blocks on this sharp random model), and no more than 32x."""
    ids = torch.tensor([1, 5, 9, 200, 17, 3, 44, 101])
    ref = load_model(tiny_checkpoint, dtype=torch.float32, progress=False)
    want = _logits(ref, ids)
    with torch.no_grad():
        for layer in ref.model.layers:
            for module in layer.modules():
                if isinstance(module, torch.nn.Linear):
                    module.weight.copy_(module.weight.bfloat16())
    bf16_error = ((_logits(ref, ids) - want).norm() / want.norm()).item()
    got = _logits(load_model(tiny_checkpoint, dtype=torch.float32, progress=False, quantization=method), ids)
    fp8_error = ((got - want).norm() / want.norm()).item()
    assert 4 * bf16_error < fp8_error < 32 * bf16_error, (fp8_error, bf16_error)
    kl = (want.softmax(-1) * (want.log_softmax(-1) - got.log_softmax(-1))).sum(-1)
    assert kl.mean() < 0.1, kl  # measured 0.039 (per channel); random weights give near-ties, so no argmax check


def test_a_tiny_llama_served_in_fp8_answers_as_its_module(tmp_path):
    from mstar.runtime.offline import MStar
    from tests.models.llm_runtime_testing import PROMPTS, make_checkpoint, token_ids

    _, tok = make_checkpoint("llama", tmp_path)
    config = {"model": "llama", "device": "cpu", "kv_cache": {"max_num_pages": 64}, "quantization": {"llm": "fp8"}}
    with MStar("llama", config=config, model_path=str(tmp_path)) as m:
        got = [token_ids(m.submit({"text": p}, temperature=0.0, ignore_eos=True, max_tokens=12)) for p in PROMPTS[:2]]
    module = load_model(tmp_path, dtype=torch.float32, progress=False, quantization="fp8")
    assert len(_fp8_layers(module)) == 8
    with torch.no_grad():
        assert got == [greedy(module, tok.encode(p), 12) for p in PROMPTS[:2]]
