"""Orpheus pieces without a runtime: prompt, token filter, frame layout, window plans, options."""

from __future__ import annotations

import pytest
import torch

from mstar.graph import SlidingWindow
from mstar.models.common.loading import fold_weight_norm
from mstar.models.orpheus.tokens import (
    FRAME,
    OrpheusTokens,
    accept_audio_token,
    split_levels,
    window_is_valid,
)
from mstar.models.orpheus.vocoder import GRAPH_PLANS, plan_window
from mstar.worker.streams import END, StreamBuffer

REAL = OrpheusTokens()


def test_real_layout_ids_and_prompt():
    assert (REAL.start_of_speech, REAL.end_of_speech, REAL.start_of_human, REAL.end_of_human,
            REAL.start_of_ai, REAL.audio_offset) == (128257, 128258, 128259, 128260, 128261, 128266)
    assert REAL.vocab_size == 156940
    assert REAL.prompt_ids([5, 6]) == [128259, 128000, 5, 6, 128009, 128260, 128261, 128257]
    assert REAL.prompt_ids([128000, 5]) == [128259, 128000, 5, 128009, 128260, 128261, 128257]


def _original_filter(ids: list[int]) -> list[int]:
    """What orpheus_tts' tokens_decoder appends, written from its rule: id = N - 10 - (count % 7) * 4096
    for `<custom_token_N>` (N = token - 128256), kept when > 0; other tokens are skipped."""
    kept = []
    for t in ids:
        if t < 128256:
            continue
        code = (t - 128256) - 10 - (len(kept) % 7) * 4096
        if code > 0:
            kept.append(t)
    return kept


def test_stream_filter_matches_the_original_decoder():
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(128000, REAL.vocab_size, (3000,), generator=gen).tolist()
    ids[:3] = [REAL.end_of_speech, 128266, 128266 + 5]  # marker dropped; code 0 dropped (as the original)
    ours = []
    for t in ids:
        if accept_audio_token(REAL, torch.tensor([t]), len(ours)):
            ours.append(t)
    assert ours == _original_filter(ids) and len(ours) > 50
    assert ours[0] == 128266 + 5


def test_place_windows_hold_the_next_places_codes_that_the_decoder_keeps():
    """After start of speech, and after each audio token, the window is codes 1..4095 of the place the
    original decoder reads next: walking any path through the windows, every token is kept."""
    t = OrpheusTokens()
    vocab = t.vocab_size
    windows = t.place_windows(vocab)
    lo = t.end_of_speech
    assert windows.width == t.codebook_size - 1 and windows.always == (0,)  # end of speech is column 0
    windows.check(t.speakable_span[1] - lo, vocab)
    gen = torch.Generator().manual_seed(0)
    token, kept = t.start_of_speech, 0
    for _ in range(3 * FRAME + 2):
        first = int(windows.starts[token]) + lo
        ids = range(first, first + windows.width)
        assert [t.code(i, kept) for i in (ids[0], ids[-1])] == [1, t.codebook_size - 1]
        token = ids[int(torch.randint(len(ids), (), generator=gen))]
        assert accept_audio_token(t, torch.tensor([token]), kept)
        kept += 1
    assert int(windows.starts[t.end_of_text]) + lo == t.audio_offset + 1  # any other id: place 0


def test_frame_layout_splits_levels_like_the_original():
    places = torch.arange(FRAME)
    codes = torch.tensor([[10, 11, 12, 13, 14, 15, 16], [20, 21, 22, 23, 24, 25, 26]])
    frame_tokens = (codes + REAL.audio_offset + places * 4096).reshape(1, -1)
    c0, c1, c2 = split_levels(frame_tokens, REAL)
    assert c0.tolist() == [[10, 20]]
    assert c1.tolist() == [[11, 14, 21, 24]]
    assert c2.tolist() == [[12, 13, 15, 16, 22, 23, 25, 26]]
    assert window_is_valid(frame_tokens[0].tolist(), REAL)
    assert not window_is_valid([REAL.audio_offset + 4096, *frame_tokens[0, 1:].tolist()], REAL)  # code 4096


def _drain(buf: StreamBuffer, emitted: list[int]) -> None:
    """Pop every ready chunk, plan it as the vocoder does, and record the frames it emits."""
    early = buf.policy.first
    while (chunk := buf.pop()) not in (None, END):
        plan = plan_window(len(chunk.value), chunk.new, chunk.start, chunk.final)
        assert plan.frames <= 4 and plan.first_token + 7 * plan.frames <= len(chunk.value)
        emitted.extend(range(plan.first_frame + plan.emit_from, plan.first_frame + plan.emit_to))
        if not chunk.final and chunk.start > 0:  # ordinary windows keep their middle frame
            assert (plan.emit_from, plan.emit_to) == (1, 2)
        elif not chunk.final and len(chunk.value) == early:  # the early window: frame 0
            assert (plan.emit_from, plan.emit_to) == (0, 1)
        elif not chunk.final:  # the first full window: 0:4096, or 2048:4096 after the early window
            assert (plan.emit_from, plan.emit_to) == ((1, 2) if chunk.new < len(chunk.value) else (0, 2))


