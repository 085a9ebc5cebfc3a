"""Prefill/decode disaggregation's layer-by-layer KV stream in one process (two workers, mstar/configs/llama_pd.yaml):
a request cancelled while its K/V stream leaves every page free on both workers; a decode worker that declines a
text prompt recomputes it with the same greedy tokens; media prompts (tiny Qwen3-Omni, slow) whose decode pool
holds one at a time wait for its pages and give one worker's tokens, and one the decode worker declines fails
alone with a message naming the pool."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest

from mstar.config import load_config
from mstar.engines.autoregressive import AutoregressiveEngine, kv_transfer
from mstar.runtime.offline import MStar, RequestFailed
from mstar.worker import kv_moves
from tests.models.llm_runtime_testing import PROMPTS, hf_greedy, make_checkpoint, token_ids

GREEDY = {"temperature": 0.0, "ignore_eos": True, "max_tokens": 8}


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    hf, tok = make_checkpoint("llama", path)
    return path, hf, tok


def _split(path) -> MStar:
    return MStar("llama", config=dataclasses.replace(load_config("llama_pd"), device="cpu"), model_path=str(path))


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


def _decline(self, rid, kv_slot, offer, granted) -> bool:
    return False


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


def _omni_pd(thinker_pages: int | None = None):
    from mstar.config import config_from_dict
    from tests.models.test_pd_kv_transfer import OMNI_PD

    if thinker_pages is None:
        return config_from_dict(OMNI_PD)
    kwargs = {**OMNI_PD["model_kwargs"], "max_model_len": thinker_pages * 16}
    return config_from_dict({**OMNI_PD, "model_kwargs": kwargs, "engines": {"thinker": {"max_num_pages": thinker_pages}}})


OMNI_TEXT = {"temperature": 0.0, "max_tokens": 6, "modalities": ["text"]}


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
def test_media_prompts_wait_for_the_decode_workers_pages_and_give_one_workers_tokens(monkeypatch):
    from tests.models.qwen3_omni_testing import media_chat_request

    one = {"model": "qwen3_omni", "device": "cpu", "model_kwargs": {"code2wav_chunk": 4}}
    with MStar("qwen3_omni", config=one, tiny=True) as m:
        want = m.generate(media_chat_request(), **OMNI_TEXT).outputs["text"]
    queued, reserve = [], kv_transfer.KVStreams.reserve

    def noting_the_queue(self, key, offer, granted):
        taken = reserve(self, key, offer, granted)
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
