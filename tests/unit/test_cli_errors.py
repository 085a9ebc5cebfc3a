"""`mstar serve` mistakes end in one line with the fix: a port in use (found before anything loads), an
unknown model, a config or checkpoint mistake; `--version` answers."""

from __future__ import annotations

import importlib.util
import socket

import pytest

from mstar import __version__
from mstar.cli import main as cli


@pytest.fixture
def no_runtime(monkeypatch):
    """Fails the test if a runtime is started (the check must come first)."""
    from mstar.runtime import launcher

    def refuse(*args, **kwargs):
        raise AssertionError("the runtime was started")

    monkeypatch.setattr(launcher, "Runtime", refuse)


def test_a_port_in_use_is_one_line_before_anything_loads(no_runtime):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(SystemExit) as exc:
            cli.main(["serve", "toy", "--port", str(port)])
    assert str(exc.value) == f"mstar: cannot listen on 127.0.0.1:{port}: Address already in use; pass another --port"


def test_a_host_that_cannot_be_bound_names_host_not_port(no_runtime):
    with pytest.raises(SystemExit) as exc:
        cli.main(["serve", "toy", "--host", "999.1.1.1", "--port", "8000"])
    assert str(exc.value).startswith("mstar: cannot listen on 999.1.1.1:8000: ") and str(exc.value).endswith(
        "; check --host (an address of this machine, or 0.0.0.0)")


@pytest.mark.parametrize("argv,message", [
    (["serve", "nosuchmodel"], "mstar: unknown model 'nosuchmodel'; registered models are: "),
    (["serve", "--config", "toy_9workers"], "mstar: config file toy_9workers does not exist (shipped configs"),
    (["serve", "llama"], "mstar: model 'llama' needs a checkpoint: pass --model-path"),
    (["serve", "qwen3", "--tiny", "--max-model-len", "1024"],
     "mstar: max_model_len=1024 is over this checkpoint's context of 512 tokens"),
    (["serve", "toy", "--model-path", "/tmp"], "mstar: model 'toy' loads no checkpoint; leave --model-path out"),
])
def test_startup_mistakes_are_one_line_with_the_fix(argv, message):
    with socket.socket() as probe:  # a free port, so the port check passes
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(SystemExit) as exc:
        cli.main([*argv, "--port", str(port)])
    first, hint = str(exc.value).split("\n")
    assert first.startswith(message) and hint == "(--log-level DEBUG shows the traceback)"


def test_version(capsys):
    for entry in (cli.main, cli.serve_main):
        with pytest.raises(SystemExit) as exc:
            entry(["--version"])
        assert exc.value.code == 0 and capsys.readouterr().out.strip() == f"mstar {__version__}"


def test_vllm_style_flags_set_the_model_config_and_the_yaml_wins(tmp_path, caplog):
    from mstar.config import ConfigError, config_from_dict, load_config

    args = cli.build_parser().parse_args(["serve", "qwen3", "--max-model-len", "1024", "--dtype", "float32"])
    config = cli.apply_model_flags(config_from_dict({"model": "qwen3"}), args)
    assert config.model_kwargs == {"max_model_len": 1024, "dtype": "float32"}
    path = tmp_path / "q.yaml"
    path.write_text("model: qwen3\nmodel_kwargs: {dtype: bfloat16}\n")
    config = cli.apply_model_flags(load_config(path), args)
    assert config.model_kwargs == {"dtype": "bfloat16", "max_model_len": 1024}
    assert f"--dtype float32 ignored: {path} sets model_kwargs.dtype to 'bfloat16'" in caplog.text
    toy = cli.build_parser().parse_args(["serve", "toy", "--max-model-len", "64"])
    with pytest.raises(ConfigError, match="--max-model-len: model 'toy' has no setting 'max_model_len'"):
        cli.apply_model_flags(config_from_dict({"model": "toy"}), toy)


def test_the_banner_quotes_the_context_the_engine_enforces():
    assert "(max_model_len: 256 tokens)" in cli.snippets("http://127.0.0.1:8000", "qwen3", None, 256)
    assert "max_model_len" not in cli.snippets("http://127.0.0.1:8000", "toy", None)


@pytest.mark.parametrize(("outputs", "route"), [(("text", "audio"), "/v1/chat/completions"),
                                                (("audio",), "/v1/audio/speech"), (("video",), "/v1/videos"),
                                                (("actions",), "/generate")])
def test_the_banner_shows_a_route_the_model_serves(outputs, route):
    text = cli.snippets("http://127.0.0.1:8000", "m", None, outputs=outputs)
    assert route in text and ("chat.completions" in text) == ("text" in outputs)


def test_seed_sets_the_model_config():
    args = cli.build_parser().parse_args(["serve", "qwen3", "--seed", "7"])
    from mstar.config import config_from_dict

    assert cli.apply_model_flags(config_from_dict({"model": "qwen3"}), args).model_kwargs == {"seed": 7}


def test_tensor_parallel_size_splits_the_tensor_parallel_components(tmp_path, caplog):
    from mstar.config import ConfigError, config_from_dict, load_config

    args = cli.build_parser().parse_args(["serve", "qwen3_omni", "--tiny", "--tensor-parallel-size", "2"])
    config = cli.apply_parallel_flags(config_from_dict({"model": "qwen3_omni"}), args)
    (split, rest) = config.node_groups
    assert (split.node_names, split.ranks, split.tp_size) == (["thinker"], [0, 1], 2)
    assert rest.ranks == [0] and "thinker" not in rest.node_names and "talker" in rest.node_names
    placed = load_config("qwen3_omni_2gpu_tp")
    assert cli.apply_parallel_flags(placed, args) is placed
    assert "--tensor-parallel-size 2 ignored" in caplog.text
    toy = cli.build_parser().parse_args(["serve", "toy", "--tensor-parallel-size", "2"])
    with pytest.raises(ConfigError, match="model 'toy' has no tensor-parallel component"):
        cli.apply_parallel_flags(config_from_dict({"model": "toy"}), toy)


