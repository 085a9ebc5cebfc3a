"""Prefill on worker 0, decode on worker 1 (mstar/configs/llama_pd.yaml, multiproc): same tokens as one worker."""

from __future__ import annotations

import pytest

from mstar.config import load_config
from mstar.runtime.offline import MStar
from tests.models.llm_runtime_testing import PROMPTS, hf_greedy, make_checkpoint, token_ids


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    hf, tok = make_checkpoint("llama", path)
    return path, hf, tok


def _config(**kw):
    import dataclasses

    cfg = load_config("llama_pd")
    return dataclasses.replace(cfg, device="cpu", **kw)


# two worker processes: test_pd_kv_transfer.py serves this placement by default, and seeded decoding after a
# handoff is checked between two engines in process by tests/unit/test_ar_kv_handoff.py
@pytest.mark.slow
def test_prefill_decode_split_matches_one_worker(checkpoint):
    path, hf, tok = checkpoint
    prompts = PROMPTS[:4]
    greedy = {"temperature": 0.0, "ignore_eos": True, "max_tokens": 24}
    seeded = {"temperature": 1.0, "top_k": 50, "ignore_eos": True, "max_tokens": 16, "min_tokens": 4,
              "frequency_penalty": 0.5}
    with MStar("llama", config={"model": "llama", "device": "cpu"}, model_path=str(path)) as one:
        expected_seeded = [token_ids(one.submit({"text": p}, seed=i, **seeded)) for i, p in enumerate(prompts)]
    with MStar("llama", config=_config(), mode="multiproc", model_path=str(path)) as split:
        greedy_handles = [split.submit({"text": p}, **greedy) for p in prompts]
        seeded_handles = [split.submit({"text": p}, seed=i, **seeded) for i, p in enumerate(prompts)]
        assert [token_ids(h) for h in greedy_handles] == [hf_greedy(hf, tok.encode(p), 24) for p in prompts]
        assert [token_ids(h) for h in seeded_handles] == expected_seeded
        assert token_ids(split.submit({"text": prompts[0]}, max_tokens=1, temperature=0.0)) == \
            hf_greedy(hf, tok.encode(prompts[0]), 1)
