"""benchmarks/code2wav_bench.py on a GPU (full-size Code2Wav, dummy bf16 weights), few calls: every case runs,
the served component is padded and replays its graphs, and its audio matches the eager decode's length."""

from __future__ import annotations

from benchmarks.code2wav_bench import main


def test_full_size_code2wav_bench(tmp_path):
    doc = main(["--batches", "1", "4", "--calls", "2", "--out", str(tmp_path / "c2w.json")])
    build, cases = doc["build"], doc["cases"]
    assert build["pad_frames"] == 50 and build["graph_sizes"] == [1, 2, 4] and build["dtype"] == "torch.bfloat16"
    assert build["build_held_gib"] > 0.3  # ~200M bf16 parameters plus the graphs' pool
    for b in (1, 4):
        assert set(cases[f"b{b}"]) == {"graphs", "engine", "eager"}
        assert all(c["wall_ms"] > 0 and c["audio_s_per_s"] > 0 for c in cases[f"b{b}"].values())
    assert len(cases["new_width"]) == 3 and cases["stages_b1_ms"]["decoder1:DecoderBlock"] > 0
