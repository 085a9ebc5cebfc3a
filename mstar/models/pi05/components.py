"""Pi0.5's stateless components as the stateless engine runs them.

Edges carry one request's tensors without a batch dimension: images [C, 3, S, S], image_tokens
[C * N, W], prompt_ids [T], noise and x_t [chunk, max_action_dim], prefix_len [1].
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from mstar.engines.base import StatelessBase, StepItem
from mstar.models.pi05.network import PolicyNet, flow_time
from mstar.models.pi05.prefix_kv import PoolFull, PrefixKVPool
from mstar.models.pi05.siglip import VisionTower


class VisionComponent(StatelessBase, nn.Module):
    """Node `vision`: every camera of every request in one SigLIP forward; images -> image_tokens."""

    def __init__(self, encoder: VisionTower) -> None:
        super().__init__()
        self.encoder = encoder

    @torch.no_grad()
    def run_items(self, items: list[StepItem]) -> list[dict[str, Any]]:
        counts = [item.inputs["images"].shape[0] for item in items]
        tokens = self.encoder(torch.cat([item.inputs["images"] for item in items]))
        return [{"image_tokens": part.flatten(0, 1)} for part in tokens.split(counts)]


class PolicyComponent(StatelessBase, nn.Module):
    """The Gemma prefix and the action expert behind two nodes, sharing the paged prefix cache:

    `prefix` (walk `prefix`): image_tokens and prompt_ids -> every layer's keys and values, written to
    pages the request holds until its chunk is out; outputs prefix_len.
    `flow` (walk `act`, once per Euler step): x_t (the walk's `noise` at the first step) -> x_t one step
    nearer the actions, the velocity attending the request's prefix; the last step also outputs
    `actions`, stops the loop and gives the pages back. Requests at different steps share a forward.
    """

    def __init__(self, net: PolicyNet, pool: PrefixKVPool) -> None:
        super().__init__()
        self.net, self.pool = net, pool

    def release(self, request_id: str) -> None:
        self.pool.release(request_id)

    @torch.no_grad()
    def run_items(self, items: list[StepItem]) -> list[dict[str, Any]]:
        return self._prefix(items) if items[0].node == "prefix" else self._flow(items)

    def _prefix(self, items: list[StepItem]) -> list[dict[str, Any]]:
        rids = [item.request_id for item in items]
        prefixes, valid = self.net.prefix_embeddings([i.inputs["image_tokens"] for i in items],
                                                     [i.inputs["prompt_ids"] for i in items])
        lengths = valid.sum(dim=1).tolist()
        try:
            for rid, length in zip(rids, lengths, strict=True):
                self.pool.allocate(rid, length)
        except PoolFull:
            for rid in rids:  # the engine runs the items again one by one: those that fit go on
                self.pool.release(rid)
            raise
        slots = self.pool.slots(rids, prefixes.device)
        self.net.prefill(prefixes, valid, lambda layer, k, v: self.pool.write(layer, slots, k[valid], v[valid]))
        return [{"prefix_len": torch.tensor([length])} for length in lengths]

    def _flow(self, items: list[StepItem]) -> list[dict[str, Any]]:
        x_t = torch.stack([item.inputs.get("x_t", item.inputs["noise"]) for item in items]).float()
        steps = [int(item.options["num_steps"]) for item in items]
        device = x_t.device
        t = torch.tensor([flow_time(i.iteration, n) for i, n in zip(items, steps, strict=True)], device=device)
        view = self.pool.view([item.request_id for item in items])
        prefix_len = torch.cat([item.inputs["prefix_len"] for item in items]).to(device)
        velocity = self.net.velocity(x_t, t, view.layer, view.valid, prefix_len)
        dt = torch.tensor([-1.0 / n for n in steps], device=device)[:, None, None]
        x_next = x_t + dt * velocity
        out = []
        for row, item in enumerate(items):
            values: dict[str, Any] = {"x_t": x_next[row]}
            if item.iteration + 1 >= steps[row]:
                values.update(actions=x_next[row], stop=True)
                self.pool.release(item.request_id)
            out.append(values)
        return out
