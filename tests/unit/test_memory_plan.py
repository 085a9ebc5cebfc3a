"""Memory-checked placement (runtime/memory_plan.py): weight bytes counted on the meta device equal a real
build's, `mstar serve` refuses a placement that does not fit in one line before anything loads, the default
config is chosen by the GPUs' memory, the docs' table is the planner's, and an attention backend that runs
out of memory is not retried as a backend failure."""

from __future__ import annotations

import re
import socket
from pathlib import Path

import pytest
import torch
from torch import nn

from mstar.config import config_from_dict
from mstar.engines.kv_cache.config import page_bytes
from mstar.runtime import memory_plan
from mstar.runtime.build import build_model

ROOT = Path(__file__).resolve().parents[2]
GiB = 1 << 30


def _bytes(module: object) -> int:
    assert isinstance(module, nn.Module)
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])


@pytest.mark.parametrize("model,quantization", [
    ("smollm2", {}), ("orpheus", {"llm": "fp8"}), ("qwen3_omni", {}), ("bagel", {}), ("wan22", {}), ("cosmos3", {}),
    ("pi05", {}), ("vjepa2_ac", {})])
def test_weight_bytes_are_the_built_models(model, quantization):
    config = config_from_dict({"model": model, "model_kwargs": {"dtype": "bfloat16"}, "quantization": quantization})
    (plan,) = memory_plan.plan_memory(config, [64 * GiB], tiny=True)
    real = build_model(config, tiny=True)
    for need in plan.needs:
        assert need.weight_bytes == _bytes(real.build_component(need.name, torch.device("cpu")).module), need.name
    if quantization:  # FP8 weights are counted at one byte
        plain = memory_plan.plan_memory(config_from_dict({"model": model, "model_kwargs": {"dtype": "bfloat16"}}),
                                        [64 * GiB], tiny=True)[0]
        assert plan.needs[0].weight_bytes < plain.needs[0].weight_bytes


def test_kv_pools_count_the_pages_asked_for_or_one_step():
    asked = config_from_dict({"model": "smollm2", "kv_cache": {"max_num_pages": 100, "page_size": 16}})
    share = config_from_dict({"model": "smollm2", "engines": {"llm": {"max_batch_tokens": 64}}})
    bf16 = config_from_dict({"model": "smollm2", "model_kwargs": {"dtype": "bfloat16"}})  # as on CUDA
    layout = build_model(bf16, tiny=True).build_component("llm", torch.device("meta")).module.kv_layout
    (need,) = memory_plan.plan_memory(asked, [64 * GiB], tiny=True)[0].needs
    assert (need.kv_bytes, need.kv_share) == (100 * page_bytes(layout, 16), False)
    (need,) = memory_plan.plan_memory(share, [64 * GiB], tiny=True)[0].needs
    assert (need.kv_bytes, need.kv_share) == (4 * page_bytes(layout, 16), True)
    assert need.allowance_bytes == need.weight_bytes + memory_plan.SMALL_ALLOWANCE_BYTES  # a small model's


def test_a_stateless_components_declared_pool_is_counted():
    """BAGEL's LLM keeps its contexts in a pool its spec declares (`StatelessSpec.kv_pool`): the plan counts
    `model_kwargs.kv_tokens` of it (default 262,144 at full size: 56 KiB a token in bfloat16), and a
    placement that does not fit names that setting."""
    per_token = 2 * 28 * 4 * 128 * 2  # K and V, layers, kv heads, head size, bfloat16
    default = config_from_dict({"model": "bagel"})
    small = config_from_dict({"model": "bagel", "model_kwargs": {"kv_tokens": 65_536}})
    (plan,), (plan_small,) = memory_plan.plan_memory(default, [40 * GiB]), memory_plan.plan_memory(small, [80 * GiB])
    needs, needs_small = ({n.name: n for n in p.needs} for p in (plan, plan_small))
    llm, llm_small = needs["llm"], needs_small["llm"]
    assert (llm.kv_bytes, llm.kv_share, llm.kv_setting) == (262_144 * per_token, False, "model_kwargs.kv_tokens")
    assert llm_small.kv_bytes == 65_536 * per_token and llm_small.weight_bytes == llm.weight_bytes
    assert all(n.kv_bytes == 0 for name, n in needs.items() if name != "llm")
    assert plan_small.fits and not plan.fits and "a smaller model_kwargs.kv_tokens (its pool takes 14.0 GiB)" in \
        memory_plan._what_fits(default, plan, [40 * GiB], False, None)


