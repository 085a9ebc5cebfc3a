"""Qwen3-Omni's per-frame speech path on CUDA never makes the host wait for the GPU, but for the talker
step's one read of its sampled ids: talker_input -> talker (submit and step) -> code predictor, frame
after frame, and Code2Wav's chunks on its side stream, each checked under
torch.cuda.set_sync_debug_mode("error") (tiny model, bf16, components built as the server builds them;
inputs handed over as the worker hands them: the talker's ids on the host, states on the device)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from mstar.config import CudaGraphConfig, KVCacheConfig
from mstar.engines.autoregressive import build_autoregressive_engine
from mstar.engines.base import StatelessSpec, StepItem
from mstar.engines.sampling import SampleOutput
from mstar.engines.stateless import StatelessEngine, capture_step_graphs
from mstar.models.qwen3_omni.builders import build_component
from mstar.models.qwen3_omni.checkpoint import OmniCheckpoint
from mstar.models.qwen3_omni.model import Qwen3Omni
from mstar.models.qwen3_omni.options import CODE_PREDICTOR_DEFAULTS, TALKER_DEFAULTS

CUDA = torch.device("cuda")
BATCH = 4
PROMPT_ROWS = 12
TALKER_OPTIONS = {**{k.removeprefix("talker."): v for k, v in TALKER_DEFAULTS.items()}, "max_tokens": None,
                  "ignore_eos": True}  # the served sampling (temperature, top-k, repetition penalty)
OPTIONS = {**CODE_PREDICTOR_DEFAULTS, "voice": "Ethan"}  # what talker_input and the code predictor see


@contextlib.contextmanager
def no_syncs():
    """Any operation that syncs the host with the device inside the block raises."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


@pytest.fixture
def allow_sampled_ids_read(monkeypatch):
    """The autoregressive engine's one host read per step (its sampled ids) is allowed."""
    real = SampleOutput.to_host

    def read(out: SampleOutput) -> SampleOutput:
        mode = torch.cuda.get_sync_debug_mode()  # "error" inside no_syncs(), off outside it
        torch.cuda.set_sync_debug_mode(0)
        try:
            return real(out)
        finally:
            torch.cuda.set_sync_debug_mode(mode)
    monkeypatch.setattr(SampleOutput, "to_host", read)


@pytest.fixture(scope="module")
def parts():
    cfg = Qwen3Omni.make_config(tiny=True, dtype="bfloat16")
    ckpt = OmniCheckpoint.open(cfg, None, "dummy")
    built = {n: build_component(ckpt, cfg, n, CUDA) for n in ("talker_input", "talker", "code_predictor", "code2wav")}
    for name in ("code_predictor", "code2wav"):  # as their stateless engines do when the server builds them
        capture_step_graphs(built[name].module, built[name].engine.graph_sizes(), CUDA)
    kv = KVCacheConfig(max_num_pages=64, page_size=16)
    talker = build_autoregressive_engine(built["talker"].module, built["talker"].engine, kv, CUDA,
                                         CudaGraphConfig(batch_sizes=[1, 2, 4, 8]))
    return {"talker": talker, **{n: built[n].module for n in ("talker_input", "code_predictor", "code2wav")}}


class _Lane:
    """BATCH requests of the talk loop after the talker's prompt: each `frame()` runs the code predictor on
    the last talker results, talker_input on its outputs, then one talker step, handing values over as
    the worker does (talker outputs as they come; loop-back edges as talker_input left them)."""

    def __init__(self, parts) -> None:
        self.parts = parts
        talker, ti = parts["talker"], parts["talker_input"]
        h, dtype = talker.runner.model.hidden_size, ti.tts_rows.dtype
        positions = torch.arange(PROMPT_ROWS).expand(3, -1).contiguous()
        for i in range(BATCH):
            talker.submit(StepItem(f"r{i}", "talk", "talker", {
                "input_ids": torch.zeros(PROMPT_ROWS, dtype=torch.long),
                "input_embeds": torch.randn(PROMPT_ROWS, h, device=CUDA, dtype=dtype), "positions": positions},
                TALKER_OPTIONS))
        self.results = _drain(talker, BATCH)
        ht = ti.config.thinker_hidden_size
        self.text = torch.randn(2, 1, ht, device=CUDA, dtype=dtype)  # one thinker token's states
        self.loop = [{"frame_index": torch.tensor(0), "text_ended": torch.tensor(False), "talker_pos": positions,
                      "talker_positions": positions.to(CUDA), "prompt_ids": torch.arange(4, device=CUDA)}
                     for _ in range(BATCH)]
        self.no_frame = torch.zeros(h, device=CUDA, dtype=dtype)
        self.iteration = 0

    def frame(self, text_left: bool) -> None:
        talker, ti, predictor = self.parts["talker"], self.parts["talker_input"], self.parts["code_predictor"]
        self.iteration += 1
        preds = predictor.run_batch("talk", "code_predictor", [
            {"talker_hidden": r.outputs["hidden"], "first_code": r.outputs["token"], "frame_index": x["frame_index"]}
            for r, x in zip(self.results, self.loop)], [OPTIONS] * BATCH)
        inputs = []
        for r, x, p in zip(self.results, self.loop, preds):
            # a sampled codec EOS makes no frame (the walk would stop there; the test goes on)
            item = {**x, "first_code": r.outputs["token"],
                    "codec_embed_sum": p["codec_embed_sum"] if p else self.no_frame}
            if text_left:
                item["thinker_states"] = self.text
            inputs.append(item)
        outs = ti.run_batch("talk", "talker_input", inputs, [OPTIONS] * BATCH)
        for i, (r, out) in enumerate(zip(self.results, outs)):
            self.loop[i].update({k: out[k] for k in ("frame_index", "text_ended", "talker_pos")})
            talker.submit(StepItem(r.request_id, "talk", "talker", {
                "input_ids": out["talker_ids"], "input_embeds": out["talker_embeds"], "positions": out["talker_pos"]},
                TALKER_OPTIONS, iteration=self.iteration))
        self.results = talker.step()
        assert [r.error for r in self.results] == [None] * BATCH

    def release(self) -> None:
        for i in range(BATCH):
            self.parts["talker"].release(f"r{i}")


