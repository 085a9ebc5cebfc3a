"""Decode on CUDA: graph replay equals eager token for token; greedy parity with transformers; fused kernels."""

from __future__ import annotations

import pytest
import torch

from mstar.config import CudaGraphConfig, KVCacheConfig
from mstar.engines.autoregressive.engine import AutoregressiveEngine
from mstar.engines.base import LoopSpec, StepItem
from mstar.layers.fused import fused_kernels
from mstar.models.llama.weights import load_model
from tests.models.llama_testing import DenseAttention, save_hf_model

DEVICE = torch.device("cuda")


def engine_for(model, graphs: bool, backend: str = "triton", max_batch: int = 8, pages: int = 256,
               max_model_len: int = 512, prefill_tokens: list[int] | None = None,
               max_batch_tokens: int | None = None) -> AutoregressiveEngine:
    kv = KVCacheConfig(max_num_pages=pages, page_size=16, attention_backend=backend)
    extra = {} if max_batch_tokens is None else {"max_batch_tokens": max_batch_tokens}
    return AutoregressiveEngine(model, kv, DEVICE, max_num_seqs=max_batch, max_model_len=max_model_len,
                                cuda_graphs=CudaGraphConfig(enabled=graphs, max_batch_size=max_batch,
                                                            prefill_tokens=prefill_tokens or []), **extra)


def generate(engine: AutoregressiveEngine, prompts: list[list[int]], max_tokens: list[int],
             options: list[dict] | None = None) -> list[list[int]]:
    """Tokens per prompt (greedy unless `options` say otherwise), all submitted at once."""
    opts = [{"temperature": 0.0, **(options[i] if options else {}), "max_tokens": n} for i, n in enumerate(max_tokens)]
    return generate_staggered(engine, prompts, opts, [0] * len(prompts))


def graphed_draws(engine: AutoregressiveEngine) -> int:
    """Steps drawn by sampler graphs: alone or inside a step graph (with the next forward)."""
    assert engine.sampler is not None
    return engine.sampler.replays + (engine.step_graphs.replays if engine.step_graphs is not None else 0)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    hf = save_hf_model("llama3", path)
    return path, hf


def prompts_of(lengths: list[int], vocab: int = 256) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def test_graph_replay_equals_eager(checkpoint):
    model = load_model(checkpoint[0], dtype=torch.bfloat16, device=DEVICE)
    # 5 sequences (padded to the graph of 8) of different lengths that finish at different steps,
    # so the batch shrinks through the captured sizes 8 -> 4 -> 2 -> 1.
    prompts, budgets = prompts_of([3, 17, 40, 9, 64]), [40, 33, 20, 7, 50]
    graphed = engine_for(model, graphs=True)
    assert graphed.runner.graphs is not None and graphed.runner.graphs.sizes == [1, 2, 4, 8]
    eager = engine_for(model, graphs=False)
    assert eager.runner.graphs is None
    assert generate(graphed, prompts, budgets) == generate(eager, prompts, budgets)


def test_graph_replay_equals_eager_under_preemption(checkpoint):
    """A pool too small for all sequences: preempted ones come back with new page lists, in other
    rows of the batch; the staged block tables (rewritten only where pages changed) must follow."""
    model = load_model(checkpoint[0], dtype=torch.bfloat16, device=DEVICE)
    prompts, budgets = prompts_of([3, 17, 40, 9, 64, 20]), [120, 100, 90, 110, 80, 100]
    graphed = engine_for(model, graphs=True, pages=20, max_model_len=256)
    got = generate(graphed, prompts, budgets)
    assert graphed.batch_scheduler.num_preemptions > 0
    eager = engine_for(model, graphs=False, pages=20, max_model_len=256)  # the same preemptions, eagerly
    assert got == generate(eager, prompts, budgets)


def test_sampling_graphs_equal_eager_sampling(checkpoint):
    """Rows whose draw does not depend on the noise (a repetition-penalised argmax, top_k 1 at a
    temperature) get the same tokens from the sampling graphs as from eager `sample`."""
    model = load_model(checkpoint[0], dtype=torch.bfloat16, device=DEVICE)
    prompts, budgets = prompts_of([5, 30, 12]), [30, 25, 18]
    options = [{"repetition_penalty": 1.3}, {"temperature": 0.8, "top_k": 1, "repetition_penalty": 1.1},
               {"temperature": 1.2, "top_k": 1, "top_p": 0.5}]
    graphed = engine_for(model, graphs=True)
    assert graphed.sampler is not None
    before = graphed_draws(graphed)  # the warm-up's sampled batch already replays them
    got = generate(graphed, prompts, budgets, options)
    assert graphed_draws(graphed) - before >= max(budgets) - 1
    eager = engine_for(model, graphs=False)
    assert eager.sampler is None
    assert got == generate(eager, prompts, budgets, options)


