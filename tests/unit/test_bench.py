"""`mstar bench` against a fake streaming server on a free local port."""

import argparse
import asyncio
import json
import threading
import time

import pytest

from mstar.cli.bench import BenchConfig, add_parser, main, run_bench
from mstar.cli.bench_report import percentile

fastapi = pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")

EOS_AFTER = 5  # the fake model stops after 5 tokens unless ignore_eos
PCM_CHUNK = 4800  # bytes = 0.1 s at 24 kHz, 16-bit mono
PCM_CHUNKS = 4


HEALTH_GETS: list[float] = []  # when the fake server answered GET /health (the client's untimed warm-up)


def _app(bodies: list):
    from fastapi.responses import JSONResponse, StreamingResponse

    app = fastapi.FastAPI()

    @app.get("/health")
    async def health():
        HEALTH_GETS.append(time.perf_counter())
        return {"status": "ok"}

    @app.post("/v1/chat/completions")
    async def chat(body: dict):
        bodies.append(body)
        if body["model"] == "broken":
            return JSONResponse({"error": "no such model"}, status_code=404)
        n = body["max_tokens"] if body.get("ignore_eos") else min(EOS_AFTER, body["max_tokens"])

        async def events():
            yield 'data: {"choices":[{"index":0,"delta":{"role":"assistant"}}]}\n\n'  # role only: no token
            for i in range(n):
                await asyncio.sleep(0.002)
                chunk = {"choices": [{"index": 0, "delta": {"content": f"t{i} "}}]}
                yield f"data: {json.dumps(chunk)}\n\n"
            usage = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": n + 3}}
            yield f"data: {json.dumps(usage)}\n\n"
            yield "data: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/audio/speech")
    async def speech(body: dict):
        bodies.append(body)

        async def pcm():
            for _ in range(PCM_CHUNKS):
                await asyncio.sleep(0.003)
                yield b"\x01\x00" * (PCM_CHUNK // 2)
        return StreamingResponse(pcm(), media_type="audio/pcm")

    return app


@pytest.fixture(scope="module")
def server():
    """(base_url, list of received request bodies) for a uvicorn server on 127.0.0.1, port chosen by the OS."""
    bodies: list = []
    srv = uvicorn.Server(uvicorn.Config(_app(bodies), host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.time() + 10
    while not srv.started:
        assert time.time() < deadline, "fake server did not start"
        time.sleep(0.02)
    port = srv.servers[0].sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}", bodies
    srv.should_exit = True
    thread.join(timeout=5)


def test_chat_counts_and_latencies(server):
    url, bodies = server
    bodies.clear()
    report = run_bench(BenchConfig(base_url=url, concurrencies=(1, 4), num_requests=8, max_tokens=12,
                                   ignore_eos=True), command="mstar bench x")
    assert report["command"] == "mstar bench x" and len(report["results"]) == 2
    assert len(bodies) == 16 and all(b["ignore_eos"] is True and b["stream"] for b in bodies)
    for res in report["results"]:
        assert (res["requests"], res["completed"], res["errors"]) == (8, 8, 0)
        assert res["output_tokens"] == 8 * 12  # from usage
        assert res["output_tokens_per_s"] == pytest.approx(res["output_tokens"] / res["wall_s"])
        assert res["requests_per_s"] == pytest.approx(8 / res["wall_s"])
        for key in ("ttft_ms", "itl_ms", "e2e_ms"):
            stats = res[key]
            assert 0 <= stats["p50"] <= stats["p95"] <= stats["p99"]
        assert res["ttft_ms"]["p50"] <= res["e2e_ms"]["p50"]
        assert res["itl_ms"]["p50"] >= 1.0  # the fake server sleeps 2 ms between tokens
    # Without ignore_eos the fake model stops early; token counts follow.
    res = run_bench(BenchConfig(base_url=url, num_requests=3, max_tokens=12))["results"][0]
    assert res["output_tokens"] == 3 * EOS_AFTER and "ignore_eos" not in bodies[-1]


def test_chat_errors_are_counted(server):
    url, _ = server
    res = run_bench(BenchConfig(base_url=url, model="broken", num_requests=4, concurrencies=(2,)))["results"][0]
    assert (res["requests"], res["completed"], res["errors"]) == (4, 0, 4)
    assert "HTTP 404" in res["error_samples"][0] and res["requests_per_s"] == 0
    res = run_bench(BenchConfig(base_url="http://127.0.0.1:9", num_requests=2))["results"][0]
    assert res["errors"] == 2 and "ConnectError" in res["error_samples"][0]


def test_speech_audio_seconds(server):
    url, bodies = server
    report = run_bench(BenchConfig(base_url=url, workload="speech", concurrencies=(2,), num_requests=5,
                                   voice="tara"))
    res = report["results"][0]
    assert bodies[-1]["response_format"] == "pcm" and bodies[-1]["stream_format"] == "audio"
    assert res["completed"] == 5 and res["audio_bytes"] == 5 * PCM_CHUNK * PCM_CHUNKS
    assert res["audio_s"] == pytest.approx(res["audio_bytes"] / (2 * 24000)) == pytest.approx(2.0)
    assert res["audio_s_per_s"] == pytest.approx(res["audio_s"] / res["wall_s"])
    assert 0 < res["time_to_first_audio_ms"]["p50"] <= res["e2e_ms"]["p50"]
    assert 0 < res["rtf"]["p50"] == pytest.approx(res["e2e_ms"]["p50"] / 1000 / 0.4, rel=0.5)
    res = run_bench(BenchConfig(base_url=url, workload="speech", num_requests=1, sample_rate=16000))
    assert res["results"][0]["audio_s"] == pytest.approx(PCM_CHUNK * PCM_CHUNKS / 32000)


def test_duration_mode_keeps_requests_in_flight(server):
    url, _ = server
    res = run_bench(BenchConfig(base_url=url, concurrencies=(3,), duration_s=0.3, max_tokens=4))["results"][0]
    assert res["completed"] >= 3 and res["errors"] == 0 and res["wall_s"] >= 0.3


def test_cli_writes_json_and_table(server, tmp_path, capsys):
    url, _ = server
    out = tmp_path / "bench.json"
    argv = ["--base-url", url, "--concurrency", "1,2", "--num-requests", "2", "--max-tokens", "3",
            "--output", str(out)]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    assert report["command"].startswith("mstar bench --base-url") and "--concurrency 1,2" in report["command"]
    assert [r["concurrency"] for r in report["results"]] == [1, 2]
    captured = capsys.readouterr()
    table = captured.out
    assert "ttft p50" in table and len(table.strip().splitlines()) == 4
    # progress: one line per level as it ends, on stderr
    assert [line.split()[2] for line in captured.err.splitlines() if line.startswith("level done:")] == ["1", "2"]
    # The subcommand registration used by the `mstar` entry point.
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    args = parser.parse_args(["bench", "--workload", "speech", "--concurrency", "2,8"])
    assert args.func is main and args.concurrency == (2, 8) and args.workload == "speech"


def test_report_after_each_level_keeps_finished_levels(server):
    """A sweep cut short after its first level still has that level: on_level sees the report grow."""
    url, _ = server
    seen = []
    run_bench(BenchConfig(base_url=url, concurrencies=(1, 2), num_requests=2, max_tokens=3),
              on_level=lambda report: seen.append([r["concurrency"] for r in report["results"]]))
    assert seen == [[1], [1, 2]]


def test_bad_config_and_percentile():
    with pytest.raises(ValueError, match="unknown workload 'tts'"):
        BenchConfig(workload="tts")
    with pytest.raises(ValueError, match=">= 1"):
        BenchConfig(concurrencies=(0,))
    assert percentile([], 50) is None
    assert percentile([1, 2, 3, 4], 50) == 2.5 and percentile([5], 99) == 5
    assert percentile(list(range(101)), 95) == 95


def test_speech_body_carries_the_token_budget():
    """--max-tokens and --ignore-eos reach a speech request as model options (a TTS model counts audio tokens)."""
    body = BenchConfig(base_url="http://x", workload="speech", model="orpheus", max_tokens=600,
                       ignore_eos=True).request()[1]
    assert body["max_tokens"] == 600 and body["ignore_eos"] is True
    assert body["response_format"] == "pcm" and body["stream_format"] == "audio"
    plain = BenchConfig(base_url="http://x", workload="speech", model="orpheus").request()[1]
    assert "ignore_eos" not in plain


def test_each_level_warms_the_client_before_its_clock(server):
    """One GET /health per level, before the level's requests; it is not counted as a request."""
    base, bodies = server
    HEALTH_GETS.clear()
    before = len(bodies)
    report = run_bench(BenchConfig(base_url=base, workload="speech", model="m", concurrencies=[1, 2], num_requests=2))
    assert len(HEALTH_GETS) == 2
    assert [r["requests"] for r in report["results"]] == [2, 2] and len(bodies) - before == 4



@pytest.mark.parametrize("argv, named", [
    (["--concurrency", "0"], "--concurrency"), (["--concurrency", "2,-1"], "--concurrency"),
    (["--num-requests", "-3"], "--num-requests"), (["--duration", "0"], "--duration"),
    (["--timeout", "0"], "--timeout"), (["--sample-rate", "0"], "--sample-rate"),
    (["--max-tokens", "0"], "--max-tokens"), (["--extra-body", "[1]"], "--extra-body"),
    (["--output", "/nonexistent-dir/x.json"], "--output"),
])
def test_bad_flag_values_are_one_line_before_any_request(argv, named, capsys):
    """A bad value ends `mstar bench` with argparse's one line naming the flag, before a request is sent;
    it was a ValueError traceback from BenchConfig (or, for --output, after the whole sweep had run)."""
    from mstar.cli.main import main as mstar_main

    with pytest.raises(SystemExit) as exc:
        mstar_main(["bench", "--base-url", "http://127.0.0.1:9", *argv])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and named in err and len(err.strip().splitlines()) == 1
    assert "Traceback" not in err


def test_failed_requests_say_why_on_stderr(capsys):
    """A sweep whose requests all fail prints a sample of the errors, not only a count."""
    assert main(["--base-url", "http://127.0.0.1:9", "--num-requests", "1"]) == 1
    assert "ConnectError" in capsys.readouterr().err
