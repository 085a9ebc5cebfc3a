"""Checkpoint loading: locating checkpoints, name mapping errors, dummy weights, progress, configs."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from mstar.models.common.loading import (
    CheckpointNotFoundError,
    deployment_checkpoint,
    resolve_checkpoint,
    weight_files,
)
from mstar.models.llama.config import LlamaConfig
from mstar.models.llama.tiny import tiny_hf_config
from mstar.models.llama.weights import load_model


def _save_tiny(path, name="llama"):
    """A tiny random HF checkpoint written by transformers."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(**tiny_hf_config(name))
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


def test_missing_hub_checkpoint_offline_fails_fast(monkeypatch, tmp_path):
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(CheckpointNotFoundError) as info:
        resolve_checkpoint("some-org/no-such-model")
    message = str(info.value)
    assert "some-org/no-such-model" in message and "--model-path" in message and "HF_HUB_OFFLINE" in message


def test_missing_local_path_names_it_without_the_hub(tmp_path):
    missing = tmp_path / "nowhere" / "model"
    with pytest.raises(CheckpointNotFoundError, match="--model-path") as info:
        resolve_checkpoint(missing)
    assert str(missing) in str(info.value)


def test_deployment_checkpoint_is_none_only_for_random_weights(tmp_path):
    assert deployment_checkpoint(tmp_path, False, "auto", "m", "a folder") == tmp_path
    assert deployment_checkpoint(None, True, "auto", "m", "a folder") is None
    assert deployment_checkpoint(None, False, "dummy", "m", "a folder") is None
    with pytest.raises(ValueError, match=r"m needs --model-path \(a folder\), or --load-format dummy, or --tiny"):
        deployment_checkpoint(None, False, "auto", "m", "a folder")


def test_folder_without_weights_says_what_it_looked_for(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(tiny_hf_config("llama")))
    with pytest.raises(CheckpointNotFoundError, match=r"\*\.safetensors"):
        weight_files(tmp_path)
    with pytest.raises(CheckpointNotFoundError):
        load_model(tmp_path, progress=False)


def test_unexpected_and_missing_tensors_are_named(tmp_path):
    path = _save_tiny(tmp_path)
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.0.self_attn.extra_proj.weight"] = torch.zeros(2, 2)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ValueError) as info:
        load_model(path, progress=False)
    message = str(info.value)
    assert "model.layers.0.self_attn.extra_proj.weight" in message
    assert "model.layers.1.mlp.gate_up_proj.weight" in message  # up_proj fills half of it


def test_shape_mismatch_blames_the_config(tmp_path):
    path = _save_tiny(tmp_path)
    config = json.loads((path / "config.json").read_text())
    config["intermediate_size"] = 96
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"mlp\.\w+_proj\.weight has shape.*config.json does not match"):
        load_model(path, progress=False)


def test_dummy_weights_need_no_weight_files_and_are_seeded(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(tiny_hf_config("qwen3")))
    first = load_model(tmp_path, load_format="dummy", dtype=torch.float32)
    second = load_model(tmp_path, load_format="dummy", dtype=torch.float32)
    for (name, a), b in zip(first.named_parameters(), second.parameters(), strict=True):
        assert torch.isfinite(a).all() and torch.equal(a, b), name
    assert torch.equal(first.model.norm.weight, torch.ones(64))
    assert 0.01 < first.model.embed_tokens.weight.std().item() < 0.05


def test_unknown_load_format_lists_choices(tmp_path):
    with pytest.raises(ValueError, match="dummy"):
        load_model(tmp_path, load_format="pickle")


def test_progress_bar_goes_to_stderr_and_can_be_disabled(tmp_path, capfd):
    path = _save_tiny(tmp_path)
    capfd.readouterr()
    load_model(path, progress=True)
    out, err = capfd.readouterr()
    assert "Loading weights" in err and "Loading weights" not in out
    load_model(path, progress=False)
    assert "Loading weights" not in capfd.readouterr().err


def test_unsupported_architecture_lists_supported():
    cfg = {**tiny_hf_config("llama"), "model_type": "mistral", "architectures": ["MistralForCausalLM"]}
    with pytest.raises(ValueError, match="'mistral'.*llama.*qwen2.*qwen3"):
        LlamaConfig.from_hf(cfg)


def test_rope_config_old_and_new_layouts_agree():
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    old = {**tiny_hf_config("llama"), "rope_theta": 500000.0, "rope_scaling": scaling}
    new = {**tiny_hf_config("llama"), "rope_parameters": {**scaling, "rope_theta": 500000.0}}
    new.pop("rope_theta")
    assert LlamaConfig.from_hf(old).rope == LlamaConfig.from_hf(new).rope
    assert (
        LlamaConfig.from_hf(old).rope.rope_type == "llama3"
        and LlamaConfig.from_hf(old).rope.theta == 500000.0
    )


def test_bad_rope_type_and_heads_are_rejected():
    with pytest.raises(ValueError, match="yarn"):
        LlamaConfig.from_hf({**tiny_hf_config("llama"), "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ValueError, match="num_key_value_heads"):
        LlamaConfig.from_hf({**tiny_hf_config("llama"), "num_key_value_heads": 3})


def test_dummy_weights_give_norm_scales_one_and_every_bias_zero():
    from mstar.models.common.loading import fill_dummy_weights

    block = torch.nn.ModuleDict({"proj": torch.nn.Linear(4, 4), "layer_norm": torch.nn.LayerNorm(4),
                                 "final_norm": torch.nn.LayerNorm(4, elementwise_affine=True)})
    fill_dummy_weights(block, seed=3)
    assert torch.equal(block["layer_norm"].weight, torch.ones(4))
    assert torch.equal(block["layer_norm"].bias, torch.zeros(4))  # a norm's bias is a bias, not a scale
    assert torch.equal(block["final_norm"].bias, torch.zeros(4))
    assert torch.equal(block["proj"].bias, torch.zeros(4)) and block["proj"].weight.std() > 0
