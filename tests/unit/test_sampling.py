"""Batched sampling: masks, penalties, seeds, bans, logprobs and option validation."""

import math

import pytest
import torch

from mstar.engines.sampling import SamplingParams, SamplingRow, sample


def _row(temperature=1.0, tokens=(), num_prompt=0, seed=None, eos=(), **kw):
    gen = None
    if seed is not None:
        gen = torch.Generator().manual_seed(seed)
    return SamplingRow(SamplingParams(temperature=temperature, **kw), list(tokens), num_prompt, gen, eos)


def _draws(logits, row_kwargs, n=400):
    """The set of tokens drawn in n samples of one row (one seeded stream)."""
    row = _row(seed=0, **row_kwargs)
    return {int(sample(logits[None], [row]).token_ids[0]) for _ in range(n)}


def test_greedy_is_argmax():
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(1))
    out = sample(logits, [_row(temperature=0.0) for _ in range(5)])
    assert torch.equal(out.token_ids, logits.argmax(-1))


def test_top_k_keeps_only_the_k_best():
    logits = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0])
    assert _draws(logits, {"top_k": 2}) == {0, 1}


def test_top_p_keeps_the_smallest_nucleus():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    assert _draws(probs.log(), {"top_p": 0.7}) == {0, 1}  # 0.5 < 0.7, then 0.8 >= 0.7
    assert _draws(probs.log(), {"top_p": 0.5}) == {0}


def test_min_p_drops_unlikely_tokens():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    assert _draws(probs.log(), {"min_p": 0.25}) == {0, 1, 2}  # threshold 0.125


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.7, 0.2, 0.1])
    row = _row(seed=3)
    counts = torch.bincount(torch.stack([sample(probs.log()[None], [row]).token_ids[0] for _ in range(3000)]),
                            minlength=3).float() / 3000
    assert torch.allclose(counts, probs, atol=0.03)


def test_repetition_penalty_uses_prompt_and_output():
    logits = torch.tensor([[2.0, 1.9, -1.0, -1.1]])
    # token 0 (seen in the prompt) is divided, token 2 (seen in the output) multiplied
    out = sample(logits, [_row(0.0, tokens=[0, 2], num_prompt=1, repetition_penalty=2.0)])
    assert int(out.token_ids[0]) == 1
    logits = torch.tensor([[-1.0, -1.1, -5.0]])
    out = sample(logits, [_row(0.0, tokens=[0], num_prompt=1, repetition_penalty=2.0)])
    assert int(out.token_ids[0]) == 1  # -1 * 2 = -2 < -1.1


def test_presence_and_frequency_penalties_count_output_only():
    logits = torch.tensor([[3.0, 2.5, 0.0]])
    prompt_only = _row(0.0, tokens=[0, 0, 0], num_prompt=3, frequency_penalty=1.0)
    assert int(sample(logits, [prompt_only]).token_ids[0]) == 0
    twice = _row(0.0, tokens=[0, 0], num_prompt=0, frequency_penalty=0.4)  # 3 - 0.8 < 2.5
    assert int(sample(logits, [twice]).token_ids[0]) == 1
    once = _row(0.0, tokens=[0], num_prompt=0, presence_penalty=0.6)  # 3 - 0.6 < 2.5
    assert int(sample(logits, [once]).token_ids[0]) == 1


def test_min_tokens_bans_eos_and_stop_tokens():
    logits = torch.tensor([[5.0, 4.0, 1.0, 0.0]])
    early = _row(0.0, tokens=[3], num_prompt=1, eos=(0,), min_tokens=2, stop_token_ids=(1,))
    assert int(sample(logits, [early]).token_ids[0]) == 2
    later = _row(0.0, tokens=[3, 2, 2], num_prompt=1, eos=(0,), min_tokens=2, stop_token_ids=(1,))
    assert int(sample(logits, [later]).token_ids[0]) == 0


