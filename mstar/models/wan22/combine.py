"""The guidance scheduler component: per-request noise, UniPC state and classifier-free guidance.

Node `prepare` (before the step loop) draws the request's starting noise from its own generator
(option `seed`) and opens its scheduler state; node `combine` (end of each step) applies guidance to
the two branch velocities and takes one UniPC step. State is keyed by request id and dropped when the
schedule finishes or the engine releases the request (finished, failed or cancelled), so requests at
different steps, with different step counts, never share anything but DiT forwards.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mstar.engines.base import StatelessBase
from mstar.models.wan22 import denoise, scheduler
from mstar.models.wan22.config import UniPCConfig
from mstar.models.wan22.vae_config import WanVAEConfig

logger = logging.getLogger(__name__)


@dataclass
class _RequestState:
    """What one request keeps between steps."""

    unipc: scheduler.UniPCState
    generator: torch.Generator  # drew the request's noise; kept so any later draw stays per request


class GuidanceScheduler(StatelessBase, nn.Module):
    """Runs nodes `prepare` and `combine` (see the module docstring) for many requests."""

    def __init__(self, config: UniPCConfig, vae: WanVAEConfig, device: torch.device) -> None:
        super().__init__()
        self.config, self.vae, self.device = config, vae, device
        self._requests: dict[str, _RequestState] = {}

    @property
    def num_requests(self) -> int:
        """Requests whose state is held (for leak tests)."""
        return len(self._requests)

    def release(self, request_id: str) -> None:
        """Forget the request (safe for unknown ids)."""
        self._requests.pop(request_id, None)

    @torch.no_grad()
    def run_items(self, items: list[Any]) -> list[dict]:
        return [self._prepare(i) if i.node == "prepare" else self._combine(i) for i in items]

    def latent_shape(self, options: dict) -> tuple[int, int, int, int]:
        """(C, F', H', W') of a request's latents from its resolved width, height and num_frames."""
        return (self.vae.z_dim, 1 + (int(options["num_frames"]) - 1) // self.vae.scale_factor_temporal,
                int(options["height"]) // self.vae.scale_factor_spatial,
                int(options["width"]) // self.vae.scale_factor_spatial)

    def _prepare(self, item: Any) -> dict:
        options = item.options
        generator = torch.Generator().manual_seed(int(options["seed"]))  # CPU, as the reference draws
        latents = denoise.initial_noise((1, *self.latent_shape(options)), [generator], device=self.device)[0]
        state = scheduler.new_state(self.config, int(options["num_inference_steps"]))
        self._requests[item.request_id] = _RequestState(state, generator)
        return {"latents": latents, **self._dit_inputs(latents, item.inputs.get("condition"), state)}

    def _combine(self, item: Any) -> dict:
        request = self._requests.get(item.request_id)
        if request is None:
            raise RuntimeError(f"request {item.request_id} has no scheduler state: its prepare node never ran here")
        x, options, state = item.inputs, item.options, request.unipc
        velocity = x["cond_velocity"]
        if "uncond_velocity" in x:
            velocity = denoise.combine_guidance(velocity, x["uncond_velocity"], float(options["guidance_scale"]))
        latents = scheduler.step(state, velocity[None], x["latents"][None])[0]
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
                    state: scheduler.UniPCState) -> dict:
        """The DiT's view of this step: frame 0 replaced by the condition, which sits at timestep 0."""
        dit_latents = denoise.blend_first_frame(latents[None], _batch(condition))[0]
        timestep = denoise.frame_timesteps(state.timestep, latents.shape[1], condition is not None, latents.device)
        return {"dit_latents": dit_latents, "timestep": timestep}


def _batch(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return None if tensor is None else tensor[None]
