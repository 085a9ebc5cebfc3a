"""Pi0.5 through our runtime (MStar, inproc) from a tiny lerobot-named folder with normalisation stats
(#39): each robot's action chunk as the plain Pi0.5 (lerobot's semantics) gives it for the same noise
seed, within 1e-4 in float32; a batch of different robots gives each what it gets alone; the prefix
cache's pages come back when chunks are out; bad observations are refused naming the fault."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from mstar.models.common.text import Tokenizer
from mstar.models.pi05.processor import noise, pixels
from mstar.models.pi05.prompt import Quantiles, prompt_text
from mstar.models.pi05.tiny import tiny_config, tiny_tokenizer_folder
from mstar.runtime.offline import MStar, RequestFailed
from tests.models.pi05_reference import (
    adaptive_expert_norms,
    lerobot_state_dict,
    plain_sample_actions,
    tiny_pi0,
)

pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py
TOL = 1e-4
CONFIG = tiny_config()
CAMERAS = CONFIG.cameras
STATE_Q = (np.linspace(-2.0, 0.0, 8), np.linspace(1.0, 3.0, 8))
ACTION_Q = (np.linspace(-1.0, 0.5, 7), np.linspace(0.0, 2.0, 7))


@pytest.fixture(scope="module")
def state() -> dict[str, torch.Tensor]:
    return adaptive_expert_norms(lerobot_state_dict(tiny_pi0(CONFIG), seed=11), seed=12)


@pytest.fixture(scope="module")
def folder(state, tmp_path_factory) -> Path:
    from safetensors.torch import save_file

    root = tmp_path_factory.mktemp("pi05_tiny")
    save_file({"model." + k: v.contiguous() for k, v in state.items()}, str(root / "model.safetensors"))
    stats = {"observation.state.q01": STATE_Q[0], "observation.state.q99": STATE_Q[1],
             "action.q01": ACTION_Q[0], "action.q99": ACTION_Q[1]}
    tensors = {k: torch.tensor(v, dtype=torch.float32) for k, v in stats.items()}
    save_file({k: v for k, v in tensors.items() if k.startswith("obs")},
              str(root / "policy_preprocessor_step_2_normalizer_processor.safetensors"))
    save_file({k: v for k, v in tensors.items() if k.startswith("action")},
              str(root / "policy_postprocessor_step_0_unnormalizer_processor.safetensors"))
    return root


@pytest.fixture(scope="module")
def policy(folder: Path):
    config = {"model": "pi05", "max_concurrent_requests": 3, "model_kwargs": {"max_robots": 3}}
    with MStar("pi05", config=config, tiny=True, model_path=str(folder)) as m:
        yield m


def _observation(seed: int, cameras: tuple[str, ...], task: str) -> tuple[dict, list[float]]:
    rng = np.random.default_rng(seed)
    media = [{"type": "image", "name": c, "data": rng.integers(0, 256, (40 + 8 * i, 48, 3), dtype=np.uint8)}
             for i, c in enumerate(cameras)]
    return {"text": task, "media": media}, rng.uniform(-2.0, 3.0, 8).tolist()


def _expected(state, request: dict, robot_state: list[float], seed: int) -> np.ndarray:
    """The plain Pi0.5 on what lerobot's processors make of the observation."""
    images = torch.stack([pixels(m["data"], CONFIG.vision.image_size) for m in sorted(
        request["media"], key=lambda m: CAMERAS.index(m["name"]))])
    normalized = Quantiles(*STATE_Q).normalize(np.asarray(robot_state))
    ids = Tokenizer.from_pretrained(tiny_tokenizer_folder()).encode(
        prompt_text(request["text"], normalized, CONFIG.max_state_dim))
    actions = plain_sample_actions(state, CONFIG, images, torch.tensor(ids), noise(seed, CONFIG.chunk_size,
                                   CONFIG.max_action_dim), CONFIG.num_steps)
    return Quantiles(*ACTION_Q).unnormalize(actions[:, :CONFIG.action_dim].double().numpy())


