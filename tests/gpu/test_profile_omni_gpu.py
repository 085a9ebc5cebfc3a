"""benchmarks/profile_omni.py on a GPU: the tiny model with every component (the decode graphs are really
used), and the full-size speech components (Code2Wav, code predictor, talker_input) with few calls."""

from __future__ import annotations

from benchmarks.profile_omni import COMPONENTS, main


def test_tiny_model_on_cuda_replays_the_decode_graphs(tmp_path):
    doc = main(["--quick", "--device", "cuda", "--batches", "1", "8", "--out", str(tmp_path / "p.json")])
    cases = doc["cases"]
    assert not {n: c["error"] for n, c in cases.items() if "error" in c}
    assert set(cases) == set(COMPONENTS) | {"frame_loop"}
    for b in (1, 8):
        talker, thinker = cases["talker"][f"extras_b{b}"], cases["thinker"]
        assert talker["paths"]["extras_graph"] == 3 and talker["paths"]["eager_extras"] == 0
        assert talker["forward_gpu_ms"] > 0 and talker["graph_bucket"] == b
        # the thinker's spoken-answer steps run a step ahead through the extras graph (an engine loop)
        extras = thinker[f"extras_b{b}"]["paths"]
        assert extras["extras_graph"] + extras["extras_ahead"] >= 3 and extras["eager_extras"] == 0
        plain = thinker[f"plain_b{b}"]["paths"]
        assert plain["plain_graph"] + plain["lookahead_steps"] >= 3 and plain["eager_extras"] == 0
        assert "error" not in cases["frame_loop"][f"b{b}"]
    predictor = cases["code_predictor"]
    assert predictor["graph_sizes"][0] == 1 and "graph_sampled_b8" in predictor
    assert doc["components"]["code2wav"]["warm_up_s"] > 0


def test_full_size_speech_components(tmp_path):
    doc = main(["--components", "code2wav", "code_predictor", "talker_input", "--batches", "1", "--calls", "2",
                "--out", str(tmp_path / "p.json")])
    cases = doc["cases"]
    assert not {n: c["error"] for n, c in cases.items() if "error" in c}
    c2w = cases["code2wav"]
    assert set(c2w) >= {"bf16", "bf16_padded", "bf16_cudnn_benchmark", "bf16_no_cudnn", "float32"}
    kernels = c2w["bf16"]["chunk_b1"]["kernels"]
    assert kernels["categories_ms"]["conv"] > 0 and kernels["kernels"] > 50
    assert c2w["bf16"]["stages_chunk_b1_ms"]["embed+pre_transformer"] > 0
    assert cases["code_predictor"]["graph_sampled_b1"]["kernels"]["kernels"] > 0
    assert 0.3 < doc["components"]["code2wav"]["weights_gib"] < 1.0  # ~200M bf16 parameters
