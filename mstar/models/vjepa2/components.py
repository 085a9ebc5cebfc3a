"""V-JEPA 2's stateless components as the stateless engine runs them.

Edges carry one request's tensors without a batch dimension: pixels [T, 3, S, S], latents [N, D]
(V-JEPA 2) or [C, HW, E] (one row per context frame, V-JEPA 2-AC), states and actions [n, 7].
"""

from __future__ import annotations

import functools
from collections.abc import Hashable
from typing import Any

import torch
from torch import nn

from mstar.engines.base import CapturePlan, GraphBufferSpec, StatelessBase, StepItem
from mstar.models.vjepa2.ac_predictor import ACPredictor, RolloutCache, normalize_latents
from mstar.models.vjepa2.classifier import VideoClassifier
from mstar.models.vjepa2.encoder import VJEPA2Encoder
from mstar.models.vjepa2.planning import CEMSearch, CEMSettings
from mstar.models.vjepa2.processor import first_or_all
from mstar.models.vjepa2.rollout import EagerSteps, FrameStep


class ClipEncoderComponent(StatelessBase, nn.Module):
    """Node `encode`: video [T, 3, S, S] -> latents [N, D] (wanted in `modalities`) and pooled [D] (their
    mean); clips of one shape share a forward."""

    def __init__(self, encoder: VJEPA2Encoder) -> None:
        super().__init__()
        self.encoder = encoder

    def batch_key(self, item: StepItem) -> Hashable:
        return (item.walk, tuple(item.inputs["video"].shape))

    @torch.no_grad()
    def run_items(self, items: list[StepItem]) -> list[dict[str, Any]]:
        latents = self.encoder(torch.stack([item.inputs["video"] for item in items])).float()
        out = []
        for row, item in enumerate(items):
            wanted = set(item.options.get("modalities") or ["latents"])
            values = {"latents": latents[row]}
            if "pooled" in wanted:
                values["pooled"] = latents[row].mean(dim=0)
            out.append(values)
        return out


class ClassifierComponent(StatelessBase, nn.Module):
    """Node `classify`: latents [N, D] -> logits [labels] float32 and label (the top one's index). Built
    without a head for a checkpoint that has none (its processor refuses requests for labels)."""

    def __init__(self, head: VideoClassifier | None) -> None:
        super().__init__()
        self.head = head

    def batch_key(self, item: StepItem) -> Hashable:
        return (item.walk, tuple(item.inputs["latents"].shape))

    @torch.no_grad()
    def run_items(self, items: list[StepItem]) -> list[dict[str, Any]]:
        if self.head is None:
            raise ValueError("this checkpoint has no classifier head")
        weights = self.head.head.weight
        logits = self.head(torch.stack([item.inputs["latents"] for item in items]).to(weights.dtype)).float()
        return [{"logits": row, "label": row.argmax().reshape(1)} for row in logits]


class FrameEncoderComponent(StatelessBase, nn.Module):
    """Node `encode` of V-JEPA 2-AC: every context frame (and the goal image) is encoded on its own as a
    clip of itself twice: frames [C, 3, S, S] -> latents [C, HW, E], goal -> goal_latents [HW, E], both
    normalised (`normalize_latents`)."""

    def __init__(self, encoder: VJEPA2Encoder) -> None:
        super().__init__()
        self.encoder = encoder

    @torch.no_grad()
    def run_items(self, items: list[StepItem]) -> list[dict[str, Any]]:
        images = [item.inputs["frames"] for item in items] + [item.inputs["goal"][None] for item in items
                                                              if "goal" in item.inputs]
        flat = torch.cat(images)  # one clip per image, all requests together
        latents = normalize_latents(self.encoder(flat[:, None].expand(-1, 2, -1, -1, -1)).float())
        out, start = [], 0
        for item in items:
            count = item.inputs["frames"].shape[0]
            out.append({"latents": latents[start:start + count]})
            start += count
        for item, values in zip(items, out, strict=True):
            if "goal" in item.inputs:
                values["goal_latents"] = latents[start]
                start += 1
        return out


