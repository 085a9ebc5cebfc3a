"""The autoregressive engine: paged KV cache, continuous batching, chunked prefill, prefix reuse.

Items are keyed by (request_id, kv_slot): each key is one sequence. An item's `inputs["input_ids"]`
(1-D int64) are appended to its sequence: the prompt on the first item, the previously sampled token
(or any tokens the caller chooses) on later ones. Each item yields one StepResult with `outputs["token"]`
(LongTensor[1]) once its tokens are computed. An engine-loop item (`StepItem.loop`) is a decode loop:
after each sample that does not end it, the engine appends the token to the sequence itself and yields
a result with `more=True`; the item stays pending until the last iteration, a stop, the length limit or
its release. A result with `stop=True` ends the sequence: its pages are freed (full pages stay in the
prefix cache) and a later item with the same key starts a new sequence.

Lookahead (`lookahead.py`): once a step's draw is queued on the device, the next forward of the
engine-loop sequences that go on is launched with the drawn ids before the host reads them.

Structured outputs (`engines/token_masks.py`): a constrained row's token mask depends only on the tokens
its matcher has accepted, so the host fills it while the step's forward runs, and the device applies it
right before the draw (inside the sampler and step graphs). Constrained sequences run ahead like free
ones: their sampled tokens reach the matchers while the next forward runs.

A model whose logits cover a window of ids (`CausalLM.logit_offset`) is sampled over the window's
columns; every id handed back (tokens, `top_ids`, the ids a lookahead forward is fed) is a token id,
the offset added on the device.

Resuming a sequence started elsewhere (prefill/decode split): the KV cache of a request lives in the
engine of the worker that ran its prefill, so a decode walk placed on another worker meets a sequence
its engine has never seen. A model makes that case correct without changing its graph by also feeding
the decode node the request's prompt on the port `prompt_ids` (`CONTEXT_PORT`): an unknown sequence
then starts from `prompt_ids + input_ids` (recomputing the prompt's KV once) and counts `input_ids` as
tokens already generated, so penalties, `min_tokens`, `max_tokens` and seeded sampling (which skips
the draws those tokens consumed: one row of `logit_width` each) continue exactly where the prefill
worker left off. For a sequence it already holds, `prompt_ids` is ignored.

Moving a sequence instead (`KVHandoff`, kv_transfer.py): the prefill worker's sequence waits until the
decode worker has taken pages for it (`submit_streamed`, `reserve_kv`, `stream_kv`; an offer without room
queues there until pages free, for `kv_offer_timeout_s` at most: `expire_kv`), then each layer's K/V
leaves as soon as the forward wrote it (`place_kv` on the other side), and the decode worker's first item
starts from those pages (`submit_with_kv`): no prompt token is computed again.
`stats()["prompt_tokens"]` counts the prompt tokens this engine computed.
"""

from __future__ import annotations

import zlib

import torch

from mstar.config import CudaGraphConfig
from mstar.engines.autoregressive import kv_transfer
from mstar.engines.autoregressive.batch_scheduler import BatchScheduler, Chunk
from mstar.engines.autoregressive.lookahead import Ahead
from mstar.engines.autoregressive.runner import ModelRunner, make_attention_backend
from mstar.engines.autoregressive.sequence import Sequence
from mstar.engines.autoregressive.step_graph import StepGraphs
from mstar.engines.autoregressive.token_inputs import ItemExtras, TokenInputs, parse_item
from mstar.engines.autoregressive.warm_up import warm_up_engine
from mstar.engines.base import AutoregressiveSpec, CausalLM, StepItem, StepResult, require
from mstar.engines.cuda_graphs import to_device_async
from mstar.engines.grammar import Grammars, start_matcher
from mstar.engines.kv_cache.block_pool import BlockPool
from mstar.engines.kv_cache.config import KVCacheConfig, compute_num_pages
from mstar.engines.kv_handoff import WHOLE_POOL, KVGranted, KVOffer, KVStreamEnd, KVStreamSink, KVWithdrawn
from mstar.engines.sampling import SampleOutput, SamplingParams, SamplingRow, plain_greedy, sample
from mstar.engines.sampling_graph import SamplerGraphs
from mstar.engines.token_masks import TokenMasks

