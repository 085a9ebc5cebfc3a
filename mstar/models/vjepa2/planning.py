"""Planning with V-JEPA 2-AC: the cross-entropy method over action sequences.

The search keeps a Gaussian over H-step action sequences (position deltas and the gripper; rotations
stay zero). Each iteration draws `samples` candidate sequences, rolls every candidate out from the
context in one batch, scores each by the mean absolute distance of its last predicted frame to the
goal's latents, and refits the Gaussian to the `topk` best with momentum. The context frames before
the last (their actions are history, not searched) are run through the predictor once per plan and
their keys and values copied into every candidate's cache; each iteration only appends the searched
frames, through a `FrameStep` (eager, or replayed from CUDA graphs by the served component). Nothing
in an iteration waits on the GPU: its best energy stays a device tensor. The answer is the final mean,
gripper moves under 0.25 rounded to zero.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mstar.models.vjepa2.ac_predictor import ACPredictor, RolloutCache
from mstar.models.vjepa2.rollout import EagerSteps, FrameStep

XYZ, GRIPPER = slice(0, 3), slice(3, 4)  # the searched dims of a 4-wide sample; actions are 7 wide


@dataclass(frozen=True)
class CEMSettings:
    """The search's knobs (defaults: the checkpoint authors' planning demo)."""

    horizon: int = 2  # actions per sequence
    samples: int = 400  # candidates per iteration
    topk: int = 10  # candidates the distribution is refitted to
    iterations: int = 10
    momentum_mean: float = 0.15  # share of the old mean kept at each refit
    momentum_std: float = 0.15
    momentum_mean_gripper: float = 0.15
    momentum_std_gripper: float = 0.15
    maxnorm: float = 0.05  # position deltas are clipped to +-maxnorm; also their first std
    gripper_limit: float = 0.75  # gripper deltas are clipped to +-gripper_limit
    normalize: bool = True  # layer-norm predictions, as the checkpoint's world model does

    def __post_init__(self) -> None:
        if not 1 <= self.topk <= self.samples:
            raise ValueError(f"topk={self.topk} must be in [1, samples={self.samples}]")
        if self.topk < 2:
            raise ValueError("topk must be >= 2: the refit needs a spread")
        if self.horizon < 1 or self.iterations < 1:
            raise ValueError(f"horizon={self.horizon} and iterations={self.iterations} must be >= 1")


def full_action(sample: torch.Tensor) -> torch.Tensor:
    """[..., 4] (xyz, gripper) -> [..., 7] with zero rotation."""
    zeros = sample.new_zeros(*sample.shape[:-1], 3)
    return torch.cat([sample[..., XYZ], zeros, sample[..., GRIPPER]], dim=-1)


class CEMSearch:
    """One request's search: the context cache, the current distribution and its random stream."""

    def __init__(self, predictor: ACPredictor, latents: torch.Tensor, states: torch.Tensor, history: torch.Tensor,
                 goal: torch.Tensor, settings: CEMSettings, generator: torch.Generator,
                 cache: RolloutCache | None = None, steps: FrameStep | None = None) -> None:
        """latents [C, HW, E] and states [C, A] of the context frames, history [C - 1, A] the actions
        between them, goal [HW, E] the latents to reach. `cache` (default: a new one) holds `samples`
        rows of C - 1 + horizon frames; `steps` runs the candidates' frames on it (default: eagerly)."""
        assert steps is None or cache is not None, "steps run on a cache: pass the one they write"
        self.predictor, self.settings, self.generator = predictor, settings, generator
        context = latents.shape[0]
        self.last = (latents[None, -1:], states[None, -1:])  # the context frame the searched actions start at
        self.goal = goal.reshape(1, -1)
        self.prefix_frames = context - 1
        self.cache = cache if cache is not None else predictor.new_cache(settings.samples, context - 1 + settings.horizon)
        self.steps = steps or EagerSteps(predictor, self.cache, settings.normalize)
        prefix = predictor.new_cache(1, max(context - 1, 1))
        if context > 1:
            predictor(latents[None, :-1], history[None], states[None, :-1], cache=prefix, last_only=True)
        prefix.truncate(context - 1)
        prefix.share(self.cache)
        device = latents.device
        self.mean = torch.zeros(settings.horizon, 4, device=device)
        self.std = torch.cat([torch.full((settings.horizon, 3), settings.maxnorm, device=device),
                              torch.ones(settings.horizon, 1, device=device)], dim=-1)
        # filled in place by kernels: an indexed assignment of a host scalar is a synchronizing copy
        self.keep = torch.empty(2, 4, device=device)
        self.keep[0, :3].fill_(settings.momentum_mean)
        self.keep[0, 3:].fill_(settings.momentum_mean_gripper)
        self.keep[1, :3].fill_(settings.momentum_std)
        self.keep[1, 3:].fill_(settings.momentum_std_gripper)

    def sample(self, step: int) -> torch.Tensor:
        """[samples, 7] candidate actions for `step` of the sequence."""
        s = self.settings
        draw = torch.randn(s.samples, 4, generator=self.generator, device=self.mean.device)
        draw = draw * self.std[step] + self.mean[step]
        draw = torch.cat([draw[:, XYZ].clamp(-s.maxnorm, s.maxnorm),
                          draw[:, GRIPPER].clamp(-s.gripper_limit, s.gripper_limit)], dim=-1)
        return full_action(draw)

    def energies(self, candidates: list[torch.Tensor]) -> torch.Tensor:
        """Distance to the goal [samples] of each candidate sequence, rolled out step by step as drawn."""
        s = self.settings
        latents, states = (t.expand(s.samples, -1, *t.shape[2:]) for t in self.last)
        for step in range(s.horizon):
            candidates.append(self.sample(step))
            frame, state = self.steps(self.prefix_frames + step, latents, candidates[-1][:, None], states)
            latents, states = frame[:, None], state[:, None]
        return (latents.flatten(1).float() - self.goal.float()).abs().mean(dim=-1)

    def iterate(self) -> torch.Tensor:
        """One draw, rollout and refit; the best candidate's energy (a 0-d device tensor)."""
        s = self.settings
        candidates: list[torch.Tensor] = []
        energy = self.energies(candidates)
        lowest, best = energy.topk(s.topk, largest=False)
        chosen = torch.stack(candidates, dim=1)[best].float()  # [topk, H, 7]
        mean, std = chosen.mean(0), chosen.std(0)
        mean, std = torch.cat([mean[:, :3], mean[:, -1:]], -1), torch.cat([std[:, :3], std[:, -1:]], -1)
        keep_mean, keep_std = self.keep
        self.mean = mean * (1 - keep_mean) + self.mean * keep_mean
        self.std = std * (1 - keep_std) + self.std * keep_std
        return lowest[0]

    def actions(self) -> torch.Tensor:
        """The plan [H, 7]: the current mean, small gripper moves rounded to zero."""
        gripper = self.mean[:, GRIPPER]
        rounded = torch.where(gripper.abs() < 0.25, torch.zeros_like(gripper), gripper)
        return full_action(torch.cat([self.mean[:, XYZ], rounded], dim=-1))