def test_vjepa2_ac_graph_caches_are_counted_where_graphs_are_captured():
    """V-JEPA 2-AC's predictor allocates its lanes' caches when its graphs are captured (`StatelessSpec.
    graph_buffers`): at full size in bfloat16, 400 candidates x 2 frames plus a 32-frame rollout, 258 tokens a
    frame, 24 layers of keys and values of 16 heads x 64; a card that cannot hold them is refused naming the
    setting; without CUDA graphs nothing is allocated, so nothing is counted."""
    per_frame = 2 * 24 * 258 * 16 * 64 * 2  # K and V, layers, tokens, heads, head size, bfloat16
    default = config_from_dict({"model": "vjepa2_ac"})
    (plan,) = memory_plan.plan_memory(default, [24 * GiB])
    predictor = next(n for n in plan.needs if n.name == "predictor")
    assert predictor.buffer_bytes == (400 * 2 + 1 * 32) * per_frame
    assert predictor.buffer_setting == "model_kwargs.plan_graph_samples" and "19.7 GiB graph caches" in plan.describe()
    assert not plan.fits and "a smaller model_kwargs.plan_graph_samples" in \
        memory_plan._what_fits(default, plan, [24 * GiB], False, None)
    fewer = config_from_dict({"model": "vjepa2_ac", "model_kwargs": {"plan_graph_samples": 100}})
    assert next(n for n in memory_plan.plan_memory(fewer, [24 * GiB])[0].needs
                if n.name == "predictor").buffer_bytes == (100 * 2 + 32) * per_frame
    eager = config_from_dict({"model": "vjepa2_ac", "cuda_graphs": {"enabled": False}})
    assert all(n.buffer_bytes == 0 for n in memory_plan.plan_memory(eager, [24 * GiB])[0].needs)


def test_vjepa2_ac_declared_graph_caches_are_what_capture_allocates():
    config = config_from_dict({"model": "vjepa2_ac", "model_kwargs": {"plan_graph_samples": 6, "plan_graph_frames": 3,
                                                                      "rollout_graph_frames": 5}})
    world = build_model(config, tiny=True).build_component("predictor", torch.device("cpu"))
    world.module.capture_plans()  # allocates the lanes' caches (capturing is the engine's, on CUDA)
    allocated = sum(t.numel() * t.element_size() for cache in world.module.lanes.values()
                    for layer in cache.layers for t in (layer.keys, layer.values))
    assert allocated > 0 and world.engine.graph_buffers.nbytes == allocated


def test_ranks_share_a_gpu_when_there_are_fewer_gpus():
    config = config_from_dict({"model": "toy", "node_groups": [
        {"node_names": ["encoder", "decoder", "guide", "painter"], "ranks": [0]},
        {"node_names": ["vocoder"], "ranks": [1]}]})
    assert [p.device for p in memory_plan.plan_memory(config, [GiB, GiB], tiny=True)] == [0, 1]
    (one,) = memory_plan.plan_memory(config, [GiB], tiny=True)
    assert sorted(n.name for n in one.needs) == ["decoder", "encoder", "guide", "painter", "vocoder"]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_serve_refuses_in_one_line_before_loading(monkeypatch):
    from mstar.cli import main as cli
    from mstar.runtime import launcher

    def no_engines(*args, **kwargs):
        raise AssertionError("weights were loaded")

    monkeypatch.setattr(launcher, "build_engines", no_engines)
    monkeypatch.setattr(memory_plan, "cuda_devices", lambda: [GiB])
    with pytest.raises(SystemExit) as exc:
        cli.main(["serve", "smollm2", "--tiny", "--port", str(_free_port())])
    message = str(exc.value)
    assert "\n" not in message and message.startswith("mstar: ")
    assert re.search(r"does not fit: cuda:0 \(1\.0 GiB\) needs 1\.\d GiB: llm 0\.0 GiB weights \+ 0\.0 GiB KV "
                     r"\(at least\) \+ 0\.\d GiB activations; CUDA context 1\.0 GiB\. No shipped config", message), message


def test_the_refusal_names_fewer_pages_and_fp8_where_they_fit(monkeypatch):
    monkeypatch.setattr(memory_plan, "cuda_devices", lambda: [6 * GiB])
    pages = config_from_dict({"model": "orpheus", "kv_cache": {"max_num_pages": 10**7}}, source="big.yaml")
    with pytest.raises(memory_plan.MemoryPlanError, match=r"What would fit: kv_cache\.max_num_pages: \d+; or "
                                                          r"--config orpheus; or --config orpheus_disaggregated on 2 "
                                                          r"GPUs of this size; or --config orpheus_eager_prefill\.$"):
        memory_plan.check_memory(pages, tiny=True)
    plain = config_from_dict({"model": "orpheus"}, source="plain.yaml")
    (need,) = memory_plan.plan_memory(plain, [GiB], tiny=True)
    monkeypatch.setattr(memory_plan, "cuda_devices", lambda: [need.need_bytes - 1])
    with pytest.raises(memory_plan.MemoryPlanError, match=r"What would fit: .*--quantization fp8\.$"):
        memory_plan.check_memory(plain, tiny=True)


def test_nothing_is_checked_without_cuda(monkeypatch):
    monkeypatch.setattr(memory_plan, "cuda_devices", list)
    huge = config_from_dict({"model": "smollm2", "kv_cache": {"max_num_pages": 10**9}})
    assert memory_plan.check_memory(huge, tiny=True) == []
    monkeypatch.setattr(memory_plan, "cuda_devices", lambda: [GiB])
    assert memory_plan.check_memory(config_from_dict({"model": "smollm2", "device": "cpu"}), tiny=True) == []


