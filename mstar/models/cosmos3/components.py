"""The Cosmos3 generator and VAE as the stateless engine runs them.

Edges carry one request's tensors without a batch dimension: prompt ids [L], latents [C, T, H, W],
sound latents [sound_dim, S], action latents [A, action_dim], the step's timestep [1]. The guidance
scheduler (per-request state) is in guidance.py.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mstar.engines.base import StatelessBase
from mstar.models.common.guidance import run_live_branches
from mstar.models.common.wan_vae.component import VAEComponent
from mstar.models.cosmos3.guidance import Layout
from mstar.models.cosmos3.positions import GenLayout, gen_positions, rope_tables
from mstar.models.cosmos3.transformer import Cosmos3Generator, GenRow, TextKV


@dataclass
class _Prompt:
    """What one (request, branch) keeps across steps: its text's keys and values, its rotary tables."""

    text: TextKV
    cos: torch.Tensor
    sin: torch.Tensor


class GeneratorComponent(StatelessBase, nn.Module):
    """(prompt_ids, latents, timestep[, sound_latents, action_latents]) -> velocity[, sound_velocity,
    action_velocity], float32, zero where the request conditions.

    Every item of a step shares one forward, whatever its branch, step, request or size; an item
    without `prompt_ids` (the unconditional branch of a request without guidance) produces nothing.
    A (request, branch)'s prompt runs through the understanding tower once, at its first step.
    """

    def __init__(self, generator: Cosmos3Generator, temporal_compression: int) -> None:
        super().__init__()
        self.generator = generator
        self.temporal_compression = temporal_compression
        self._prompts: dict[tuple[str, str], _Prompt] = {}
        self.sp_group: Any = None  # a sequence-parallel replica's torch.distributed group

    def set_sp_group(self, group: Any) -> None:
        """Run every forward sequence-parallel over `group` (all its ranks make the same calls)."""
        self.sp_group = group

    @property
    def num_prompts(self) -> int:
        """(request, branch) prompts whose keys and values are held (for leak tests)."""
        return len(self._prompts)

    def release(self, request_id: str) -> None:
        """Forget the request's prompts (safe for unknown ids)."""
        for key in [k for k in self._prompts if k[0] == request_id]:
            del self._prompts[key]

    def batch_key(self, item: Any) -> Hashable:
        """Every branch and request of a walk shares a forward; skipped branches go together."""
        return (item.walk, "prompt_ids" in item.inputs)

    @torch.no_grad()
    def run_items(self, items: list[Any]) -> list[dict]:
        return run_live_branches(items, "prompt_ids", self._velocities)

    def _velocities(self, items: list[Any]) -> list[dict]:
        out = []
        for result in self.generator([self._row(item) for item in items], sp_group=self.sp_group):
            values = {"velocity": result.vision.float()}
            if result.sound is not None:
                values["sound_velocity"] = result.sound.float()
            if result.action is not None:
                values["action_velocity"] = result.action.float()
            out.append(values)
        return out

    def _row(self, item: Any) -> GenRow:
        x, layout = item.inputs, Layout.of(item.options)
        prompt = self._prompt(item, layout)
        device = prompt.cos.device
        frames = layout.vision[1]
        action = x.get("action_latents")
        return GenRow(
            text=prompt.text, cos=prompt.cos, sin=prompt.sin, vision=x["latents"],
            vision_noisy=torch.arange(frames, device=device) >= layout.condition_frames,
            timestep=x["timestep"], sound=x.get("sound_latents"), action=action,
            action_noisy=None if action is None else torch.ones(action.shape[0], dtype=torch.bool, device=device),
            domain=layout.domain)

    def _prompt(self, item: Any, layout: Layout) -> _Prompt:
        key = (item.request_id, item.node)
        prompt = self._prompts.get(key)
        if prompt is None:
            g = self.generator
            ids = item.inputs["prompt_ids"].to(g.proj_in.weight.device)
            p = g.config.latent_patch_size
            _, frames, height, width = layout.vision
            gen = GenLayout((frames, math.ceil(height / p), math.ceil(width / p)), float(item.options["fps"]),
                            sound_len=layout.sound[1] if layout.sound else 0,
                            action_len=layout.action[0] if layout.action else 0)
            positions = gen_positions(g.config, gen, ids.shape[0], self.temporal_compression)
            cos, sin = rope_tables(g.config, positions, g.dtype, ids.device)
            prompt = self._prompts[key] = _Prompt(g.text_kv(ids), cos, sin)
        return prompt


class Cosmos3VAEComponent(VAEComponent):
    """The Wan2.2 VAE's component; node `encode_image` also crops the condition to the request's latent
    size (a policy frame's canvas padding has no latents of its own)."""

    @torch.no_grad()
    def run_batch(self, walk: str, node: str, inputs: list[dict], options: list[dict]) -> list[dict]:
        if node != "encode_image":
            return super().run_batch(walk, node, inputs, options)
        out = []
        for x, opts in zip(inputs, options, strict=True):
            _, _, height, width = Layout.of(opts).vision
            condition = self.vae.encode(x["image"][None])[0]
            out.append({"condition": condition[:, :, :height, :width].contiguous()})
        return out
