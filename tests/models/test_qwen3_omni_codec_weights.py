"""Checkpoint name mapping of the code predictor and Code2Wav at full size (meta tensors), dummy weights."""

from __future__ import annotations

import pytest
import torch

from mstar.models.qwen3_omni.code2wav import Code2Wav
from mstar.models.qwen3_omni.code2wav_config import Code2WavConfig
from mstar.models.qwen3_omni.code_predictor import CodePredictor
from mstar.models.qwen3_omni.code_predictor_config import CodePredictorConfig
from mstar.models.qwen3_omni.codec_weights import (
    build_code2wav,
    build_code_predictor,
    code2wav_name_mapper,
    code_predictor_name_mapper,
)
from tests.models.qwen3_omni_codec_testing import hf_code2wav_config, hf_talker_config


def _covers_exactly(ours: torch.nn.Module, hf_named_shapes: dict[str, torch.Size], mapper) -> None:
    """Every HF tensor lands on rows of one of our parameters with the same shape; every row is filled once."""
    params = dict(ours.named_parameters())
    filled = dict.fromkeys(params, 0)
    for name, shape in hf_named_shapes.items():
        target = mapper(name)
        assert target is not None, f"{name} was skipped"
        param, offset = target
        assert param in params, f"{name} -> {param}: no such parameter"
        assert params[param][offset:offset + shape[0]].shape == shape, f"{name} -> {param}[{offset}:]"
        filled[param] += shape[0]
    assert {n: r for n, r in filled.items() if r != params[n].shape[0]} == {}


def test_full_size_code_predictor_names_cover_the_hf_layout():
    from transformers.models.qwen3_omni_moe import configuration_qwen3_omni_moe as hf_cfg
    from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as hf

    cfg = CodePredictorConfig.full()
    hf_config = hf_cfg.Qwen3OmniMoeTalkerCodePredictorConfig(**hf_talker_config(cfg)["code_predictor_config"])
    with torch.device("meta"):
        ref = hf.Qwen3OmniMoeTalkerCodePredictorModelForConditionalGeneration(hf_config)
        ours = CodePredictor(cfg)
    shapes = {f"talker.code_predictor.{k}": v.shape for k, v in ref.state_dict().items()}
    shapes["talker.model.codec_embedding.weight"] = torch.Size([cfg.talker_vocab_size, cfg.hidden_size])
    _covers_exactly(ours, shapes, code_predictor_name_mapper(cfg))
    mapper = code_predictor_name_mapper(cfg)
    assert mapper("talker.codec_head.weight") is None and mapper("code2wav.code_embedding.weight") is None


def test_full_size_code2wav_names_cover_the_hf_layout():
    from transformers.models.qwen3_omni_moe import configuration_qwen3_omni_moe as hf_cfg
    from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as hf

    cfg = Code2WavConfig.full()
    with torch.device("meta"):
        ref = hf.Qwen3OmniMoeCode2Wav(hf_cfg.Qwen3OmniMoeCode2WavConfig(**hf_code2wav_config(cfg)))
        ours = Code2Wav(cfg)
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in ref.parameters())
    _covers_exactly(ours, {f"code2wav.{k}": v.shape for k, v in ref.state_dict().items()}, code2wav_name_mapper(cfg))
    assert code2wav_name_mapper(cfg)("talker.model.norm.weight") is None


@torch.no_grad()
def test_tiny_dummy_weights_run():
    cp = build_code_predictor(CodePredictorConfig.tiny(), None, load_format="dummy")
    out = cp.run_batch("talker", "code_predictor", [{"talker_hidden": torch.randn(32), "first_code": torch.tensor([3])}],
                       [{"code_predictor.temperature": 0.0}])
    assert out[0]["codes"].shape == (1, 16) and bool(out[0]["codec_embed_sum"].isfinite().all())
    c2w = build_code2wav(Code2WavConfig.tiny(), None, load_format="dummy")
    audio = c2w.run_batch("talker", "code2wav", [{"codes": out[0]["codes"].repeat(3, 1) % 32}], [{}])[0]["audio"]
    assert audio.shape == (3 * 12 - c2w.lookahead_samples,) and bool(audio.isfinite().all())


def test_load_format_errors():
    with pytest.raises(ValueError, match="load_format 'bogus'"):
        build_code2wav(Code2WavConfig.tiny(), None, load_format="bogus")
    with pytest.raises(ValueError, match="--load-format dummy"):
        build_code_predictor(CodePredictorConfig.tiny(), None)
