"""Prefill/decode disaggregation on one GPU, two worker processes (mstar/configs/llama_pd.yaml): the decode
worker takes the prefilled KV pages (by CUDA IPC: they never leave the device) and gives the tokens of one worker
on the same GPU, computing no prompt token."""

from __future__ import annotations

import dataclasses

from mstar.config import config_from_dict, load_config
from mstar.runtime.offline import MStar
from tests.models.llm_runtime_testing import PROMPTS, make_checkpoint, token_ids
from tests.models.test_pd_kv_transfer import _gauges

KV = {"max_num_pages": 512, "page_size": 16}  # two processes share the card: a small pool each


def test_pd_on_one_gpu_matches_one_worker(tmp_path):
    make_checkpoint("llama", tmp_path)
    options = {"temperature": 0.0, "ignore_eos": True, "max_tokens": 24}
    long = "The quick brown fox jumps over the lazy dog again and again, " * 4
    prompts = [*PROMPTS[:4], long, long]
    one_cfg = config_from_dict({"model": "llama", "device": "cuda", "kv_cache": KV})
    with MStar("llama", config=one_cfg, mode="multiproc", model_path=str(tmp_path)) as one:
        want = [token_ids(one.submit({"text": p}, **options)) for p in prompts]
    base = load_config("llama_pd")
    cfg = dataclasses.replace(base, device="cuda", kv_cache=dataclasses.replace(base.kv_cache, **KV))
    with MStar("llama", config=cfg, mode="multiproc", model_path=str(tmp_path)) as split:
        got = [token_ids(split.submit({"text": p}, **options)) for p in prompts]
        stats = _gauges(split, "llm", lambda s: s.get(1, {}).get("kv_pages_reused", 0) > 0)
    assert got == want
    assert stats[1]["prompt_tokens"] == 0 and stats[1]["kv_pages_received"] > 0 and stats[1]["kv_pages_reused"] > 0