class WorldModelComponent(StatelessBase, nn.Module):
    """The AC predictor behind two nodes, each keeping per-request state until the request ends:

    `step` (walk `rollout`, once per step): the first iteration appends the context frames ([C, HW, E]
    latents, [C, 7] states, their actions) to the request's KV cache; each later one appends the frame
    predicted last (loop-back `frame` [HW, E] and `state` [7]) with the next action. Each predicts the next
    frame: `frame`, `state`, and `predicted` [1, HW, E] / `predicted_states` [1, 7] for the walk to
    accumulate.
    `cem` (walk `plan`, once per search iteration): the first opens the search (`CEMSearch`) from the
    context, the history actions and `goal_latents`; each runs one iteration and emits `energy`; the
    last emits `actions`.

    On CUDA (`capture_plans`) each lane, `rollout` and `plan`, has one preallocated cache (1 row of
    `rollout_frames` frames; `max(plan_samples)` rows of `plan_frames` frames; 0 or none: no such lane)
    and a CUDA graph of the one-frame step at every frame position of it (candidates padded up to a
    captured count). One request at a time holds a lane's cache; a request that finds it held, or does
    not fit it, runs eagerly on a cache of its own.
    """

    def __init__(self, predictor: ACPredictor, normalize: bool = True, rollout_frames: int = 32,
                 plan_samples: tuple[int, ...] = (400,), plan_frames: int = 2) -> None:
        super().__init__()
        self.predictor, self.normalize = predictor, normalize
        self.rollout_frames, self.plan_samples, self.plan_frames = rollout_frames, plan_samples, plan_frames
        self.lanes: dict[str, RolloutCache] = {}  # lane -> the cache its graphs write (made by capture_plans)
        self.holders: dict[str, str] = {}  # lane -> the request using its cache
        self.rollouts: dict[str, tuple[FrameStep, int]] = {}  # request -> (its steps, steps taken)
        self.searches: dict[str, tuple[CEMSearch, int]] = {}  # request -> (its search, iterations run)

    def capture_plans(self) -> list[CapturePlan]:
        """The one-frame step (`lane_step`) at each frame position of each lane's cache: a step's few
        hundred kernels replay as one graph. Allocates the lanes' caches."""
        p = self.predictor
        self.lanes = {lane: p.new_cache(rows, frames) for lane, (rows, frames) in self.lane_shapes().items()}
        if not self.lanes:
            return []
        cfg, dtype = p.config, p.proj.weight.dtype
        p.rope(0, max(cache.capacity for cache in self.lanes.values()), p.proj.weight.device)  # outside capture
        example = (((1, cfg.tokens_per_frame, cfg.embed_dim), dtype), ((1, cfg.action_dim), torch.float32),
                   ((1, cfg.action_dim), torch.float32))
        sizes = {"rollout": (1,), "plan": tuple(self.plan_samples)}
        return [CapturePlan((lane, position), functools.partial(self.lane_step, lane, position), example, sizes[lane])
                for lane, cache in self.lanes.items() for position in range(cache.capacity)]

    def lane_shapes(self) -> dict[str, tuple[int, int]]:
        """(rows, frames) of each lane's cache that `capture_plans` allocates."""
        shapes = {"rollout": (1, self.rollout_frames)} if self.rollout_frames else {}
        if self.plan_samples and self.plan_frames:
            shapes["plan"] = (max(self.plan_samples), self.plan_frames)
        return shapes

    def graph_buffers(self) -> GraphBufferSpec | None:
        """The lanes' caches as the memory plan counts them (`StatelessSpec.graph_buffers`); None: no lane."""
        shapes = self.lane_shapes()
        if not shapes:
            return None
        setting = "model_kwargs.plan_graph_samples" if "plan" in shapes else "model_kwargs.rollout_graph_frames"
        return GraphBufferSpec(sum(self.predictor.cache_bytes(*shape) for shape in shapes.values()), setting)

    def lane_step(self, lane: str, position: int, latents: torch.Tensor, actions: torch.Tensor,
                  states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One frame per row ([B, 1, HW, E] latents, [B, 1, A] actions and states) appended at frame
        `position` of the first B rows of `lane`'s cache: (next frame [B, HW, E], its state [B, A])."""
        cache = self.lanes[lane].rows(latents.shape[0])
        return EagerSteps(self.predictor, cache, self.normalize)(position, latents, actions, states)

    def steps(self, lane: str, request_id: str, rows: int, frames: int) -> tuple[RolloutCache, FrameStep]:
        """A cache of `rows` x `frames` for a request and the `FrameStep` that runs on it: `lane`'s cache
        and its graphs when they are captured, free and large enough (held until `release`), else a new
        cache, eager."""
        cache = self.lanes.get(lane)
        if cache is None or lane in self.holders or rows > cache.batch or frames > cache.capacity:
            cache = self.predictor.new_cache(rows, frames)
            return cache, EagerSteps(self.predictor, cache, self.normalize)
        self.holders[lane] = request_id
        cache = cache.rows(rows)
        return cache, _GraphSteps(self, lane, cache)

    def release(self, request_id: str) -> None:
        self.rollouts.pop(request_id, None)
        self.searches.pop(request_id, None)
        for lane in [lane for lane, holder in self.holders.items() if holder == request_id]:
            del self.holders[lane]

    @torch.no_grad()
    def run_items(self, items: list[StepItem]) -> list[dict[str, Any]]:
        return [self._step(item) if item.node == "step" else self._cem(item) for item in items]

    def _step(self, item: StepItem) -> dict[str, Any]:
        x = item.inputs
        context = x["latents"].shape[0]
        horizon = int(item.options["horizon"])
        if "frame" not in x:
            cache, steps = self.steps("rollout", item.request_id, 1, context + horizon - 1)
            latents, states, actions = x["latents"][None], x["states"][None], x["actions"][None, :context]
            first = steps if context == 1 else EagerSteps(self.predictor, cache, self.normalize)
            frame, state = first(0, latents, actions, states)
            taken = 1
        else:
            steps, taken = self.rollouts[item.request_id]
            latents, states = x["frame"][None, None], x["state"][None, None]
            actions = x["actions"][None, context - 1 + taken][None]
            frame, state = steps(context - 1 + taken, latents, actions, states)
            taken += 1
        if taken < horizon:
            self.rollouts[item.request_id] = (steps, taken)
        else:
            self.release(item.request_id)
        frame = frame[0].float()
        return {"frame": frame, "state": state[0], "predicted": frame[None], "predicted_states": state,
                "stop": taken >= horizon}

    def _cem(self, item: StepItem) -> dict[str, Any]:
        o = item.options
        if item.request_id not in self.searches:
            self.searches[item.request_id] = (self._search(item), 0)
        search, done = self.searches[item.request_id]
        energy = search.iterate()
        done += 1
        out: dict[str, Any] = {"energy": energy.reshape(1).float()}
        if o.get("report_progress"):
            out["progress"] = torch.tensor([done / search.settings.iterations])
        if done < search.settings.iterations:
            self.searches[item.request_id] = (search, done)
            return out
        self.release(item.request_id)
        return {**out, "actions": first_or_all(search.actions(), o), "stop": True}

    def _search(self, item: StepItem) -> CEMSearch:
        x, o = item.inputs, item.options
        settings = CEMSettings(horizon=o["horizon"], samples=o["samples"], topk=o["topk"],
                               iterations=o["cem_iterations"], maxnorm=o["maxnorm"], normalize=self.normalize)
        device = x["latents"].device
        generator = torch.Generator(device=device).manual_seed(int(o["seed"]))
        states = x["states"]
        history = x.get("history", states.new_zeros(0, states.shape[1]))
        dtype = self.predictor.proj.weight.dtype
        context = x["latents"].shape[0]
        cache, steps = self.steps("plan", item.request_id, settings.samples, context - 1 + settings.horizon)
        return CEMSearch(self.predictor, x["latents"].to(dtype), states, history, x["goal_latents"].to(dtype),
                         settings, generator, cache, steps)


class _GraphSteps:
    """`FrameStep` on a lane's cache: each position's graph replayed (eager where none is captured)."""

    def __init__(self, world: WorldModelComponent, lane: str, cache: RolloutCache) -> None:
        self.world, self.lane, self.cache = world, lane, cache
        self.eager = EagerSteps(world.predictor, cache, world.normalize)

    def __call__(self, position: int, latents: torch.Tensor, actions: torch.Tensor,
                 states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        replayed = None
        if latents.shape[1] == 1:
            replayed = self.world.graphs.replay((self.lane, position), latents, actions, states)
        if replayed is None:
            return self.eager(position, latents, actions, states)
        self.cache.truncate(position + 1)  # what the replayed appends wrote
        return replayed[0].clone(), replayed[1].clone()  # views of the graphs' buffers: copied out