def test_chunk_matches_the_plain_policy(policy, state) -> None:
    request, robot_state = _observation(1, CAMERAS, "pick up the red cube")
    got = policy.generate(request, state=robot_state, seed=5).outputs["actions"]
    assert len(got) == 1 and got[0].shape == (CONFIG.chunk_size, CONFIG.action_dim) and got[0].dtype == np.float32
    np.testing.assert_allclose(got[0], _expected(state, request, robot_state, 5), atol=TOL, rtol=0)


def test_cameras_at_the_policys_size_match_the_plain_policy(policy, state) -> None:
    """Cameras at the policy's size travel as uint8 and are mapped to [-1, 1] by the vision component."""
    side, rng = CONFIG.vision.image_size, np.random.default_rng(6)
    media = [{"type": "image", "name": c, "data": rng.integers(0, 256, (side, side, 3), dtype=np.uint8)}
             for c in CAMERAS]
    request, robot_state = {"text": "stack the cups", "media": media}, rng.uniform(-2.0, 3.0, 8).tolist()
    got = policy.generate(request, state=robot_state, seed=6).outputs["actions"][0]
    np.testing.assert_allclose(got, _expected(state, request, robot_state, 6), atol=TOL, rtol=0)


def test_a_batch_of_robots_gets_what_each_gets_alone(policy, state) -> None:
    robots = [(_observation(2, CAMERAS, "open the drawer"), 7),
              (_observation(3, CAMERAS[:1], "fold the towel and place it in the bowl"), 8),
              (_observation(4, CAMERAS[1:], "push"), 9)]
    handles = [policy.submit(req, state=st, seed=seed) for (req, st), seed in robots]
    together = [h.decoded().outputs["actions"][0] for h in handles]
    for ((req, st), seed), got in zip(robots, together, strict=True):
        alone = policy.generate(req, state=st, seed=seed).outputs["actions"][0]
        np.testing.assert_allclose(got, alone, atol=1e-5, rtol=0)  # padding to the batch's longest prefix
        np.testing.assert_allclose(got, _expected(state, req, st, seed), atol=TOL, rtol=0)
    assert not np.allclose(together[0], together[1])


def test_pages_come_back_when_chunks_are_out(policy) -> None:
    """The cache holds 3 prefixes: far more requests than that, in waves, all succeed."""
    for wave in range(3):
        observations = [_observation(10 * wave + i, CAMERAS, "pick") for i in range(3)]
        handles = [policy.submit(request, state=robot_state) for request, robot_state in observations]
        assert all(h.decoded().outputs["actions"][0].shape == (10, 7) for h in handles)


@pytest.mark.parametrize(("media", "options", "fault"), [
    ([{"type": "image", "name": "top_cam", "data": np.zeros((8, 8, 3), np.uint8)}], {"state": [0.0] * 8}, "top_cam"),
    ([{"type": "image", "data": np.zeros((8, 8, 3), np.uint8)}] * 4, {"state": [0.0] * 8}, "4 images for 3 cameras"),
    ([], {"state": [0.0] * 8}, "at least one camera"),
    ([{"type": "image", "data": np.zeros((8, 8, 3), np.uint8)}], {"state": [0.0] * 7}, "state must hold 8"),
    ([{"type": "image", "data": np.zeros((8, 8), np.uint8)}], {"state": [0.0] * 8}, "uint8 [H, W, 3]"),
    ([{"type": "image", "data": np.zeros((8, 8, 3), np.uint8)}], {"state": [0.0] * 8, "num_steps": 0}, "num_steps"),
])
def test_bad_observations_are_refused(policy, media, options, fault) -> None:
    with pytest.raises((RequestFailed, ValueError), match=fault.replace("[", r"\[").replace("]", r"\]")):
        policy.generate({"text": "pick", "media": media}, **options)
