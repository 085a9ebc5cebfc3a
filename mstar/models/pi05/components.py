"""Pi0.5's stateless components as the stateless engine runs them.

Edges carry one request's tensors without a batch dimension: images [C, 3, S, S] (uint8 pixels, or
float32 in [-1, 1]: `processor.camera_pixels`), image_tokens
[C * N, W], prompt_ids [T], noise and actions [chunk, max_action_dim], prefix_len [1].
"""

from __future__ import annotations

import functools
from collections.abc import Hashable
from typing import Any

import torch
from torch import nn

from mstar.engines.base import CapturePlan, StatelessBase, StepItem
from mstar.engines.cuda_graphs import to_device_async
from mstar.models.pi05.config import Pi05Config
from mstar.models.pi05.network import PolicyNet
from mstar.models.pi05.prefix_kv import PoolFull, PrefixKVPool
from mstar.models.pi05.processor import pixel_values, unit_pixels
from mstar.models.pi05.siglip import VisionTower


class VisionComponent(StatelessBase, nn.Module):
    """Node `vision`: every camera of every request in one SigLIP forward; images -> image_tokens. uint8
    images are mapped to [-1, 1] here, on the tower's device, so a worker process receives a quarter of
    float32's bytes. On CUDA the forward replays a graph captured per image count (`capture_plans`; the
    engine's batch sizes count images here)."""

    def __init__(self, encoder: VisionTower) -> None:
        super().__init__()
        self.encoder = encoder
        device = next(encoder.parameters()).device
        self.register_buffer("pixel_values", pixel_values().to(device), persistent=False)

    def capture_plans(self) -> list[CapturePlan]:
        """The tower over a batch of images [N, 3, S, S] (float32): its few hundred kernels as one launch."""
        size = self.encoder.shape.image_size
        return [CapturePlan("tower", self.encoder, (((3, size, size), torch.float32),))]

    @torch.no_grad()
    def run_items(self, items: list[StepItem]) -> list[dict[str, Any]]:
        parts = [unit_pixels(item.inputs["images"], self.pixel_values) for item in items]
        counts = [part.shape[0] for part in parts]
        images = parts[0] if len(parts) == 1 else torch.cat(parts)  # one robot's cameras go in as they are
        replayed = self.graphs.replay("tower", images)  # views of the graph's buffer: copied out
        tokens = self.encoder(images) if replayed is None else replayed[0].clone()
        return [{"image_tokens": part.flatten(0, 1)} for part in tokens.split(counts)]


PREFIX_GRAPH_SIZES = (1, 2, 4)  # batches of prefixes replayed from graphs; larger ones are compute-bound
PROMPT_BUCKET = 32  # prompt tokens between two captured prefix lengths