CONTEXT_PORT = "prompt_ids"  # optional input port: the tokens before `input_ids` of a resumed sequence


class AutoregressiveEngine:
    """Engine protocol implementation for a `CausalLM` (see the module docstring for the item rules).

    `max_model_len` (prompt + generated tokens of one sequence) defaults to the pool's capacity
    and may not exceed it, so that any single sequence always fits once others are preempted.
    Token inputs are read on the host and token outputs are host tensors (`host_inputs`), so a
    decode loop costs one device-to-host copy per step, not one per request.
    """

    host_inputs = True  # the worker hands item inputs over as they are, without a device copy

    def __init__(self, model: CausalLM, kv_config: KVCacheConfig, device: torch.device | str,
                 eos_token_ids: tuple[int, ...] = (), default_sampling: SamplingParams | None = None,
                 max_num_seqs: int = 256, max_batch_tokens: int = 2048, max_model_len: int | None = None,
                 enable_prefix_caching: bool = True, cuda_graphs: CudaGraphConfig | None = None,
                 warm_up: bool | None = None, lookahead: bool | None = None, num_pages: int | None = None,
                 grammars: Grammars | None = None,
                 kv_offer_timeout_s: float = AutoregressiveSpec.kv_offer_timeout_s) -> None:
        if max_num_seqs < 1 or max_batch_tokens < 1:
            raise ValueError(f"max_num_seqs={max_num_seqs}, max_batch_tokens={max_batch_tokens}: both must be >= 1")
        self.device = torch.device(device)
        self.eos_token_ids = tuple(eos_token_ids)
        require(model, CausalLM, " (subclass mstar.engines.base.CausalLMBase for the optional members)")
        self.logit_offset = model.logit_offset  # the token id of the logits' column 0
        self.default_sampling = default_sampling or SamplingParams()
        self.grammars = grammars  # structured outputs' matchers (engines/grammar.py)
        # their token masks, filled on the host while the forward runs and applied on the device
        self.masks = None if grammars is None else TokenMasks(max_num_seqs, model.logit_width, self.device,
                                                              self.logit_offset)
        if num_pages is None:  # a worker's pools are sized together (kv_cache.config.kv_pool_pages)
            num_pages = compute_num_pages(kv_config, model.kv_layout, self.device)
        capacity = num_pages * kv_config.page_size
        self.max_model_len = capacity if max_model_len is None else max_model_len
        if not 1 < self.max_model_len <= capacity:
            raise ValueError(f"max_model_len={max_model_len} must be in [2, {capacity}] (the KV pool holds "
                             f"{num_pages} pages of {kv_config.page_size}); lower it or raise kv_cache.max_num_pages")
        self.pool = BlockPool(num_pages, kv_config.page_size, enable_prefix_caching)
        attn = make_attention_backend(kv_config.attention_backend, model.kv_layout, num_pages,
                                      kv_config.page_size, self.device, max_num_seqs=max_num_seqs,
                                      max_pages_per_seq=-(-self.max_model_len // kv_config.page_size))
        self.batch_scheduler = BatchScheduler(self.pool, max_num_seqs, max_batch_tokens)
        self.runner = ModelRunner(model, attn, kv_config.page_size, self.device, cuda_graphs, max_num_seqs)
        self._seqs: dict[tuple[str, str], Sequence] = {}
        self._errors: list[StepResult] = []  # items refused at submit, reported by the next step
        self.kv = kv_transfer.KVStreams(self.pool, attn, kv_offer_timeout_s)  # sequences moving to or from another worker
        self.prompt_tokens = 0  # prompt tokens computed (a moved sequence's count none)
        # a request without a seed samples from a generator seeded by its id, not the device's shared one:
        # the ranks of a tensor-parallel replica then draw the same tokens (worker/replica.py)
        self.seed_per_request = False
        # decode lookahead (lookahead.py): on by default where decode replays CUDA graphs
        if lookahead is None:
            lookahead = self.runner.graphs is not None and (cuda_graphs is None or cuda_graphs.lookahead)
        self.lookahead = lookahead
        self._ahead: Ahead | None = None
        # marks a step's samples copied to the host; one event reused (created per step it costs the host)
        self._copied = torch.cuda.Event() if self.device.type == "cuda" else None
        self.lookahead_steps = 0  # steps whose forward was launched ahead
        # sampling replayed from CUDA graphs (sampling_graph.py), captured at the first sampled step
        self.sampler: SamplerGraphs | None = None
        if self.runner.graphs is not None and (cuda_graphs is None or cuda_graphs.sampling):
            # reading the decode graphs' logits and writing their next ids in place (no copies between)
            self.sampler = SamplerGraphs(self.runner.graphs.sizes, self.device, self.logit_offset,
                                         logits=self.runner.logits_out, ids=self.runner.decode_ids, masks=self.masks)
        # a steady lookahead step's draw and next forward as one replay (step_graph.py), captured now
        self.step_graphs: StepGraphs | None = None
        if self.sampler is not None and self.lookahead and (cuda_graphs is None or cuda_graphs.step_graphs) \
                and self.runner.logits_out is not None and self.runner.decode_inputs is not None:
            self.step_graphs = StepGraphs(self.runner, self.sampler)
        if warm_up if warm_up is not None else self.device.type == "cuda":
            warm_up_engine(self)
            self.prompt_tokens = 0  # served prompts only
        self.last_step_items = 0  # sequences the latest step computed (`Engine`)

    def submit(self, item: StepItem) -> None:
        """Queue an item; a malformed one (bad options, too long, ...) fails alone at the next step."""
        self._try_accept(item)

    def _try_accept(self, item: StepItem, moved: KVStreamEnd | None = None, waiting: bool = False) -> bool:
        """`_accept`; False, the item's error reported by the next step, when it is malformed."""
        try:
            self._accept(item, moved, waiting)
        except ValueError as e:
            self._errors.append(StepResult(item.request_id, item.walk, item.node, error=str(e),
                                           iteration=item.iteration))
            return False
        return True

    def step(self) -> list[StepResult]:
        """Run one packed forward (the one launched ahead by the last step, or a newly scheduled one),
        sample; results for the items finished in this step and the engine loops' iterations."""
        results, self._errors = self._errors, []
        ahead, self._ahead = self._ahead, None
        chunks, logits = self._ahead_chunks(ahead) if ahead is not None else ([], None)
        if not chunks:
            if self.kv.seating:
                self.kv.seat(self.batch_scheduler)
            chunks = self.batch_scheduler.schedule()
            self.prompt_tokens += sum(min(c.start + c.num_tokens, c.seq.num_prompt) - c.start
                                      for c in chunks if c.start < c.seq.num_prompt)
            tap = self.kv.layer_tap(chunks) if self.kv.streams else None
            logits = self.runner.run(chunks, tap) if chunks else None
            if tap is not None:
                self.kv.computed(chunks)
        self.last_step_items = len(chunks)
        if chunks:
            self.batch_scheduler.update(chunks)
            done = [c for c in chunks if c.completes]  # a prefill chunk that ends mid-prompt samples nothing
            if done:
                assert logits is not None
                results += self._postprocess(done, logits)
        if self.batch_scheduler.dropped:
            results += kv_transfer.fail_dropped(self.batch_scheduler, self._seqs)
        if self.kv.queued:  # pages the step freed go to offers waiting for them
            self.kv.grant()
        return results

    def _ahead_chunks(self, ahead: Ahead) -> tuple[list[Chunk], torch.Tensor | None]:
        """The step launched ahead: its sequences that are still live (a sequence that sampled a stop
        or was released meanwhile is left out, its row dropped) with their logits rows."""
        live = [i for i, (s, pos) in enumerate(zip(ahead.seqs, ahead.positions))
                if self._seqs.get(s.key) is s and s.num_computed == pos and len(s.token_ids) == pos + 1]
        if not live:
            return [], None
        chunks = [Chunk(ahead.seqs[i], ahead.positions[i], 1) for i in live]
        logits, greedy = ahead.logits, ahead.greedy_ids
        if len(live) < len(ahead.seqs):
            rows = to_device_async(torch.tensor(live), logits.device)
            logits = logits.index_select(0, rows)
            greedy = None if greedy is None else greedy.index_select(0, rows)
        self.runner.last_greedy_ids = greedy
        ahead.hand_over(chunks, live)  # captured hidden states to the sequences asking for them
        self.lookahead_steps += 1
        return chunks, logits

    def has_work(self) -> bool:
        """Whether some submitted item has no result yet and can run (an offered sequence waits for its receiver)."""
        offered = self.kv.offered
        return bool(self._errors) or any(s.item is not None and s.key not in offered for s in self._seqs.values())

    def stats(self) -> dict[str, float]:
        """Load and KV cache counters (keys documented at `Engine.stats`); O(live sequences)."""
        sched, pool = self.batch_scheduler, self.pool
        return {
            "queue_depth": len(self._errors) + sum(s.item is not None for s in self._seqs.values()),
            "kv_pages_used": pool.num_used,
            "kv_pages_cached": pool.num_cached_idle,
            "kv_pages_total": pool.num_pages,
            "seqs_running": len(sched.running),
            "seqs_waiting": len(sched.waiting),
            "preemptions": sched.num_preemptions,
            "prompt_tokens": self.prompt_tokens,
            "kv_pages_sent": self.kv.pages_sent,
            "kv_pages_received": self.kv.pages_received,
            "kv_pages_reused": self.kv.pages_reused,
        }

    def release(self, request_id: str) -> None:
        """Drop every sequence (all KV slots) and pending item of `request_id`; unknown ids are fine."""
        for key in [k for k in self._seqs if k[0] == request_id]:
            self.batch_scheduler.remove(self._seqs.pop(key))
        self.kv.release(request_id)
        self._errors = [r for r in self._errors if r.request_id != request_id]

    def submit_streamed(self, item: StepItem, sink: KVStreamSink) -> KVOffer | None:
        """`KVHandoff.submit_streamed`."""
        key = (item.request_id, item.kv_slot)
        if key in self._seqs:
            self.submit(item)
            return None
        return self.kv.offer(self._seqs[key], sink) if self._try_accept(item, waiting=True) else None

    def stream_kv(self, request_id: str, kv_slot: str, skip: int | None, declined: str = WHOLE_POOL) -> None:
        """`KVHandoff.stream_kv`; unknown keys (released meanwhile) are fine."""
        key = (request_id, kv_slot)
        if not self.kv.start(key, skip) or key not in self._seqs:
            return
        seq = self._seqs[key]
        if skip is None and seq.num_shareable < len(seq.token_ids):  # the receiver's recompute would be wrong
            self.kv.unstreamed.discard(key)
            del self._seqs[key]
            self._errors.append(StepResult(request_id, seq.item.walk, seq.item.node, iteration=seq.item.iteration,
                                           error=kv_transfer.not_recomputable(request_id, len(seq.token_ids), declined)))
            return
        self.batch_scheduler.add(seq)

    def reserve_kv(self, request_id: str, kv_slot: str, offer: KVOffer, granted: KVGranted,
                   withdrawn: KVWithdrawn) -> bool:
        """`KVHandoff.reserve_kv`."""
        key = (request_id, kv_slot)
        return key not in self._seqs and self.kv.reserve(key, offer, granted, withdrawn)

    def expire_kv(self, now: float) -> None:
        """`KVHandoff.expire_kv`."""
        if self.kv.queued:
            self.kv.expire(now)

    def place_kv(self, request_id: str, kv_slot: str, layer: int, start: int, k: torch.Tensor,
                 v: torch.Tensor) -> None:
        """`KVHandoff.place_kv`."""
        self.kv.place((request_id, kv_slot), layer, start, k, v)

    def submit_with_kv(self, item: StepItem, done: KVStreamEnd | None) -> None:
        """`KVHandoff.submit_with_kv`."""
        self._try_accept(item, done)
        self.kv.release_reserved((item.request_id, item.kv_slot))  # unless adopted

    def _accept(self, item: StepItem, moved: KVStreamEnd | None = None, waiting: bool = False) -> None:
        ids = item.inputs.get("input_ids")
        if ids is None or ids.dim() != 1 or ids.numel() == 0 or ids.is_floating_point():
            raise ValueError(f"item {item.node!r} needs inputs['input_ids'] as a non-empty 1-D integer tensor")
        tokens = ids.tolist()
        extras = parse_item(item, len(tokens), self.runner.model)  # validated before the sequence changes
        if item.loop is not None and item.loop.max_iterations < 1:
            raise ValueError(f"item {item.node!r}: an engine loop needs max_iterations >= 1, got {item.loop.max_iterations}")
        key = (item.request_id, item.kv_slot)
        seq = self._seqs.get(key)
        if seq is None:
            seq = self._new_sequence(key, item, tokens, None if moved is None else moved.tokens)
            if moved is not None:
                if moved.positions is not None:
                    seq.inputs = TokenInputs.resumed(moved.positions)
                seq.num_moved = len(moved.tokens)
                # adopted: running now or once a seat is free (kv.seat); else recomputed (in prompt_tokens)
                waiting = self.kv.adopt(seq, moved, self.batch_scheduler)
                if not waiting and not seq.recomputable:
                    del self._seqs[key]
                    raise ValueError(kv_transfer.not_recomputable(key[0], len(moved.tokens),
                                                                  "more KV pages than this worker's pool had free for its stream"))
        elif seq.item is not None:
            raise ValueError(f"request {key[0]!r} slot {key[1]!r} already has an item waiting for its result")
        elif seq.error is not None:  # dropped while idle (`kv_transfer.fail_dropped`)
            raise ValueError(seq.error)
        elif len(seq.token_ids) + len(tokens) > self.max_model_len:
            raise ValueError(f"request {key[0]!r} would exceed max_model_len={self.max_model_len}")
        else:
            seq.token_ids.extend(tokens)
        if extras is not None:
            self._add_extras(seq, len(tokens), extras)
        # what each token the engine appends in this loop brings: the hidden capture its item asks for
        seq.loop_done = 0
        seq.loop_extras = ItemExtras(hidden_layers=extras.hidden_layers) if extras and extras.hidden_layers else None
        seq.item = item
        if not waiting:
            self.batch_scheduler.add(seq)

    def _add_extras(self, seq: Sequence, n: int, extras: ItemExtras) -> None:
        """Keep the item's embeddings/positions/capture request with its n tokens (just appended)."""
        if seq.inputs is None:
            seq.inputs = TokenInputs()
        seq.inputs.add(len(seq.token_ids) - n, n, extras)

    def _new_sequence(self, key: tuple[str, str], item: StepItem, tokens: list[int],
                      moved: list[int] | None = None) -> Sequence:
        """A sequence of `tokens`, or, when the item brings `prompt_ids` (or `moved`: the tokens of a
        sequence moved here), one started on another worker: its prompt recomputed (or moved) and
        `tokens` counted as generated (module doc)."""
        params = SamplingParams.from_options(item.options, self.default_sampling)
        context = item.inputs.get(CONTEXT_PORT)
        prompt = moved if moved is not None else [] if context is None else context.tolist()
        if prompt and (len(prompt) + len(tokens) >= self.max_model_len
                       or len(prompt) + (params.max_tokens or 0) > self.max_model_len):
            raise ValueError(f"resumed sequence of {len(prompt)} prompt + {len(tokens)} generated tokens "
                             f"(max_tokens={params.max_tokens}) does not fit max_model_len={self.max_model_len}")
        tokens = prompt + tokens
        if len(tokens) >= self.max_model_len:
            raise ValueError(f"prompt of {len(tokens)} tokens leaves no room to generate under "
                             f"max_model_len={self.max_model_len}; shorten the prompt")
        if params.max_tokens is not None and len(tokens) + params.max_tokens > self.max_model_len:
            raise ValueError(f"max_tokens={params.max_tokens} plus the {len(tokens)}-token prompt exceeds "
                             f"max_model_len={self.max_model_len}; lower max_tokens")
        generator = None
        seed = params.seed if params.seed is not None or not self.seed_per_request else request_seed(key)
        if seed is not None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(seed)
            for _ in range(len(tokens) - len(prompt) if prompt else 0):  # the draws the generated tokens took:
                torch.empty(self.runner.model.logit_width, dtype=torch.float32,  # one Exp(1) row each
                            device=self.device).exponential_(generator=generator)
        seq = Sequence(key, params, tokens, len(tokens), generator, matcher=start_matcher(self.grammars, params.structured_outputs, tokens[len(prompt):]
                                                                                   if prompt else []))
        # one row for the sequence's life: it reads token_ids and the sampling cache, which grow in place
        seq.sampling_row = SamplingRow(params, seq.token_ids, seq.num_prompt, generator, self.eos_token_ids,
                                       seq.sampling_cache)
        if prompt:
            seq.num_prompt, seq.num_generated = len(prompt), len(tokens) - len(prompt)
        self._seqs[key] = seq
        return seq

    def _postprocess(self, chunks: list[Chunk], logits: torch.Tensor) -> list[StepResult]:
        seqs = [c.seq for c in chunks]
        rows = [s.sampling_row for s in seqs]
        constrained = [i for i, s in enumerate(seqs) if s.matcher is not None]
        # the masks need only the tokens accepted so far: filled while this step's forward runs, and the
        # next forward may be launched before this step's tokens reach their matchers
        masked = self.masks is not None and self.masks.stage([s.matcher for s in seqs])
        continuing = self._continuing(seqs) if self.lookahead else None
        out, tokens = (self._step_graph(seqs, rows, logits, continuing)
                       or self._draw(seqs, rows, logits, continuing, masked))
        for i in constrained:  # advances each grammar (not an assert: python -O would skip the call)
            if not seqs[i].matcher.accept(tokens[i]):
                raise RuntimeError(f"{seqs[i].key} sampled token {tokens[i]} that its grammar forbids")
        views = out.token_ids.unsqueeze(1).unbind(0)  # each row's [1] view, in one call, not a slice per row
        results = []
        for i, seq in enumerate(seqs):
            item = seq.item
            assert item is not None, f"{seq.key} computed without a pending item"
            seq.num_generated += 1
            reason = self._finish_reason(seq, tokens[i])
            if reason is None and seq.matcher is not None and seq.matcher.is_finished():
                reason = "stop"  # the grammar took its end token (ignore_eos cannot extend a complete grammar)
            outputs = {"token": views[i]} if seq.params.logprobs is None else out.row(i, seq.params)
            if seq.inputs is not None and (hidden := seq.inputs.take_hidden()) is not None:
                outputs["hidden"] = hidden
            more = reason is None and item.loop is not None and seq.loop_done + 1 < item.loop.max_iterations
            if more:
                self._append(seq, tokens[i])
            else:
                seq.item = None
                if self.kv.finish(seq) and reason is None:  # it lives on on the receiver
                    self.batch_scheduler.remove(self._seqs.pop(seq.key))
            results.append(StepResult(item.request_id, item.walk, item.node, outputs, stop=reason is not None,
                                      iteration=item.iteration, finish_reason=reason, more=more))
            if reason is not None:
                self.batch_scheduler.remove(self._seqs.pop(seq.key))
        return results

    def _append(self, seq: Sequence, token: int) -> None:
        """The next iteration of `seq`'s engine loop: its sampled token appended as the next input."""
        seq.loop_done += 1
        seq.token_ids.append(token)
        if seq.loop_extras is not None:
            self._add_extras(seq, 1, seq.loop_extras)

    def _continuing(self, seqs: list[Sequence]) -> list[int] | None:
        """Indexes (into `seqs`, the step's sampled sequences) of those whose next forward is launched
        ahead: engine-loop sequences that go on unless they sample a stop. None, launching nothing, when
        the next step should be scheduled as usual: other work could join it (tokens still to compute,
        a sequence waiting for a seat, the next item of one sampled by a non-loop item such as a
        prefill), or none goes on.

        A sequence whose next token opens a page gets it now, from free pages only (it needs the page
        for its next token anyway); when there are not enough, nothing is launched ahead."""
        sched = self.batch_scheduler
        if (sched.waiting or self.kv.seating) and len(sched.running) < sched.max_num_seqs:
            return None
        if any(s.num_pending for s in sched.running) or any(s.item.loop is None for s in seqs):
            return None
        continuing, grow, with_inputs = [], [], []
        for i, seq in enumerate(seqs):
            loop, p = seq.item.loop, seq.params
            pos = len(seq.token_ids)  # where the token sampled now will sit
            if loop is None or seq.loop_done + 1 >= loop.max_iterations or pos + 1 >= self.max_model_len \
                    or (p.max_tokens is not None and seq.num_generated + 1 >= p.max_tokens):
                continue
            if seq.inputs is not None:
                with_inputs.append(seq)
            if pos // self.runner.page_size >= len(seq.pages):
                grow.append(seq)
            continuing.append(i)
        if not continuing or (with_inputs and not self.runner.extras_ahead(with_inputs)):
            return None
        if grow and not sched.grow_ahead(grow):
            return None
        return continuing

    def _step_graph(self, seqs: list[Sequence], rows: list[SamplingRow], logits: torch.Tensor,
                    continuing: list[int] | None) -> tuple[SampleOutput, list[int]] | None:
        """Draw this step's tokens and launch the lookahead forward of every sequence in one step-graph
        replay (step_graph.py); the samples on the host and their ids as ints, or None when the step
        does not take it (some sequence stops on length, an extras graph's argmax, rows the sampler
        graphs do not serve, logits not in `logits_out`): nothing was launched then."""
        if self.step_graphs is None or continuing is None or len(continuing) < len(seqs) \
                or self.runner.last_greedy_ids is not None:
            return None
        ahead = self.step_graphs.launch(seqs, logits, rows)
        if ahead is None:
            return None
        ids = self.step_graphs.drawn(len(seqs))
        self._ahead = ahead
        return SampleOutput(ids), ids.tolist()

    def _draw(self, seqs: list[Sequence], rows: list[SamplingRow], logits: torch.Tensor,
              continuing: list[int] | None, masked: bool = False) -> tuple[SampleOutput, list[int]]:
        """Draw this step's tokens (an extras graph's argmax, the sampler graphs or eager `sample`; with
        `masked`, after the staged token masks), then launch the lookahead forward of `seqs[continuing]`
        (none when `continuing` is None); the samples on the host and their ids as ints."""
        greedy = self.runner.last_greedy_ids  # token ids of an extras graph's argmax, if one ran
        if greedy is not None and all(plain_greedy(r) for r in rows):  # no constrained row is plain greedy
            out = SampleOutput(greedy)
        elif self.sampler is not None and (ids := self.sampler(logits, rows)) is not None:
            out = SampleOutput(ids)  # the graphs applied the masks
        else:
            if masked:
                assert self.masks is not None
                with torch.inference_mode():  # in place: the runner's logits are inference tensors
                    self.masks.apply_(logits)
            out = sample(logits, rows, self.logit_offset)
        if continuing is None:
            out = out.to_host()  # the step's one host sync
            return out, out.token_ids.tolist()
        return self._launch_ahead(seqs, continuing, out)

    def _launch_ahead(self, seqs: list[Sequence], continuing: list[int],
                      out: SampleOutput) -> tuple[SampleOutput, list[int]]:
        """Queue the copy of this step's samples to the host, launch the next forward of
        `seqs[continuing]` fed with them, then wait for the copy only (see lookahead.py); the samples on
        the host, and their token ids as ints."""
        host, copied = out.to_host_async(self._copied)
        ids = out.token_ids
        if len(continuing) < len(seqs):
            ids = ids.index_select(0, to_device_async(torch.tensor(continuing), ids.device))
        ahead = self.runner.launch_ahead([seqs[i] for i in continuing], ids)
        if copied is not None:
            copied.synchronize()
        self._ahead = ahead
        return host, host.token_ids.tolist()

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
            return "stop"
        if p.max_tokens is not None and seq.num_generated >= p.max_tokens:
            return "length"
        if len(seq.token_ids) + 1 >= self.max_model_len:  # no room to feed this token back
            return "length"
        return None


def request_seed(key: tuple[str, str]) -> int:
    """A seed from a sequence's (request id, KV slot), the same in every process."""
    return zlib.crc32("\x00".join(key).encode())
