"""Step graphs on CUDA (engines/autoregressive/step_graph.py): the pinned-memory copy kernel inside a graph,
the external event that lets the host read the drawn ids before the replay's forward ends, and decoding
through step graphs token for token equal to separate launches."""

from __future__ import annotations

import pytest
import torch

from mstar.config import CudaGraphConfig, KVCacheConfig
from mstar.engines.autoregressive.engine import AutoregressiveEngine
from mstar.kernels.host_copy import copy_words
from mstar.models.llama.weights import load_model
from tests.gpu.test_decode_graphs import generate_staggered, prompts_of
from tests.models.llama_testing import save_hf_model

DEVICE = torch.device("cuda")


def test_copy_words_between_pinned_host_and_device_inside_a_graph():
    host_in = torch.zeros(5000, dtype=torch.int32).pin_memory()
    dev = torch.zeros(5000, dtype=torch.int32, device=DEVICE)
    ids = torch.zeros(64, dtype=torch.long, device=DEVICE)
    host_out = torch.zeros(64, dtype=torch.long).pin_memory()
    graph = torch.cuda.CUDAGraph()
    copy_words([(host_in, dev)])  # compile outside the capture
    copy_words([(ids, host_out)])
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        copy_words([(host_in, dev), (host_in[:64], ids[:32].view(torch.int32))])
        ids.add_(1)
        copy_words([(ids, host_out)])
    for round_ in range(3):
        host_in.copy_(torch.randint(0, 1 << 30, (5000,), dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(dev.cpu(), host_in), round_
        want = host_in[:64].view(torch.long)
        assert torch.equal(host_out[:32], want + 1), round_


def test_external_event_fires_mid_graph():
    """The host waits for the event recorded after the copy out, and reads the ids while the kernel
    captured after it still runs (a long sleep)."""
    ids = torch.arange(8, dtype=torch.long, device=DEVICE)
    host_out = torch.zeros(8, dtype=torch.long).pin_memory()
    drawn, done = torch.cuda.Event(external=True), torch.cuda.Event()
    copy_words([(ids, host_out)])
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ids.add_(10)
        copy_words([(ids, host_out)])
        drawn.record()
        torch.cuda._sleep(200_000_000)  # ~0.1 s at H200 clocks
    graph.replay()
    done.record()
    drawn.synchronize()
    assert not done.query(), "the event waited for the whole graph"
    assert host_out.tolist() == list(range(10, 18))
    done.synchronize()


def test_external_event_on_a_branch_fires_while_the_main_line_runs():
    """As a step graph captures it: the ids copied out and the event recorded on a side stream forked after
    the draw and joined at the end, while the main line runs on (a long sleep); the host reads the ids
    before the graph ends, every replay."""
    ids = torch.arange(8, dtype=torch.long, device=DEVICE)
    host_out = torch.zeros(8, dtype=torch.long).pin_memory()
    drawn, done = torch.cuda.Event(external=True), torch.cuda.Event()
    side = torch.cuda.Stream()
    copy_words([(ids, host_out)])
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        main = torch.cuda.current_stream()
        ids.add_(10)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            copy_words([(ids, host_out)])
            drawn.record()
        torch.cuda._sleep(200_000_000)  # ~0.1 s at H200 clocks
        main.wait_stream(side)
    for round_ in range(2):
        graph.replay()
        done.record()
        drawn.synchronize()
        assert not done.query(), f"the event waited for the whole graph (replay {round_})"
        assert host_out.tolist() == list(range(10 * (round_ + 1), 10 * (round_ + 1) + 8))
        done.synchronize()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    save_hf_model("llama3", path)
    return path


def engine_for(model, step_graphs: bool) -> AutoregressiveEngine:
    kv = KVCacheConfig(max_num_pages=20, page_size=16, attention_backend="triton")
    return AutoregressiveEngine(model, kv, DEVICE, max_num_seqs=8, max_model_len=256,
                                cuda_graphs=CudaGraphConfig(max_batch_size=8, step_graphs=step_graphs))


def test_step_graphs_equal_separate_launches(checkpoint):
    """Noise-free draws (greedy, repetition-penalised greedy, top_k 1 at a temperature: both graph sets)
    with joins, stops on length and preemption (a small pool): the same tokens with step graphs as with
    the sampler and decode graphs launched separately."""
    model = load_model(checkpoint, dtype=torch.bfloat16, device=DEVICE)
    prompts = prompts_of([5, 30, 12, 3, 44, 17, 8])
    options = [{"temperature": 0.0, "max_tokens": 60}, {"temperature": 0.0, "repetition_penalty": 1.3, "max_tokens": 90},
               {"temperature": 0.9, "top_k": 1, "max_tokens": 75}, {"temperature": 0.0, "max_tokens": 40},
               {"temperature": 1.1, "top_k": 1, "repetition_penalty": 1.2, "max_tokens": 100},
               {"temperature": 0.0, "max_tokens": 55}, {"temperature": 0.7, "top_k": 1, "max_tokens": 80}]
    join_at = [0, 0, 3, 7, 7, 20, 41]
    fused = engine_for(model, step_graphs=True)
    assert fused.step_graphs is not None
    before = fused.step_graphs.replays  # the warm-up's
    got = generate_staggered(fused, prompts, options, join_at)
    separate = engine_for(model, step_graphs=False)
    assert separate.step_graphs is None
    assert got == generate_staggered(separate, prompts, options, join_at)
    assert fused.step_graphs.replays - before > 100
    assert fused.batch_scheduler.num_preemptions > 0
