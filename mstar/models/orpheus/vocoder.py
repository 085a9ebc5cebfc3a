"""The `snac` component: windows of the audio-token stream -> samples, batched across requests.

The stream (SlidingWindow of 28 tokens, stride 7, recut at the end) cuts windows of 4 frames.
Each frame g of a request is emitted by exactly one window, so streamed audio has no gap and no
repeat:
  - an ordinary window [7k, 7k + 28) emits its second frame (samples 2048:4096 of its 4 * 2048),
    where both neighbours give the decoder context, as the original does; the request's first
    window (k = 0) also emits frame 0 (samples 0:4096);
  - with the early window (SlidingWindow `first`: the first 14 tokens, cut before the first full
    window so that audio starts after 2 frames instead of 4), the early window emits frame 0 and
    the first full window then emits frame 1 only;
  - the final window (the stream's last 28 items, or all of them when fewer) emits every frame
    no earlier window emitted: the last two frames after ordinary windows, everything for a short
    request. A trailing partial frame (generation stopped mid-frame) has no audio, as in the original.
Noise of SNAC's noise blocks comes from a fixed table indexed by the sample's position in the
request, so a request's audio does not depend on batching or on streaming.

A window decodes only the samples it emits (`SnacDecoder` `emit`): each decoder block runs on the span
of its input those samples depend on, the same numbers as the whole window's decode. An ordinary window
emits one frame of four, and its decoder blocks after the first then run on about a third of their steps.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn

from mstar.engines.base import CapturePlan, StatelessBase
from mstar.engines.cuda_graphs import to_device_async
from mstar.models.orpheus.snac import SnacDecoder, TableNoise
from mstar.models.orpheus.tokens import FRAME, OrpheusTokens, split_levels, valid_windows

WINDOW_FRAMES = 4
EARLY_FRAMES = 2  # the early window (model.EARLY_WINDOW_TOKENS = 14 tokens)
FINAL_FRAMES = 3  # whole frames of a final window when generation stops mid-frame (600 tokens: 85 frames + 5)
# (frames decoded, first frame emitted, end) of the windows replayed from CUDA graphs: the ordinary window
# and the early one; final windows after generation stops mid-frame (600 tokens), at a frame's end (an
# end-of-speech token) and after only an early window; then whole windows of 4 to 1 frames, which any other
# plan slices (tests/models/test_orpheus_units.py checks the plans streams of 14 tokens and more make)
GRAPH_PLANS = ((WINDOW_FRAMES, 1, 2), (EARLY_FRAMES, 0, 1), (FINAL_FRAMES, 1, 3), (WINDOW_FRAMES, 2, 4),
               (EARLY_FRAMES, 1, 2), *((n, 0, n) for n in range(WINDOW_FRAMES, 0, -1)))
NOISE_TABLE = 1 << 18  # entries per table: positions wrap after 2^18 steps of a decoder block
_NOISE_SEED = 20240317


@dataclass(frozen=True)
class WindowPlan:
    """What to decode from one window and which of its frames to emit."""

    first_token: int  # window index of the first token of its first whole frame
    frames: int  # whole frames decoded
    first_frame: int  # the request's index of that first frame (noise positions)
    emit_from: int  # decoded frames [emit_from, emit_to) are emitted
    emit_to: int


def plan_window(length: int, new: int, start: int, final: bool) -> WindowPlan:
    """The plan of a window of `length` tokens starting at stream index `start` (module doc rules)."""
    g0, g1 = -(-start // FRAME), (start + length) // FRAME
    frames = max(g1 - g0, 0)
    seen = length - new  # tokens of this window that an earlier window had
    if not final and start == 0 and length < FRAME * WINDOW_FRAMES:  # the early window
        lo, hi = 0, frames - 1
    elif not final and start == 0:  # after an early window of `seen` tokens, from the frame it kept back
        lo, hi = max(seen // FRAME - 1, 0), 2
    elif not final:
        lo, hi = 1, 2
    elif new == length:  # no earlier window saw any of these tokens
        lo, hi = 0, frames
    elif start == 0 and length < FRAME * WINDOW_FRAMES:  # a short stream after its early window
        lo, hi = seen // FRAME - 1, frames
    else:  # ordinary windows emitted up to frame start // 7 + 1
        lo, hi = start // FRAME + 2 - g0, frames
    lo, hi = max(lo, 0), min(hi, frames)
    return WindowPlan(FRAME * g0 - start, frames, g0, lo, max(hi, lo))


class OrpheusVocoder(StatelessBase, nn.Module):
    """run_batch over stream windows ("codes", "codes_new", "codes_start", "codes_final") -> "audio".

    `decode_windows` is the fixed-shape part (tokens [B, 7F] and first frames [B] -> samples
    [B, F * samples_per_frame]) with no host sync: its engine captures it in CUDA graphs for each
    window plan of `GRAPH_PLANS` (`capture_plans`).
    """

    host_outputs = True  # audio goes to the client: copied to the host asynchronously (stateless.py)
    host_inputs = True  # windows stay on the host (read there); run_batch moves the spans in one copy
    side_stream = True  # on CUDA its steps run on their own stream, overlapping the LM's decode (stateless.py)

    def __init__(self, snac: SnacDecoder, tokens: OrpheusTokens) -> None:
        super().__init__()
        self.snac = snac
        self.tokens = tokens
        self.samples_per_frame = snac.cfg.samples_per_frame
        self.noise_steps = snac.cfg.noise_lengths_per_frame() if snac.cfg.noise else []
        gen = torch.Generator().manual_seed(_NOISE_SEED)
        self.register_buffer("noise_table", torch.randn(len(self.noise_steps), NOISE_TABLE, generator=gen),
                             persistent=False)

    def capture_plans(self) -> list[CapturePlan]:
        """`decode_windows` for each (frames, emit_from, emit_to) of `GRAPH_PLANS` (the plans
        streams make and whole windows), keyed by that plan. A window of another plan takes its whole
        window's graph and keeps its frames; only one with no such graph, or a batch larger than the largest
        size, decodes eagerly. Replayed as graphs, the decoder's many small kernels cost one launch instead
        of stalling the worker that also runs the LM."""
        return [CapturePlan((frames, lo, hi), functools.partial(self.decode_windows, emit=(lo, hi)),
                            (((FRAME * frames,), torch.long), ((), torch.long)))
                for frames, lo, hi in GRAPH_PLANS]

    def table_noise(self, first_frame: torch.Tensor) -> TableNoise:
        """The decoder blocks' noise for windows starting at `first_frame` [B], read from the table (the
        fused noise kernel reads it in place; the PyTorch form gathers it)."""
        return TableNoise(self.noise_table, first_frame, tuple(self.noise_steps))

    def noises(self, first_frame: torch.Tensor, frames: int) -> list[torch.Tensor]:
        """Noise of each decoder block for windows starting at `first_frame` [B] ([B, 1, T] each)."""
        noise = self.table_noise(first_frame)
        return [noise.block(i).tensor(frames * steps) for i, steps in enumerate(self.noise_steps)]

    @torch.inference_mode()
    def decode_windows(self, frame_tokens: torch.Tensor, first_frame: torch.Tensor,
                       emit: tuple[int, int] | None = None) -> torch.Tensor:
        """Audio tokens of whole frames [B, 7F] -> float32 samples [B, F * samples_per_frame], or with
        `emit` = (lo, hi) the samples of frames [lo, hi) alone, [B, (hi - lo) * samples_per_frame], decoded
        on the spans they depend on (the same samples as the whole window's)."""
        codes = split_levels(frame_tokens, self.tokens)
        dtype = self.noise_table.dtype
        spf = self.samples_per_frame
        samples = None if emit is None else (emit[0] * spf, emit[1] * spf)
        noise = self.table_noise(first_frame) if self.noise_steps else None
        return self.snac(codes, noise, samples)[:, 0].to(dtype)

    def run_batch(self, walk, node, inputs, options):
        # Windows and their stream metadata are read on the host (host_inputs), without a device sync.
        windows = [x["codes"].reshape(-1) for x in inputs]
        plans = [plan_window(len(w), x["codes_new"].item(), x["codes_start"].item(), bool(x["codes_final"].item()))
                 for x, w in zip(inputs, windows)]
        groups: dict[tuple[int, int, int], list[int]] = {}
        for i, plan in enumerate(plans):
            if plan.emit_to > plan.emit_from:
                groups.setdefault((plan.frames, plan.emit_from, plan.emit_to), []).append(i)
        outputs: list[dict[str, torch.Tensor]] = [{} for _ in inputs]
        for (frames, lo, hi), rows in groups.items():  # one batched decode per window plan
            spans = torch.stack([windows[i][plans[i].first_token: plans[i].first_token + FRAME * frames]
                                 for i in rows]).long()
            valid = valid_windows(spans, self.tokens)
            if not all(valid):  # a window holding an out-of-codebook code makes no audio (as the original)
                spans = spans[torch.tensor(valid)]
                rows = [i for i, ok in zip(rows, valid) if ok]
                if not rows:
                    continue
            spans, first = _to_device(spans, [plans[i].first_frame for i in rows], self.noise_table.device)
            # the rows' audio in one copy out of the decode's buffer (graphs' outputs are reused by the next
            # replay); each row's is a view of it (stateless.start_host_copies copies a shared base once)
            emitted = self._decode(frames, lo, hi, spans, first).clone(memory_format=torch.contiguous_format)
            for row, i in enumerate(rows):
                outputs[i]["audio"] = emitted[row]
        return outputs  # a window with nothing to emit sends no audio chunk

    def _decode(self, frames: int, lo: int, hi: int, spans: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
        """Samples of frames [lo, hi) of windows of `frames` frames [B, (hi - lo) * samples_per_frame]: from
        this plan's graph, else sliced from the whole window's graph, else decoded eagerly on their spans."""
        for plan in ((frames, lo, hi), (frames, 0, frames)):
            replayed = self.graphs.replay(plan, spans, first)  # views of the graph's output
            if replayed is not None:
                spf = self.samples_per_frame
                return replayed[0][:, (lo - plan[1]) * spf: (hi - plan[1]) * spf]
        return self.decode_windows(spans, first, (lo, hi))


def _to_device(spans: torch.Tensor, first: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Host token spans [B, 7F] and first frames [B] on `device`: one pinned, non-blocking copy on CUDA
    (a pageable `.to` would wait for all the work queued before, the LM's next step included)."""
    host = torch.cat([spans, torch.tensor(first)[:, None]], dim=1)
    moved = to_device_async(host, device)
    return moved[:, :-1], moved[:, -1]
