"""V-JEPA 2-AC at tiny size (float32): the predictor against cc-vjepa2's VisionTransformerPredictorAC,
rollouts on our KV cache against the upstream recompute-everything loop, the pose update against scipy,
and the cross-entropy search against a plain reference search; full-size AC key mapping on meta; V-JEPA 2 and
2-AC refuse FP8 quantization (no quantizable component) with a one-line error."""

from __future__ import annotations

import pytest
import torch

from mstar.models.common.loading import load_named_tensors
from mstar.models.common.meta import build_on_meta
from mstar.models.vjepa2.ac_predictor import ACPredictor
from mstar.models.vjepa2.config import AC_VITG
from mstar.models.vjepa2.planning import CEMSearch, CEMSettings
from mstar.models.vjepa2.pose import next_state
from mstar.models.vjepa2.rollout import horizon_of, rollout
from mstar.models.vjepa2.tiny import tiny_ac_config
from mstar.models.vjepa2.weights import build, upstream_ac_mapper
from tests.models.test_vjepa2_networks import randomize
from tests.models.vjepa2_reference import recompute_rollout, scipy_next_pose, upstream_predictor

TOL = 1e-4
HW, E = 16, 64


def _pair(use_extrinsics: bool = False):
    config = tiny_ac_config()
    if use_extrinsics:
        from dataclasses import replace

        config = replace(config, use_extrinsics=True)
    torch.manual_seed(0)
    reference = upstream_predictor(config)
    randomize(reference, 7)
    ours = build(lambda: ACPredictor(config), torch.float32, "cpu", reference.state_dict().items(), upstream_ac_mapper)
    return reference, ours


