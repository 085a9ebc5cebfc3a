"""BAGEL with FP8 LLM weights (`quantization: {llm: fp8}`): which linears are quantized (both experts' decoder
linears, nothing else), the MoT LLM's logits and velocities against float32 on CPU (the weight-only path, and the
W8A8 emulation of what CUDA runs from 16 rows), a served tiny model's greedy answer and image against float32's,
the weights the memory plan counts, and the config checks."""

from __future__ import annotations

import argparse

import numpy as np
import pytest
import torch
from torch import nn

from mstar.config import ConfigError, config_from_dict
from mstar.layers import fp8
from mstar.layers import linear as linear_module
from mstar.layers.fp8 import Fp8Linear
from mstar.models.bagel.context import PackedAttention, QuerySpec
from mstar.models.bagel.llm import BagelLLM, Routing
from mstar.models.bagel.tiny import tiny_config
from mstar.models.bagel.weights import load_part
from mstar.runtime.build import build_model
from mstar.runtime.offline import MStar

pytestmark = pytest.mark.usefixtures("one_thread")
CFG = tiny_config()
EXPERT_LINEARS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
FP8_CONFIG = {"model": "bagel", "quantization": {"llm": "fp8"}}


def _llm(quantization: str | None) -> BagelLLM:
    module = load_part("llm", CFG, None, torch.float32, "cpu", seed=3, std=0.2, quantization=quantization)
    assert isinstance(module, BagelLLM)
    return module


def _fp8_names(module: nn.Module) -> set[str]:
    return {name for name, m in module.named_modules() if isinstance(m, Fp8Linear)}


def test_only_both_experts_decoder_linears_are_fp8():
    model = _llm("fp8")
    want = {f"language_model.layers.{i}.{block}{suffix}.{proj}" for i in range(CFG.llm.num_layers)
            for block, proj in (p.split(".") for p in EXPERT_LINEARS) for suffix in ("", "_moe_gen")}
    assert _fp8_names(model) == want and len(want) == 8 * CFG.llm.num_layers
    for kept in ("language_model.lm_head", "vae2llm", "llm2vae"):
        assert type(model.get_submodule(kept)) is nn.Linear, kept
    assert type(model.language_model.embed_tokens) is nn.Embedding
    assert not any(isinstance(m, Fp8Linear) for m in model.time_embedder.modules())


def test_fp8_dummy_llm_is_the_float32_one_quantized():
    """Dummy weights are drawn in full precision and quantized, so the FP8 model is the full-precision model of the
    same seed quantized: what lets the benchmark's PSNR compare the two."""
    ref, quantized = _llm(None), _llm("fp8")
    for name in _fp8_names(quantized):
        got, want = quantized.get_submodule(name), Fp8Linear.from_linear(ref.get_submodule(name), None)
        assert torch.equal(got.weight.view(torch.uint8), want.weight.view(torch.uint8)), name
        assert torch.equal(got.weight_scale, want.weight_scale), name
        assert (got.bias is None) == (want.bias is None) and (got.bias is None or torch.equal(got.bias, want.bias))


