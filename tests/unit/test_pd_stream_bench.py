"""benchmarks/pd_stream.py: the two layouts follow the shipped configs with the benchmark's pool; a --quick run
(the tiny Llama on CPU, two worker processes for the split) writes what it returns, times every prompt length
in both layouts, computes each prompt once (none on the decode worker, whose pages all came from the prefill
worker) and times a plain and a streamed prefill."""

from __future__ import annotations

import json

import pytest

from benchmarks.pd_stream import main, parse_args, pool_pages, served_config


def test_layouts_are_the_shipped_configs_with_one_pool() -> None:
    args = parse_args(["--quick", "--prompt-lens", "40", "100", "--decode-tokens", "4"])
    one, split = served_config("colocated", args), served_config("disaggregated", args)
    assert one.num_workers == 1 and split.num_workers == 2
    assert [g.graph_walks for g in split.node_groups] == [["prefill"], ["decode"]]
    assert one.kv_cache.max_num_pages == split.kv_cache.max_num_pages == pool_pages(args) == 2 * 7 + 64
    assert one.model_kwargs["max_model_len"] == 100 + 4 + 16 and one.device == "cpu"


@pytest.mark.slow  # a whole benchmark script over worker processes
@pytest.mark.usefixtures("one_thread")
def test_quick_run(tmp_path) -> None:
    out = tmp_path / "pd.json"
    doc = main(["--quick", "--prompt-lens", "40", "100", "--decode-tokens", "4", "--repeats", "1", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(doc))
    computed = 2 * (40 + 100)  # a warm-up and one timed request per length
    for layout in ("colocated", "disaggregated"):
        for n in ("40", "100"):
            row = doc[layout]["prompt_lens"][n]
            assert row["ttft_s"] > 0 and row["first_to_second_s"] > 0 and row["decode_tokens_per_s"] > 0
        assert doc[layout]["engine_stats"]["0"]["prompt_tokens"] == computed
    one, split = doc["colocated"]["engine_stats"], doc["disaggregated"]["engine_stats"]
    assert list(one) == ["0"] and one["0"]["kv_pages_sent"] == 0
    assert split["1"]["prompt_tokens"] == 0 and split["1"]["kv_pages_received"] == split["0"]["kv_pages_sent"] > 0
    for n in ("40", "100"):
        tap = doc["prefill_tap"]["prompt_lens"][n]
        assert tap["plain_ms"] > 0 and tap["streamed_ms"] > 0
    assert doc["prefill_tap"]["prefill_graph_max_tokens"] == 0  # no CUDA graphs on CPU
