"""Pi0.5's networks as built: the vision tower (component `vision`) and the policy (component `policy`:
the Gemma prefix and the action expert, which share the prefix's keys and values).

`prefill` turns a batch of prefixes into keys and values; `velocity` is one flow step's network;
`euler_step` moves noisy actions along it; `sample` runs all the flow's steps in one call. Pi05Network holds all three parts for whole-checkpoint checks.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from mstar.models.pi05.config import Pi05Config
from mstar.models.pi05.gemma import ActionExpert, PrefixLM
from mstar.models.pi05.siglip import VisionTower


class PolicyNet(nn.Module):
    """The Gemma prefix (`llm`) and the action expert (`expert`)."""

    def __init__(self, config: Pi05Config) -> None:
        super().__init__()
        self.config = config
        self.llm = PrefixLM(config.llm, config.vocab_size)
        self.expert = ActionExpert(config.expert, config.max_action_dim, config.min_period, config.max_period)

    def prefix_embeddings(self, image_tokens: list[torch.Tensor], prompt_ids: list[torch.Tensor], length: int,
                          rows: int) -> torch.Tensor:
        """Per request its image tokens [N_i, W] and prompt ids [T_i] -> prefixes [rows, length, W] (images
        first, then the scaled token embeddings), zero past each prefix's end and in rows past the requests'."""
        dtype = self.llm.embed.weight.dtype
        prefixes = torch.zeros(rows, length, self.config.llm.width, dtype=dtype, device=self.llm.embed.weight.device)
        for row, (images, ids) in enumerate(zip(image_tokens, prompt_ids, strict=True)):
            prefixes[row, :len(images)] = images
            prefixes[row, len(images):len(images) + len(ids)] = self.llm.embed_tokens(ids)
        return prefixes

    def prefill(self, prefixes: torch.Tensor, valid: torch.Tensor,
                store: Callable[[int, torch.Tensor, torch.Tensor], None]) -> None:
        """Every layer's keys and values of the prefixes [B, L, W] (positions 0, 1, ... per row) to `store`."""
        positions = torch.arange(prefixes.shape[1], device=prefixes.device).expand(prefixes.shape[0], -1)
        self.llm(prefixes, valid, positions, store)

    def velocity(self, x_t: torch.Tensor, t: torch.Tensor, prefix: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
                 prefix_len: torch.Tensor) -> torch.Tensor:
        """The flow's velocity [B, C, A] (float32) at noisy actions x_t [B, C, A] and times t [B], over each
        robot's first prefix_len [B] keys and values of `prefix(layer)`."""
        return self.expert(x_t, t, prefix, prefix_len)

    def sample(self, noise: torch.Tensor, prefix: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
               prefix_len: torch.Tensor, num_steps: int) -> torch.Tensor:
        """Every Euler step from noise [B, C, A] at t = 1 to the actions at t = 0 (float32), as `num_steps`
        calls of `velocity` and `euler_step` give them; device work only, so a CUDA graph may hold it.
        What every step shares is computed once: the rotary tables, and each step's adaRMS
        modulations (the time is the same for every row), all steps' in one matmul per norm."""
        expert = self.expert
        steps = torch.arange(num_steps, dtype=torch.float64, device=noise.device)
        t = (1.0 + steps * (-1.0 / num_steps)).float()  # `flow_time` of every step, as the host computes it
        per_step = expert.modulations(expert.condition(t))
        context = expert.context(noise.shape[1], prefix_len)
        x_t = noise.float()
        for step in range(num_steps):
            modulations = [(scale[step:step + 1], shift[step:step + 1], gate[step:step + 1])
                           for scale, shift, gate in per_step]
            x_t = euler_step(x_t, expert.velocity(x_t, modulations, context, prefix), num_steps)
        return x_t


def euler_step(x_t: torch.Tensor, velocity: torch.Tensor, num_steps: int) -> torch.Tensor:
    """One Euler step from t toward 0: x_t - velocity / num_steps, in float32."""
    return x_t.float() + (-1.0 / num_steps) * velocity


def flow_time(step: int, num_steps: int) -> float:
    """The time of Euler step `step` (0-based) of `num_steps`: 1 at the first, 1/num_steps at the last."""
    return 1.0 + step * (-1.0 / num_steps)


class Pi05Network(nn.Module):
    """The whole checkpoint: vision tower, Gemma prefix and action expert."""

    def __init__(self, config: Pi05Config) -> None:
        super().__init__()
        self.vision = VisionTower(config.vision, config.llm.width)
        self.policy = PolicyNet(config)
