"""Prefill/decode disaggregation with KV transfer, over two CPU worker processes: the decode worker takes
the prefilled K/V (streamed layer by layer: KVOffer / KVAccept / KVLayer / KVEnd) instead of recomputing the
prompt, gives the greedy tokens of one worker, and computes no prompt token (its engine's `prompt_tokens` stat
stays 0); pages its prefix cache already holds are not sent again."""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest

from mstar.config import config_from_dict, load_config
from mstar.runtime.offline import MStar
from tests.models.llm_runtime_testing import PROMPTS, hf_greedy, make_checkpoint, token_ids
from tests.models.qwen3_omni_testing import media_chat_request


def _gauges(m: MStar, component: str, until, timeout_s: float = 15.0) -> dict[int, dict[str, float]]:
    """rank -> the engine stats of `component` the workers last reported, once `until(them)` holds (workers
    report about twice a second)."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = {rank: c.gauges for rank, ws in m.runtime.conductor.worker_stats().items()
                 for c in ws.components if c.component == component}
        if until(stats) or time.monotonic() > deadline:
            return stats
        time.sleep(0.1)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    hf, tok = make_checkpoint("llama", path)
    return path, hf, tok


def test_llama_decode_worker_takes_the_kv_and_prefills_nothing(llama):
    path, hf, tok = llama
    prompts = PROMPTS[:4]
    long = "The quick brown fox jumps over the lazy dog again and again, " * 4  # > 8 pages of 16
    greedy = {"temperature": 0.0, "ignore_eos": True, "max_tokens": 12}
    cfg = dataclasses.replace(load_config("llama_pd"), device="cpu")
    with MStar("llama", config=cfg, mode="multiproc", model_path=str(path)) as split:
        handles = [split.submit({"text": p}, **greedy) for p in prompts]
        assert [token_ids(h) for h in handles] == [hf_greedy(hf, tok.encode(p), 12) for p in prompts]
        first = _gauges(split, "llm", lambda s: s.get(1, {}).get("kv_pages_received", 0) >= len(prompts)
                        and s[1]["kv_pages_received"] == s.get(0, {}).get("kv_pages_sent"))
        assert first[1]["prompt_tokens"] == 0 and first[1]["kv_pages_received"] >= len(prompts)
        assert first[0]["prompt_tokens"] == sum(len(tok.encode(p)) for p in prompts)
        assert first[0]["kv_pages_sent"] == first[1]["kv_pages_received"]
        # the same long prompt twice: the second time the decode worker's prefix cache holds its full pages
        want = hf_greedy(hf, tok.encode(long), 8)
        assert token_ids(split.submit({"text": long}, **{**greedy, "max_tokens": 8})) == want
        sent = first[0]["kv_pages_sent"] + -(-len(tok.encode(long)) // 16)
        _gauges(split, "llm", lambda s: s.get(0, {}).get("kv_pages_sent", 0) >= sent)
        assert token_ids(split.submit({"text": long}, **{**greedy, "max_tokens": 8})) == want
        after = _gauges(split, "llm", lambda s: s.get(1, {}).get("kv_pages_reused", 0) > 0
                        and s.get(0, {}).get("kv_pages_sent", 0) > sent)
    full = len(tok.encode(long)) // 16
    assert after[1]["kv_pages_reused"] == full
    assert after[0]["kv_pages_sent"] == sent + -(-len(tok.encode(long)) // 16) - full
    assert after[1]["prompt_tokens"] == 0


# Qwen3-Omni: text prefill (walk prefill) and media prefill (walk prefill_media, encoders with it) on rank 0,
# the thinker's decode and the speech components on rank 1: a media prompt's M-RoPE positions continue there
OMNI_PD = {
    "model": "qwen3_omni", "device": "cpu", "model_kwargs": {"code2wav_chunk": 4},
    "kv_cache": {"page_size": 16},
    "node_groups": [
        {"node_names": ["audio_encoder", "vision_encoder", "thinker"], "ranks": [0],
         "graph_walks": ["prefill", "prefill_media"]},
        {"node_names": ["thinker"], "ranks": [1], "graph_walks": ["decode"]},
        {"node_names": ["talker_input", "talker", "code_predictor", "code2wav"], "ranks": [1]},
    ],
}
OMNI_OPTIONS = dict(temperature=0.0, max_tokens=6, modalities=["text", "audio"],
                    **{"talker.temperature": 0.0, "talker.max_tokens": 8})




@pytest.mark.slow  # a second model over two processes; the Llama test above is the default run's representative
@pytest.mark.usefixtures("one_thread")
def test_qwen3_omni_thinker_decode_takes_the_kv_with_its_positions():
    text = {"messages": [{"role": "user", "content": "Say something."}]}
    one_cfg = {"model": "qwen3_omni", "device": "cpu", "model_kwargs": {"code2wav_chunk": 4}}
    with MStar("qwen3_omni", config=one_cfg, tiny=True) as one:
        want = [one.generate(r, **OMNI_OPTIONS) for r in (text, media_chat_request())]
    with MStar("qwen3_omni", config=config_from_dict(OMNI_PD), mode="multiproc", tiny=True) as two:
        got = [two.generate(r, **OMNI_OPTIONS) for r in (text, media_chat_request())]
        stats = _gauges(two, "thinker", lambda s: s.get(1, {}).get("kv_pages_received", 0) >= 2
                        and s[1]["kv_pages_received"] == s.get(0, {}).get("kv_pages_sent"))
    for w, g in zip(want, got):
        assert "".join(w.outputs["text"]) and g.outputs["text"] == w.outputs["text"]
        np.testing.assert_allclose(np.concatenate(g.outputs["audio"]), np.concatenate(w.outputs["audio"]), atol=1e-6)
    assert stats[1]["prompt_tokens"] == 0 and stats[1]["kv_pages_received"] >= 2
    assert stats[0]["prompt_tokens"] > 0 and stats[0]["kv_pages_sent"] == stats[1]["kv_pages_received"]
