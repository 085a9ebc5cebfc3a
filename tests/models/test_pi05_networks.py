"""Pi0.5's networks at tiny size on CPU, float32, loaded from a lerobot-named folder written from
transformers' PI0 (#39): SigLIP and the projector, the Gemma prefix's keys and values, and the expert
attending them against PI0; the adaptive norms, time condition and flow against the plain Pi0.5."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mstar.engines.base import StepItem
from mstar.models.pi05.components import PolicyComponent
from mstar.models.pi05.network import PolicyNet, euler_step, flow_time
from mstar.models.pi05.prefix_kv import PrefixKVPool
from mstar.models.pi05.tiny import tiny_config
from mstar.models.pi05.weights import load_part
from tests.models.pi05_reference import (
    adaptive_expert_norms,
    lerobot_state_dict,
    plain_sample_actions,
    tiny_pi0,
    write_folder,
)

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py
TOL = 1e-4
CONFIG = tiny_config()


@pytest.fixture(scope="module")
def pi0():
    return tiny_pi0(CONFIG)


@pytest.fixture(scope="module")
def folder(pi0, tmp_path_factory) -> Path:
    return write_folder(lerobot_state_dict(pi0), tmp_path_factory.mktemp("pi05_shared"))


@pytest.fixture(scope="module")
def parts(folder: Path):
    return load_part(folder, CONFIG, "vision"), load_part(folder, CONFIG, "policy")


def _images(count: int, seed: int) -> torch.Tensor:
    side = CONFIG.vision.image_size
    return torch.rand(count, 3, side, side, generator=torch.Generator().manual_seed(seed)) * 2 - 1


def _prompts() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(0, CONFIG.vocab_size, (n,), generator=gen) for n in (9, 4)]


def test_vision_matches_siglip_and_projector(pi0, parts) -> None:
    images = _images(3, 1)
    with torch.no_grad():
        expected = pi0.model.vlm.get_image_features(images).pooler_output
        got = parts[0](images)
    assert got.shape == expected.shape == (3, CONFIG.vision.tokens, CONFIG.llm.width)
    torch.testing.assert_close(got, expected, atol=TOL, rtol=0)
    assert expected.abs().mean() > 0.1


def _prefix_cache(pi0, images: torch.Tensor, prompts: list[torch.Tensor]):
    """PI0's prefix (two cameras a robot, right-padded prompts) and its KV cache."""
    tokens = CONFIG.vision.tokens
    width = 2 * tokens + max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, :2 * tokens] = CONFIG.vocab_size  # the image token
        ids[row, 2 * tokens:2 * tokens + len(p)] = p
        mask[row, :2 * tokens + len(p)] = 1
    pixels = images.view(len(prompts), 2, *images.shape[1:])
    with torch.no_grad():
        embeds = pi0.model.embed_prefix(ids, pixels, torch.ones(len(prompts), 2, dtype=torch.bool))
        cache = pi0.model.vlm(inputs_embeds=embeds, attention_mask=mask, position_ids=mask.cumsum(-1) - 1,
                              token_type_ids=torch.zeros_like(mask), use_cache=True).past_key_values
    return embeds, mask, cache


def _our_prefix(parts, images, prompts, pool: PrefixKVPool, rids: list[str]):
    """The policy component's prefix node over the tower's tokens (writes `pool`): the padded prefixes and
    which of their rows are real."""
    vision, policy = parts
    with torch.no_grad():
        tokens = list(vision(images).view(len(prompts), -1, CONFIG.llm.width))
        PolicyComponent(policy, pool).run_items([StepItem(rid, "prefix", "prefix", {"image_tokens": t, "prompt_ids": p})
                                                 for rid, t, p in zip(rids, tokens, prompts, strict=True)])
        lengths = torch.tensor([len(t) + len(p) for t, p in zip(tokens, prompts, strict=True)])
        prefixes = policy.prefix_embeddings(tokens, prompts, int(lengths.max()), len(prompts))
    return prefixes, torch.arange(prefixes.shape[1])[None, :] < lengths[:, None]


