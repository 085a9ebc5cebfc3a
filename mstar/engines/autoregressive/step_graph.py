"""Step graphs: the draw of decode step N and the lookahead forward of N+1 as one CUDA graph replay.

With sampler graphs (`engines/sampling_graph.py`) and decode lookahead (`lookahead.py`), a steady decode
step queues on the GPU: a copy of the sampler's packed inputs, the sampler graph (its ids written into
the decode graphs' id input), a copy of the ids to the host, a copy of the next forward's packed inputs
and the decode graph. Each copy and each graph launch leaves the GPU idle a few microseconds before
it, more than the copies themselves take.

A step graph holds all of it, captured at each decode batch size and for both sampler graph sets:

    copy in (one kernel: the staged sampler inputs and decode inputs, from pinned host memory)
    -> the sampler's draw (ids into the decode id input)
    -> the decode forward of N+1 (logits into `logits_out`)
       and, on a branch beside it: copy the ids out (one kernel, into pinned host memory)
       -> record an event (external: recorded by the replay at this point, not at its end)

The branch keeps the copy and the event node out of the way of the forward, whose first kernel then
follows the draw's last by Programmatic Dependent Launch instead of waiting behind the copy and the
event node's launch gap.

The host stages both inputs into its own pinned sets, replays once, and waits for the event only: the ids
are on the host while the forward runs, as with separate launches. The host sets are single: the host
stages the next step only after waiting for the last replay's event, which comes after that
replay's copy in.

Used for a lookahead step whose every row continues (all rows' ids feed the next forward in place),
whose logits are the decode graphs' (`logits_out`, as the sampler graphs read them) and whose rows the
sampler graphs serve; any other step takes the separate launches. Captured when the engine starts
(CUDA, a backend sharing its decode buffers, float32 logits, `cuda_graphs.step_graphs`), before any
request: the capture's warm-up runs the step on the shared buffers. Off CUDA (tests), the copies are
plain copies and there is no event.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from mstar.engines.autoregressive.lookahead import Ahead
from mstar.engines.autoregressive.sequence import Sequence
from mstar.engines.cuda_graphs import BatchGraphs
from mstar.engines.sampling import SamplingRow
from mstar.engines.sampling_filters import COLUMNS
from mstar.engines.sampling_graph import SamplerGraphs

if TYPE_CHECKING:
    from mstar.engines.autoregressive.runner import ModelRunner


def copy_pairs(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """(source, destination) byte spans copied in one kernel on CUDA (`kernels/host_copy.py`), plainly
    elsewhere."""
    if pairs[0][1].is_cuda or pairs[0][0].is_cuda:
        from mstar.kernels.host_copy import copy_words

        copy_words(pairs)
    else:
        for src, dst in pairs:
            dst.copy_(src)


class StepGraphs:
    """Step graphs (module docstring) over a runner's decode graphs and the engine's sampler graphs."""

    def __init__(self, runner: ModelRunner, sampler: SamplerGraphs, graph_class: type = BatchGraphs) -> None:
        assert runner.graphs is not None and runner.logits_out is not None
        dec = runner.decode_inputs
        assert dec is not None, "a step graph needs an attention backend sharing the decode buffers"
        self.runner, self.sampler = runner, sampler
        sizes = runner.graphs.sizes
        sampler.capture(runner.logits_out.shape[1])
        assert sampler.writes_ids and sampler.input_rows(1)[0].data_ptr() == runner.logits_out.data_ptr(), \
            "the sampler graphs must read logits_out and write the decode id input"
        self._dec = dec
        self._sampler_host = sampler.staging()
        self._decode_host = dec.staging()
        cuda = runner.device.type == "cuda"
        with torch.inference_mode(False):
            self._samples = torch.zeros(max(sizes), dtype=torch.long, pin_memory=cuda)
        # recorded inside each replay once the ids are out (external: a node of the graph, not a capture
        # dependency), so the host can wait for the ids without waiting for the forward
        self._drawn_event = torch.cuda.Event(external=True) if cuda else None
        self._side = torch.cuda.Stream(runner.device) if cuda else None  # the branch copying the ids out
        logits, table, new = sampler.input_rows(max(sizes))
        example = [((logits.shape[1],), torch.float32), ((COLUMNS,), torch.float32), ((), torch.long),
                   ((), torch.long), ((), torch.long)]
        statics = [logits, table, new, dec.ids, dec.positions]
        with torch.inference_mode():  # as the decode graphs are captured: no autograd state in the forward
            self._graphs = {filtered: graph_class(self._step(filtered), sizes, example, runner.device,
                                                  before_capture=runner._describe_dummy_batch,
                                                  static_inputs=statics)
                            for filtered in (False, True)}
        self.replays = 0

    def _step(self, filtered: bool) -> Callable[..., torch.Tensor]:
        """The captured function for the `filtered` sampler graph set (module docstring)."""
        draw, dec = self.sampler.draw_step(filtered), self._dec

        def step(logits: torch.Tensor, table: torch.Tensor, new: torch.Tensor, ids: torch.Tensor,
                 positions: torch.Tensor) -> torch.Tensor:
            bucket = logits.shape[0]
            copy_pairs([(self.sampler.span(bucket, self._sampler_host), self.sampler.span(bucket)),
                        (dec.span(bucket, self._decode_host), dec.span(bucket))])
            drawn = draw(logits, table, new)  # into ids[:bucket]
            if self._side is None:
                copy_pairs([(drawn, self._samples[:bucket])])
                return self.runner.decode_step(ids, positions)
            # the ids go out on a branch of their own, so the forward follows the draw at once
            main = torch.cuda.current_stream()
            self._side.wait_stream(main)
            with torch.cuda.stream(self._side):
                copy_pairs([(drawn, self._samples[:bucket])])
                self._drawn_event.record()
            logits_next = self.runner.decode_step(ids, positions)
            main.wait_stream(self._side)  # a captured branch must join before the capture ends
            return logits_next

        return step

    def launch(self, seqs: list[Sequence], logits: torch.Tensor, rows: list[SamplingRow]) -> Ahead | None:
        """Queue, in one replay, the draw of each of `seqs`' next token from `logits` (rows of
        `logits_out`) and the forward of all of them fed with it; the forward as an `Ahead`, or None when
        the step does not fit (the caller then draws and launches separately; nothing was queued).
        `drawn` then gives the ids."""
        sampler, dec, n = self.sampler, self._dec, len(seqs)
        inputs = sampler.input_rows(n)
        if logits.data_ptr() != inputs[0].data_ptr() or not sampler.serves(logits, rows):
            return None
        filtered, bucket = sampler.stage(rows, self._sampler_host)
        positions, decode_bucket = self.runner.stage_ahead(seqs, self._decode_host)
        assert decode_bucket == bucket, (decode_bucket, bucket)  # both graph sets have the decode graphs' sizes
        out = self._graphs[filtered](*inputs, dec.ids_rows[n], dec.positions_rows[n], bucket=bucket)[0]
        self.replays += 1
        return Ahead(seqs, positions, out)

    def drawn(self, n: int) -> torch.Tensor:
        """The ids the last replay drew for its `n` rows, on the host, once they are there (not waiting
        for its forward)."""
        if self._drawn_event is not None:
            self._drawn_event.synchronize()
        return self._samples[:n].clone()
