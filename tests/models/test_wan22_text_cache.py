"""Cross-attention K/V of a request's text, computed once and reused across its denoising steps."""

from __future__ import annotations

import time
import types

import pytest
import torch

from mstar.models.common.loading import fill_dummy_weights
from mstar.models.wan22.components import DiTComponent
from mstar.models.wan22.text_cache import TextKVCache
from mstar.models.wan22.tiny import TINY_TEXT_LENGTH, tiny_config
from mstar.models.wan22.transformer import build_transformer

pytestmark = pytest.mark.usefixtures("one_thread")


def _dit() -> torch.nn.Module:
    model = build_transformer(tiny_config().transformer, torch.float32)
    fill_dummy_weights(model, std=0.3)
    return model


def test_cache_hits_only_for_the_same_rows_and_text_objects() -> None:
    cache = TextKVCache(max_rows=3)
    a, b = torch.zeros(2), torch.zeros(2)
    cache.put([("r1", "cond"), ("r1", "uncond")], [a, b], ["kv1"])
    assert cache.get([("r1", "cond"), ("r1", "uncond")], [a, b]) == ["kv1"]
    assert cache.get([("r1", "cond"), ("r1", "uncond")], [a, b.clone()]) is None  # new text: recompute
    assert cache.get([("r1", "uncond"), ("r1", "cond")], [b, a]) is None  # another row order
    cache.put([("r2", "cond")], [a], ["kv2"])
    assert cache.rows == 3
    cache.put([("r3", "cond")], [a], ["kv3"])  # over max_rows: the least recently used entry goes
    assert cache.get([("r1", "cond"), ("r1", "uncond")], [a, b]) is None and cache.rows == 2
    cache.release("r2")
    assert cache.rows == 1 and cache.get([("r3", "cond")], [a]) == ["kv3"]
    assert (cache.hits, cache.misses) == (2, 3)
    with pytest.raises(ValueError, match="max_rows=-1"):
        TextKVCache(-1)


def test_cached_text_kv_gives_the_recomputed_velocities() -> None:
    torch.manual_seed(0)
    model = _dit()
    cached, fresh = DiTComponent(model), DiTComponent(model, text_cache_rows=0)
    gen = torch.Generator().manual_seed(1)
    contexts = [torch.randn(TINY_TEXT_LENGTH, 32, generator=gen) for _ in range(2)]
    latents = torch.randn(16, 3, 4, 6, generator=gen)
    for step in range(3):
        ts = torch.full((3,), 900.0 - 300 * step)
        items = [types.SimpleNamespace(request_id="r", node=node, walk="denoise",
                                       inputs={"latents": latents, "timestep": ts, "context": ctx})
                 for node, ctx in zip(("cond", "uncond"), contexts, strict=True)]
        got, want = cached.run_items(items), fresh.run_items(items)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g["velocity"], w["velocity"], atol=1e-6, rtol=0)
        assert not torch.equal(got[0]["velocity"], got[1]["velocity"])  # the two texts matter
    assert (cached.text_cache.hits, cached.text_cache.misses) == (2, 1) and cached.text_cache.rows == 2
    assert fresh.text_cache.rows == 0
    cached.release("r")
    assert cached.text_cache.rows == 0


def test_served_request_reuses_its_text_kv_and_releases_it() -> None:
    from mstar.runtime.offline import MStar

    with MStar("wan22", tiny=True) as m:
        m.submit({"text": "a fox"}, num_inference_steps=4, width=64, height=64, num_frames=5,
                 guidance_scale=5.0).result()
        dit = m.runtime.workers[0].engines["dit"].module
        cache = dit.text_cache
        assert cache.hits >= 3 and cache.misses <= 1  # one miss at the first step, hits after
        deadline = time.monotonic() + 5
        while cache.rows and time.monotonic() < deadline:
            time.sleep(0.01)
        assert cache.rows == 0  # released with the request


def test_removed_dit_switches_are_refused_by_name() -> None:
    """`compile`, `dit_graphs` and `vae_autotune` lost their measurements and are gone (docs/benchmarks.md): a config
    that still sets them gets the unknown-key error, not a silent no-op."""
    from mstar.config import ConfigError, config_from_dict
    from mstar.runtime.build import build_model

    for key in ("compile", "dit_graphs", "vae_autotune"):
        with pytest.raises(ConfigError, match=f"unknown key 'model_kwargs.{key}'"):
            build_model(config_from_dict({"model": "wan22", "model_kwargs": {key: True}}), tiny=True)