def generate_staggered(engine: AutoregressiveEngine, prompts: list[list[int]], options: list[dict],
                       join_at: list[int]) -> list[list[int]]:
    """`generate` with request i submitted at step join_at[i] (sequences join a running batch), each an
    engine loop as a decode walk runs it."""
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    opts = [{"ignore_eos": True, **o} for o in options]
    step = 0
    while step <= max(join_at) or engine.has_work():
        for i, at in enumerate(join_at):
            if at == step:
                engine.submit(StepItem(f"r{i}", "w", "llm", {"input_ids": torch.tensor(prompts[i])}, opts[i],
                                       loop=LoopSpec(10_000)))
        for r in engine.step():
            assert r.error is None, r.error
            out[r.request_id].append(int(r.outputs["token"]))
        step += 1
    return [out[f"r{i}"] for i in range(len(prompts))]


def test_packed_decode_inputs_with_joins_penalties_and_preemption_equal_eager(checkpoint):
    """Every decode input goes in one packed copy shared with the backend, the sampler graphs mark seen
    tokens inside the replay: with sequences joining mid-run, leaving, growing pages, preempted, and
    repetition-penalised greedy draws (noise-free), the tokens equal the eager engine's."""
    model = load_model(checkpoint[0], dtype=torch.bfloat16, device=DEVICE)
    prompts = prompts_of([5, 30, 12, 3, 44, 17, 8])
    options = [{"temperature": 0.0, "repetition_penalty": 1.2 + 0.05 * i, "max_tokens": 40 + 9 * i}
               for i in range(len(prompts))]
    join_at = [0, 0, 3, 10, 11, 25, 40]
    graphed = engine_for(model, graphs=True, pages=18, max_model_len=256)
    runner = graphed.runner
    assert runner._shared_attn is runner.attn and runner._decode is not None
    assert runner.graphs._shared[0] is runner._decode.ids and runner.graphs._shared[1] is runner._decode.positions
    replays = graphed_draws(graphed)
    got = generate_staggered(graphed, prompts, options, join_at)
    assert graphed.batch_scheduler.num_preemptions > 0 and graphed.lookahead_steps > 0
    assert graphed_draws(graphed) - replays > 100
    eager = engine_for(model, graphs=False, pages=18, max_model_len=256)
    assert got == generate_staggered(eager, prompts, options, join_at)


def test_prefill_graphs_equal_eager(checkpoint):
    """Steps with prompt tokens replayed from prefill graphs (chunked prompts, mixed with decode rows,
    sequences joining a running batch, padded token buckets): the eager engine's greedy tokens, and
    every such step replayed a graph."""
    model = load_model(checkpoint[0], dtype=torch.bfloat16, device=DEVICE)
    prompts = prompts_of([5, 30, 12, 3, 44, 17, 8])
    options = [{"temperature": 0.0, "repetition_penalty": 1.1, "max_tokens": 20 + 3 * i} for i in range(len(prompts))]
    join_at = [0, 0, 3, 10, 11, 25, 40]
    graphed = engine_for(model, graphs=True, prefill_tokens=[16, 32, 64], max_batch_tokens=64)
    prefill = graphed.runner.prefill_graphs
    assert prefill is not None and prefill.tokens == [16, 32, 64]
    eager_steps = []
    forward = graphed.runner._eager
    graphed.runner._eager = lambda *a: eager_steps.append(a[0].shape[0]) or forward(*a)
    got = generate_staggered(graphed, prompts, options, join_at)
    assert prefill.replays >= 5 and eager_steps == [], (prefill.replays, eager_steps)
    eager = engine_for(model, graphs=False, max_batch_tokens=64)
    assert got == generate_staggered(eager, prompts, options, join_at)


def test_greedy_parity_with_transformers_on_gpu(checkpoint):
    path, hf = checkpoint
    hf = hf.to(DEVICE)
    model = load_model(path, dtype=torch.float32, device=DEVICE)
    engine = engine_for(model, graphs=True)
    prompts = prompts_of([5, 12, 30])
    ours = generate(engine, prompts, [24, 24, 24])
    for p, got in zip(prompts, ours):
        ids = torch.tensor([p], device=DEVICE)
        with torch.inference_mode():
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, min_new_tokens=24,
                              do_sample=False, pad_token_id=0)
        assert got == ref[0, len(p):].tolist()


def test_fused_layers_match_pytorch_on_gpu(checkpoint):
    """float32: the same greedy tokens; bfloat16: logits within rounding (reduction order differs)."""
    model = load_model(checkpoint[0], dtype=torch.float32, device=DEVICE)
    prompts = prompts_of([11, 30])
    fused = generate(engine_for(model, graphs=False, backend="sdpa"), prompts, [16, 16])
    with fused_kernels(False):
        reference = generate(engine_for(model, graphs=False, backend="sdpa"), prompts, [16, 16])
    assert fused == reference

    model = load_model(checkpoint[0], dtype=torch.bfloat16, device=DEVICE)
    ids = torch.tensor(prompts[1], device=DEVICE)
    logits = {}
    for enabled in (True, False):
        with fused_kernels(enabled), torch.inference_mode():
            hidden = model.forward(ids, torch.arange(len(ids), device=DEVICE), DenseAttention())
            logits[enabled] = model.compute_logits(hidden)
    scale = logits[False].abs().max().item()
    assert (logits[True] - logits[False]).abs().max().item() < 0.03 * scale
    agree = (logits[True].argmax(-1) == logits[False].argmax(-1)).float().mean().item()
    assert agree >= 0.9, agree  # near-ties may flip in bf16; most positions must not
