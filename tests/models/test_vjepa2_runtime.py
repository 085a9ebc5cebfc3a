"""V-JEPA 2 and V-JEPA 2-AC through our runtime (MStar, inproc) from a tiny checkpoint folder written
by the references (transformers' VJEPA2ForVideoClassification, and cc-vjepa2's AC predictor in
`ac_predictor/`): encode, classify, rollout and plan against the references run by hand (float32)."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
import torch

from mstar.models.vjepa2.planning import CEMSettings
from mstar.models.vjepa2.processor import pixels
from mstar.models.vjepa2.tiny import TINY_CLASSIFIER_HF, TINY_LABELS, tiny_ac_config, tiny_config
from mstar.runtime.offline import MStar
from tests.models.test_vjepa2_ac import reference_search
from tests.models.test_vjepa2_networks import randomize
from tests.models.vjepa2_reference import (
    random_frames,
    recompute_rollout,
    request_images,
    upstream_encoder,
    upstream_predictor,
)

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py
TOL = 1e-4
HW = 16


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    from safetensors.torch import save_file

    root = tmp_path_factory.mktemp("vjepa2_ac_tiny")
    torch.manual_seed(0)
    encoder = transformers.VJEPA2ForVideoClassification(transformers.VJEPA2Config(**TINY_CLASSIFIER_HF))
    randomize(encoder, 1)
    encoder.save_pretrained(root)
    config = tiny_ac_config()
    predictor = upstream_predictor(config)
    randomize(predictor, 2)
    (root / "ac_predictor").mkdir()
    save_file({k: v.contiguous() for k, v in predictor.state_dict().items()}, root / "ac_predictor" / "model.safetensors")
    fields = {k: v for k, v in asdict(config).items() if k != "embed_dim"}
    (root / "ac_predictor" / "config.json").write_text(json.dumps(fields))
    return root


@pytest.fixture(scope="module")
def references(folder: Path):
    from safetensors.torch import load_file

    encoder = transformers.VJEPA2ForVideoClassification.from_pretrained(folder).eval()
    predictor = upstream_predictor(tiny_ac_config())
    predictor.load_state_dict(load_file(folder / "ac_predictor" / "model.safetensors"))
    return encoder, predictor


@pytest.fixture(scope="module")
def world(folder: Path):
    with MStar("vjepa2_ac", model_path=str(folder)) as m:
        yield m


def _reference_latents(encoder, frames: np.ndarray) -> torch.Tensor:
    """Each frame encoded alone as a clip of itself twice, layer-normed: [C, HW, E]."""
    clips = pixels(frames, 32)[:, None].expand(-1, 2, -1, -1, -1)
    with torch.no_grad():
        latents = encoder.vjepa2(clips, skip_predictor=True).last_hidden_state
    return torch.nn.functional.layer_norm(latents, (latents.shape[-1],))


def test_clip_model_encodes_and_classifies_like_transformers(folder: Path, references) -> None:
    encoder = references[0]
    frames = random_frames(4, 1)
    with MStar("vjepa2", model_path=str(folder)) as m:
        result = m.generate({"media": [{"type": "video", "data": frames}]},
                            modalities=["latents", "pooled", "logits", "label"])
    with torch.no_grad():
        clip = pixels(frames, 32)[None]
        latents = encoder.vjepa2(clip, skip_predictor=True).last_hidden_state[0]
        logits = encoder(clip).logits[0]
    out = result.outputs
    np.testing.assert_allclose(out["latents"][0], latents.numpy(), atol=TOL, rtol=0)
    np.testing.assert_allclose(out["pooled"][0], latents.mean(0).numpy(), atol=TOL, rtol=0)
    np.testing.assert_allclose(out["logits"][0], logits.numpy(), atol=TOL, rtol=0)
    assert out["label"] == [TINY_LABELS[int(logits.argmax())]] and result.finish_reason == "stop"


def test_encode_gives_normalised_per_frame_latents(world, references) -> None:
    frames = random_frames(2, 2)
    result = world.generate(request_images(frames))
    np.testing.assert_allclose(result.outputs["latents"][0], _reference_latents(references[0], frames).numpy(),
                               atol=TOL, rtol=0)
    assert set(result.outputs) == {"latents"}


@pytest.mark.parametrize("context,horizon", [(1, 4), (2, 3)])
def test_rollout_matches_the_recompute_loop(world, references, context: int, horizon: int) -> None:
    encoder, predictor = references
    frames = random_frames(context, 3)
    gen = torch.Generator().manual_seed(4)
    states = torch.rand(context, 7, generator=gen)
    actions = 0.1 * torch.randn(context + horizon - 1, 7, generator=gen)
    result = world.generate(request_images(frames), states=states.tolist(), actions=actions.tolist())
    with torch.no_grad():
        expected = recompute_rollout(predictor, _reference_latents(encoder, frames)[None], states[None], actions[None],
                                     HW)[0]
    got = result.outputs["predicted"][0]
    assert got.shape == (horizon, HW, 64) and result.outputs["predicted_states"][0].shape == (horizon, 7)
    np.testing.assert_allclose(got, expected.numpy(), atol=TOL, rtol=0)


def test_plan_matches_the_reference_search(world, references) -> None:
    encoder, predictor = references
    frames, goal = random_frames(1, 5), random_frames(1, 6)[0]
    states = torch.rand(1, 7, generator=torch.Generator().manual_seed(7))
    settings = CEMSettings(horizon=2, samples=24, topk=4, iterations=3)
    result = world.generate(request_images(frames, goal), states=states.tolist(), samples=24, topk=4, cem_iterations=3,
                            seed=9, return_sequence=True)
    with torch.no_grad():
        expected = reference_search(predictor, _reference_latents(encoder, frames), states, torch.zeros(0, 7),
                                    _reference_latents(encoder, goal[None])[0], settings, seed=9)
    np.testing.assert_allclose(result.outputs["actions"][0], expected.numpy(), atol=1e-5, rtol=0)
    assert len(result.outputs["energy"]) == 3
    first = world.generate(request_images(frames, goal), states=states.tolist(), samples=24, topk=4, cem_iterations=3, seed=9)
    np.testing.assert_allclose(first.outputs["actions"][0], expected[:1].numpy(), atol=1e-5, rtol=0)


@pytest.mark.parametrize("options,message", [
    ({"task": "rollout", "states": [[0.0] * 7]}, r"actions must have shape \[n, 7\]"),
    ({"actions": [[0.0] * 7]}, r"states must have shape \[1, 7\]"),
    ({"actions": [[0.0] * 6], "states": [[0.0] * 7]}, r"actions must have shape \[n, 7\], got \[1, 6\]"),
    ({"actions": [[0.0] * 7], "states": [[0.0] * 7], "horizon": 3}, "horizon=3 but 1 actions"),
    ({"task": "plan", "states": [[0.0] * 7]}, "a plan needs a goal image"),
    ({"task": "fly"}, "task must be one of"),
    ({"actions": [[0.0] * 7], "states": [[float("nan")] * 7]}, "not a finite number"),
])
def test_bad_requests_are_refused_naming_the_problem(world, options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        world.generate(request_images(random_frames(1, 8)), **options)


def test_two_context_frames_need_the_action_between_them(world) -> None:
    with pytest.raises(ValueError, match="2 context frames needs at least 2 actions"):
        world.generate(request_images(random_frames(2, 8)), states=[[0.0] * 7] * 2, actions=[[0.0] * 7])


def test_upstream_pt_checkpoint_rolls_out_like_its_modules(tmp_path: Path) -> None:
    """An upstream-layout .pt ("encoder" keys prefixed module.backbone., "predictor"), read with --tiny shapes."""
    encoder, predictor = upstream_encoder(tiny_config().encoder), upstream_predictor(tiny_ac_config())
    randomize(encoder, 3)
    randomize(predictor, 4)
    path = tmp_path / "vjepa2-ac-tiny.pt"
    torch.save({"encoder": {f"module.backbone.{k}": v for k, v in encoder.state_dict().items()},
                "predictor": {f"module.{k}": v for k, v in predictor.state_dict().items()}}, path)
    frames = random_frames(1, 10)
    states, actions = torch.rand(1, 7), 0.1 * torch.randn(3, 7, generator=torch.Generator().manual_seed(1))
    with MStar("vjepa2_ac", tiny=True, model_path=str(path)) as m:
        got = m.generate(request_images(frames), states=states.tolist(), actions=actions.tolist()).outputs["predicted"][0]
    with torch.no_grad():
        clips = pixels(frames, 32)[:, None].expand(-1, 2, -1, -1, -1).permute(0, 2, 1, 3, 4)
        latents = torch.nn.functional.layer_norm(encoder(clips), (64,))
        expected = recompute_rollout(predictor, latents[None], states[None], actions[None], HW)[0]
    np.testing.assert_allclose(got, expected.numpy(), atol=TOL, rtol=0)