def test_tensor_parallel_size_splits_the_shipped_default_config(monkeypatch, caplog):
    """`mstar serve qwen3_omni --tensor-parallel-size 2` (the README's line): the shipped qwen3_omni.yaml puts
    every component on rank 0, which gives way to the flag; only a YAML given with --config keeps its own."""
    from mstar.runtime import memory_plan

    monkeypatch.setattr(memory_plan, "cuda_devices", list)  # no GPU: the first config is served, unchecked
    args = cli.build_parser().parse_args(["serve", "qwen3_omni", "--tiny", "--tensor-parallel-size", "2"])
    config = cli.serve_config(args)
    assert config.source.endswith("qwen3_omni.yaml") and config.kv_cache.max_num_pages == 16384
    (split, rest) = config.node_groups
    assert (split.node_names, split.ranks, split.tp_size) == (["thinker"], [0, 1], 2)
    assert rest.ranks == [0] and "talker" in rest.node_names
    assert "ignored" not in caplog.text
    toy = cli.build_parser().parse_args(["serve", "toy", "--tensor-parallel-size", "2"])
    with pytest.raises(Exception, match="model 'toy' has no tensor-parallel component"):
        cli.serve_config(toy)


@pytest.mark.parametrize("missing,fix", [
    ("gguf", "pip install -c constraints.txt -e '.[gguf]'"),
    ("triton.language", "pip install -c constraints.txt -e '.[gpu]'"),
    ("einops", "pip install einops"),
])
def test_a_missing_optional_package_is_one_line_naming_how_to_install_it(monkeypatch, missing, fix):
    from mstar.runtime import launcher

    def runtime(*args, **kwargs):
        raise ModuleNotFoundError(f"No module named {missing!r}", name=missing)

    monkeypatch.setattr(launcher, "Runtime", runtime)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(SystemExit) as exc:
        cli.main(["serve", "toy", "--port", str(port)])
    package = missing.split(".")[0]
    assert str(exc.value) == f"mstar: the Python package {package!r} is needed and not installed; install it: {fix}"


@pytest.mark.parametrize("missing,fix", [("python_multipart", "pip install python-multipart"),
                                         ("av", "pip install av")])
def test_a_missing_route_package_fails_the_start_not_a_request(monkeypatch, no_runtime, missing, fix):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == missing else find_spec(name, *a))
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(SystemExit) as exc:
        cli.main(["serve", "toy", "--port", str(port)])
    package = fix.split()[-1]
    assert str(exc.value) == f"mstar: the Python package {package!r} is needed and not installed; install it: {fix}"


def test_ray_address_without_ray_is_one_line_before_anything_loads(monkeypatch, no_runtime):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else find_spec(name, *a))
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(SystemExit) as exc:
        cli.main(["serve", "toy", "--port", str(port), "--ray-address", "auto"])
    assert str(exc.value) == ("mstar: the Python package 'ray' is needed and not installed; install it: "
                              "pip install -c constraints.txt -e '.[ray]'")


def test_models_lists_the_voices_of_the_models_that_speak(capsys):
    from mstar.models.orpheus.tokens import VOICES

    assert cli.main(["models"]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()}
    assert lines["orpheus"].endswith(f"voices: {', '.join(VOICES)}")
    assert lines["qwen3_omni"].endswith("voices: Aiden, Chelsie, Ethan") and "voices" not in lines["toy"]


@pytest.mark.parametrize("argv,message", [
    (["serve", "qwen3", "--seed", "x"], "mstar serve: argument --seed: invalid int value: 'x'"),
    (["serve", "--mode", "fast"], "mstar serve: argument --mode: invalid choice: 'fast'"),
    (["serve", "toy", "--port", "99999"], "mstar serve: argument --port: a port is 1 to 65535, got 99999"),
    (["serve", "toy", "--port", "-5"], "mstar serve: argument --port: a port is 1 to 65535, got -5"),
    # these three were accepted: a bad --gpus hid every GPU, a negative timeout and an empty name went through
    (["serve", "toy", "--gpus", "x"], "mstar serve: argument --gpus: GPU ids are comma-separated"),
    (["serve", "toy", "--gpus", "0,,1"], "mstar serve: argument --gpus: GPU ids are comma-separated"),
    (["serve", "toy", "--shutdown-timeout", "-1"], "mstar serve: argument --shutdown-timeout: must be >= 0"),
    (["serve", "toy", "--served-model-name", " "], "mstar serve: argument --served-model-name: must not be empty"),
])
def test_bad_flag_values_are_one_line(capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    (line,) = capsys.readouterr().err.splitlines()
    assert exc.value.code == 2 and line.startswith(message) and line.endswith("(mstar serve --help lists the flags)")


def test_a_file_that_is_not_gguf_is_one_line_naming_it(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_text("not gguf")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(SystemExit) as exc:
        cli.main(["serve", "smollm2", "--model-path", str(bad), "--port", str(port)])
    assert str(exc.value).split("\n")[0].startswith(f"mstar: {bad} is not a readable GGUF file")


@pytest.mark.parametrize("command", ["configs", "models"])
def test_a_listing_piped_into_head_ends_quietly(command):
    """`mstar configs | head -1`: the reader closing the pipe ends the listing without a BrokenPipeError
    traceback."""
    import subprocess
    import sys

    code = f"import sys; from mstar.cli.main import main; sys.exit(main([{command!r}]))"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.read(1)
    proc.stdout.close()  # as `head -c 1` does once it has its line
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) in (0, 141, 1) and "Traceback" not in err, err
