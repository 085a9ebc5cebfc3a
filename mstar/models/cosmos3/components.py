"""The Cosmos3 generator and VAE as the stateless engine runs them.

Edges carry one request's tensors without a batch dimension: prompt ids [L], latents [C, T, H, W],
sound latents [sound_dim, S], action latents [A, action_dim], the step's timestep [1]. The guidance
scheduler (per-request state) is in guidance.py.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mstar.engines.base import CapturePlan, GraphBufferSpec, StatelessBase, StepGraphs
from mstar.engines.cuda_graphs import to_device_async
from mstar.models.common.guidance import run_live_branches
from mstar.models.common.wan_vae.component import VAEComponent
from mstar.models.cosmos3.guidance import Layout
from mstar.models.cosmos3.positions import GenLayout, gen_positions, rope_tables
from mstar.models.cosmos3.transformer import Cosmos3Generator, GenOut, GenRow, TextKV

GRAPH_ROWS = [1, 2, 4]  # rows (requests x guidance branches) step graphs are captured at, by default
TEXT_BUCKETS = (128, 512)  # prompt lengths a step graph pads its rows' prompts to; longer ones run eagerly


@dataclass
class _Prompt:
    """What one (request, branch) keeps across steps: its text's keys and values, its rotary tables and
    which of its frames and actions are denoised (device masks, made once rather than every step)."""

    text: TextKV
    cos: torch.Tensor
    sin: torch.Tensor
    vision_noisy: torch.Tensor
    action_noisy: torch.Tensor | None


class GeneratorComponent(StatelessBase, nn.Module):
    """(prompt_ids, latents, timestep[, sound_latents, action_latents]) -> velocity[, sound_velocity,
    action_velocity], float32, zero where the request conditions.

    Every item of a step shares one forward, whatever its branch, step, request or size; an item
    without `prompt_ids` (the unconditional branch of a request without guidance) produces nothing.
    A (request, branch)'s prompt runs through the understanding tower once, at its first step.

    On CUDA (`capture_plans`) the generation tower of a step (`forward_padded`) is captured as CUDA graphs
    for rows of each of `graph_tokens` generated tokens, at the engine's batch sizes (up to `graph_rows`
    rows) and prompts padded to each of `TEXT_BUCKETS`: a step's rows of such a size, `graph_rows` at a
    time, with prompts no longer than the largest bucket, replay one graph (their prompts copied into the
    buffer the graphs read, `text_buffer`); the others, and every step of a sequence-parallel replica, run
    eagerly.
    """

    def __init__(self, generator: Cosmos3Generator, temporal_compression: int,
                 graph_tokens: Sequence[int] = (), graph_rows: int = max(GRAPH_ROWS)) -> None:
        super().__init__()
        self.generator = generator
        self.temporal_compression = temporal_compression
        self.graph_tokens = tuple(sorted(set(graph_tokens)))
        self.graph_rows = graph_rows  # the largest batch size its engine captures graphs at
        self._prompts: dict[tuple[str, str], _Prompt] = {}
        self.sp_group: Any = None  # a sequence-parallel replica's torch.distributed group
        self.text_buffer: torch.Tensor | None = None  # [rows, 2, layers, Lb, Hk, d], made by capture_plans

    def set_sp_group(self, group: Any) -> None:
        """Run every forward sequence-parallel over `group` (all its ranks make the same calls): eagerly,
        so any captured graphs and their buffer are dropped."""
        self.sp_group = group
        self.graphs, self.text_buffer = StepGraphs(), None

    def capture_plans(self) -> list[CapturePlan]:
        """The generation tower (`padded_step`) at each of `graph_tokens` tokens per row and each of
        `TEXT_BUCKETS` prompt tokens: a step's few hundred kernels per layer replay as one graph. Allocates
        `text_buffer`."""
        if not self.graph_tokens:
            return []
        g = self.generator
        c, dtype, device = g.config, g.dtype, g.proj_in.weight.device
        self.text_buffer = torch.zeros(self.text_buffer_shape(), dtype=dtype, device=device)
        return [CapturePlan(("step", tokens, bucket), functools.partial(self.padded_step, bucket),
                            (((tokens, c.hidden_size), dtype), ((tokens, c.head_dim), dtype),
                             ((tokens, c.head_dim), dtype), ((), torch.int64)))
                for tokens in reversed(self.graph_tokens)  # largest first: the smaller reuse its pool memory
                for bucket in reversed(TEXT_BUCKETS)]

    def text_buffer_shape(self) -> tuple[int, ...]:
        """The shape of `text_buffer`: every captured row's prompt keys and values at the longest bucket."""
        c = self.generator.config
        return (self.graph_rows, 2, c.num_layers, max(TEXT_BUCKETS), c.num_kv_heads, c.head_dim)

    def graph_buffers(self) -> GraphBufferSpec | None:
        """`text_buffer` as the memory plan counts it (`StatelessSpec.graph_buffers`); None: no graphs."""
        if not self.graph_tokens:
            return None
        return GraphBufferSpec(math.prod(self.text_buffer_shape()) * self.generator.dtype.itemsize,
                               "model_kwargs.graph_sizes")

    def padded_step(self, bucket: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    text_lengths: torch.Tensor) -> torch.Tensor:
        """`forward_padded` of B rows over the first B rows of `text_buffer`, cut to `bucket` prompt tokens."""
        assert self.text_buffer is not None, "padded_step reads text_buffer, which capture_plans makes"
        return self.generator.forward_padded(x, cos, sin, self.text_buffer[: x.shape[0], :, :, :bucket],
                                             text_lengths)

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
        rows = [self._row(item) for item in items]
        results: list[GenOut | None] = [None] * len(rows)
        if self.graphs and self.sp_group is None:
            self._replay(rows, results)
        eager = [i for i, result in enumerate(results) if result is None]
        if eager:
            for i, result in zip(eager, self.generator([rows[i] for i in eager], sp_group=self.sp_group), strict=True):
                results[i] = result
        out = []
        for result in results:
            assert result is not None
            values = {"velocity": result.vision.float()}
            if result.sound is not None:
                values["sound_velocity"] = result.sound.float()
            if result.action is not None:
                values["action_velocity"] = result.action.float()
            out.append(values)
        return out

    def _replay(self, rows: list[GenRow], results: list[GenOut | None]) -> None:
        """Fill `results` for the rows a captured graph holds: rows of one token count, up to the largest
        `graph_rows` at a time, replay the graph of the shortest bucket that holds their prompts."""
        g, buffer = self.generator, self.text_buffer
        assert buffer is not None
        by_tokens: dict[int, list[int]] = {}
        for i, row in enumerate(rows):
            if row.num_tokens in self.graph_tokens and row.text.length <= max(TEXT_BUCKETS):
                by_tokens.setdefault(row.num_tokens, []).append(i)
        for tokens, indexes in by_tokens.items():
            for start in range(0, len(indexes), self.graph_rows):
                chunk = [rows[i] for i in indexes[start: start + self.graph_rows]]
                lengths = [row.text.length for row in chunk]
                bucket = next(b for b in TEXT_BUCKETS if b >= max(lengths))
                for j, row in enumerate(chunk):  # after the previous replay on the stream: it read its rows
                    buffer[j, :, :, : row.text.length].copy_(row.text.packed)
                x = torch.stack([g.embed_row(row) for row in chunk])
                cos, sin = torch.stack([row.cos for row in chunk]), torch.stack([row.sin for row in chunk])
                replayed = self.graphs.replay(("step", tokens, bucket), x, cos, sin,
                                              to_device_async(torch.tensor(lengths), x.device))
                if replayed is None:
                    continue
                for i, row, hidden in zip(indexes[start: start + len(chunk)], chunk, replayed[0], strict=True):
                    results[i] = g.heads(row, hidden)  # new tensors: read before the next replay overwrites

    def _row(self, item: Any) -> GenRow:
        x, layout = item.inputs, Layout.of(item.options)
        prompt = self._prompt(item, layout)
        action = x.get("action_latents")
        return GenRow(
            text=prompt.text, cos=prompt.cos, sin=prompt.sin, vision=x["latents"], vision_noisy=prompt.vision_noisy,
            timestep=x["timestep"], sound=x.get("sound_latents"), action=action,
            action_noisy=None if action is None else prompt.action_noisy, domain=layout.domain)

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
            vision_noisy = torch.arange(frames, device=ids.device) >= layout.condition_frames
            action_noisy = None if layout.action is None else \
                torch.ones(layout.action[0], dtype=torch.bool, device=ids.device)
            prompt = self._prompts[key] = _Prompt(g.text_kv(ids), cos, sin, vision_noisy, action_noisy)
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
