"""Qwen3-Omni with FP8 weights (`quantization: {thinker: fp8, talker: fp8}`): which layers are FP8
(attention, dense MLPs, the talker's shared experts, the routed experts with row scales; never routers),
quantize-on-load through the thinker's checkpoint mapper (fused q/k/v, one expert's gate and up at a time),
the thinker's logits against float32, the bytes the memory plan counts, and the config checks."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mstar.config import ConfigError, config_from_dict
from mstar.layers.fp8 import Fp8Linear, quantize_linears, quantize_per_channel
from mstar.models.qwen3_omni.decoder import ROUTER_GATES
from mstar.models.qwen3_omni.tiny import tiny_hf_config
from mstar.models.qwen3_omni.weights import load_thinker
from mstar.runtime.build import build_model
from tests.models.qwen3_omni_testing import FullAttention, randomize, save_checkpoint

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py
QUANTIZED = {"thinker": "fp8", "talker": "fp8"}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from transformers.models.qwen3_omni_moe import configuration_qwen3_omni_moe as C
    from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as M

    cfg = tiny_hf_config()
    hf = M.Qwen3OmniMoeThinkerForConditionalGeneration(C.Qwen3OmniMoeConfig(**cfg).thinker_config).eval()
    randomize(hf, seed=0, std=0.1)
    path = tmp_path_factory.mktemp("omni_fp8")
    save_checkpoint(path, {"thinker": hf}, cfg)
    return path


def _fp8(module: nn.Module) -> dict[str, Fp8Linear]:
    return {name: m for name, m in module.named_modules() if isinstance(m, Fp8Linear)}


def _expected(layers: nn.ModuleList) -> set[str]:
    """Every linear of the decoder layers but the routers' and shared-expert gates."""
    return {f"model.layers.{name}" for name, m in layers.named_modules()
            if isinstance(m, nn.Linear) and not name.endswith(ROUTER_GATES)}


