"""Executes one scheduled step: packs the chunks, runs the model once, returns logits to sample.

Decode-only steps replay a CUDA graph when the attention backend supports capture
(`GraphedAttention`), the model does (`CausalLM.supports_cuda_graphs`) and the device is CUDA: the
step's host work is then building a few small index tensors and one graph launch, instead of
launching every kernel of the model. With
`cuda_graphs.prefill_tokens`, steps with prompt tokens replay graphs too (prefill_graph.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from mstar.config import CudaGraphConfig
from mstar.engines.attention.base import (
    AttentionBackend,
    AttentionMetadata,
    GraphedAttention,
    GraphedPrefillAttention,
    SharedDecodeAttention,
)
from mstar.engines.autoregressive.batch_scheduler import Chunk
from mstar.engines.autoregressive.decode_inputs import DecodeInputs, HostSet
from mstar.engines.autoregressive.extras_graph import ExtrasGraphs
from mstar.engines.autoregressive.lookahead import Ahead
from mstar.engines.autoregressive.prefill_graph import PrefillGraphs
from mstar.engines.autoregressive.sequence import Sequence
from mstar.engines.base import CausalLM, KVLayout
from mstar.engines.cuda_graphs import BatchGraphs
from mstar.layers.linear import pack_cpu_linears

logger = logging.getLogger(__name__)

ATTENTION_BACKENDS = ("auto", "sdpa", "triton", "flashinfer")


def make_attention_backend(name: str, layout: KVLayout, num_pages: int, page_size: int,
                           device: torch.device, max_num_seqs: int = 256,
                           max_pages_per_seq: int | None = None) -> AttentionBackend:
    """The attention backend called `name` (`kv_cache.attention_backend`), owning a fresh KV pool.

    "auto" tries, in order, "triton" (CUDA, when triton imports), "flashinfer" (CUDA, when flashinfer
    imports) and "sdpa"; a backend that fails to initialise (unsupported dtype or head size, kernels
    that do not load) is logged and the next one is tried; running out of device memory is raised, not
    tried again. Triton comes first: it is the backend the decode benchmarks cover and the one prefill
    graphs use; FlashInfer is chosen with
    `kv_cache.attention_backend: flashinfer`. `max_num_seqs` and `max_pages_per_seq` (default: the whole pool) size the persistent
    buffers of the CUDA-graph-capable backends.
    """
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown kv_cache.attention_backend {name!r}; available: {list(ATTENTION_BACKENDS)}")
    args = (layout, num_pages, page_size, device, max_num_seqs, max_pages_per_seq)
    if name != "auto":
        return _build_backend(name, *args)
    candidates = _auto_candidates(torch.device(device).type == "cuda")
    for candidate in candidates[:-1]:
        try:
            return _build_backend(candidate, *args)
        except torch.OutOfMemoryError:  # the pool does not fit: every backend would fail alike
            raise
        except Exception as exc:  # any other init failure: the next candidate serves instead
            logger.warning("attention backend %r failed to initialise (%s: %s); trying %r",
                           candidate, type(exc).__name__, exc, candidates[candidates.index(candidate) + 1])
            logger.debug("attention backend %r init failure", candidate, exc_info=True)
    return _build_backend(candidates[-1], *args)


def _auto_candidates(on_cuda: bool) -> list[str]:
    """Backends "auto" tries, best first; "sdpa" always ends the list."""
    if not on_cuda:
        return ["sdpa"]
    names = [n for n, module in (("triton", "triton"), ("flashinfer", "flashinfer")) if _importable(module)]
    return [*names, "sdpa"]


def _build_backend(name: str, layout: KVLayout, num_pages: int, page_size: int, device: torch.device,
                   max_num_seqs: int, max_pages_per_seq: int | None) -> AttentionBackend:
    if name == "flashinfer":
        from mstar.engines.attention.flashinfer_backend import FlashInferBackend

        return FlashInferBackend(layout, num_pages, page_size, device, max_num_seqs=max_num_seqs,
                                 max_pages_per_seq=max_pages_per_seq)
    if name == "triton":
        from mstar.engines.attention.triton_backend import TritonBackend

        return TritonBackend(layout, num_pages, page_size, device, max_num_seqs=max_num_seqs,
                             max_pages_per_seq=max_pages_per_seq)
    from mstar.engines.attention.sdpa import SDPABackend

    return SDPABackend(layout, num_pages, page_size, device)


def _importable(module: str) -> bool:
    try:
        __import__(module)
    except ImportError:
        return False
    except Exception as exc:  # a package that breaks on import (missing CUDA libraries) is not usable
        logger.info("%s is installed but does not import (%s: %s); not using it", module, type(exc).__name__, exc)
        return False
    return True


class ModelRunner:
    """Turns chunks into model inputs and attention metadata; owns no scheduling state."""

    def __init__(self, model: CausalLM, attn: AttentionBackend, page_size: int, device: torch.device,
                 graphs: CudaGraphConfig | None = None, max_num_seqs: int = 256) -> None:
        self.model = model
        self.attn = attn
        self.page_size = page_size
        self.device = device
        self.graphs: BatchGraphs | None = None
        self.extras_graphs: ExtrasGraphs | None = None  # decode with embeddings/positions/hidden capture
        self.prefill_graphs: PrefillGraphs | None = None  # steps with prompt tokens (cuda_graphs.prefill_tokens)
        self._decode: DecodeInputs | None = None  # packed inputs of graphed decode steps (decode_inputs.py)
        self._graphed_attn: GraphedAttention | None = None  # the backend, once decode graphs use it
        # the backend when it reads its decode buffers from `_decode` (`SharedDecodeAttention`), else None
        self._shared_attn: SharedDecodeAttention | None = None
        self.last_greedy_ids: torch.Tensor | None = None  # token ids of the step's argmax, when an extras graph ran
        # float32 logits of every decode graph, written in place by the graph (all sizes share it), so a
        # sampler graph reading this buffer needs no copy of them (`SamplerGraphs(logits=...)`)
        self.logits_out: torch.Tensor | None = None
        self.ids_copies = 0  # lookahead forwards whose ids had to be copied in (not sampled in place)
        self._graph_rows = 0  # the largest decode graph's rows (logits_out holds that many)
        if self.device.type == "cpu" and isinstance(model, nn.Module):  # weights are loaded by now
            pack_cpu_linears(model)
        if graphs is not None and graphs.enabled and self.device.type == "cuda":
            if not model.supports_cuda_graphs():
                logger.info("%s cannot be captured in CUDA graphs here; decode runs eagerly", type(model).__name__)
            elif isinstance(attn, GraphedAttention):
                sizes = [s for s in graphs.sizes() if s <= max_num_seqs] or [1]
                self.graphs = self._capture(sizes)
                if model.graph_hidden_layers:
                    self.extras_graphs = ExtrasGraphs(model, attn, self.device)
                    self.extras_graphs.capture(sizes, self._describe_dummy_batch)
                if graphs.prefill_tokens and isinstance(attn, GraphedPrefillAttention):
                    self.prefill_graphs = self._capture_prefill(attn, graphs.prefill_tokens)
            else:
                logger.info("%s cannot be captured in CUDA graphs; decode runs eagerly", type(attn).__name__)

    @torch.inference_mode()
    def _capture(self, sizes: list[int]) -> BatchGraphs:
        self._graph_rows = max(sizes)
        dec = self._decode or self._decode_inputs(max(sizes))
        return BatchGraphs(self.decode_step, sizes, [((), torch.long), ((), torch.long)], self.device,
                           before_capture=self._describe_dummy_batch, static_inputs=[dec.ids, dec.positions])

    def decode_step(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """What a decode graph captures: the rows' logits, float32 ones in `logits_out`. Logits only: a
        greedy batch takes its argmax after the replay; inside the graph it would cost every sampled step
        a wasted pass over the logits."""
        hidden = self.model.forward(input_ids, positions, self.attn)
        out = self.logits_out  # None at the first warm-up call, which makes it
        logits = self.model.compute_logits(hidden, input_ids, out=None if out is None else out[: hidden.shape[0]])
        return self._into_logits_out(logits, self._graph_rows)

    def _into_logits_out(self, logits: torch.Tensor, rows: int) -> torch.Tensor:
        """`logits` copied into the first rows of `logits_out` (made at the first warm-up call, before any
        capture); float32 logits only, others are returned as they are."""
        if logits.dtype != torch.float32:
            return logits
        out = self.logits_out
        if out is None or out.shape[1] != logits.shape[1] or out.device != logits.device:
            assert not (logits.is_cuda and torch.cuda.is_current_stream_capturing()), "warm up before capturing"
            with torch.inference_mode(False):  # a normal tensor: the sampler copies other logits into it
                out = self.logits_out = torch.zeros(rows, logits.shape[1], dtype=torch.float32, device=logits.device)
        out = out[: logits.shape[0]]
        if logits.data_ptr() != out.data_ptr():  # not written in place by the head
            out.copy_(logits)
        return out

    def _eager(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The model's forward run eagerly: a step that replays no graph (its attention prepared)."""
        return self.model.forward(input_ids, positions, self.attn)

    @property
    def decode_ids(self) -> torch.Tensor | None:
        """The token ids every decode graph reads (int64 [rows]); a sampler that writes its ids here feeds
        a lookahead forward without a copy. None before the graphs exist."""
        return self._decode.ids if self._decode is not None else None

    @torch.inference_mode()
    def _capture_prefill(self, attn: GraphedPrefillAttention, tokens: list[int]) -> PrefillGraphs:
        return PrefillGraphs(self.model, attn, self.device, tokens)

    def _describe_dummy_batch(self, size: int) -> None:
        """Prepare the backend for a capture: every row one token over itself, written nowhere."""
        meta = AttentionMetadata([1] * size, [1] * size, torch.full((size,), -1, dtype=torch.long),
                                 torch.zeros(size, 1, dtype=torch.int32))
        assert self._graphed_attn is not None  # the decode inputs are made before any capture
        self._graphed_attn.prepare(meta, pad_to=size)

    @torch.inference_mode()
    def run(self, chunks: list[Chunk], layer_done: Callable[[int], None] | None = None) -> torch.Tensor | None:
        """One packed forward over all chunks; float32 logits [N, V] for the chunks that complete
        (columns from the model's `logit_offset`; None when none does). With `layer_done` the forward runs
        eagerly and calls it with each layer's index as soon as that layer's K/V are in the cache."""
        self.last_greedy_ids = None
        attn = self.attn if layer_done is None else _LayerTap(self.attn, layer_done)
        if any(c.seq.inputs is not None for c in chunks):
            if layer_done is None and self.extras_graphs is not None and self.extras_graphs.accepts(chunks):
                return self._replay_extras(chunks)
            return self._run_with_extras(chunks, attn)
        if layer_done is None and self.graphs is not None and len(chunks) <= self.graphs.max_batch and \
                all(c.num_tokens == 1 and c.completes for c in chunks):
            return self._replay(chunks)
        input_ids, positions, slots = [], [], []
        for c in chunks:
            pos = range(c.start, c.start + c.num_tokens)
            input_ids.extend(c.seq.token_ids[c.start : c.start + c.num_tokens])
            positions.extend(pos)
            slots.extend(c.seq.pages[p // self.page_size] * self.page_size + p % self.page_size for p in pos)
        meta = self._metadata(chunks, slots)
        if layer_done is None and self.prefill_graphs is not None and self.prefill_graphs.accepts(chunks):
            hidden = self.prefill_graphs.run(chunks, meta, input_ids, positions)
        else:
            attn.prepare(meta)
            hidden = self.model.forward(self._tensor(input_ids), self._tensor(positions), attn)
        return self._last_logits(chunks, hidden, input_ids)

    def _last_logits(self, chunks: list[Chunk], hidden: torch.Tensor, input_ids: list[int]) -> torch.Tensor | None:
        """Logits of the last token of each chunk that completes (None when none does)."""
        ends = torch.cumsum(torch.tensor([c.num_tokens for c in chunks]), 0) - 1
        last = [int(e) for c, e in zip(chunks, ends) if c.completes]
        if not last:
            return None
        return self.model.compute_logits(hidden[self._tensor(last)], self._tensor([input_ids[i] for i in last]))

    def _run_with_extras(self, chunks: list[Chunk], attn: AttentionBackend) -> torch.Tensor | None:
        """`run` for batches where a sequence has input embeddings, explicit positions or hidden capture."""
        from mstar.engines.autoregressive.token_inputs import collect_hidden, pack_extras

        input_ids, slots = [], []
        for c in chunks:
            input_ids.extend(c.seq.token_ids[c.start : c.start + c.num_tokens])
            slots.extend(c.seq.pages[p // self.page_size] * self.page_size + p % self.page_size
                         for p in range(c.start, c.start + c.num_tokens))
        positions, extras = pack_extras(chunks, self.device)
        attn.prepare(self._metadata(chunks, slots))
        hidden = self.model.forward(self._tensor(input_ids), positions, attn, extras)  # type: ignore[call-arg]
        collect_hidden(chunks, extras)
        return self._last_logits(chunks, hidden, input_ids)

    def _replay(self, chunks: list[Chunk]) -> torch.Tensor:
        """A decode step through the captured graph of the smallest size that holds the batch."""
        return self._replay_rows([c.seq for c in chunks], [c.start for c in chunks], None)

    def _replay_rows(self, seqs: list[Sequence], positions: list[int], ids: torch.Tensor | None) -> torch.Tensor:
        """Replay one decode row per sequence at `positions`, fed `ids` (a device tensor) or, when None,
        each sequence's own token there; the logits, a view valid until the next replay."""
        assert self.graphs is not None
        dec, n, bucket = self._stage(seqs, positions, ids)
        return self.graphs(dec.ids_rows[n], dec.positions_rows[n], bucket=bucket)[0]

    def _replay_extras(self, chunks: list[Chunk]) -> torch.Tensor:
        """A decode step with extras through `extras_graphs` (see extras_graph.py)."""
        assert self.extras_graphs is not None and self.extras_graphs.graphs is not None
        dec, n, bucket = self._stage([c.seq for c in chunks], [c.start for c in chunks], None)
        positions, embeds, use_embeds = self.extras_graphs.inputs(chunks)
        logits, greedy, *hidden = self.extras_graphs.graphs(dec.ids_rows[n], positions, embeds, use_embeds,
                                                            bucket=bucket)
        self.extras_graphs.store_hidden(chunks, tuple(hidden))
        self.last_greedy_ids = greedy
        return logits

    def _stage(self, seqs: list[Sequence], positions: list[int],
               ids: torch.Tensor | None) -> tuple[DecodeInputs, int, int]:
        """Send a decode batch (token ids: `ids` on the device or, when None, each sequence's own token
        at its position; positions, slots, block tables) to the packed decode inputs and prepare the
        attention backend for its graph bucket; (inputs, rows, bucket). One copy per step when the
        backend shares the buffers, else the backend's `prepare` copies slots and tables itself."""
        assert self.graphs is not None
        dec = self._decode or self._decode_inputs(self.graphs.max_batch)
        n = len(seqs)
        bucket = self.graphs.bucket(n)
        assert bucket is not None
        host = dec.stage(seqs, positions, ids is None, bucket, self._shared_attn is not None)
        if ids is not None and ids.data_ptr() != dec.ids.data_ptr():  # else sampled in place already
            dec.ids_rows[n].copy_(ids, non_blocking=True)
            self.ids_copies += 1
        if self._shared_attn is not None:
            self._shared_attn.prepare_staged_decode(n, bucket)
        else:
            assert self._graphed_attn is not None
            meta = AttentionMetadata([1] * n, [p + 1 for p in positions], host.slots[:n], host.tables[:n])
            self._graphed_attn.prepare(meta, pad_to=bucket)
        dec.sent(host)
        return dec, n, bucket

    def stage_ahead(self, seqs: list[Sequence], host: HostSet) -> tuple[list[int], int]:
        """Stage the lookahead forward of `seqs` (ids: drawn on the device) into `host` without copying
        it, and prepare the attention backend for it; (positions, bucket). For a step graph
        (`step_graph.py`), which copies `host` in itself; needs a backend sharing the decode buffers."""
        assert self.graphs is not None and self._decode is not None and self._shared_attn is not None
        positions = [len(s.token_ids) for s in seqs]
        bucket = self.graphs.bucket(len(seqs))
        assert bucket is not None
        self._decode.stage(seqs, positions, False, bucket, True, host=host, send=False)
        self._shared_attn.prepare_staged_decode(len(seqs), bucket)
        return positions, bucket

    @property
    def decode_inputs(self) -> DecodeInputs | None:
        """The packed decode inputs, when the attention backend reads its decode buffers from them (the
        case a step graph needs); else None."""
        return self._decode if self._shared_attn is not None else None

    def _decode_inputs(self, max_batch: int) -> DecodeInputs:
        """The packed decode inputs for graphs of up to `max_batch` rows, made before the decode graphs
        are captured (or at the first replay of graphs installed from outside, as tests do): a backend
        that can share its decode buffers reads them from there from then on."""
        attn = self.attn
        if not isinstance(attn, GraphedAttention):
            raise TypeError(f"{type(attn).__name__} cannot replay decode graphs (it is no GraphedAttention)")
        # batches larger than the backend holds do not fit it anyway (it raises at prepare)
        shared = attn if isinstance(attn, SharedDecodeAttention) and max_batch <= attn.max_num_seqs else None
        rows = attn.max_num_seqs if shared is not None else max_batch
        dec = DecodeInputs(rows, attn.max_pages_per_seq, self.page_size, self.device)
        if shared is not None:
            shared.share_decode_buffers(dec.seq_lens, dec.slots, dec.tables)
        self._decode, self._graphed_attn, self._shared_attn = dec, attn, shared
        return dec

    def launch_ahead(self, seqs: list[Sequence], ids: torch.Tensor) -> Ahead:
        """Queue the decode forward of `seqs` fed token ids `ids` (device, one per sequence) at the
        position after each one's last token, without waiting for anything (see `lookahead.py`)."""
        positions = [len(s.token_ids) for s in seqs]
        if any(s.inputs is not None for s in seqs):  # `continuing` let them: `extras_ahead` said yes
            return self._extras_ahead(seqs, positions, ids)
        if self.graphs is not None and len(seqs) <= self.graphs.max_batch:
            # the replay enters inference mode itself; the packed inputs are normal tensors
            return Ahead(seqs, positions, self._replay_rows(seqs, positions, ids))
        with torch.inference_mode():
            page = self.page_size
            slots = [s.pages[p // page] * page + p % page for s, p in zip(seqs, positions)]
            self.attn.prepare(self._metadata([Chunk(s, p, 1) for s, p in zip(seqs, positions)], slots))
            ids = ids.to(self.device)
            hidden = self._eager(ids, self._tensor(positions))
            return Ahead(seqs, positions, self.model.compute_logits(hidden, ids))

    def extras_ahead(self, seqs: list[Sequence]) -> bool:
        """Whether `launch_ahead` can run `seqs`, which have TokenInputs: through the extras graphs."""
        return self.extras_graphs is not None and self.extras_graphs.accepts_ahead(seqs)

    def _extras_ahead(self, seqs: list[Sequence], positions: list[int], ids: torch.Tensor) -> Ahead:
        """The lookahead forward through the extras graph (appended tokens: no embeddings); its captured
        states are copied out at once (the next replay overwrites the graph's)."""
        extras = self.extras_graphs
        assert extras is not None and extras.graphs is not None
        dec, n, bucket = self._stage(seqs, positions, ids)
        pos, embeds, use_embeds = extras.appended_inputs(seqs, positions)
        logits, greedy, *hidden = extras.graphs(dec.ids_rows[n], pos, embeds, use_embeds, bucket=bucket)
        kept = torch.stack(hidden) if hidden else None
        return Ahead(seqs, positions, logits, greedy_ids=greedy, hidden=kept, layers=extras.layers)

    def _metadata(self, chunks: list[Chunk], slots: list[int]) -> AttentionMetadata:
        max_pages = max(len(c.seq.pages) for c in chunks)
        tables = torch.tensor([c.seq.pages + [0] * (max_pages - len(c.seq.pages)) for c in chunks],
                              dtype=torch.int32)
        return AttentionMetadata(
            query_lens=[c.num_tokens for c in chunks],
            seq_lens=[c.start + c.num_tokens for c in chunks],
            slot_mapping=self._tensor(slots),
            block_tables=tables.to(self.device),
        )

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long).to(self.device, non_blocking=True)


class _LayerTap:
    """An attention backend that calls `layer_done(layer)` after each layer's attention: that layer's K/V
    of the step's tokens are in the cache then, and the layers after it not computed yet."""

    def __init__(self, attn: AttentionBackend, layer_done: Callable[[int], None]) -> None:
        self.attn, self.layer_done = attn, layer_done

    def prepare(self, meta: AttentionMetadata) -> None:
        self.attn.prepare(meta)

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = self.attn.forward(layer, q, k, v)
        self.layer_done(layer)
        return out