def test_seeded_rows_do_not_depend_on_the_batch():
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(6, 100, generator=gen)
    params = {"top_k": 20, "top_p": 0.9}
    seq_alone, seq_batch = [], []
    row_alone = _row(seed=42, **params)
    row_batch = _row(seed=42, **params)
    others = [_row(seed=None), _row(temperature=0.0), _row(seed=5, min_p=0.1), _row(), _row(seed=9)]
    for _ in range(20):
        seq_alone.append(int(sample(logits[:1], [row_alone]).token_ids[0]))
        seq_batch.append(int(sample(logits[[1, 2, 0, 3, 4, 5]], [others[0], others[1], row_batch, *others[2:]])
                             .token_ids[2]))
    assert seq_alone == seq_batch
    assert len(set(seq_alone)) > 1  # really sampling, not greedy


def test_logprobs_and_top_alternatives():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.0, 0.0, 5.0, 0.0]])
    out = sample(logits, [_row(0.0, logprobs=2), _row(0.0, logprobs=0)])
    expected = logits.log_softmax(-1)
    assert out.token_ids.tolist() == [1, 2]
    assert torch.allclose(out.logprobs, expected[[0, 1], [1, 2]])
    assert out.top_ids[0].tolist() == [1, 2]
    assert torch.allclose(out.top_logprobs[0], expected[0, [1, 2]])
    assert sample(logits, [_row(0.0), _row(0.0)]).logprobs is None


