"""Rolling V-JEPA 2-AC's latent world forward on a KV cache, one frame per step.

Frame t's block holds action a_t (the move from frame t to t+1) and state s_t. A rollout from C
context frames (latents z_0..z_{C-1}, states s_0..s_{C-1}) over actions a_0..a_{C+H-2} first appends
the context blocks and predicts z_C; each further step appends the frame it predicted last, with the
next action and the state that action led to, and predicts one more frame. Predictions are
layer-normed (`normalize`) before they are compared or fed back, as the checkpoint's world model does.
"""

from __future__ import annotations

from typing import Protocol

import torch

from mstar.models.vjepa2.ac_predictor import ACPredictor, RolloutCache, normalize_latents
from mstar.models.vjepa2.pose import next_state


class FrameStep(Protocol):
    """Appends frames at frame `position` of a cache it holds (forgetting any after) and predicts the
    next: (latents [B, T, HW, E], actions and states [B, T, A]) -> (frame [B, HW, E], state [B, A])."""

    def __call__(self, position: int, latents: torch.Tensor, actions: torch.Tensor,
                 states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


def horizon_of(context_frames: int, actions: int) -> int:
    """Frames a rollout predicts from `context_frames` and `actions` actions (one per context frame,
    then one per further step); ValueError when they do not fit."""
    horizon = actions - context_frames + 1
    if horizon < 1:
        raise ValueError(f"{context_frames} context frames need at least {context_frames} actions (one per "
                         f"frame: the last moves to the first predicted frame), got {actions}")
    return horizon


def rollout_step(predictor: ACPredictor, cache: RolloutCache, latents: torch.Tensor, actions: torch.Tensor,
                 states: torch.Tensor, normalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Append frames ([B, T, HW, E] latents, [B, T, A] actions and states) to `cache`: the latents of the
    frame after the last [B, HW, E] and its state [B, A]."""
    predicted = predictor(latents, actions, states, cache=cache, last_only=True)[:, 0]
    if normalize:
        predicted = normalize_latents(predicted)
    return predicted, next_state(states[:, -1], actions[:, -1])


class EagerSteps:
    """`FrameStep` on `cache`, run eagerly (every shape a Python int, no host sync)."""

    def __init__(self, predictor: ACPredictor, cache: RolloutCache, normalize: bool = True) -> None:
        self.predictor, self.cache, self.normalize = predictor, cache, normalize

    def __call__(self, position: int, latents: torch.Tensor, actions: torch.Tensor,
                 states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.cache.truncate(position)
        return rollout_step(self.predictor, self.cache, latents, actions, states, self.normalize)


def rollout(predictor: ACPredictor, latents: torch.Tensor, states: torch.Tensor, actions: torch.Tensor,
            normalize: bool = True, cache: RolloutCache | None = None,
            steps: FrameStep | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Every predicted frame [B, H, HW, E] and its state [B, H, A], from context latents [B, C, HW, E],
    states [B, C, A] and actions [B, C + H - 1, A]; on `cache` (default: a new one for the whole
    horizon), one frame a step through `steps` (default: eager; a context of several frames is
    appended eagerly in one forward)."""
    batch, context = latents.shape[:2]
    horizon = horizon_of(context, actions.shape[1])
    cache = cache if cache is not None else predictor.new_cache(batch, context + horizon - 1)
    eager = EagerSteps(predictor, cache, normalize)
    steps = steps or eager
    frame, state = (steps if context == 1 else eager)(0, latents, actions[:, :context], states)
    frames, poses = [frame], [state]
    for step in range(1, horizon):
        action = actions[:, context - 1 + step]
        frame, state = steps(context - 1 + step, frame[:, None], action[:, None], state[:, None])
        frames.append(frame)
        poses.append(state)
    return torch.stack(frames, 1), torch.stack(poses, 1)
