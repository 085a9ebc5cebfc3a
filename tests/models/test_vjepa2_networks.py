"""V-JEPA 2's encoder, mask predictor and classifier head at tiny size against transformers (float32),
loaded from a Hugging Face folder the reference wrote; full-size name and shape mapping on the meta device."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mstar.models.common.loading import load_named_tensors
from mstar.models.common.meta import build_on_meta
from mstar.models.vjepa2.config import VITG_FPC64_256, VITL_FPC64_256, VJEPA2Config
from mstar.models.vjepa2.tiny import TINY_CLASSIFIER_HF, TINY_LABELS
from mstar.models.vjepa2.weights import hf_mapper, load_hf_part, part_factory, read_hf_config

transformers = pytest.importorskip("transformers")
TOL = 1e-4


def randomize(module: torch.nn.Module, seed: int) -> None:
    """Non-trivial values everywhere (norm scales around 1), so a mis-mapped tensor cannot hide."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            is_scale = param.ndim == 1 and name.endswith("weight") and "norm" in name
            param.copy_(1 + 0.1 * noise if is_scale else 0.2 * noise)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """A tiny VJEPA2ForVideoClassification folder written by transformers."""
    torch.manual_seed(0)
    reference = transformers.VJEPA2ForVideoClassification(transformers.VJEPA2Config(**TINY_CLASSIFIER_HF))
    randomize(reference, 1)
    root = tmp_path_factory.mktemp("vjepa2_tiny")
    reference.save_pretrained(root)
    return root


@pytest.fixture(scope="module")
def reference(folder: Path):
    return transformers.VJEPA2ForVideoClassification.from_pretrained(folder).eval()


def _video(batch: int, frames: int, seed: int) -> torch.Tensor:
    return torch.randn(batch, frames, 3, 32, 32, generator=torch.Generator().manual_seed(seed))


def test_config_reads_the_hf_folder(folder: Path) -> None:
    config = read_hf_config(folder)
    assert config.encoder.vit.hidden_size == 64 and config.encoder.vit.head_dim == 16
    assert config.predictor.vit.hidden_size == 32 and config.predictor.num_mask_tokens == 3
    assert config.classifier is not None and config.classifier.labels == TINY_LABELS


@pytest.mark.parametrize("frames", [4, 1])  # one frame is repeated to fill a tubelet, as the reference does
def test_encoder_matches_transformers(folder: Path, reference, frames: int) -> None:
    encoder = load_hf_part(folder, "encoder", progress=False)
    video = _video(2, frames, 2)
    with torch.no_grad():
        expected = reference.vjepa2(video, skip_predictor=True).last_hidden_state
        got = encoder(video)
    assert got.shape == expected.shape == (2, (max(frames, 2) // 2) * 16, 64)
    torch.testing.assert_close(got, expected, atol=TOL, rtol=0)
    assert expected.abs().mean() > 0.1  # the comparison is not between near-zero tensors


def test_mask_predictor_matches_transformers(folder: Path, reference) -> None:
    encoder = load_hf_part(folder, "encoder", progress=False)
    predictor = load_hf_part(folder, "predictor", progress=False)
    video = _video(2, 4, 3)
    gen = torch.Generator().manual_seed(4)
    context = torch.stack([torch.randperm(32, generator=gen)[:20] for _ in range(2)])
    target = torch.stack([torch.randperm(32, generator=gen)[:12] for _ in range(2)])
    with torch.no_grad():
        latents = encoder(video)
        full = reference.vjepa2(video).predictor_output.last_hidden_state  # every token context and target
        masked = reference.vjepa2(video, context_mask=[context], target_mask=[target]).predictor_output
        every = torch.arange(32).repeat(2, 1)
        torch.testing.assert_close(predictor(latents, every, every, (4, 4)), full, atol=TOL, rtol=0)
        got = predictor(latents, context, target, (4, 4))
    torch.testing.assert_close(got, masked.last_hidden_state, atol=TOL, rtol=0)
    assert masked.last_hidden_state.abs().mean() > 0.1


def test_classifier_matches_transformers(folder: Path, reference) -> None:
    encoder = load_hf_part(folder, "encoder", progress=False)
    head = load_hf_part(folder, "classifier", progress=False)
    video = _video(3, 4, 5)
    with torch.no_grad():
        expected = reference(video).logits
        got = head(encoder(video))
    torch.testing.assert_close(got, expected, atol=TOL, rtol=0)
    assert expected.std() > 0.1


def test_a_model_checkpoint_has_no_classifier(tmp_path: Path) -> None:
    config = VJEPA2Config.from_hf({**TINY_CLASSIFIER_HF, "architectures": ["VJEPA2Model"]})
    with pytest.raises(ValueError, match="no classifier head"):
        part_factory(config, "classifier")


@pytest.mark.parametrize("hf", [VITL_FPC64_256, VITG_FPC64_256], ids=["vitl-fpc64-256", "vitg-fpc64-256"])
@pytest.mark.parametrize("classifier", [False, True])
def test_full_size_checkpoint_keys_map_onto_our_parameters(hf: dict, classifier: bool) -> None:
    """Every tensor of the reference's state dict (built on the meta device) fills our parameters with
    its shape, and every parameter of ours is filled (load_named_tensors raises otherwise)."""
    hf = {**hf, "architectures": ["VJEPA2ForVideoClassification"], "num_labels": 174} if classifier else hf
    reference_cls = transformers.VJEPA2ForVideoClassification if classifier else transformers.VJEPA2Model
    with torch.device("meta"):
        reference = reference_cls(transformers.VJEPA2Config(**hf))
    state = reference.state_dict()
    config = VJEPA2Config.from_hf(hf)
    parts = ("encoder", "predictor", "classifier") if classifier else ("encoder", "predictor")
    claimed = set()
    for part in parts:
        ours = build_on_meta(part_factory(config, part), torch.float32, "meta")
        mapper = hf_mapper(config, part)
        load_named_tensors(ours, state.items(), mapper)
        claimed |= {name for name in state if mapper(name) is not None}
    assert claimed == set(state)  # no checkpoint tensor is left unread
    assert config.encoder.vit.mlp_size == (6144 if hf["hidden_size"] == 1408 else 4096)