@torch.no_grad()
def _forward(llm: BagelLLM) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 (logits of 12 text rows, velocities of 32 latent rows) of one packed sequence: text, then a
    denoising block (two markers around the latents) that the generation expert takes whole."""
    g = torch.Generator().manual_seed(0)
    lm, n = llm.language_model, 32
    ids = torch.randint(0, CFG.llm.vocab_size, (12,), generator=g)
    latents = torch.randn(n, CFG.patch_latent_dim, generator=g)
    marker = lm.embed_tokens(ids[:1])
    x = torch.cat([lm.embed_tokens(ids), marker, llm.latent_embeds(latents, torch.full((n,), 0.7), torch.arange(n)),
                   marker])
    is_gen = torch.zeros(x.shape[0], dtype=torch.bool)
    is_gen[13:13 + n] = True
    t = x.shape[0]
    hidden = lm(x, torch.arange(t), Routing.of(is_gen), PackedAttention([QuerySpec(None, t, "full")],
                                                                        lm.attention_scale))
    return lm.logits(hidden[:12]), llm.velocity(hidden[is_gen])


def _rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm()).item()


@pytest.mark.parametrize("path", ["weight_only", "w8a8"])
def test_fp8_logits_and_velocities_stay_close_to_float32(monkeypatch, path):
    """E4M3 keeps 3 mantissa bits to bfloat16's 7, so FP8 weights err about 16x what bfloat16 weights do. Both
    outputs' errors are held to 4x-32x those of the same LLM with its decoder linears rounded to bfloat16 (twice
    that for W8A8, whose per-token E4M3 activations add about half again, emulated by `w8a8_reference`), and the
    text rows' KL to under 0.02. Measured on this sharp random model (its bfloat16 errors are 0.53% logits, 0.44%
    velocities): weight-only 6.4% / 5.2% (12x), KL 0.0040; W8A8 9.2% / 7.6% (17x), KL 0.0076."""
    if path == "w8a8":
        monkeypatch.setattr(linear_module, "fp8_linear", fp8.w8a8_reference)  # what `linear` runs for an Fp8Linear
    ref = _llm(None)
    want_logits, want_velocity = _forward(ref)
    got_logits, got_velocity = _forward(_llm("fp8"))
    with torch.no_grad():
        for module in ref.language_model.layers.modules():
            if isinstance(module, nn.Linear):
                module.weight.copy_(module.weight.bfloat16())
    bf16_logits, bf16_velocity = _forward(ref)
    scale = 2 if path == "w8a8" else 1
    for got, bf16, want in ((got_logits, bf16_logits, want_logits), (got_velocity, bf16_velocity, want_velocity)):
        fp8_error, bf16_error = _rel_error(got, want), _rel_error(bf16, want)
        assert 4 * bf16_error < fp8_error < 32 * scale * bf16_error, (fp8_error, bf16_error)
    kl = (want_logits.softmax(-1) * (want_logits.log_softmax(-1) - got_logits.log_softmax(-1))).sum(-1)
    assert kl.mean() < 0.02, kl


PROMPTS = ("What is in this picture? Describe the colors.", "The answer is a cat. There are two cups")


def _served(m: MStar) -> tuple[list[list[int]], list[np.ndarray]]:
    """Greedy answers (24 tokens) to PROMPTS and two 64x64 images of 8 steps (seeds 0 and 1)."""
    answers = [m.submit({"text": p}, max_tokens=24, ignore_eos=True, temperature=0.0).result() for p in PROMPTS]
    images = [m.submit({"text": "a red fox in the snow"}, modalities=["image"], num_inference_steps=8,
                       seed=seed).result().outputs["image"][0] for seed in (0, 1)]
    return [[int(t) for t in a.outputs["text"]] for a in answers], [np.asarray(i, dtype=np.float64) for i in images]


def _psnr(image: np.ndarray, reference: np.ndarray) -> float:
    mse = ((image - reference) ** 2).mean()
    return float("inf") if mse == 0 else float(10 * np.log10(255.0**2 / mse))


def test_served_fp8_answers_and_draws_close_to_float32():
    """The tiny model served with `quantization: {llm: fp8}` holds FP8 linears in its llm component only and answers
    and draws close to float32, but not identically (quantization is not skipped). Greedy answers on random weights
    follow near-ties, so only a prefix is held: measured 18 and 20 of 24 tokens agree, 8 are required. Images:
    measured 28.1 and 25.4 dB PSNR against float32 (bfloat16-rounded decoder linears: 50.0 and 49.8 dB; an image
    of another seed: 5.7 dB); held to 20-45 dB."""
    with MStar("bagel", tiny=True) as m:
        want_answers, want_images = _served(m)
        llm = m.runtime.workers[0].engines["llm"].module.llm
        with torch.no_grad():
            for module in llm.language_model.layers.modules():
                if isinstance(module, nn.Linear):
                    module.weight.copy_(module.weight.bfloat16())
        _, bf16_images = _served(m)
    with MStar("bagel", FP8_CONFIG, tiny=True) as m:
        engines = m.runtime.workers[0].engines
        assert len(_fp8_names(engines["llm"].module)) == 8 * CFG.llm.num_layers
        assert not _fp8_names(engines["vit"].module) and not _fp8_names(engines["vae"].module)
        got_answers, got_images = _served(m)
    for got, want in zip(got_answers, want_answers, strict=True):
        assert got[:8] == want[:8], (got, want)
    for got, bf16, want in zip(got_images, bf16_images, want_images, strict=True):
        assert 20 < _psnr(got, want) < 45 < _psnr(bf16, want), (_psnr(got, want), _psnr(bf16, want))


def test_the_quantization_flag_reaches_the_llm_and_the_memory_plan_counts_fp8_bytes():
    from mstar.cli.main import apply_quantization_flag
    from mstar.runtime import memory_plan

    flagged = apply_quantization_flag(config_from_dict({"model": "bagel"}), argparse.Namespace(quantization="fp8"))
    assert flagged.quantization == {"llm": "fp8"}

    def weight_bytes(config: dict) -> tuple[int, int]:
        config = config_from_dict({**config, "model_kwargs": {"dtype": "bfloat16"}})
        (plan,) = memory_plan.plan_memory(config, [64 << 30], tiny=True)
        module = build_model(config, tiny=True).build_component("llm", torch.device("cpu")).module
        built = sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])
        return next(n.weight_bytes for n in plan.needs if n.name == "llm"), built

    planned, built = weight_bytes(FP8_CONFIG)
    plain, _ = weight_bytes({"model": "bagel"})
    assert planned == built < plain


@pytest.mark.parametrize("quantization,match", [
    ({"vit": "fp8"}, r"component 'vit' of model 'bagel' cannot be quantized; quantizable: \['llm'\]"),
    ({"vae": "fp8"}, r"component 'vae' .* cannot be quantized"),
    ({"llm": "int4"}, r"quantization.llm='int4': use one of \['fp8', 'fp8_block'\]"),
])
def test_config_validation(quantization, match):
    config = config_from_dict({"model": "bagel", "quantization": quantization}, source="bagel.yaml")
    with pytest.raises(ConfigError, match=match):
        build_model(config, tiny=True)
    assert build_model(config_from_dict(FP8_CONFIG), tiny=True).quantization == {"llm": "fp8"}
    with pytest.raises(ValueError, match="bagel 'vae' cannot be quantized"):
        load_part("vae", CFG, None, torch.float32, "cpu", quantization="fp8")