def _inputs(batch: int, frames: int, actions: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    latents = torch.nn.functional.layer_norm(torch.randn(batch, frames, HW, E, generator=gen), (E,))
    states = torch.rand(batch, frames, 7, generator=gen)
    acts = 0.1 * torch.randn(batch, actions, 7, generator=gen)
    return latents, states, acts


@pytest.mark.parametrize("frames", [1, 3])
@pytest.mark.parametrize("use_extrinsics", [False, True])
def test_one_step_prediction_matches_upstream(frames: int, use_extrinsics: bool) -> None:
    reference, ours = _pair(use_extrinsics)
    latents, states, actions = _inputs(2, frames, frames, 1)
    extrinsics = torch.randn(2, frames, 6, generator=torch.Generator().manual_seed(2)) if use_extrinsics else None
    with torch.no_grad():
        expected = reference(latents.flatten(1, 2), actions, states, extrinsics)
        got = ours(latents, actions, states, extrinsics).flatten(1, 2)
        cache = ours.new_cache(2, frames)  # the same frames appended one at a time onto the cache
        stepped = [ours(latents[:, t:t + 1], actions[:, t:t + 1], states[:, t:t + 1],
                        None if extrinsics is None else extrinsics[:, t:t + 1], cache=cache) for t in range(frames)]
    torch.testing.assert_close(got, expected, atol=TOL, rtol=0)
    torch.testing.assert_close(torch.cat(stepped, 1).flatten(1, 2), expected, atol=TOL, rtol=0)
    assert expected.abs().mean() > 0.1


@pytest.mark.parametrize("context", [1, 2])
def test_rollouts_of_horizon_1_to_8_match_the_recompute_loop(context: int) -> None:
    reference, ours = _pair()
    latents, states, actions = _inputs(2, context, context + 7, 3)
    with torch.no_grad():
        expected = recompute_rollout(reference, latents, states, actions, HW)
        for horizon in range(1, 9):
            got, poses = rollout(ours, latents, states, actions[:, :context - 1 + horizon])
            assert got.shape == (2, horizon, HW, E) and poses.shape == (2, horizon, 7)
            torch.testing.assert_close(got, expected[:, :horizon], atol=TOL, rtol=0)
    assert (expected[:, -1] - expected[:, 0]).abs().mean() > 0.1  # later frames really differ


def test_horizon_needs_an_action_per_context_frame() -> None:
    assert horizon_of(3, 5) == 3
    with pytest.raises(ValueError, match="3 context frames need at least 3 actions"):
        horizon_of(3, 2)


def test_next_state_matches_scipy_rotations() -> None:
    gen = torch.Generator().manual_seed(4)
    pose = torch.cat([torch.randn(64, 3, generator=gen), (torch.rand(64, 3, generator=gen) - 0.5) * 3,
                      torch.rand(64, 1, generator=gen)], dim=-1)
    action = 0.3 * torch.randn(64, 7, generator=gen)
    got, expected = next_state(pose, action), scipy_next_pose(pose, action)
    torch.testing.assert_close(got[:, :3], expected[:, :3], atol=1e-6, rtol=0)
    torch.testing.assert_close(got[:, 6], expected[:, 6], atol=1e-6, rtol=0)
    turned = torch.stack([got[:, 3:6], expected[:, 3:6]])  # angles modulo 2 pi
    assert (torch.remainder(turned[0] - turned[1] + torch.pi, 2 * torch.pi) - torch.pi).abs().max() < 1e-5


def reference_search(reference, latents, states, history, goal, settings: CEMSettings, seed: int) -> torch.Tensor:
    """The cross-entropy search written plainly: every candidate's whole trajectory re-run at each step
    by the upstream predictor, the same draws in the same order from the same seed."""
    gen = torch.Generator().manual_seed(seed)
    s, h = settings, settings.horizon
    mean = torch.zeros(h, 4)
    std = torch.cat([torch.full((h, 3), s.maxnorm), torch.ones(h, 1)], -1)
    for _ in range(s.iterations):
        frames = latents[None].expand(s.samples, -1, -1, -1)
        poses = states[None].expand(s.samples, -1, -1)
        past = history[None].expand(s.samples, -1, -1)
        chosen = []
        for step in range(h):
            draw = torch.randn(s.samples, 4, generator=gen) * std[step] + mean[step]
            draw[:, :3] = draw[:, :3].clamp(-s.maxnorm, s.maxnorm)
            draw[:, 3:] = draw[:, 3:].clamp(-s.gripper_limit, s.gripper_limit)
            chosen.append(torch.cat([draw[:, :3], torch.zeros(s.samples, 3), draw[:, 3:]], -1))
            acts = torch.cat([past, torch.stack(chosen, 1)], 1)
            nxt = reference(frames.flatten(1, 2), acts, poses)[:, -HW:]
            nxt = torch.nn.functional.layer_norm(nxt, (E,))
            frames = torch.cat([frames, nxt[:, None]], 1)
            poses = torch.cat([poses, scipy_next_pose(poses[:, -1], acts[:, -1])[:, None]], 1)
        energy = (frames[:, -1].flatten(1) - goal.flatten()[None]).abs().mean(-1)
        top = torch.stack(chosen, 1)[energy.topk(s.topk, largest=False).indices]
        new_mean = torch.cat([top.mean(0)[:, :3], top.mean(0)[:, 6:]], -1)
        new_std = torch.cat([top.std(0)[:, :3], top.std(0)[:, 6:]], -1)
        mean = new_mean * (1 - s.momentum_mean) + mean * s.momentum_mean
        std = new_std * (1 - s.momentum_std) + std * s.momentum_std
    grip = torch.where(mean[:, 3:].abs() < 0.25, 0.0, mean[:, 3:])
    return torch.cat([mean[:, :3], torch.zeros(h, 3), grip], -1)


@pytest.mark.parametrize("context,horizon", [(1, 2), (2, 3)])
def test_search_with_a_seed_returns_the_reference_actions(context: int, horizon: int) -> None:
    reference, ours = _pair()
    latents, states, history = _inputs(1, context, context - 1, 5)
    goal = _inputs(1, 1, 0, 6)[0][0, 0]
    settings = CEMSettings(horizon=horizon, samples=24, topk=4, iterations=3, gripper_limit=0.75)
    with torch.no_grad():
        expected = reference_search(reference, latents[0], states[0], history[0], goal, settings, seed=11)
        search = CEMSearch(ours, latents[0], states[0], history[0], goal, settings, torch.Generator().manual_seed(11))
        energies = [search.iterate() for _ in range(settings.iterations)]
    got = search.actions()
    assert got.shape == (horizon, 7)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    assert got[:, :3].abs().max() > 1e-4 and all(e > 0 for e in energies)


def test_full_size_ac_checkpoint_keys_map_onto_our_parameters(monkeypatch) -> None:
    """The upstream ViT-g AC predictor's state dict (built on meta) fills every parameter of ours."""
    linspace = torch.linspace
    monkeypatch.setattr(torch, "linspace", lambda *a, **k: linspace(*a, **{**k, "device": "cpu"}))  # .item() in its init
    with torch.device("meta"):
        reference = upstream_predictor(AC_VITG)
    ours = build_on_meta(lambda: ACPredictor(AC_VITG), torch.float32, "meta")
    load_named_tensors(ours, reference.state_dict().items(), upstream_ac_mapper)
    assert ours.blocks[0].attn.qkv.weight.shape == (3072, 1024) and ours.proj.weight.shape == (1408, 1024)


@pytest.mark.parametrize("model,component", [("vjepa2", "encoder"), ("vjepa2_ac", "predictor")])
def test_quantization_is_refused_naming_no_quantizable_component(model: str, component: str) -> None:
    """`quantization:` in the YAML and `--quantization` are one-line ConfigErrors (runtime.build, cli.main)."""
    from mstar.cli import main as cli
    from mstar.config import ConfigError, config_from_dict
    from mstar.runtime.build import build_model

    config = config_from_dict({"model": model, "quantization": {component: "fp8"}}, source="vjepa2.yaml")
    with pytest.raises(ConfigError) as exc:
        build_model(config, tiny=True)
    want = f"vjepa2.yaml: quantization.{component}: component {component!r} of model {model!r} cannot be quantized; " \
        "quantizable: none"
    assert str(exc.value) == want
    args = cli.build_parser().parse_args(["serve", model, "--quantization", "fp8"])
    with pytest.raises(ConfigError) as exc:
        cli.apply_quantization_flag(config_from_dict({"model": model}), args)
    assert str(exc.value) == f"--quantization fp8: model {model!r} has no component that can be quantized"
