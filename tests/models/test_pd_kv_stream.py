"""Prefill/decode disaggregation's layer-by-layer KV stream in one process (two workers, mstar/configs/llama_pd.yaml):
a request cancelled while its K/V stream leaves every page free on both workers; a decode worker that declines a
text prompt recomputes it with the same greedy tokens; with the decode pool held full, an offer seated before
`kv_offer_timeout_s` streams (nothing recomputed) and a text prompt whose offer waits past it is declined and
recomputed; media prompts (tiny Qwen3-Omni, slow) whose decode pool holds one at a time wait for its pages and
give one worker's tokens, and one the decode worker declines (larger than its pool, or not seated by the deadline)
fails alone with a message naming the setting; nothing stays reserved on either worker."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
import torch

from mstar.config import load_config
from mstar.engines.autoregressive import AutoregressiveEngine, kv_transfer
from mstar.engines.kv_handoff import KVOffer
from mstar.runtime.offline import MStar, RequestFailed
from mstar.transport import wire
from mstar.worker import kv_moves
from tests.models.llm_runtime_testing import PROMPTS, hf_greedy, make_checkpoint, token_ids

GREEDY = {"temperature": 0.0, "ignore_eos": True, "max_tokens": 8}


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    hf, tok = make_checkpoint("llama", path)
    return path, hf, tok


def _split(path, **llm) -> MStar:
    """llama_pd on CPU; `llm`: engine settings of the llm component (both workers)."""
    config = dataclasses.replace(load_config("llama_pd"), device="cpu", engines={"llm": llm} if llm else {})
    return MStar("llama", config=config, model_path=str(path))


def _wait(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def test_cancelled_mid_stream_leaves_every_page_free(llama, monkeypatch):
    path, hf, tok = llama
    sent, cancelled = [], threading.Event()
    layer = kv_moves._Sink.layer

    def cancel_after_the_first_layer(self, *args):
        layer(self, *args)
        sent.append(args[0])
        if not cancelled.is_set():
            cancelled.set()
            split.runtime.cancel("r")  # the prefill worker's forward goes on; its later layers meet a released request

    monkeypatch.setattr(kv_moves._Sink, "layer", cancel_after_the_first_layer)
    with _split(path) as split:
        handle = split.submit({"text": PROMPTS[3]}, request_id="r", **GREEDY)
        list(handle)
        assert handle.finish.finish_reason == "cancelled" and sent[0] == 0
        workers = split.runtime.workers
        _wait(lambda: all(w.state_size() == 0 and w.engines["llm"].pool.num_used == 0 for w in workers.values()))
        assert not any(w.engines["llm"].kv.reserved or w.engines["llm"].kv.streams for w in workers.values())
        # both workers serve on: a later request streams and decodes as usual
        want = hf_greedy(hf, tok.encode(PROMPTS[0]), 8)
        assert token_ids(split.submit({"text": PROMPTS[0]}, **GREEDY)) == want


def _decline(self, rid, kv_slot, offer, granted, withdrawn) -> bool:
    return False


HOLDER = "pool-holder"  # a request id no client uses


def _hold_the_whole_pool(engine) -> None:
    """Take every page of an idle worker's `engine` for a made-up request, as a leak or long sequences would."""
    granted: list = []
    offer = KVOffer([0] * (engine.pool.num_pages * engine.pool.page_size), [])
    assert engine.reserve_kv(HOLDER, "main", offer, granted.append, granted.append) and granted == [0]
    assert engine.pool.num_free == 0


def _let_go(m: MStar, rank: int) -> None:
    """Free what `_hold_the_whole_pool` took, on the worker's own thread (as a request's release does)."""
    m.runtime._send(rank, wire.Release(HOLDER))


def _bounded(handle, seconds: float = 60.0) -> threading.Timer:
    """Cancel `handle` if it still runs after `seconds`: a wedged request fails the test instead of hanging it."""
    timer = threading.Timer(seconds, handle.cancel)
    timer.daemon = True
    timer.start()
    return timer