def _drain(engine, count: int) -> list:
    results = []
    for _ in range(32):
        results += engine.step()
        if len(results) >= count:
            assert all(r.error is None for r in results), [r.error for r in results]
            return results
    raise AssertionError(f"{len(results)} of {count} results")


def test_talk_loop_frames_never_sync(parts, allow_sampled_ids_read):
    lane = _Lane(parts)
    runner, replays = parts["talker"].runner, []
    real = runner._replay_extras
    try:
        for _ in range(3):  # warm: the sampler's graphs, first shapes
            lane.frame(text_left=True)
        runner._replay_extras = lambda chunks: replays.append(len(chunks)) or real(chunks)
        with no_syncs():
            for k in range(4):
                lane.frame(text_left=k < 2)  # the thinker's text, then tts_eos, then tts_pad
    finally:
        del runner._replay_extras
        lane.release()
    assert replays == [BATCH] * 4  # every talker step replayed its extras graph
    for loop in lane.loop:  # the loop-back values stayed on the host, and the positions moved on
        assert loop["frame_index"].device.type == "cpu" and int(loop["frame_index"]) == 7
        assert loop["talker_pos"].device.type == "cpu" and loop["talker_pos"].tolist() == [[PROMPT_ROWS + 6]] * 3
        assert bool(loop["text_ended"])


def test_code2wav_chunks_on_the_side_stream_never_sync(parts):
    code2wav = parts["code2wav"]
    assert code2wav.graphs.keys() == ["decode"] and code2wav.pad_frames == 50  # padded by default on CUDA
    engine = StatelessEngine(code2wav, StatelessSpec(max_batch_size=8))
    assert engine.stream is not None
    q = code2wav.cfg.num_quantizers
    gen = torch.Generator(device=CUDA).manual_seed(0)
    frames = [torch.randint(0, code2wav.cfg.codebook_size, (1, q), device=CUDA, generator=gen) for _ in range(60)]

    def chunks(new: int, context: int) -> list[StepItem]:  # as the worker cuts them from the codes stream
        items = []
        for i in range(3):
            codes = torch.cat(frames[i: i + context + new])
            items.append(StepItem(f"c{i}", "vocode", "code2wav", {
                "codes": codes, "codes_new": torch.tensor(new), "codes_start": torch.tensor(i),
                "codes_final": torch.tensor(False)}))
        return items

    def run(items: list[StepItem]) -> list[torch.Tensor]:
        for item in items:
            engine.submit(item)
        out = []
        while engine.has_work():
            out += engine.step()
        assert [r.error for r in out] == [None] * len(items)
        return [r.outputs["audio"] for r in out]

    run(chunks(25, 0))  # warm (the graphs were captured at build)
    with no_syncs():
        first = run(chunks(25, 0))
        steady = run(chunks(25, 25))
        last = run(chunks(7, 25))
    spf, lookahead = code2wav.cfg.samples_per_frame, code2wav.lookahead_samples
    assert [a.shape[0] for a in first] == [25 * spf - lookahead] * 3
    assert [a.shape[0] for a in steady] == [25 * spf] * 3 and [a.shape[0] for a in last] == [7 * spf] * 3
    assert all(a.device.type == "cpu" and a.dtype == torch.float32 for a in first + steady + last)
    # the steady chunks decoded eagerly on the default stream (same shape as the graph's bucket of 4)
    codes = torch.stack([torch.cat(frames[i: i + 50]).T for i in (0, 1, 2, 0)])
    eager = code2wav.decode(codes)[:3, 25 * spf - lookahead: 50 * spf - lookahead].cpu()
    assert float(eager.abs().max()) > 0.01
    for got, want in zip(steady, eager):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-2)
