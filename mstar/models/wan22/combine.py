"""The Wan2.2 guidance scheduler component: per-request noise, UniPC state and classifier-free guidance.

Node `prepare` (before the step loop) draws the request's starting noise from its own generator
(option `seed`) and opens its scheduler state; node `combine` (end of each step) applies guidance to
the two branch velocities and takes one UniPC step. Per-request state is kept as
`common.guidance.GuidanceSchedulerBase` keeps it. Image-to-video writes the condition over frame 0 of
what the DiT sees, at timestep 0 (`denoise.py`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from mstar.models.common import unipc
from mstar.models.common.guidance import GuidanceSchedulerBase, combine_guidance, initial_noise
from mstar.models.common.wan_vae.vae_config import WanVAEConfig
from mstar.models.wan22 import denoise

logger = logging.getLogger(__name__)


@dataclass
class _RequestState:
    """What one request keeps between steps."""

    solver: unipc.UniPCState
    generator: torch.Generator  # drew the request's noise; kept so any later draw stays per request


class GuidanceScheduler(GuidanceSchedulerBase[_RequestState]):
    """Runs nodes `prepare` and `combine` (see the module docstring) for many requests."""

    def __init__(self, config: unipc.UniPCConfig, vae: WanVAEConfig, device: torch.device) -> None:
        super().__init__()
        self.config, self.vae, self.device = config, vae, device

    def latent_shape(self, options: dict) -> tuple[int, int, int, int]:
        """(C, F', H', W') of a request's latents from its resolved width, height and num_frames."""
        return (self.vae.z_dim, 1 + (int(options["num_frames"]) - 1) // self.vae.scale_factor_temporal,
                int(options["height"]) // self.vae.scale_factor_spatial,
                int(options["width"]) // self.vae.scale_factor_spatial)

    def _prepare(self, item: Any) -> dict:
        options = item.options
        generator = torch.Generator().manual_seed(int(options["seed"]))  # CPU, as the reference draws
        latents = initial_noise((1, *self.latent_shape(options)), [generator], device=self.device)[0]
        state = unipc.new_state(self.config, int(options["num_inference_steps"]))
        self._requests[item.request_id] = _RequestState(state, generator)
        return {"latents": latents, **self._dit_inputs(latents, item.inputs.get("condition"), state)}

    def _combine(self, item: Any) -> dict:
        x, options, state = item.inputs, item.options, self._state(item).solver
        velocity = x["cond_velocity"]
        if "uncond_velocity" in x:
            velocity = combine_guidance(velocity, x["uncond_velocity"], float(options["guidance_scale"]))
        latents = unipc.step(state, velocity[None], x["latents"][None])[0]
        out: dict[str, Any] = {}
        if options.get("debug_outputs"):
            out["step_latents"] = latents[None].clone()
        if options.get("report_progress"):  # the decode walk reports the last share
            out["progress"] = torch.tensor([state.step_index / (state.num_steps + 1)])
        condition = x.get("condition")
        if state.done:
            del self._requests[item.request_id]
            out["latents"] = denoise.blend_first_frame(latents[None], _batch(condition))[0]
            out["stop"] = True
            return out
        return {**out, "latents": latents, **self._dit_inputs(latents, condition, state)}

    def _dit_inputs(self, latents: torch.Tensor, condition: torch.Tensor | None,
                    state: unipc.UniPCState) -> dict:
        """The DiT's view of this step: frame 0 replaced by the condition, which sits at timestep 0."""
        dit_latents = denoise.blend_first_frame(latents[None], _batch(condition))[0]
        timestep = denoise.frame_timesteps(state.timestep, latents.shape[1], condition is not None, latents.device)
        return {"dit_latents": dit_latents, "timestep": timestep}


def _batch(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return None if tensor is None else tensor[None]
