"""V-JEPA 2's stateless components as the stateless engine runs them.

Edges carry one request's tensors without a batch dimension: pixels [T, 3, S, S], latents [N, D]
(V-JEPA 2) or [C, HW, E] (one row per context frame, V-JEPA 2-AC), states and actions [n, 7].
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import torch
from torch import nn

from mstar.engines.base import StatelessBase, StepItem
from mstar.models.vjepa2.ac_predictor import ACPredictor, RolloutCache, normalize_latents
from mstar.models.vjepa2.classifier import VideoClassifier
from mstar.models.vjepa2.encoder import VJEPA2Encoder
from mstar.models.vjepa2.planning import CEMSearch, CEMSettings
from mstar.models.vjepa2.processor import first_or_all
from mstar.models.vjepa2.rollout import rollout_step


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
    latents, [C, 7] states, their actions) to a new KV cache; each later one appends the frame predicted
    last (loop-back `frame` [HW, E] and `state` [7]) with the next action. Each predicts the next frame:
    `frame`, `state`, and `predicted` [1, HW, E] / `predicted_states` [1, 7] for the walk to accumulate.
    `cem` (walk `plan`, once per search iteration): the first opens the search (`CEMSearch`) from the
    context, the history actions and `goal_latents`; each runs one iteration and emits `energy`; the
    last emits `actions`.
    """

    def __init__(self, predictor: ACPredictor, normalize: bool = True) -> None:
        super().__init__()
        self.predictor, self.normalize = predictor, normalize
        self.rollouts: dict[str, tuple[RolloutCache, int]] = {}  # request -> (its cache, steps taken)
        self.searches: dict[str, tuple[CEMSearch, int]] = {}  # request -> (its search, iterations run)

    def release(self, request_id: str) -> None:
        self.rollouts.pop(request_id, None)
        self.searches.pop(request_id, None)

    @torch.no_grad()
    def run_items(self, items: list[StepItem]) -> list[dict[str, Any]]:
        return [self._step(item) if item.node == "step" else self._cem(item) for item in items]

    def _step(self, item: StepItem) -> dict[str, Any]:
        x, dtype = item.inputs, self.predictor.proj.weight.dtype
        context = x["latents"].shape[0]
        horizon = int(item.options["horizon"])
        if "frame" not in x:
            cache = self.predictor.new_cache(1, context + horizon - 1)
            latents, states, actions = x["latents"][None], x["states"][None], x["actions"][None, :context]
            taken = 0
        else:
            cache, taken = self.rollouts[item.request_id]
            latents, states = x["frame"][None, None].to(dtype), x["state"][None, None]
            actions = x["actions"][None, context - 1 + taken][None]
        frame, state = rollout_step(self.predictor, cache, latents, actions, states, self.normalize)
        taken += 1
        if taken < horizon:
            self.rollouts[item.request_id] = (cache, taken)
        else:
            self.rollouts.pop(item.request_id, None)
        frame = frame[0].float()
        return {"frame": frame, "state": state[0], "predicted": frame[None], "predicted_states": state,
                "stop": taken >= horizon}

    def _cem(self, item: StepItem) -> dict[str, Any]:
        x, o = item.inputs, item.options
        if item.request_id not in self.searches:
            settings = CEMSettings(horizon=o["horizon"], samples=o["samples"], topk=o["topk"],
                                   iterations=o["cem_iterations"], maxnorm=o["maxnorm"], normalize=self.normalize)
            device = x["latents"].device
            generator = torch.Generator(device=device).manual_seed(int(o["seed"]))
            states = x["states"]
            history = x.get("history", states.new_zeros(0, states.shape[1]))
            dtype = self.predictor.proj.weight.dtype
            search = CEMSearch(self.predictor, x["latents"].to(dtype), states, history, x["goal_latents"].to(dtype),
                               settings, generator)
            self.searches[item.request_id] = (search, 0)
        search, done = self.searches[item.request_id]
        energy = search.iterate()
        done += 1
        out: dict[str, Any] = {"energy": torch.tensor([energy])}
        if o.get("report_progress"):
            out["progress"] = torch.tensor([done / search.settings.iterations])
        if done < search.settings.iterations:
            self.searches[item.request_id] = (search, done)
            return out
        self.searches.pop(item.request_id, None)
        return {**out, "actions": first_or_all(search.actions(), o), "stop": True}