def _row_quantized(experts) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Full-precision stacked experts quantized per row, as FP8 experts hold them."""
    out = []
    for weight in (experts.gate_up_proj, experts.down_proj):
        q, s = quantize_per_channel(weight.detach().reshape(-1, weight.shape[-1]))
        out += [q.view(weight.shape), s.view(weight.shape[:-1])]
    return tuple(out)


def test_thinker_and_talker_quantize_linears_and_experts_not_routers():
    model = build_model(config_from_dict({"model": "qwen3_omni", "quantization": QUANTIZED}), tiny=True)
    plain = build_model(config_from_dict({"model": "qwen3_omni"}), tiny=True)
    for name in QUANTIZED:
        got = model.build_component(name, torch.device("cpu")).module
        want = plain.build_component(name, torch.device("cpu")).module
        want = getattr(want, "talker", want)  # the talker component wraps its backbone
        got = getattr(got, "talker", got)
        assert set(_fp8(got)) == _expected(want.model.layers), name
        names = set(_fp8(got))
        assert any(n.endswith("self_attn.qkv_proj") for n in names) and any(n.endswith("o_proj") for n in names)
        assert not any(n.endswith(ROUTER_GATES) for n in names)
        assert all(type(m) is not Fp8Linear for m in (got.model.norm,))
    talker = model.build_component("talker", torch.device("cpu")).module.talker
    assert any(n.endswith("shared_expert.down_proj") for n in _fp8(talker))
    thinker = model.build_component("thinker", torch.device("cpu")).module
    assert any(n.endswith("mlp.gate_up_proj") for n in _fp8(thinker))  # layer 1 is dense (mlp_only_layers)
    experts = thinker.model.layers[0].mlp.experts
    assert experts.fp8 and experts.gate_up_proj.dtype == experts.down_proj.dtype == torch.float8_e4m3fn
    assert experts.gate_up_scale.shape == experts.gate_up_proj.shape[:2]
    assert thinker.model.layers[0].mlp.gate.weight.dtype == torch.float32  # the router stays


def test_quantized_on_load_as_loading_then_quantizing(folder):
    got = load_thinker(folder, dtype=torch.bfloat16, progress=False, quantization="fp8")
    want = load_thinker(folder, dtype=torch.bfloat16, progress=False)
    quantize_linears(want.model.layers, None, only={n.removeprefix("model.layers.") for n in _fp8(got)})
    assert set(_fp8(got)) == set(_fp8(want)) == _expected(load_thinker(folder, progress=False).model.layers)
    for name, layer in _fp8(want).items():
        assert torch.equal(_fp8(got)[name].weight.view(torch.uint8), layer.weight.view(torch.uint8)), name
        assert torch.equal(_fp8(got)[name].weight_scale, layer.weight_scale), name
    for got_layer, want_layer in zip(got.model.layers, want.model.layers, strict=True):
        if not hasattr(want_layer.mlp, "experts"):
            continue  # a dense layer
        e = got_layer.mlp.experts
        gate_up, gate_up_scale, down, down_scale = _row_quantized(want_layer.mlp.experts)
        assert torch.equal(e.gate_up_proj.view(torch.uint8), gate_up.view(torch.uint8))
        assert torch.equal(e.down_proj.view(torch.uint8), down.view(torch.uint8))
        assert torch.equal(e.gate_up_scale, gate_up_scale) and torch.equal(e.down_scale, down_scale)


def test_fp8_thinker_logits_stay_close_to_float32(folder):
    """FP8 weights err about 16x what bfloat16 weights do (3 mantissa bits to 7): the logit error is held
    to 4x-32x that of the same thinker with the same layers and experts rounded to bfloat16 (measured 14x:
    7.7% against 0.54% on this sharp random model)."""
    ids = torch.randint(0, 300, (13,), generator=torch.Generator().manual_seed(1))

    def logits(model) -> torch.Tensor:
        with torch.no_grad():
            return model.compute_logits(model(ids, torch.arange(13), FullAttention()))

    ref = load_thinker(folder, dtype=torch.float32, progress=False)
    want = logits(ref)
    got = logits(load_thinker(folder, dtype=torch.float32, progress=False, quantization="fp8"))
    with torch.no_grad():
        for name in _expected(ref.model.layers):
            weight = ref.get_submodule(name).weight
            weight.copy_(weight.bfloat16())
        for layer in ref.model.layers:
            if hasattr(layer.mlp, "experts"):
                for weight in (layer.mlp.experts.gate_up_proj, layer.mlp.experts.down_proj):
                    weight.copy_(weight.bfloat16())
    bf16_error = ((logits(ref) - want).norm() / want.norm()).item()
    fp8_error = ((got - want).norm() / want.norm()).item()
    assert 4 * bf16_error < fp8_error < 32 * bf16_error, (fp8_error, bf16_error)


def test_memory_plan_counts_the_built_fp8_bytes():
    from mstar.runtime import memory_plan

    def weights(quantization: dict) -> dict[str, int]:
        config = config_from_dict({"model": "qwen3_omni", "model_kwargs": {"dtype": "bfloat16"},
                                   "quantization": quantization})
        (plan,) = memory_plan.plan_memory(config, [64 << 30], tiny=True)
        return {n.name: n.weight_bytes for n in plan.needs}

    fp8, plain = weights(QUANTIZED), weights({})
    model = build_model(config_from_dict({"model": "qwen3_omni", "model_kwargs": {"dtype": "bfloat16"},
                                          "quantization": QUANTIZED}), tiny=True)
    for name in QUANTIZED:
        module = model.build_component(name, torch.device("cpu")).module
        assert fp8[name] == sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])
        assert fp8[name] < plain[name], name
    assert {k: v for k, v in fp8.items() if k not in QUANTIZED} == {k: v for k, v in plain.items() if k not in QUANTIZED}


def test_only_thinker_and_talker_can_be_quantized():
    config = config_from_dict({"model": "qwen3_omni", "quantization": {"code_predictor": "fp8"}}, source="o.yaml")
    with pytest.raises(ConfigError, match=r"code_predictor.*cannot be quantized; quantizable: \['thinker', 'talker'\]"):
        build_model(config, tiny=True)


def test_tiny_model_served_with_fp8_speaks():
    """Served end to end with FP8 thinker and talker (CPU: the weight-only linears and the per-expert loop)."""
    from mstar.runtime.offline import MStar

    chat = {"messages": [{"role": "user", "content": "Say hello to the assistant."}]}
    config = {"model": "qwen3_omni", "device": "cpu", "model_kwargs": {"code2wav_chunk": 4}, "quantization": QUANTIZED}
    with MStar("qwen3_omni", config=config, tiny=True) as m:
        spoken = m.generate(chat, temperature=0.0, max_tokens=6, modalities=["text", "audio"], voice="Aiden",
                            **{"talker.temperature": 0.0, "talker.max_tokens": 12})
        thinker = m.runtime.workers[0].engines["thinker"].runner.model
    assert isinstance(thinker.model.layers[0].self_attn.qkv_proj, Fp8Linear)
    assert "".join(spoken.outputs["text"]) and sum(len(a) for a in spoken.outputs["audio"]) > 0
