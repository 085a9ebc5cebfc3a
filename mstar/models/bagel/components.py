"""BAGEL's stateless components as the stateless engine runs them: ViT, VAE, the LLM over KV contexts, the flow.

Edges carry one request's tensors without a batch dimension: ViT rows [N, H], latent patches [N, p*p*C],
a token [1], a flow time [1]; image pixels come in as uint8 (`vit_patches`, `vae_pixels`) and are mapped to
[-1, 1] on the component's device by a lookup in the host formula's table (`embeddings.unit_pixels`). The
LLM component keeps each request's contexts (one per guidance branch it prefilled, keyed by request and
branch) and its text sampling state until the request is released.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mstar.engines.base import CapturePlan, PagedKVStore, StatelessBase, StepItem
from mstar.engines.cuda_graphs import to_device_async
from mstar.engines.grammar import GrammarMatcher, Grammars, constrain, start_matcher
from mstar.engines.sampling import SamplingParams, SamplingRow, sample
from mstar.models.bagel import flow
from mstar.models.bagel.config import BagelConfig, TokenIds
from mstar.models.bagel.context import KVContext, describe_decode
from mstar.models.bagel.embeddings import patchify, pixel_values, unit_pixels, unpatchify
from mstar.models.bagel.llm import BagelLLM, Routing
from mstar.models.bagel.model import request_pages
from mstar.models.bagel.plan import VAE, decode_segments, extent, shared_prefix
from mstar.models.bagel.queries import Query, QueryBuilder, run
from mstar.models.bagel.vae import FluxVAE
from mstar.models.bagel.vit import VisionTower


class ViTComponent(StatelessBase, nn.Module):
    """(vit_patches [N, 3 * p * p] uint8, vit_positions [N], vit_lengths [images]) -> vit_embeds [N, H]; the
    images of every request in the batch go through the encoder packed together."""

    host_inputs = True  # the image lengths are read on the host; patches and positions are moved here

    def __init__(self, tower: VisionTower) -> None:
        super().__init__()
        self.tower = tower
        device = next(tower.parameters()).device
        self.register_buffer("pixel_values", pixel_values().to(device), persistent=False)

    @torch.no_grad()
    def run_batch(self, walk: str, node: str, inputs: list[dict], options: list[dict]) -> list[dict]:
        rows = [i for i, x in enumerate(inputs) if "vit_patches" in x]
        out: list[dict] = [{} for _ in inputs]
        if not rows:
            return out
        lengths = [n for i in rows for n in inputs[i]["vit_lengths"].tolist()]
        device = next(self.tower.parameters()).device
        patches = unit_pixels(torch.cat([inputs[i]["vit_patches"] for i in rows]).to(device, non_blocking=True),
                              self.pixel_values)
        embeds = self.tower(patches, torch.cat([inputs[i]["vit_positions"] for i in rows]).to(device, non_blocking=True),
                            lengths)
        for i, part in zip(rows, embeds.split([inputs[i]["vit_patches"].shape[0] for i in rows]), strict=True):
            out[i] = {"vit_embeds": part}
        return out


class VAEComponent(StatelessBase, nn.Module):
    """Node `encode`: vae_pixels (every VAE image segment's [3, H, W] uint8 pixels, flattened one after another)
    -> vae_latents [N, p*p*C] (each image's latent patches). Node `decode`: latents [N, p*p*C] -> image
    uint8 [H, W, 3]; requests of one size decode together."""

    host_inputs = True  # the segments are read on the host; pixels and latents are moved here

    def __init__(self, vae: FluxVAE, cfg: BagelConfig) -> None:
        super().__init__()
        self.vae, self.cfg = vae, cfg
        self.register_buffer("pixel_values", pixel_values().to(self._device), persistent=False)

    def batch_key(self, item: StepItem) -> Hashable:
        if item.node == "decode":
            return (item.node, item.options["latent_rows"], item.options["latent_cols"])
        return item.node

    @torch.no_grad()
    def run_batch(self, walk: str, node: str, inputs: list[dict], options: list[dict]) -> list[dict]:
        if node == "encode":
            return [self._encode(x) for x in inputs]
        p = self.cfg.latent_patch_size
        rows, cols = options[0]["latent_rows"], options[0]["latent_cols"]
        latents = torch.stack([unpatchify(x["latents"], rows, cols, p) for x in inputs]).to(self._device,
                                                                                             non_blocking=True)
        images = ((self.vae.decode(latents).float() * 0.5 + 0.5).clamp(0, 1) * 255).to(torch.uint8)  # truncated
        out = []
        for image, opts in zip(images, options, strict=True):
            item = {"image": image.permute(1, 2, 0).contiguous()}
            if opts.get("report_progress"):
                item["progress"] = torch.ones(1)
            out.append(item)
        return out

    @property
    def _device(self) -> torch.device:
        return next(self.vae.parameters()).device

    def _encode(self, x: dict) -> dict:
        if "vae_pixels" not in x:
            return {}
        pixels = unit_pixels(x["vae_pixels"].to(self._device, non_blocking=True), self.pixel_values)
        offset, parts = 0, []
        step, p = self.cfg.latent_downsample, self.cfg.latent_patch_size
        for seg in decode_segments(x["segments"]):
            if seg.kind != VAE:
                continue
            height, width = seg.rows * step, seg.cols * step
            image = pixels[offset:offset + 3 * height * width].reshape(1, 3, height, width)
            offset += 3 * height * width
            parts.append(patchify(self.vae.encode(image)[0].float(), p))
        return {"vae_latents": torch.cat(parts)}


@dataclass
class _TextState:
    """A request's text sampling: its parameters, generator, the tokens generated so far and, for structured
    outputs, where it is in its grammar."""

    row: SamplingRow
    tokens: list[int]
    matcher: GrammarMatcher | None = None


_KINDS = {"prefill": "prefill", "prefill_guided": "prefill", "decode": "text", "close": "text", "denoise": "denoise"}
_PREFILLS = ("prefill", "prefill_guided")


class LLMComponent(StatelessBase, nn.Module):
    """The MoT LLM over per-branch contexts. Walks `prefill`/`prefill_guided`: node `full`, `no_text` or
    `no_image` builds that branch's context from (prompt_ids, segments, vit_embeds, vae_latents); a guidance
    context that is a prefix of the full one prefilled in the same batch is a view of it. Walk `decode`:
    feeds `token` [1] to the full context and samples the next `token` (stop at <|im_end|>, or once the grammar
    of option `structured_outputs` is complete: its logits masked through engines/grammar.py). Walk `close`:
    appends a thought's end to the full context. Walk `denoise`: node `full`/`no_text`/`no_image` runs the
    noisy `latents` at flow `timestep` over its branch's context -> `velocity` [N, p*p*C] float32; a branch
    the request does not guide with at this time produces nothing. Items of any request, branch or step
    share one forward per kind (prefill, text, denoise). The contexts live in the paged KV pool its engine
    hands it (`set_kv_pool`, from the spec's `kv_pool`); a released request's pages go back to it."""

    host_inputs = True  # token ids, segments and flow times are read on the host; `_query` moves the rest

    def __init__(self, llm: BagelLLM, cfg: BagelConfig, ids: TokenIds, grammars: Grammars | None = None) -> None:
        super().__init__()
        self.llm, self.cfg, self.ids = llm, cfg, ids
        self.grammars = grammars  # structured outputs' matchers; None: such requests fail
        self.queries = QueryBuilder(llm, cfg, ids)
        self._contexts: dict[tuple[str, str], KVContext] = {}
        self._texts: dict[str, _TextState] = {}
        self._pool: PagedKVStore | None = None

    def set_kv_pool(self, pool: PagedKVStore) -> None:
        self._pool = pool

    def kv_pages(self, item: StepItem) -> int:
        """A prefill's request: every branch context it needs at full length (`request_pages`); other walks
        take pages only within what their request's prefill counted."""
        if item.walk not in _PREFILLS:
            return 0
        return request_pages(decode_segments(item.inputs["segments"]), item.options, self.pool.page_size)

    @property
    def pool(self) -> PagedKVStore:
        """The pool the contexts live in."""
        if self._pool is None:
            raise RuntimeError("the bagel llm component has no KV pool: its engine hands it one (StatelessSpec.kv_pool)")
        return self._pool

    @property
    def num_contexts(self) -> int:
        """Contexts held (for leak tests)."""
        return len(self._contexts)

    def contexts(self) -> dict[tuple[str, str], KVContext]:
        """The contexts held, by (request, branch) (to inspect them)."""
        return dict(self._contexts)

    def release(self, request_id: str) -> None:
        """Forget the request's contexts and sampling state (safe for unknown ids)."""
        for key in [k for k in self._contexts if k[0] == request_id]:
            self._contexts.pop(key).free()
        self._texts.pop(request_id, None)

    def batch_key(self, item: StepItem) -> Hashable:
        return _KINDS[item.walk]

    def capture_plans(self) -> Sequence[CapturePlan]:
        return (self.decode_plan(),) if self.pool.graphed else ()

    def decode_plan(self) -> CapturePlan:
        """The understanding expert's decode step (`decode_step`) as its engine captures it in CUDA graphs: one
        token id and rope position per row; the pool's decode buffers describe the rows (`decode_rows`),
        rows past the batch attend nothing and store nothing."""
        def blank(rows: int) -> None:
            self.pool.prepare_decode([0] * rows, torch.full((rows,), -1, dtype=torch.int64),
                                     torch.zeros((rows, 1), dtype=torch.int32), pad_to=rows)

        return CapturePlan("decode", self.decode_step, (((), torch.int64), ((), torch.int64)), before_capture=blank)

    def decode_step(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Final hidden states [B, H] of one token per row (ids, rope positions [B] on the device) over the
        contexts the pool's decode buffers describe: launches only, every row through the understanding expert."""
        lm = self.llm.language_model
        return lm(lm.embed_tokens(ids), positions, Routing(), self.pool.decode)

    @torch.no_grad()
    def run_items(self, items: list[StepItem]) -> list[dict[str, Any]]:
        if self.graphs and all(i.walk == "decode" for i in items) and len(items) <= self.graphs.sizes("decode")[-1]:
            return self._replay_decode(items)
        out: list[dict[str, Any]] = [{} for _ in items]
        planned: list[tuple[int, KVContext, Query]] = []
        views: list[tuple[str, str, tuple[int, int]]] = []  # (request, branch, extent in the full context)
        fulls = {i.request_id for i in items if i.walk in _PREFILLS and i.node == "full"}
        for i, item in enumerate(items):
            held = item.request_id in fulls or (item.request_id, "full") in self._contexts
            view = self._view(item) if held else None
            if view is not None:
                views.append((item.request_id, item.node, view))
                continue
            work = self._query(item)
            if work is not None:
                planned.append((i, *work))
        if planned:
            self._forward(items, planned, out)
        for rid, branch, (tokens, rope) in views:
            self._keep(rid, branch, self._contexts[(rid, "full")].prefix(tokens, rope))
        return out

    def _replay_decode(self, items: list[StepItem]) -> list[dict[str, Any]]:
        """A decode batch replayed from the graph of the smallest captured size that holds it."""
        contexts = [self._context(i.request_id, "full") for i in items]
        rows = next(s for s in self.graphs.sizes("decode") if s >= len(items))
        ids, positions = self.decode_rows(contexts, [int(i.inputs["token"].reshape(-1)[0]) for i in items], rows)
        device = self.llm.language_model.embed_tokens.weight.device
        (hidden,) = self.graphs.replay("decode", to_device_async(ids, device), to_device_async(positions, device))
        for context in contexts:
            context.commit(1, context.rope + 1)
        out: list[dict[str, Any]] = [{} for _ in items]
        self._sample(items, list(enumerate(hidden)), out)
        return out

    def decode_rows(self, contexts: list[KVContext], tokens: list[int],
                    rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Reserve each context's next slot and describe the rows to the pool's decode attention (padded to
        `rows`); the host (ids, rope positions) [B] of `decode_step`. The caller commits the contexts after."""
        describe_decode(contexts, torch.cat([c.reserve(1) for c in contexts]), rows)
        return torch.tensor(tokens, dtype=torch.long), torch.tensor([c.rope for c in contexts], dtype=torch.long)

    def _forward(self, items: list[StepItem], planned: list[tuple[int, KVContext, Query]], out: list[dict]) -> None:
        hidden = run(self.llm, [(c, q) for _, c, q in planned]).split([q.num_tokens for _, _, q in planned])
        texts = []
        for (i, _, _), h in zip(planned, hidden, strict=True):
            if items[i].walk == "denoise":
                out[i] = {"velocity": self.llm.velocity(h[1:-1])}
            elif items[i].walk == "decode":
                texts.append((i, h[-1]))
        if texts:
            self._sample(items, texts, out)

    def _view(self, item: StepItem) -> tuple[int, int] | None:
        """A guidance branch's prefill whose context is a prefix of the full one (prefilled in the same batch or
        before): (tokens, rope) of that prefix, taken as a view after the forward instead of computed again, as
        `request_pages` counts it."""
        if item.walk not in _PREFILLS or item.node == "full" or not flow.branch_needed(item.node, item.options):
            return None
        segments = decode_segments(item.inputs["segments"])
        count = shared_prefix(segments, item.node)
        return None if count is None else extent(segments[:count])

    def _query(self, item: StepItem) -> tuple[KVContext, Query] | None:
        """The item's context and query; None when it has nothing to compute."""
        rid, options, x = item.request_id, item.options, item.inputs
        if item.walk in _PREFILLS:
            if not flow.branch_needed(item.node, options):
                return None
            context = self._keep(rid, item.node, KVContext(self.pool))
            query = self.queries.prefill(decode_segments(x["segments"]), item.node, 0, x["prompt_ids"],
                                         self._on_device(x.get("vit_embeds")), self._on_device(x.get("vae_latents")))
            return None if query is None else (context, query)
        if item.walk == "denoise":
            t = float(x["timestep"].reshape(-1)[0])
            if not flow.branch_active(item.node, t, options):
                return None
            context = self._context(rid, item.node)
            return context, self.queries.denoise(self._on_device(x["latents"]), t, options["latent_rows"],
                                                 options["latent_cols"], context.rope)
        token = int(x["token"].reshape(-1)[0])
        context = self._context(rid, "full")
        if item.walk == "close":
            ids = [self.ids.eos] if token == self.ids.eos else [token, self.ids.eos]
            return context, self.queries.text(ids, context.rope)
        return context, self.queries.text([token], context.rope)

    def _keep(self, rid: str, branch: str, context: KVContext) -> KVContext:
        """Hold `context` as the request's `branch`, giving back the pages of one held before."""
        old = self._contexts.pop((rid, branch), None)
        if old is not None:
            old.free()
        self._contexts[(rid, branch)] = context
        return context

    def _on_device(self, tensor: torch.Tensor | None) -> torch.Tensor | None:
        device = self.llm.language_model.embed_tokens.weight.device
        return None if tensor is None else tensor.to(device, non_blocking=True)  # without waiting for queued work

    def _context(self, rid: str, branch: str) -> KVContext:
        context = self._contexts.get((rid, branch))
        if context is None:
            raise RuntimeError(f"request {rid} has no {branch!r} context here: its prefill node ran on another "
                               f"worker; place node {branch!r} of every walk on one rank")
        return context

    def _sample(self, items: list[StepItem], texts: list[tuple[int, torch.Tensor]], out: list[dict]) -> None:
        """Sample each decoding request's next token from its last hidden state."""
        states = [self._text_state(items[i]) for i, _ in texts]
        logits = self.llm.language_model.logits(torch.stack([h for _, h in texts]))
        logits = constrain(logits, [s.matcher for s in states])
        drawn = sample(logits, [s.row for s in states]).to_host()
        for j, ((i, _), state, token) in enumerate(zip(texts, states, drawn.token_ids.tolist(), strict=True)):
            state.tokens.append(token)
            params = state.row.params
            stop = token in params.stop_token_ids or (not params.ignore_eos and token == self.ids.eos)
            if state.matcher is not None:  # a plain call, not an assert: python -O would skip it
                if not state.matcher.accept(token):
                    raise RuntimeError(f"{items[i].request_id} sampled token {token} that its grammar forbids")
                stop = stop or state.matcher.is_finished()
            out[i] = {**drawn.row(j, params), "stop": stop}  # the token, and its logprobs when asked

    def _text_state(self, item: StepItem) -> _TextState:
        state = self._texts.get(item.request_id)
        if state is None:
            params = SamplingParams.from_options(dict(item.options), SamplingParams())
            device = self.llm.language_model.embed_tokens.weight.device
            generator = None if params.seed is None else torch.Generator(device=device).manual_seed(params.seed)
            tokens: list[int] = []
            state = _TextState(SamplingRow(params, tokens, 0, generator, (self.ids.eos,)), tokens,
                               start_matcher(self.grammars, params.structured_outputs))
            self._texts[item.request_id] = state
        return state


class FlowComponent(StatelessBase, nn.Module):
    """Node `prepare`: the request's starting noise (its `seed`) as `latents` [N, p*p*C] and the first `timestep`.
    Node `combine`: guidance over the branch velocities and one Euler step -> the next `latents` and
    `timestep`, stopping after the last grid point; `step_latents` with option `debug_outputs`, `progress`
    with `report_progress`. Nothing is kept between steps: the time grid is a function of the options. The
    `timestep` stays on the host: the LLM reads it as a number, which from the device would wait for it."""

    def __init__(self, cfg: BagelConfig, device: torch.device) -> None:
        super().__init__()
        self.cfg, self.device = cfg, device

    @torch.no_grad()
    def run_items(self, items: list[StepItem]) -> list[dict[str, Any]]:
        return [self._prepare(i.options) if i.node == "prepare" else self._combine(i) for i in items]

    def _grid(self, options: dict) -> torch.Tensor:
        return flow.timesteps(int(options["num_inference_steps"]), float(options["timestep_shift"]))

    def _prepare(self, options: dict) -> dict[str, Any]:
        tokens = int(options["latent_rows"]) * int(options["latent_cols"])
        latents = flow.initial_noise(tokens, self.cfg.patch_latent_dim, int(options["seed"])).to(self.device,
                                                                                                 non_blocking=True)
        return {"latents": latents, "timestep": self._grid(options)[:1]}

    def _combine(self, item: StepItem) -> dict[str, Any]:
        x, options, i = item.inputs, item.options, item.iteration
        grid = self._grid(options)
        t = float(grid[i])
        guidance = flow.guidance_of(options)
        full = x["full_velocity"]
        no_text = x["no_text_velocity"] if guidance.active(t) else None
        no_image = None
        if guidance.image_active(t):
            no_image = x["no_image_velocity"] if options.get("no_image_context") else full
        velocity = flow.guided_velocity(full, no_text, no_image, guidance)
        latents = x["latents"] - velocity * float(grid[i] - grid[i + 1])
        out: dict[str, Any] = {"latents": latents, "timestep": grid[i + 1:i + 2]}
        if options.get("debug_outputs"):
            out["step_latents"] = latents[None].clone()
        if options.get("report_progress"):
            out["progress"] = torch.tensor([(i + 1) / len(grid)])
        out["stop"] = i + 2 >= len(grid)
        return out