def _nothing_left(m: MStar, component: str) -> None:
    from mstar.engines.own_stream import OwnStreamEngine

    workers = m.runtime.workers
    engines = [w.engines[component] for w in workers.values()]
    engines = [e.engine if isinstance(e, OwnStreamEngine) else e for e in engines]  # the wrapped engines' state
    _wait(lambda: all(w.state_size() == 0 for w in workers.values()) and all(e.pool.num_used == 0 for e in engines))
    kv = [e.kv for e in engines]
    assert not any(k.queued or k.reserved or k.offered or k.streams or k.unstreamed for k in kv)


def test_an_offer_seated_before_its_deadline_streams(llama):
    path, hf, tok = llama
    prompt = tok.encode(PROMPTS[3])
    with _split(path, max_num_pages=16, kv_offer_timeout_s=30.0) as split:
        prefill, decode = (split.runtime.workers[r].engines["llm"] for r in (0, 1))
        _hold_the_whole_pool(decode)
        handle = split.submit({"text": PROMPTS[3]}, **GREEDY)
        timer = _bounded(handle)
        _wait(lambda: bool(decode.kv.queued))  # the offer waits for pages
        _let_go(split, 1)
        assert token_ids(handle) == hf_greedy(hf, prompt, 8)
        timer.cancel()
        assert decode.stats()["prompt_tokens"] == 0 and decode.stats()["kv_pages_received"] == -(-len(prompt) // 16)
        _nothing_left(split, "llm")


def test_a_text_prompt_whose_offer_waits_past_its_deadline_is_recomputed(llama):
    path, hf, tok = llama
    prompt = tok.encode(PROMPTS[3])
    with _split(path, max_num_pages=16, kv_offer_timeout_s=0.5) as split:
        prefill, decode = (split.runtime.workers[r].engines["llm"] for r in (0, 1))
        _hold_the_whole_pool(decode)
        start = time.monotonic()
        handle = split.submit({"text": PROMPTS[3]}, **GREEDY)
        # declined at the deadline: the prefill ran unstreamed, and the decode worker's recompute waits for pages
        _wait(lambda: decode.stats()["seqs_waiting"] == 1)
        assert time.monotonic() - start >= 0.5 and not decode.kv.queued and not decode.kv.reserved.keys() - {(HOLDER, "main")}
        _let_go(split, 1)
        timer = _bounded(handle)
        assert token_ids(handle) == hf_greedy(hf, prompt, 8)
        timer.cancel()
        assert decode.stats()["prompt_tokens"] == len(prompt) and decode.stats()["kv_pages_received"] == 0
        assert prefill.stats()["kv_pages_sent"] == 0
        _nothing_left(split, "llm")


def test_a_declined_text_prompt_is_recomputed_by_the_decode_worker(llama, monkeypatch):
    path, hf, tok = llama
    # the engine declines only an offer larger than its whole pool (tests/unit/test_ar_kv_handoff.py, where the
    # recompute then meets the pool's max_model_len); here the decode worker's engine declines every offer and
    # the workers take the recompute path
    monkeypatch.setattr(AutoregressiveEngine, "reserve_kv", _decline)
    with _split(path) as split:
        got = [token_ids(split.submit({"text": p}, **GREEDY)) for p in PROMPTS[:2]]
        prefill, decode = (split.runtime.workers[r].engines["llm"] for r in (0, 1))
        prompt_tokens = sum(len(tok.encode(p)) for p in PROMPTS[:2])
        assert decode.stats()["prompt_tokens"] == prompt_tokens and decode.stats()["kv_pages_received"] == 0
        assert prefill.stats()["kv_pages_sent"] == 0
    assert got == [hf_greedy(hf, tok.encode(p), 8) for p in PROMPTS[:2]]


@pytest.mark.parametrize("options", [{"max_tokens": 1}, {"max_tokens": 8, "stop_token_ids": "first"}])
def test_a_request_that_ends_at_prefill_frees_the_decode_workers_reservation(llama, options):
    path, hf, tok = llama
    with _split(path) as split:
        if options.get("stop_token_ids") == "first":  # the prefill's one token is a stop token
            options = {**options, "stop_token_ids": hf_greedy(hf, tok.encode(PROMPTS[1]), 1)}
        handle = split.submit({"text": PROMPTS[1]}, **{**GREEDY, **options})
        assert len(token_ids(handle)) == 1
        workers = split.runtime.workers
        _wait(lambda: all(w.state_size() == 0 and w.engines["llm"].pool.num_used == 0 for w in workers.values()))
        assert not any(w.engines["llm"].kv.reserved for w in workers.values())
        assert not any(split.runtime.conductor._load)  # the decode replica reserved early is let go


def _omni_pd(thinker_pages: int | None = None, **thinker):
    """OMNI_PD; `thinker_pages`: the thinker's pool (and context) on both workers; `thinker`: its other settings."""
    from mstar.config import config_from_dict
    from tests.models.test_pd_kv_transfer import OMNI_PD

    config = {**OMNI_PD, "engines": {"thinker": thinker}}
    if thinker_pages is not None:
        config["model_kwargs"] = {**OMNI_PD["model_kwargs"], "max_model_len": thinker_pages * 16}
        config["engines"]["thinker"]["max_num_pages"] = thinker_pages
    return config_from_dict(config)


OMNI_TEXT = {"temperature": 0.0, "max_tokens": 6, "modalities": ["text"]}


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
def test_media_prompts_wait_for_the_decode_workers_pages_and_give_one_workers_tokens(monkeypatch):
    from tests.models.qwen3_omni_testing import media_chat_request

    one = {"model": "qwen3_omni", "device": "cpu", "model_kwargs": {"code2wav_chunk": 4}}
    with MStar("qwen3_omni", config=one, tiny=True) as m:
        want = m.generate(media_chat_request(), **OMNI_TEXT).outputs["text"]
    queued, reserve = [], kv_transfer.KVStreams.reserve

    def noting_the_queue(self, key, offer, granted, withdrawn):
        taken = reserve(self, key, offer, granted, withdrawn)
        queued.append(len(self.queued))
        return taken

    monkeypatch.setattr(kv_transfer.KVStreams, "reserve", noting_the_queue)
    # the 81-token prompt and its 6 tokens take 6 pages of 16: the thinker's pool of 8 holds one at a time
    with MStar("qwen3_omni", config=_omni_pd(thinker_pages=8), tiny=True) as m:
        handles = [m.submit(media_chat_request(), **OMNI_TEXT) for _ in range(2)]
        got = [h.decoded().outputs["text"] for h in handles]
        decode = m.runtime.workers[1].engines["thinker"]
        stats = decode.stats()
        assert max(queued) == 1 and not decode.kv.queued  # the second offer waited for the first's pages
    assert got == [want, want]
    assert stats["prompt_tokens"] == 0 and stats["kv_pages_received"] == 12  # nothing recomputed


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
def test_a_media_prompt_the_decode_worker_declines_fails_alone_with_the_pool_to_raise(monkeypatch):
    from tests.models.qwen3_omni_testing import media_chat_request

    monkeypatch.setattr(AutoregressiveEngine, "reserve_kv", _decline)  # as for an offer larger than its pool
    with MStar("qwen3_omni", config=_omni_pd(), tiny=True) as m:
        with pytest.raises(RequestFailed, match=r"media rows or explicit positions cannot be recomputed there; "
                                                r"raise the decode worker's KV pool \(engines.<component>.max_num_pages"):
            m.generate(media_chat_request(), **OMNI_TEXT)
        text = m.generate({"messages": [{"role": "user", "content": "Say something."}]}, **OMNI_TEXT)
        assert "".join(text.outputs["text"])  # the text request after it is recomputed and served
        workers = m.runtime.workers
        _wait(lambda: all(w.state_size() == 0 and w.engines["thinker"].pool.num_used == 0 for w in workers.values()))


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
def test_a_media_prompt_whose_offer_waits_past_its_deadline_fails_alone_naming_the_setting():
    from tests.models.qwen3_omni_testing import media_chat_request

    with MStar("qwen3_omni", config=_omni_pd(thinker_pages=8, kv_offer_timeout_s=0.5), tiny=True) as m:
        decode = m.runtime.workers[1].engines["thinker"]
        _hold_the_whole_pool(decode)
        handle = m.submit(media_chat_request(), **OMNI_TEXT)
        timer = _bounded(handle)  # a request left waiting would end cancelled, with no error
        with pytest.raises(RequestFailed, match=r"needs KV pages the decode worker's pool did not free within 0.5 s "
                                                r"\(engines.<component>.kv_offer_timeout_s\), and its media rows or "
                                                r"explicit positions cannot be recomputed there; raise the decode "
                                                r"worker's KV pool"):
            handle.decoded()
        timer.cancel()
        assert not decode.kv.queued and list(decode.kv.reserved) == [(HOLDER, "main")]
        _let_go(m, 1)
        text = m.generate({"messages": [{"role": "user", "content": "Say something."}]}, **OMNI_TEXT)
        assert "".join(text.outputs["text"])  # the decode worker serves on: this one streams
        assert decode.stats()["prompt_tokens"] == 0 and decode.stats()["kv_pages_received"] > 0
        _nothing_left(m, "thinker")


def _engines_on_their_own_streams(monkeypatch) -> None:
    """Build every engine that declares `own_stream` as on a CUDA device (`KVOwnStreamEngine` where it moves
    K/V), with CUDA's stream calls stood in for (tests/unit/test_own_stream.py): it computes on the CPU."""
    from mstar.engines import own_stream
    from tests.unit.test_own_stream import fake_streams

    fake_streams(monkeypatch)
    wrap = own_stream.on_own_stream
    monkeypatch.setattr(own_stream, "on_own_stream", lambda make, device: wrap(make, torch.device("cuda", 0)))


def test_engines_on_their_own_streams_stream_as_bare_ones(llama, monkeypatch):
    from mstar.engines.own_stream import KVOwnStreamEngine

    path, hf, tok = llama
    _engines_on_their_own_streams(monkeypatch)
    with _split(path, own_stream=True) as split:
        prefill, decode = (split.runtime.workers[r].engines["llm"] for r in (0, 1))
        assert isinstance(prefill, KVOwnStreamEngine) and isinstance(decode, KVOwnStreamEngine)
        got = [token_ids(split.submit({"text": p}, **GREEDY)) for p in PROMPTS[:2]]
        stats = decode.stats()
        assert stats["prompt_tokens"] == 0 and stats["kv_pages_received"] == prefill.stats()["kv_pages_sent"] > 0
        _nothing_left(split, "llm")
    assert got == [hf_greedy(hf, tok.encode(p), 8) for p in PROMPTS[:2]]


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
def test_a_thinker_on_its_own_stream_streams_a_media_prompt(monkeypatch):
    from mstar.engines.own_stream import KVOwnStreamEngine
    from tests.models.qwen3_omni_testing import media_chat_request

    one = {"model": "qwen3_omni", "device": "cpu", "model_kwargs": {"code2wav_chunk": 4}}
    with MStar("qwen3_omni", config=one, tiny=True) as m:
        want = m.generate(media_chat_request(), **OMNI_TEXT).outputs["text"]
    _engines_on_their_own_streams(monkeypatch)  # Qwen3-Omni's thinker declares own_stream
    with MStar("qwen3_omni", config=_omni_pd(), tiny=True) as m:
        prefill, decode = (m.runtime.workers[r].engines["thinker"] for r in (0, 1))
        assert isinstance(prefill, KVOwnStreamEngine) and isinstance(decode, KVOwnStreamEngine)
        assert m.generate(media_chat_request(), **OMNI_TEXT).outputs["text"] == want
        stats = decode.stats()
        assert stats["prompt_tokens"] == 0 and stats["kv_pages_received"] == prefill.stats()["kv_pages_sent"] > 0
        _nothing_left(m, "thinker")
