"""benchmarks/pd_stream.py: the two layouts follow the shipped configs with the benchmark's pool; a --quick run
(the tiny Llama on CPU, two worker processes for the split) writes what it returns, times every prompt length
in both layouts, computes each prompt once (none on the decode worker, whose pages all came from the prefill
worker) and times a plain and a streamed prefill. With --concurrency (tiny Llama and tiny Qwen3-Omni thinker)
every level's greedy tokens are the colocated run's, and the comparison names a first mismatch when there is one."""

from __future__ import annotations

import json

import pytest

from benchmarks.pd_stream import compare_tokens, main, parse_args, pool_pages, served_config


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


def test_concurrency_mode_takes_one_prompt_length_and_pools_the_largest_level() -> None:
    args = parse_args(["--quick", "--model", "qwen3_omni", "--concurrency", "1", "8", "--decode-tokens", "4"])
    assert args.prompt_lens == [40] and args.repeats == 1
    # 44 tokens: 3 pages a request and one for its next token, for the largest level or what a config holds
    assert pool_pages(args, 64) == 8 * (3 + 1) + 64 and pool_pages(args, 2) == 2 * (3 + 1) + 64
    one, split = served_config("colocated", args), served_config("disaggregated", args)
    assert one.model == split.model == "qwen3_omni" and (one.num_workers, split.num_workers) == (1, 2)
    assert one.source.endswith("qwen3_omni.yaml")  # no GPU to size: the shipped config, not a smaller card's
    assert one.kv_cache.max_num_pages == split.kv_cache.max_num_pages == pool_pages(args, 64)
    assert "tokenizer_path" not in one.model_kwargs
    with pytest.raises(SystemExit):
        parse_args(["--quick", "--concurrency", "4", "--prompt-lens", "40", "100"])


def test_compare_tokens_names_the_first_mismatch() -> None:
    one = [[[1, 2, 3], [4, 5, 6]], [[7, 8], [9, 9]]]
    assert compare_tokens(one, one) == {"tokens_equal": True, "requests_equal": 4, "requests": 4,
                                        "first_mismatch": None}
    split = [[[1, 2, 3], [4, 0, 6]], [[7], [9, 9]]]
    got = compare_tokens(one, split)
    assert not got["tokens_equal"] and got["requests_equal"] == 2
    assert got["first_mismatch"] == {"round": 0, "request": 1, "index": 1, "colocated": 5, "disaggregated": 0}
    short = compare_tokens(one, [one[0], [[7], [9, 9]]])["first_mismatch"]
    assert short == {"round": 1, "request": 0, "index": 1, "colocated": 8, "disaggregated": None}


@pytest.mark.slow  # two models, each served in both layouts over worker processes
@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("model", ["llama", "qwen3_omni"])
def test_quick_concurrency_run_gives_the_colocated_tokens(model) -> None:
    doc = main(["--quick", "--model", model, "--concurrency", "1", "4", "--decode-tokens", "5"])
    for c in ("1", "4"):
        assert doc["greedy"][c]["tokens_equal"] and doc["greedy"][c]["requests"] == int(c)  # one timed round
        for layout in ("colocated", "disaggregated"):
            row = doc[layout]["concurrency"][c]
            assert 0 < row["ttft_p50_s"] <= row["ttft_max_s"] < row["round_s"]
            assert row["decode_tokens_per_s"] > 0 and row["request_decode_tokens_per_s"] > 0
    split = doc["disaggregated"]["engine_stats"]
    assert split["0"]["prompt_tokens"] == 2 * 40 * (1 + 4)  # a warm-up and a timed round per level
    assert split["1"]["prompt_tokens"] == 0 and split["1"]["kv_pages_received"] == split["0"]["kv_pages_sent"] > 0
    assert doc["colocated"]["config"] == model and list(doc["colocated"]["engine_stats"]) == ["0"]