@pytest.mark.parametrize("early", [0, 14])
@pytest.mark.parametrize("arrival", ["items_first", "end_first", "burst"])
def test_every_frame_is_emitted_exactly_once(arrival, early):
    """Windows of the real stream policy and the vocoder's plans cover frames 0..N//7-1 once each,
    with and without the early window, whether items come one by one (end known first or last) or
    all at once before the first pop."""
    for n in range(0, 90):
        buf = StreamBuffer(SlidingWindow(28, 7, recut_at_end=True, first=early))
        emitted: list[int] = []
        if arrival == "end_first":
            buf.end(n)
        for i in range(n):
            buf.put(i, torch.tensor([i]))
            if arrival != "burst":
                _drain(buf, emitted)
        buf.end(n)
        _drain(buf, emitted)
        assert emitted == list(range(n // 7)), n


def test_streams_of_14_tokens_and_more_make_only_plans_with_graphs():
    """Every window plan that emits audio in streams of 14-119, 595-609 and 700 tokens (early window on, as
    served; a sweep of 14-699 made the same five plans) has its own CUDA graph in GRAPH_PLANS, so no window
    of such a request decodes eagerly or slices a whole window's decode."""
    made: set[tuple[int, int, int]] = set()
    for n in [*range(14, 120), *range(595, 610), 700]:
        buf = StreamBuffer(SlidingWindow(28, 7, recut_at_end=True, first=14))
        for i in range(n + 1):
            if i < n:
                buf.put(i, torch.tensor([i]))
            else:
                buf.end(n)
            while (chunk := buf.pop()) not in (None, END):
                plan = plan_window(len(chunk.value), chunk.new, chunk.start, chunk.final)
                if plan.emit_to > plan.emit_from:
                    made.add((plan.frames, plan.emit_from, plan.emit_to))
    assert made <= set(GRAPH_PLANS), made - set(GRAPH_PLANS)
    assert {(4, 1, 2), (2, 0, 1), (3, 1, 3), (4, 2, 4), (2, 1, 2)} <= made  # the ones named in vocoder.py


def test_early_window_brings_the_first_audio_forward():
    """With the early window the first chunk that emits audio comes at token 14, not 28."""
    for early, expected in ((0, 28), (14, 14)):
        buf = StreamBuffer(SlidingWindow(28, 7, recut_at_end=True, first=early))
        emitted: list[int] = []
        for i in range(40):
            buf.put(i, torch.tensor([i]))
            _drain(buf, emitted)
            if emitted:
                assert i + 1 == expected, early
                break


def test_fold_weight_norm_both_namings():
    conv = torch.nn.utils.parametrizations.weight_norm(torch.nn.Conv1d(3, 4, 5))
    state = conv.state_dict()
    folded = fold_weight_norm(state.items())
    assert torch.allclose(folded["weight"], conv.weight, atol=1e-6)
    old = {"weight_g": state["parametrizations.weight.original0"],
           "weight_v": state["parametrizations.weight.original1"], "bias": state["bias"]}
    assert torch.allclose(fold_weight_norm(old.items())["weight"], conv.weight, atol=1e-6)


def test_options_are_validated():
    from mstar.models.orpheus.model import OrpheusModel

    model = OrpheusModel(OrpheusModel.make_config(tiny=True))
    proc = model.processor()
    proc.validate_options(model.request_options({}))
    with pytest.raises(ValueError, match="tara, leah, jess, leo, dan, mia, zac, zoe"):
        proc.validate_options(model.request_options({"voice": "bob"}))
    with pytest.raises(ValueError, match="speed"):
        proc.validate_options(model.request_options({"speed": 1.5}))
    with pytest.raises(ValueError, match="repetition_penalty"):
        proc.validate_options(model.request_options({"repetition_penalty": -1}))
    opts = model.request_options({"voice": "leo", "temperature": 0.2})
    assert opts["temperature"] == 0.2 and opts["top_p"] == 0.8 and opts["repetition_penalty"] == 1.3
    ids = proc.inputs({"text": "hi"}, opts)["prompt_ids"].tolist()
    t = model.tokens
    assert ids[0] == t.start_of_human and ids[-4:] == [t.end_of_text, t.end_of_human, t.start_of_ai,
                                                        t.start_of_speech]
    assert model.tokenizer.decode(ids[1:-4]) == "leo: hi"