@pytest.mark.parametrize("options, match", [
    ({"max_tokens": -1}, "max_tokens=-1"),
    ({"max_tokens": 0}, "max_tokens=0"),
    ({"temperature": -0.5}, "temperature=-0.5"),
    ({"top_p": 0.0}, "top_p=0.0"),
    ({"top_p": 1.5}, "top_p=1.5"),
    ({"top_k": -2}, "top_k=-2"),
    ({"min_p": 2}, "min_p=2"),
    ({"repetition_penalty": 0}, "repetition_penalty=0"),
    ({"presence_penalty": 3}, "presence_penalty=3"),
    ({"temperature": "hot"}, "temperature='hot'"),
    ({"max_tokens": 2.5}, "max_tokens=2.5"),
    ({"seed": True}, "seed=True"),
    ({"stop_token_ids": [1, "x"]}, "stop_token_ids"),
    ({"ignore_eos": 1}, "ignore_eos=1"),
    ({"logprobs": 50}, "logprobs=50"),
    ({"min_tokens": 5, "max_tokens": 3}, "min_tokens=5"),
])
def test_from_options_validation(options, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams.from_options(options, SamplingParams())


def test_from_options_overrides_defaults_and_ignores_other_keys():
    defaults = SamplingParams(temperature=0.7, max_tokens=100)
    p = SamplingParams.from_options({"top_k": -1, "stop_token_ids": [3, 4], "temperature": 0, "voice": "x"},
                                    defaults)
    assert p.top_k == 0 and p.stop_token_ids == (3, 4) and p.temperature == 0.0 and p.max_tokens == 100
    assert math.isclose(SamplingParams.from_options({}, defaults).temperature, 0.7)


def test_repetition_penalty_cache_follows_a_growing_sequence():
    """A row keeping its seen-token mask across steps penalises exactly what a fresh row would."""
    torch.manual_seed(3)
    params = SamplingParams(temperature=0.0, repetition_penalty=2.5)
    tokens, cache = [5, 9, 9, 17], {}
    for step in range(30):
        logits = torch.randn(1, 40)
        cached = sample(logits, [SamplingRow(params, list(tokens), 2, cache=cache)]).token_ids
        fresh = sample(logits, [SamplingRow(params, list(tokens), 2)]).token_ids
        assert torch.equal(cached, fresh), step
        tokens.append(int(cached) if step % 3 else (step * 7) % 40)  # sometimes a token never seen before
    assert cache["seen_upto"] == len(tokens) - 1
    assert cache["seen"].sum().item() == len(set(tokens[:-1]))


def test_batched_repetition_penalty_equals_each_row_alone():
    """Rows with and without a penalty in one batch get what each gets alone."""
    torch.manual_seed(5)
    logits = torch.randn(3, 30)
    rows = [SamplingRow(SamplingParams(temperature=0.0, repetition_penalty=pen, logprobs=0), toks, 1)
            for pen, toks in ((1.0, [1, 2, 3]), (2.0, [4, 5, 5, 29]), (1.5, [0, 7]))]
    together = sample(logits, rows)
    for i, row in enumerate(rows):
        alone = sample(logits[i : i + 1], [row])
        assert int(together.token_ids[i]) == int(alone.token_ids[0])
    # the penalised rows really changed: their best raw token was seen and is pushed down
    raw_best = logits.argmax(-1)
    penalised = SamplingRow(SamplingParams(temperature=0.0, repetition_penalty=50.0), [int(raw_best[1])], 1)
    assert int(sample(logits[1:2], [penalised]).token_ids[0]) != int(raw_best[1])


# Logits of a head restricted to a span (Orpheus' `audio_logits_only`): -inf outside [300, 420) and on
# the blocked ids [301, 308) inside it.
SPAN, BLOCKED, VOCAB = (300, 420), (301, 308), 600
SPEAKABLE = set(range(*SPAN)) - set(range(*BLOCKED))
SPAN_PARAMS = [
    {"temperature": 0.6, "top_p": 0.8, "repetition_penalty": 1.3},  # Orpheus' defaults
    {"temperature": 0.0, "repetition_penalty": 1.3},
    {"temperature": 1.5, "repetition_penalty": 0.7},  # unfiltered; a penalty < 1
    {"temperature": 0.9, "top_k": 200},  # top-k wider than the finite logits
    {"top_p": 0.99, "min_p": 0.05, "repetition_penalty": 1.3},
    {"temperature": 0.8, "presence_penalty": 1.0, "frequency_penalty": -2.0, "logprobs": 5},
    {"temperature": 0.7, "top_p": 0.9, "min_tokens": 50, "eos": (SPAN[0],)},  # eos banned
]


def span_logits(rows: int, gen: torch.Generator, scale: float) -> torch.Tensor:
    x = torch.full((rows, VOCAB), -math.inf)
    x[:, SPAN[0]:SPAN[1]] = torch.randn(rows, SPAN[1] - SPAN[0], generator=gen) * scale
    x[:, BLOCKED[0]:BLOCKED[1]] = -math.inf
    return x


@pytest.mark.parametrize("prefilter", [16, 1024])
def test_minus_inf_logits_are_never_drawn_and_make_no_nan(monkeypatch, prefilter):
    """Penalties (seen ids outside the span among them), temperature, top-k/top-p/min-p, bans and
    logprobs over -inf logits: no NaN, and every id drawn is finite. A 16-wide prefilter sends top-p
    rows to the whole-vocabulary fallback; a 1024-wide one holds -inf logits in the prefilter."""
    import mstar.engines.sampling_filters as filters
    from mstar.engines.sampling import _processed_logits

    monkeypatch.setattr(filters, "PREFILTER_K", prefilter)
    gen = torch.Generator().manual_seed(prefilter)
    torch.manual_seed(prefilter)
    for trial in range(20):
        prompt = [5, 17, 599, 302, 304]  # text and marker ids: -inf logits the repetition penalty scales
        output = torch.randint(SPAN[0], SPAN[1], (trial,), generator=gen).tolist() + [42, 42]
        rows = [_row(tokens=prompt + output, num_prompt=len(prompt), **p) for p in SPAN_PARAMS]
        logits = span_logits(len(rows), gen, 0.5 + trial % 5)
        out = sample(logits, rows)
        assert set(out.token_ids.tolist()) <= SPEAKABLE, trial
        processed = _processed_logits(logits, rows, filters.RowTable(rows, VOCAB, logits.device))
        assert not processed.isnan().any(), trial
        assert out.logprobs[5].isfinite() and not out.top_logprobs.isnan().any(), trial


def test_window_penalises_and_bans_ids_at_their_columns():
    """Logits over the ids [1000, 1008) (`sample(..., offset)`): seen ids, bans and counts act at column
    id - 1000; ids outside the window are left out without error; the ids handed back are token ids."""
    from mstar.engines.sampling_filters import seen_masks

    offset = 1000
    logits = torch.tensor([[0.0, 1.0, 2.0, 5.0, 4.0, 3.0, 0.0, 0.0]])  # id 1003 best, then 1004, 1005
    outside = [3, 999, 1008, 50_000]  # seen ids outside the window, among them id 3 (column 3 at offset 0)

    def greedy(**kw):
        return int(sample(logits, [_row(temperature=0.0, **kw)], offset).token_ids[0])

    assert greedy(tokens=outside) == 1003
    assert greedy(tokens=[*outside, 1003], repetition_penalty=50.0) == 1004
    masks = seen_masks([_row(tokens=[*outside, 1003, 1006], repetition_penalty=50.0)], 8, logits.device, offset)
    assert masks[0].nonzero()[:, 0].tolist() == [3, 6]
    assert greedy(tokens=[1], num_prompt=1, min_tokens=2, eos=(1003, 5), stop_token_ids=(1004, 2000)) == 1005
    # presence/frequency counts of the output ids, at their columns: 5 - 2 * 2 < 4
    assert greedy(tokens=[1, 1003, 1003, 17], num_prompt=1, frequency_penalty=2.0) == 1004
    out = sample(logits, [_row(temperature=0.0, logprobs=3, tokens=outside)], offset)
    assert out.token_ids.tolist() == [1003] and out.top_ids.tolist() == [[1003, 1004, 1005]]
    # normalised over the window
    torch.testing.assert_close(out.top_logprobs[0], logits[0].log_softmax(-1).topk(3).values)


@pytest.mark.parametrize("prefilter", [16, 1024])
def test_window_samples_the_ids_of_full_minus_inf_logits(monkeypatch, prefilter):
    """`sample` over the window's columns (offset SPAN[0]) draws, for the same noise (its columns), the token
    ids it draws over the full -inf logits, with the same logprobs and top ids: SPAN_PARAMS (penalties with
    seen ids outside the window, counts, eos bans inside it), seeded and greedy rows among them."""
    import mstar.engines.sampling as sampling
    import mstar.engines.sampling_filters as filters

    monkeypatch.setattr(filters, "PREFILTER_K", prefilter)
    gen = torch.Generator().manual_seed(prefilter)
    params = [*SPAN_PARAMS, {"temperature": 0.0, "min_tokens": 50, "eos": (SPAN[0], 5), "logprobs": 3},
              {"temperature": 0.9, "top_p": 0.95, "seed": 4}]
    noise = {}
    monkeypatch.setattr(sampling, "_exponential_noise",
                        lambda x, rows: noise["full"] if x.shape[1] == VOCAB else noise["full"][:, SPAN[0]:SPAN[1]])
    for trial in range(20):
        prompt = [5, 17, 599, 302, 304]
        output = torch.randint(SPAN[0], SPAN[1], (trial,), generator=gen).tolist() + [42, 42]
        rows = [_row(tokens=prompt + output, num_prompt=len(prompt), **p) for p in params]
        full = span_logits(len(rows), gen, 0.5 + trial % 5)
        noise["full"] = torch.empty_like(full).exponential_(generator=gen)
        want = sample(full, rows)
        got = sample(full[:, SPAN[0]:SPAN[1]].contiguous(), rows, SPAN[0])
        assert got.token_ids.tolist() == want.token_ids.tolist(), trial
        assert set(got.token_ids.tolist()) <= SPEAKABLE
        torch.testing.assert_close(got.logprobs, want.logprobs)
        assert torch.equal(got.top_ids, want.top_ids)
        torch.testing.assert_close(got.top_logprobs, want.top_logprobs)
