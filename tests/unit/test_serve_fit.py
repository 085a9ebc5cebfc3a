"""benchmarks/serve_fit.py: the chosen config and a refusal are read from a server's output; on CPU the
per-model routine starts a tiny toy server, waits for /ready, sends its request and stops it, and a start the
planner refuses (a 512 MiB card patched in) is recorded as the one-line refusal it is."""

from __future__ import annotations

import json
import os
import sys

import pytest

from benchmarks.serve_fit import Options, chosen_config, exit_facts, main, request_for, run_model

REFUSED = ("2026-12-07 10:00:00,000 INFO __main__: using /r/mstar/configs/qwen3_omni.yaml\n"
           "mstar: /r/mstar/configs/qwen3_omni.yaml does not fit: cuda:0 (79.6 GiB) needs 103.2 GiB: ...\n\n")
VARIANT = ("x INFO __main__: using /r/mstar/configs/qwen3_omni.yaml\n"
           "x INFO mstar.runtime.memory_plan: using /r/mstar/configs/qwen3_omni_80gb.yaml: "
           "/r/mstar/configs/qwen3_omni.yaml does not fit the GPU memory\n")
# a start that calls the real `mstar serve` with the planner seeing one CUDA device of 512 MiB
SMALL_CARD = [sys.executable, "-c", "import sys; import mstar.runtime.memory_plan as m; "
              "m.cuda_devices = lambda: [512 << 20]; from mstar.cli.main import main; sys.exit(main(sys.argv[1:]))",
              "serve"]


def test_the_chosen_config_is_the_planners_variant_else_the_shipped_file_else_defaults() -> None:
    assert chosen_config(VARIANT, "qwen3_omni") == "qwen3_omni_80gb"
    assert chosen_config(REFUSED, "qwen3_omni") == "qwen3_omni"
    assert chosen_config("x INFO mstar.cli.main: using /r/mstar/configs/toy.yaml\n", "toy") == "toy"
    assert chosen_config("nothing logged\n", "qwen2") == "<defaults for qwen2>"


def test_a_refusal_is_one_clean_line_and_a_traceback_or_oom_is_not() -> None:
    facts = exit_facts(REFUSED, 1)
    assert facts["planner_refusal"] and facts["clean"] and not facts["built_before_exit"]
    assert facts["last_line"].startswith("mstar: /r/mstar/configs/qwen3_omni.yaml does not fit")
    crash = exit_facts("x INFO mstar.runtime.build: built component thinker on cuda:0\nTraceback (most recent call "
                       "last):\ntorch.OutOfMemoryError: CUDA out of memory.\n", 1)
    assert not crash["planner_refusal"] and not crash["clean"]
    assert crash["traceback"] and crash["out_of_memory"] and crash["built_before_exit"]
    other = exit_facts("mstar: model 'llama' needs a checkpoint: pass --model-path\n"
                       "(--log-level DEBUG shows the traceback)\n", 1)
    assert other["clean"] and not other["planner_refusal"]
    assert other["message"] == "mstar: model 'llama' needs a checkpoint: pass --model-path"


def test_requests_are_json_and_sized_for_the_flavour() -> None:
    assert request_for("pi05", tiny=True)[1]["options"]["state"] == [0.0] * 8
    assert request_for("pi05", tiny=False)[1]["options"]["state"] == [0.0] * 32
    route, body = request_for("vjepa2_ac", tiny=False)
    assert route == "/generate" and body["media"][0]["data"].startswith("data:image/png;base64,")
    json.dumps(body)
    assert "media" not in request_for("vjepa2_ac", tiny=False)[0]  # the table itself is left as it was


@pytest.mark.slow  # starts a server process
def test_a_tiny_toy_serves_answers_and_stops(tmp_path) -> None:
    out = tmp_path / "fit.json"
    doc = main(["--models", "toy", "--tiny", "--limit", "120", "--port", "8491", "--log-dir", str(tmp_path),
                "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(doc))
    row = doc["rows"][0]
    assert row["outcome"] == "served" and row["config"] == "toy" and row["ready_s"] > 0
    assert row["request"]["status"] == 200 and row["request"]["route"] == "/v1/chat/completions"
    assert row["planner"]["fits"] and row["planner"]["need_gib"][0] > 1  # the CUDA context alone is 1 GiB
    assert "mstar is serving 'toy'" in (tmp_path / "toy.log").read_text()


@pytest.mark.slow  # starts a server process
def test_a_start_the_planner_refuses_is_recorded_as_its_one_line(tmp_path) -> None:
    opts = Options(8493, 120, 30, tmp_path, True, None, {})
    row = run_model("toy", 8493, opts, launcher=SMALL_CARD)
    assert row["outcome"] == "exited" and row["exit_code"] == 1
    assert row["planner_refusal"] and row["clean"] and not row["built_before_exit"], row["log_tail"]
    assert "does not fit: cuda:0 (0.5 GiB) needs" in row["last_line"] and row["config"] == "toy"


@pytest.mark.slow  # starts a server process
def test_gpu_memory_is_read_from_nvidia_smi_and_this_process_keeps_its_settings(tmp_path, monkeypatch) -> None:
    tools = tmp_path / "bin"
    tools.mkdir()
    (tools / "nvidia-smi").write_text('#!/bin/sh\necho "NVIDIA H100 80GB HBM3, 1000, 81559"\n')
    (tools / "nvidia-smi").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tools}:{os.environ['PATH']}")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    doc = main(["--models", "toy", "--tiny", "--port", "8495", "--log-dir", str(tmp_path)])
    assert doc["device"] == "NVIDIA H100 80GB HBM3" and doc["gpu_total_mib"] == 81559
    row = doc["rows"][0]
    assert row["gpu_mib_before"] == row["gpu_mib_ready"] == row["gpu_mib_request_max"] == 1000
    assert row["memory_back"] and row["planner_card"] == "NVIDIA H100 80GB HBM3"
    assert row["planner"]["card_gib"] == pytest.approx(81559 / 1024, abs=0.01)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "3"  # hidden only while the models ran
