"""Orpheus through the offline runtime (in-process, CPU): LM parity with transformers, stream order,
streamed audio == one request alone, audio arriving while the LM still speaks."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
import torch

from mstar.engines.base import CausalLMBase
from mstar.models.llama.model import LlamaForCausalLM
from mstar.models.orpheus.tokens import accept_audio_token
from mstar.runtime.offline import MStar
from tests.models.orpheus_testing import make_checkpoint, yaml_config


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("orpheus")
    hf, tokens, kwargs = make_checkpoint(path)
    return path, hf, tokens, kwargs


def _record_lm(m: MStar) -> dict[str, list]:
    """Wrap the in-process LM engine: request id -> [(token, finish time or None)] as the engine made them."""
    engine = m.runtime.workers[0].engines["llm"]
    seen: dict[str, list] = {}
    step = engine.step

    def recording_step():
        results = step()
        for r in results:
            if "token" in r.outputs:
                done = time.monotonic() if r.finish_reason else None
                seen.setdefault(r.request_id, []).append((int(r.outputs["token"]), done))
        return results
    engine.step = recording_step
    return seen


@pytest.mark.parametrize("penalty", [1.0, 1.3])
def test_lm_lane_greedy_tokens_match_transformers(checkpoint, penalty):
    path, hf, tokens, kwargs = checkpoint
    with MStar("orpheus", config=yaml_config("orpheus", model_kwargs=kwargs), model_path=str(path)) as m:
        seen = _record_lm(m)
        opts = {"temperature": 0.0, "repetition_penalty": penalty, "max_tokens": 40, "voice": "zoe"}
        prompt = m.processor.inputs({"text": "Hello, how are you today?"}, m.runtime.model.request_options(opts))
        result = m.generate({"text": "Hello, how are you today?"}, **opts)
    ids = prompt["prompt_ids"][None]
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False,
                      repetition_penalty=penalty, eos_token_id=tokens.end_of_speech, pad_token_id=0)
    (made,) = seen.values()
    ours = [t for t, _ in made]
    assert ours == out[0, ids.shape[1]:].tolist()
    kept = []
    for t in ours:
        if accept_audio_token(tokens, torch.tensor([t]), len(kept)):
            kept.append(t)
    assert len(kept) >= 35, "the tiny LM should speak audio frames"
    samples = sum(a.size for a in result.outputs["audio"])
    assert samples == len(kept) // 7 * 2048  # every whole frame once: no gap, no repeat


def test_streamed_audio_equals_one_request_alone_and_comes_before_the_lm_ends():
    opts = {"max_tokens": 200, "seed": 7}  # default sampling: temperature 0.6, top_p 0.8, penalty 1.3
    with MStar("orpheus", config=yaml_config("orpheus"), tiny=True) as m:
        alone = np.concatenate(m.generate({"text": "Speak to me."}, **opts).outputs["audio"])
        seen = _record_lm(m)
        others = [m.submit({"text": f"other {i}"}, max_tokens=120, seed=i, voice="leah") for i in range(3)]
        handle = m.submit({"text": "Speak to me."}, **opts)
        pieces, first_audio = [], None
        for event in handle:
            assert event.name == "audio"
            first_audio = first_audio or time.monotonic()
            pieces.append(event.value.numpy())
        for other in others:
            other.result()
    streamed = np.concatenate(pieces)
    assert len(pieces) > 10 and streamed.dtype == np.float32
    # Same tokens, same windows; only the vocoder's batch differs, which reorders float sums.
    assert streamed.shape == alone.shape
    np.testing.assert_allclose(streamed, alone, rtol=0, atol=1e-5)
    main = max(seen.values(), key=len)  # the only request with 200 tokens
    assert len(main) == 200
    lm_done = [done for _, done in main if done is not None]
    assert len(lm_done) == 1 and first_audio < lm_done[0], "first audio should arrive while the LM still runs"


def _speakable(tokens) -> set[int]:
    return {tokens.end_of_speech, *range(tokens.audio_offset, tokens.speakable_span[1])}


def test_tiny_speaks_only_speakable_ids_with_audio_logits_only():
    """`audio_logits_only` (on by default) restricts the LM head; sampled (Orpheus' defaults) and greedy
    requests then make only end-of-speech and audio ids. Off: the full head."""
    from mstar.models.orpheus.model import OrpheusModel

    with MStar("orpheus", config=yaml_config("orpheus"), tiny=True) as m:
        tokens = m.runtime.model.tokens
        engine = m.runtime.workers[0].engines["llm"]
        lm = engine.runner.model
        assert (lm.span, lm.blocked_ids) == (tokens.speakable_span, tokens.span_markers)
        lo, hi = tokens.speakable_span
        assert engine.logit_offset == lm.logit_offset == lo and lm.logit_width == hi - lo  # compact logits
        seen = _record_lm(m)
        m.generate({"text": "Speak to me."}, max_tokens=120, seed=3)
        m.generate({"text": "Speak to me."}, max_tokens=60, temperature=0.0)
    made = [t for run in seen.values() for t, _ in run]
    assert len(made) > 100 and set(made) <= _speakable(tokens)
    full = OrpheusModel(OrpheusModel.make_config(tiny=True, audio_logits_only=False))._load_lm(torch.device("cpu"))
    assert type(full) is LlamaForCausalLM and full.logit_offset == 0


@pytest.fixture(scope="module")
def chatty_checkpoint(tmp_path_factory):
    """The tiny checkpoint with the head rows of every id that is not speakable scaled up 50x: with the
    full head, greedy decoding says text and marker ids."""
    path = tmp_path_factory.mktemp("orpheus_chatty")
    hf, tokens, kwargs = make_checkpoint(path)
    unspeakable = torch.ones(hf.config.vocab_size, dtype=torch.bool)
    unspeakable[sorted(_speakable(tokens))] = False
    with torch.no_grad():
        hf.lm_head.weight[unspeakable] *= 50.0
    hf.save_pretrained(path)
    return path, hf, tokens, kwargs, unspeakable.nonzero()[:, 0].tolist()


def test_greedy_tokens_are_the_full_heads_masked_to_speakable_ids(chatty_checkpoint):
    path, hf, tokens, kwargs, unspeakable = chatty_checkpoint
    opts = {"temperature": 0.0, "repetition_penalty": 1.3, "max_tokens": 40, "voice": "zoe"}
    with MStar("orpheus", config=yaml_config("orpheus", model_kwargs=kwargs), model_path=str(path)) as m:
        seen = _record_lm(m)
        prompt = m.processor.inputs({"text": "Hello there."}, m.runtime.model.request_options(opts))
        m.generate({"text": "Hello there."}, **opts)
        m.generate({"text": "Hello there."}, max_tokens=80, seed=5)  # Orpheus' default sampling
    greedy, sampled = ([t for t, _ in run] for run in seen.values())
    ids = prompt["prompt_ids"][None]
    common = {"attention_mask": torch.ones_like(ids), "max_new_tokens": 40, "do_sample": False,
              "repetition_penalty": 1.3, "eos_token_id": tokens.end_of_speech, "pad_token_id": 0}
    full = hf.generate(ids, **common)[0, ids.shape[1]:].tolist()
    assert not set(full) <= _speakable(tokens), "the full head should say unspeakable ids here"
    masked = hf.generate(ids, suppress_tokens=unspeakable, **common)[0, ids.shape[1]:].tolist()
    assert greedy == masked
    assert len(sampled) > 10 and set(sampled) <= _speakable(tokens)


@pytest.fixture(scope="module")
def off_place_checkpoint(tmp_path_factory):
    """The tiny checkpoint with the head rows of frame place 3 scaled up 50x: greedy over every audio id
    then says place-3 tokens where other places belong."""
    path = tmp_path_factory.mktemp("orpheus_off_place")
    hf, tokens, kwargs = make_checkpoint(path)
    first = tokens.audio_offset + 3 * tokens.codebook_size
    with torch.no_grad():
        hf.lm_head.weight[first:first + tokens.codebook_size] *= 50.0
    hf.save_pretrained(path)
    return path, hf, tokens, kwargs


def _place_processor(tokens, vocab):
    """A transformers logits processor holding each row to `tokens.place_windows` (and end of speech)."""
    import transformers

    windows, lo = tokens.place_windows(vocab), tokens.end_of_speech

    class PlaceWindows(transformers.LogitsProcessor):
        def __call__(self, input_ids, scores):
            start = windows.starts[input_ids[:, -1]].long()[:, None] + lo
            cols = torch.arange(scores.shape[1])
            keep = ((cols >= start) & (cols < start + windows.width)) | (cols == tokens.end_of_speech)
            return scores.masked_fill(~keep, -math.inf)

    return transformers.LogitsProcessorList([PlaceWindows()])


@pytest.mark.parametrize("frame_places", [True, False])
def test_greedy_tokens_keep_to_frame_places_as_transformers_with_the_same_mask(off_place_checkpoint, frame_places):
    """Frame-place logits (on by default) equal transformers' greedy under a processor that masks each
    step to the next place's codes; off, the span's greedy says off-place tokens the vocoder loses."""
    path, hf, tokens, kwargs = off_place_checkpoint
    opts = {"temperature": 0.0, "repetition_penalty": 1.3, "max_tokens": 30, "voice": "zoe"}
    config = yaml_config("orpheus", model_kwargs={**kwargs, "frame_place_logits": frame_places})
    with MStar("orpheus", config=config, model_path=str(path)) as m:
        seen = _record_lm(m)
        prompt = m.processor.inputs({"text": "Hello there."}, m.runtime.model.request_options(opts))
        result = m.generate({"text": "Hello there."}, **opts)
    (made,) = seen.values()
    ours = [t for t, _ in made]
    ids = prompt["prompt_ids"][None]
    common = {"attention_mask": torch.ones_like(ids), "max_new_tokens": 30, "do_sample": False,
              "repetition_penalty": 1.3, "eos_token_id": tokens.end_of_speech, "pad_token_id": 0}
    placed = hf.generate(ids, logits_processor=_place_processor(tokens, hf.config.vocab_size),
                         **common)[0, ids.shape[1]:].tolist()
    kept = []
    for t in ours:
        if accept_audio_token(tokens, torch.tensor([t]), len(kept)):
            kept.append(t)
    if frame_places:
        assert ours == placed and kept == ours and len(ours) == 30
        assert sum(a.size for a in result.outputs["audio"]) == 30 // 7 * 2048
    else:
        unspeakable = [i for i in range(hf.config.vocab_size) if i not in _speakable(tokens)]
        assert ours == hf.generate(ids, suppress_tokens=unspeakable, **common)[0, ids.shape[1]:].tolist()
        assert ours != placed and len(kept) < len(ours), "place 3's rows should pull the span's greedy off place"


class _FullMinusInf(CausalLMBase):
    """The span-restricted tiny LM as the engine saw it before the sampler worked over the span's columns:
    logits of the whole vocabulary, -inf outside the span (and on the markers), offset 0."""

    def __init__(self, lm):
        self.lm, self.kv_layout, self.hidden_size = lm, lm.kv_layout, lm.hidden_size
        self.logit_width = lm.lm.config.vocab_size

    def forward(self, input_ids, positions, attn):
        return self.lm.forward(input_ids, positions, attn)

    def compute_logits(self, hidden, input_ids=None, out=None):
        lo, hi = self.lm.span
        full = torch.full((hidden.shape[0], self.logit_width), -math.inf)
        full[:, lo:hi] = self.lm.compute_logits(hidden, input_ids)
        return full


def _engine_tokens(model, prompts, eos, **options):
    """Token ids per prompt from an AutoregressiveEngine over `model`, sampled tokens fed back."""
    from mstar.engines.autoregressive import AutoregressiveEngine
    from mstar.engines.base import StepItem
    from mstar.engines.kv_cache.config import KVCacheConfig

    engine = AutoregressiveEngine(model, KVCacheConfig(max_num_pages=64, page_size=16), "cpu", eos_token_ids=eos)
    made = {str(i): [] for i in range(len(prompts))}
    for rid, prompt in zip(made, prompts):
        engine.submit(StepItem(rid, "decode", "llm", {"input_ids": torch.tensor(prompt)}, options))
    while engine.has_work():
        for r in engine.step():
            assert r.error is None, r.error
            made[r.request_id].append(int(r.outputs["token"]))
            if not r.stop:
                engine.submit(StepItem(r.request_id, "decode", "llm", {"input_ids": r.outputs["token"]}, options))
    return list(made.values())


def test_compact_span_logits_give_the_tokens_of_full_minus_inf_logits():
    """The tiny Orpheus LM (span on): greedy under repetition penalty 1.3, and under min_tokens banning end
    of speech and the first greedy token, says the same ids whether the engine samples over the span's
    columns (compact logits, `logit_offset`) or over full -inf logits; Orpheus' default sampling stays in
    the span and repeats itself with a seed."""
    from mstar.models.orpheus.model import OrpheusModel

    orpheus = OrpheusModel(OrpheusModel.make_config(tiny=True))
    lm, tokens = orpheus._load_lm(torch.device("cpu")), orpheus.tokens
    full = _FullMinusInf(lm)
    prompts = [tokens.prompt_ids(list(range(5 + i, 12 + 2 * i))) for i in range(3)]
    greedy = {"temperature": 0.0, "repetition_penalty": 1.3, "max_tokens": 30}
    first = _engine_tokens(full, prompts, (tokens.end_of_speech,), **greedy)
    assert first == _engine_tokens(lm, prompts, (tokens.end_of_speech,), **greedy)
    eos = (tokens.end_of_speech, first[0][0])
    banned = {**greedy, "min_tokens": 20}
    got = _engine_tokens(lm, prompts, eos, **banned)
    assert got == _engine_tokens(full, prompts, eos, **banned) and got[0][0] != first[0][0]
    sampled = {"temperature": 0.6, "top_p": 0.8, "repetition_penalty": 1.3, "max_tokens": 40, "seed": 9}
    runs = [_engine_tokens(lm, prompts, (tokens.end_of_speech,), **sampled) for _ in range(2)]
    assert runs[0] == runs[1] and set().union(*runs[0]) <= _speakable(tokens)
    assert set().union(*first, *got) <= _speakable(tokens)


def test_offline_logprobs_and_grammars_are_refused_as_over_http():
    """Orpheus takes the sampling options by name, but its LM's tokens reach no client as text: the offline
    API ran logprobs=2 and returned audio alone, as if asked nothing."""
    from mstar.models.base import OptionError

    with MStar("orpheus", config=yaml_config("orpheus"), tiny=True) as m:
        with pytest.raises(OptionError, match="model 'orpheus' does not return logprobs") as info:
            m.submit({"text": "hi"}, max_tokens=8, logprobs=2)
        assert info.value.option == "logprobs"
        with pytest.raises(OptionError, match="does not constrain its output to a grammar") as info:
            m.submit({"text": "hi"}, max_tokens=8, structured_outputs='{"type": "object"}')
        assert info.value.option == "structured_outputs"
        assert m.generate({"text": "hi"}, max_tokens=8, seed=1).finish_reason in ("stop", "length")  # still serves