def _pool(pages: int = 64) -> PrefixKVPool:
    llm = CONFIG.llm
    return PrefixKVPool(llm.depth, llm.num_kv_heads, llm.head_dim, pages, 16, torch.float32, "cpu")


def test_prefix_keys_and_values_match_paligemma(pi0, parts) -> None:
    images, prompts = _images(4, 2), _prompts()
    embeds, mask, cache = _prefix_cache(pi0, images, prompts)
    pool = _pool()
    prefixes, valid = _our_prefix(parts, images, prompts, pool, ["a", "b"])
    torch.testing.assert_close(prefixes[valid], embeds[mask.bool()], atol=TOL, rtol=0)
    view = pool.view(["a", "b"])
    for layer in range(CONFIG.llm.depth):
        keys, values = view.layer(layer)
        for row in range(2):
            n = int(mask[row].sum())
            torch.testing.assert_close(keys[row, :n], cache.layers[layer].keys[row, :, :n].transpose(0, 1),
                                       atol=TOL, rtol=0)
            torch.testing.assert_close(values[row, :n], cache.layers[layer].values[row, :, :n].transpose(0, 1),
                                       atol=TOL, rtol=0)
    assert cache.layers[-1].keys.abs().mean() > 0.1


def test_expert_attends_the_prefix_as_pi0s(pi0, parts) -> None:
    """PI0's expert over the same prefix cache, its mask opened so action tokens see each other (Pi0.5)."""
    images, prompts = _images(4, 3), _prompts()
    _, mask, cache = _prefix_cache(pi0, images, prompts)
    pool = _pool()
    _our_prefix(parts, images, prompts, pool, ["a", "b"])
    chunk, width = CONFIG.chunk_size, CONFIG.expert.width
    x = torch.randn(2, chunk, width, generator=torch.Generator().manual_seed(4))
    lengths = mask.sum(-1)
    positions = lengths[:, None] + torch.arange(chunk)[None]
    key_mask = torch.cat([mask, torch.ones(2, chunk, dtype=torch.long)], dim=1).bool()
    with torch.no_grad():
        expected = pi0.model.dit(inputs_embeds=x, attention_mask=key_mask[:, None, None, :].expand(-1, 1, chunk, -1),
                                 position_ids=positions, past_key_values=cache).last_hidden_state
        view = pool.view(["a", "b"])
        got = parts[1].expert.hidden(x, torch.zeros(2, width), positions, view.layer, view.lengths)
    torch.testing.assert_close(got, expected, atol=TOL, rtol=0)
    assert expected.abs().mean() > 0.1


def test_whole_flow_matches_the_plain_pi05(pi0, tmp_path: Path) -> None:
    """adaRMS with a live condition, the time MLP and ten Euler steps: each robot's chunk as the plain
    policy's, with a batch of two different prefixes in one pool."""
    state = adaptive_expert_norms(lerobot_state_dict(pi0, seed=7), seed=8)
    folder = write_folder(state, tmp_path / "ckpt", prefix="")
    parts = (load_part(folder, CONFIG, "vision"), load_part(folder, CONFIG, "policy"))
    images, prompts = _images(4, 6), _prompts()
    pool = _pool()
    _our_prefix(parts, images, prompts, pool, ["a", "b"])
    noise = torch.randn(2, CONFIG.chunk_size, CONFIG.max_action_dim, generator=torch.Generator().manual_seed(9))
    policy: PolicyNet = parts[1]
    view = pool.view(["a", "b"])
    x_t = noise
    for step in range(CONFIG.num_steps):
        t = torch.full((2,), flow_time(step, CONFIG.num_steps))
        x_t = euler_step(x_t, policy.velocity(x_t, t, view.layer, view.lengths), CONFIG.num_steps)
    for row in range(2):
        expected = plain_sample_actions(state, CONFIG, images[2 * row:2 * row + 2], prompts[row], noise[row],
                                        CONFIG.num_steps)
        torch.testing.assert_close(x_t[row], expected, atol=TOL, rtol=0)
    assert (x_t - noise).abs().mean() > 0.05  # the flow moved the noise
