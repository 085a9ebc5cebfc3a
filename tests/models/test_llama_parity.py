"""Parity of the dense decoder family with transformers on tiny random checkpoints (CPU, fp32)."""

from __future__ import annotations

import math

import pytest
import torch

from mstar.engines.base import KVLayout
from mstar.models.llama.weights import load_model
from tests.models.llama_testing import DenseAttention, greedy, save_hf_model

MODELS = ["llama", "llama3", "qwen2", "qwen3"]
PROMPT = [5, 17, 99, 3, 42, 250, 8, 77, 13, 64, 200, 31]


@pytest.fixture(scope="module", params=MODELS)
def pair(request, tmp_path_factory):
    """(transformers model, our model loaded from its save_pretrained folder)."""
    path = tmp_path_factory.mktemp(request.param)
    hf = save_hf_model(request.param, path)
    ours = load_model(path, dtype=torch.float32, progress=False)
    return hf, ours


@torch.no_grad()
def test_prefill_logits_match(pair):
    hf, ours = pair
    ref = hf(torch.tensor([PROMPT])).logits[0]
    hidden = ours(torch.tensor(PROMPT), torch.arange(len(PROMPT)), DenseAttention())
    logits = ours.compute_logits(hidden)
    assert logits.dtype == torch.float32 and logits.shape == ref.shape
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)


@torch.no_grad()
def test_incremental_steps_match_full_prefill(pair):
    hf, ours = pair
    ref = hf(torch.tensor([PROMPT])).logits[0]
    attn, split = DenseAttention(), 5
    first = ours(torch.tensor(PROMPT[:split]), torch.arange(split), attn)
    steps = [first] + [
        ours(torch.tensor([PROMPT[i]]), torch.tensor([i]), attn) for i in range(split, len(PROMPT))
    ]
    torch.testing.assert_close(ours.compute_logits(torch.cat(steps)), ref, atol=1e-4, rtol=1e-4)


@torch.no_grad()
def test_packed_sequences_match_separate_runs(pair):
    """Two requests packed along T (one prefill, one decode step) give their own logits."""
    _, ours = pair
    attn = DenseAttention()
    a, b = PROMPT[:7], PROMPT[3:]
    ours(torch.tensor(b[:-1]), torch.arange(len(b) - 1), attn)  # b's earlier steps, cached as "b"
    attn.cache["b"] = attn.cache.pop("seq")
    attn.prepare(["a", "b"], [len(a), 1])
    ids = torch.tensor(a + b[-1:])
    positions = torch.cat([torch.arange(len(a)), torch.tensor([len(b) - 1])])
    packed = ours.compute_logits(ours(ids, positions, attn))
    alone_a = ours.compute_logits(ours(torch.tensor(a), torch.arange(len(a)), DenseAttention()))
    alone_b = ours.compute_logits(ours(torch.tensor(b), torch.arange(len(b)), DenseAttention()))
    torch.testing.assert_close(packed[: len(a)], alone_a, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(packed[-1], alone_b[-1], atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_greedy_generation_matches_transformers(pair):
    hf, ours = pair
    hf.generation_config.eos_token_id = None  # always 48 tokens, no eos suppression either
    out = hf.generate(torch.tensor([PROMPT]), max_new_tokens=48, do_sample=False, pad_token_id=0)
    expected = out[0, len(PROMPT) :].tolist()
    assert len(expected) == 48 and len(set(expected)) > 10  # a varied sequence, not one repeated token
    assert greedy(ours, PROMPT, 48) == expected


def test_kv_layout_matches_config(pair):
    hf, ours = pair
    cfg = hf.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    assert ours.kv_layout == KVLayout(cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim, torch.float32)


@torch.no_grad()
def test_sharded_checkpoint_loads(tmp_path):
    hf = save_hf_model("qwen3", tmp_path, seed=1, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    ours = load_model(str(tmp_path), dtype=torch.float32, progress=False)
    ref = hf(torch.tensor([PROMPT])).logits[0]
    logits = ours.compute_logits(ours(torch.tensor(PROMPT), torch.arange(len(PROMPT)), DenseAttention()))
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)


@torch.no_grad()
def test_span_head_logits_are_the_full_heads_on_the_span(pair):
    """Orpheus' `SpanHeadLM` over the Llama decoder: compact float32 logits [N, hi - lo] (`logit_offset`
    lo, `logit_width` hi - lo) whose columns are the full head's span, the blocked ones -inf."""
    from mstar.models.orpheus.head import SpanHeadLM

    hf, ours = pair
    hidden = ours(torch.tensor(PROMPT), torch.arange(len(PROMPT)), DenseAttention())
    full = ours.compute_logits(hidden)
    vocab = full.shape[1]
    assert (ours.logit_offset, ours.logit_width) == (0, vocab)
    lo, hi, blocked = 40, vocab - 30, (41, 48)
    head = SpanHeadLM(ours, (lo, hi), blocked=blocked)
    assert torch.equal(head(torch.tensor(PROMPT), torch.arange(len(PROMPT)), DenseAttention()), hidden)
    got = head.compute_logits(hidden)
    assert got.dtype == torch.float32 and got.shape == (full.shape[0], hi - lo)
    assert (head.logit_offset, head.logit_width) == (lo, hi - lo)
    kept = torch.ones(hi - lo, dtype=torch.bool)
    kept[blocked[0] - lo:blocked[1] - lo] = False
    torch.testing.assert_close(got[:, kept], full[:, lo:hi][:, kept], atol=1e-5, rtol=1e-5)
    assert bool((got[:, ~kept] == -math.inf).all())
    whole = SpanHeadLM(ours, (0, vocab))  # the whole vocabulary as a span: the full head's logits
    torch.testing.assert_close(whole.compute_logits(hidden), full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("span, blocked, message", [
    ((-1, 10), None, "span=\\(-1, 10\\)"), ((10, 10), None, "non-empty"), ((0, 10**6), None, "vocabulary"),
    ((10, 20), (5, 12), "inside span"), ((10, 20), (15, 15), "non-empty"), ((10, 20), (15, 21), "inside span"),
])
def test_span_head_rejects_bad_ranges(pair, span, blocked, message):
    from mstar.models.orpheus.head import SpanHeadLM

    _, ours = pair
    with pytest.raises(ValueError, match=message):
        SpanHeadLM(ours, span, blocked=blocked)
