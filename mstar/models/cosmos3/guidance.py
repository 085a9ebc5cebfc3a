"""The Cosmos3 guidance scheduler component: per-request noise, conditioning, guidance and UniPC steps.

Node `prepare` (before the step loop) draws the request's noise from its own generator (option `seed`)
in the reference's order (vision, then sound, then actions), writes the conditioning latent frame over
the vision noise and opens one UniPC state per generated modality. Node `combine` (end of each step)
applies classifier-free guidance to each modality's velocities and steps its state; on the last step
it hands the latents on and emits a policy's actions, cut to the embodiment's width. Per-request
state is kept as `common.guidance.GuidanceSchedulerBase` keeps it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mstar.models.common import unipc
from mstar.models.common.guidance import GuidanceSchedulerBase, combine_guidance, initial_noise

# modality -> (latents edge, branch velocity edges): what `combine` steps
MODALITIES = {"vision": ("latents", "cond_velocity", "uncond_velocity"),
              "sound": ("sound_latents", "cond_sound", "uncond_sound"),
              "action": ("action_latents", "cond_action", "uncond_action")}


@dataclass(frozen=True)
class Layout:
    """A request's generated tensors, resolved by the processor into option `layout`."""

    vision: tuple[int, int, int, int]  # latents [C, T, H, W]
    condition_frames: int = 0  # leading latent frames given (image-to-video, policy: 1)
    sound: tuple[int, int] | None = None  # [sound_dim, steps]
    action: tuple[int, int] | None = None  # [steps, action_dim]
    action_width: int | None = None  # the embodiment's columns of the action tower's action_dim
    domain: int = 0  # the embodiment's domain id

    @classmethod
    def of(cls, options: dict) -> Layout:
        """The layout the processor wrote into `options["layout"]`."""
        raw = options["layout"]
        return cls(vision=tuple(raw["vision"]), condition_frames=int(raw.get("condition_frames", 0)),
                   sound=tuple(raw["sound"]) if raw.get("sound") else None,
                   action=tuple(raw["action"]) if raw.get("action") else None,
                   action_width=raw.get("action_width"), domain=int(raw.get("domain", 0)))

    def to_option(self) -> dict:
        """The plain dict stored in option `layout`."""
        return {"vision": list(self.vision), "condition_frames": self.condition_frames,
                "sound": list(self.sound) if self.sound else None, "action": list(self.action) if self.action else None,
                "action_width": self.action_width, "domain": self.domain}


@dataclass
class _RequestState:
    states: dict[str, unipc.UniPCState]  # one per generated modality
    generator: torch.Generator  # drew the request's noise; kept so any later draw stays per request
    layout: Layout


class GuidanceScheduler(GuidanceSchedulerBase[_RequestState]):
    """Runs nodes `prepare` and `combine` (see the module docstring) for many requests."""

    def __init__(self, config: unipc.UniPCConfig, device: torch.device) -> None:
        super().__init__()
        self.config, self.device = config, device

    def _prepare(self, item: Any) -> dict:
        layout, steps = Layout.of(item.options), int(item.options["num_inference_steps"])
        generator = torch.Generator().manual_seed(int(item.options["seed"]))  # CPU, as the reference draws
        latents = initial_noise((1, *layout.vision), [generator], device=self.device)[0]
        condition = item.inputs.get("condition")
        if layout.condition_frames:
            if condition is None or condition.shape[1] != layout.condition_frames:
                raise ValueError(f"prepare needs {layout.condition_frames} condition frame(s), got "
                                 f"{None if condition is None else tuple(condition.shape)}")
            latents[:, : layout.condition_frames] = condition.to(latents.dtype)
        out = {"latents": latents}
        states = {"vision": unipc.new_state(self.config, steps)}
        if layout.sound is not None:
            out["sound_latents"] = torch.randn(layout.sound, generator=generator).to(self.device)
            states["sound"] = unipc.new_state(self.config, steps)
        if layout.action is not None:
            action = torch.randn(layout.action, generator=generator)
            if layout.action_width is not None:
                action[:, layout.action_width:] = 0
            out["action_latents"] = action.to(self.device)
            states["action"] = unipc.new_state(self.config, steps)
        self._requests[item.request_id] = _RequestState(states, generator, layout)
        return {**out, "timestep": states["vision"].timestep.reshape(1)}

    def _combine(self, item: Any) -> dict:
        request, x, options = self._state(item), item.inputs, item.options
        scale = float(options["guidance_scale"])
        out: dict[str, Any] = {}
        for modality, state in request.states.items():
            latents_edge, cond_edge, uncond_edge = MODALITIES[modality]
            velocity = x[cond_edge].float()
            if uncond_edge in x:
                velocity = combine_guidance(velocity, x[uncond_edge].float(), scale)
            if modality == "action" and request.layout.action_width is not None:
                velocity = velocity.clone()
                velocity[:, request.layout.action_width:] = 0
            stepped = unipc.step(state, velocity[None], x[latents_edge].float()[None])[0]
            if modality == "action" and request.layout.action_width is not None:
                stepped[:, request.layout.action_width:] = 0
            out[latents_edge] = stepped
        vision = request.states["vision"]
        if options.get("debug_outputs"):
            out["step_latents"] = out["latents"][None].clone()
        if options.get("report_progress"):  # the decode walk reports the last share
            out["progress"] = torch.tensor([vision.step_index / (vision.num_steps + 1)])
        if not vision.done:
            return {**out, "timestep": vision.timestep.reshape(1)}
        del self._requests[item.request_id]
        if "action_latents" in out:
            out["actions"] = out["action_latents"][:, : request.layout.action_width]
        return {**out, "stop": True}