def test_a_model_that_cannot_be_sized_starts_unchecked(monkeypatch, caplog):
    def no_meta(model, name, shard):
        raise NotImplementedError("aten::_unique2 has no Meta kernel")

    monkeypatch.setattr(memory_plan, "_build_on_meta", no_meta)
    monkeypatch.setattr(memory_plan, "cuda_devices", lambda: [GiB])
    huge = config_from_dict({"model": "smollm2", "kv_cache": {"max_num_pages": 10**9}}, source="huge.yaml")
    assert memory_plan.check_memory(huge, tiny=True) == []
    assert "GPU memory not checked: huge.yaml cannot be sized on the meta device (NotImplementedError" in caplog.text


def test_the_first_config_that_fits_is_chosen(monkeypatch):
    big = config_from_dict({"model": "smollm2", "kv_cache": {"max_num_pages": 10**8}}, source="big.yaml")
    small = config_from_dict({"model": "smollm2", "kv_cache": {"max_num_pages": 10}}, source="small.yaml")
    monkeypatch.setattr(memory_plan, "cuda_devices", lambda: [8 * GiB])
    assert memory_plan.fitting_config([big, small], tiny=True) is small
    monkeypatch.setattr(memory_plan, "cuda_devices", lambda: [GiB])
    assert memory_plan.fitting_config([big, small], tiny=True) is big  # whose refusal says what would fit
    monkeypatch.setattr(memory_plan, "cuda_devices", list)
    assert memory_plan.fitting_config([big, small], tiny=True) is big
    assert memory_plan.memory_variants("qwen3_omni") == ["qwen3_omni_80gb"]
    assert memory_plan.memory_variants("qwen3") == []


@pytest.mark.slow  # full-size meta builds of Qwen3-Omni, several seconds each
@pytest.mark.parametrize("card,chosen", [("80 GB (H100)", "qwen3_omni_80gb"), ("141 GB (H200)", "qwen3_omni")])
def test_serve_chooses_qwen3_omni_config_by_card(monkeypatch, card, chosen):
    from mstar.cli import main as cli

    monkeypatch.setattr(memory_plan, "cuda_devices", lambda: [memory_plan.CARDS[card]])
    args = cli.build_parser().parse_args(["serve", "qwen3_omni", "--load-format", "dummy"])
    assert Path(cli.serve_config(args).source).stem == chosen


@pytest.mark.slow  # full-size meta builds of every Qwen3-Omni config
def test_serve_qwen3_omni_on_an_80_gb_card_refuses_its_141_gb_config(monkeypatch):
    from mstar.cli import main as cli
    from mstar.runtime import launcher

    def no_engines(*args, **kwargs):
        raise AssertionError("weights were loaded")

    monkeypatch.setattr(launcher, "build_engines", no_engines)
    monkeypatch.setattr(memory_plan, "cuda_devices", lambda: [memory_plan.CARDS["80 GB (H100)"]])
    with pytest.raises(SystemExit) as exc:
        cli.main(["serve", "qwen3_omni", "--config", "qwen3_omni", "--load-format", "dummy", "--port", str(_free_port())])
    message = str(exc.value)
    assert "\n" not in message and "qwen3_omni.yaml does not fit: cuda:0 (79.6 GiB) needs 103.2 GiB: " in message
    assert "thinker 56.9 GiB weights + 24.0 GiB KV + 2.0 GiB activations" in message
    assert "What would fit: kv_cache.max_num_pages: " in message
    assert "--config qwen3_omni_2gpu on 2 GPUs of this size" in message and "--config qwen3_omni_80gb" in message


@pytest.mark.slow  # a meta build of every shipped config at full size
def test_docs_table_is_the_planners():
    text = (ROOT / "docs" / "operations.md").read_text()
    found = re.search(r"<!-- memory:begin -->\n(.*?)<!-- memory:end -->", text, re.S)
    assert found, "docs/operations.md lacks the <!-- memory:begin --> ... <!-- memory:end --> block"
    assert found.group(1) == memory_plan.describe(), (
        "docs/operations.md is out of date: paste mstar.runtime.memory_plan.describe() between the memory markers")


def test_an_out_of_memory_pool_is_not_retried_with_another_backend(monkeypatch):
    from mstar.engines.autoregressive import runner
    from mstar.engines.base import KVLayout

    tried = []

    def build(name, *args):
        tried.append(name)
        raise (torch.OutOfMemoryError("CUDA out of memory") if failure == "oom" else RuntimeError("no kernels"))

    monkeypatch.setattr(runner, "_auto_candidates", lambda on_cuda: ["triton", "flashinfer", "sdpa"])
    monkeypatch.setattr(runner, "_build_backend", build)
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, dtype=torch.float32)
    failure = "oom"
    with pytest.raises(torch.OutOfMemoryError):
        runner.make_attention_backend("auto", layout, 8, 4, torch.device("cpu"))
    assert tried == ["triton"]
    failure, tried[:] = "other", []
    with pytest.raises(RuntimeError, match="no kernels"):
        runner.make_attention_backend("auto", layout, 8, 4, torch.device("cpu"))
    assert tried == ["triton", "flashinfer", "sdpa"]  # any other failure still tries the next backend