def prefix_buckets(config: Pi05Config, page_size: int) -> list[int]:
    """The padded prefix lengths (whole pages) the prefix's graphs are captured at: for each camera count
    its image tokens plus a prompt of up to 32, 64, ... tokens, and of the longest prompt."""
    prompts = [*range(PROMPT_BUCKET, config.max_prompt_tokens, PROMPT_BUCKET), config.max_prompt_tokens]
    tokens = {cameras * config.vision.tokens + prompt for cameras in range(1, len(config.cameras) + 1)
              for prompt in prompts}
    return sorted({-(-n // page_size) * page_size for n in tokens})


class PolicyComponent(StatelessBase, nn.Module):
    """The Gemma prefix and the action expert behind two nodes, sharing the paged prefix cache:

    `prefix` (walk `prefix`): image_tokens and prompt_ids -> every layer's keys and values, written to
    pages the request holds until its chunk is out; outputs prefix_len. A batch of up to the largest of
    `PREFIX_GRAPH_SIZES` replays one CUDA graph captured at the next of `prefix_buckets` (`capture_plans`),
    its prompts padded to that length and its rows to the next captured batch size.
    `flow` (walk `act`): noise -> `actions`, every Euler step of the flow in one call over the request's
    prefix, read from the cache once; then the pages go back. Requests batch by their step count; at the
    config's count the call replays one CUDA graph (`capture_plans`).
    """

    def __init__(self, net: PolicyNet, pool: PrefixKVPool) -> None:
        super().__init__()
        self.net, self.pool = net, pool

    def release(self, request_id: str) -> None:
        self.pool.release(request_id)

    def batch_key(self, item: StepItem) -> Hashable:
        return (item.walk, item.node, int(item.options["num_steps"]) if item.node == "flow" else 0)

    @functools.cached_property
    def buckets(self) -> list[int]:
        """The prefix lengths its prefix graphs are captured at (`prefix_buckets`): fixed by the config, asked
        once per prefix call."""
        return prefix_buckets(self.net.config, self.pool.page_size)

    @property
    def table_width(self) -> int:
        """Pages of the longest prefix: the page table's width in the flow's graphs."""
        return -(-self.net.config.max_prefix_tokens // self.pool.page_size)

    def capture_plans(self) -> list[CapturePlan]:
        """The Gemma prefix forward (`prefill`) at each of `buckets` tokens: its few hundred kernels as one
        launch; and the whole flow (`sample`) at the config's step count, over a page table of `table_width`
        pages: ten expert forwards of a few hundred kernels each replay as one graph instead of launching
        one by one."""
        cfg, page = self.net.config, self.pool.page_size
        prefixes = [CapturePlan(("prefix", length), self.prefill,
                                (((length, cfg.llm.width), self.net.llm.embed.weight.dtype),
                                 ((length // page + 1,), torch.long)), PREFIX_GRAPH_SIZES)
                    for length in reversed(self.buckets)]  # longest first: the shorter reuse its pool memory
        return [*prefixes, CapturePlan("flow", functools.partial(self.sample, num_steps=cfg.num_steps),
                                       (((cfg.chunk_size, cfg.max_action_dim), torch.float32),
                                        ((self.table_width + 1,), torch.long)))]

    def prefill(self, prefixes: torch.Tensor, table: torch.Tensor) -> tuple[()]:
        """Prefixes [B, L, W] (zero past each one's end) and a device `page_table` [B, L / page_size + 1]:
        every layer's keys and values written to the table's pages; device work only, so a CUDA graph may
        hold it. A row of no tokens (a graph's padding, its warm-up) sees its first one: softmax over no
        key is NaN, which would land in the sink that flows read as padding."""
        lengths = table[:, -1].clamp(min=1)
        valid = torch.arange(prefixes.shape[1], device=prefixes.device)[None, :] < lengths[:, None]
        self.net.prefill(prefixes, valid, lambda layer, k, v: self.pool.write(layer, table, k, v))
        return ()

    def sample(self, noise: torch.Tensor, table: torch.Tensor, num_steps: int) -> torch.Tensor:
        """noise [B, C, A] and a device `page_table` [B, pages + 1] -> actions [B, C, A] (float32)."""
        prefix = self.pool.gather(table)
        return self.net.sample(noise, prefix.layer, prefix.lengths, num_steps)

    @torch.no_grad()
    def run_items(self, items: list[StepItem]) -> list[dict[str, Any]]:
        return self._prefix(items) if items[0].node == "prefix" else self._flow(items)

    def _prefix(self, items: list[StepItem]) -> list[dict[str, Any]]:
        rids = [item.request_id for item in items]
        image_tokens = [i.inputs["image_tokens"] for i in items]
        prompt_ids = [i.inputs["prompt_ids"] for i in items]
        lengths = [len(images) + len(ids) for images, ids in zip(image_tokens, prompt_ids, strict=True)]
        try:
            for rid, length in zip(rids, lengths, strict=True):
                self.pool.allocate(rid, length)
        except PoolFull:
            for rid in rids:  # the engine runs the items again one by one: those that fit go on
                self.pool.release(rid)
            raise
        graph = self._prefix_graph(max(lengths), len(items))
        page = self.pool.page_size
        width, rows = graph or (-(-max(lengths) // page), len(items))
        prefixes = self.net.prefix_embeddings(image_tokens, prompt_ids, width * page, rows)
        table = self.pool.page_table(rids, width)
        if rows > len(items):  # padded rows: the sink's
            table = torch.cat([table, table.new_zeros(rows - len(items), width + 1)])
        table = to_device_async(table, prefixes.device)
        if graph is None:
            self.prefill(prefixes, table)
        else:
            replayed = self.graphs.replay(("prefix", width * page), prefixes, table)
            assert replayed is not None, f"no prefix graph of {width * page} tokens at {rows} rows"
        return [{"prefix_len": torch.tensor([length])} for length in lengths]

    def _prefix_graph(self, tokens: int, batch: int) -> tuple[int, int] | None:
        """(pages, rows) of the captured prefix graph a batch of `batch` prefixes of up to `tokens` tokens
        runs in; None: none holds it (run eagerly)."""
        length = next((n for n in self.buckets if n >= tokens), None)
        if length is None or ("prefix", length) not in self.graphs.keys():
            return None
        rows = next((size for size in self.graphs.sizes(("prefix", length)) if size >= batch), None)
        return None if rows is None else (length // self.pool.page_size, rows)

    def _flow(self, items: list[StepItem]) -> list[dict[str, Any]]:
        rids = [item.request_id for item in items]
        num_steps = int(items[0].options["num_steps"])  # one count per batch (`batch_key`)
        noise = torch.stack([item.inputs["noise"] for item in items]).float()
        replayed = None
        if self.graphs and num_steps == self.net.config.num_steps:
            table = to_device_async(self.pool.page_table(rids, self.table_width), noise.device)
            replayed = self.graphs.replay("flow", noise, table)  # views of the graph's buffer: copied out
        if replayed is not None:
            actions = replayed[0].clone()
        else:
            actions = self.sample(noise, to_device_async(self.pool.page_table(rids), noise.device), num_steps)
        for rid in rids:  # later work on this stream runs after the flow's reads of these pages
            self.pool.release(rid)
        return [{"actions": row} for row in actions]
