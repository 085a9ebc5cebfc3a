"""The `mstar` command: `mstar serve <model>`, `mstar models`, `mstar configs`, `mstar bench`; and
`mstar-serve --config x.yaml`.

`mstar serve` takes the shipped `mstar/configs/<model>.yaml` when there is one (`--config` takes a path or a
shipped name) and checks the port before anything loads; config, model-name and checkpoint mistakes end
in one line with the fix. The runtime and the server are imported inside `run_serve`, so importing this
module loads no torch.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import re
import sys
from pathlib import Path

from mstar import __version__, envs

logger = logging.getLogger(__name__)
DEFAULT_MODEL = "smollm2"
# vLLM-style flags that set a key of the model's config: flag -> (model_kwargs key, type, help)
MODEL_FLAGS = {
    "--max-model-len": ("max_model_len", int, "tokens of prompt and output one sequence may hold"),
    "--dtype": ("dtype", str, "weights and compute dtype, e.g. bfloat16, float32"),
    "--seed": ("seed", int, "seed of random weights (--load-format dummy, --tiny)"),
}

# optional packages a model or route imports when it starts: import name -> (pip name, extra that brings it)
OPTIONAL_PACKAGES = {
    "gguf": ("gguf", "gguf"),
    "triton": ("triton", "gpu"),
    "ftfy": ("ftfy", "all"),
    "xgrammar": ("xgrammar", "all"),
    "python_multipart": ("python-multipart", None),
    "ray": ("ray", "ray"),
}
# dependencies the routes import only when a request needs them (form uploads, video, audio files): checked at
# start, so an install without one fails there in one line instead of answering those requests with a 500
ROUTE_PACKAGES = ("python_multipart", "av", "soundfile")


def check_route_packages() -> None:
    """Raise ModuleNotFoundError naming the first of ROUTE_PACKAGES that is not installed."""
    for name in ROUTE_PACKAGES:
        if importlib.util.find_spec(name) is None:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)


def missing_package_line(exc: ModuleNotFoundError) -> str:
    """One line naming the package a start needs and how to install it."""
    name = (exc.name or "").split(".")[0]
    package, extra = OPTIONAL_PACKAGES.get(name, (name, None))
    fix = f"pip install -c constraints.txt -e '.[{extra}]'" if extra else f"pip install {package}"
    return f"mstar: the Python package {package!r} is needed and not installed; install it: {fix}"


class Parser(argparse.ArgumentParser):
    """An argument parser whose mistakes end in one line naming the fix, not the whole usage."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message} ({self.prog} --help lists the flags)\n")


def port_number(text: str) -> int:
    """`--port`'s value; argparse reports the error in one line."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 1 to 65535, got {port}")
    return port


def gpu_ids(text: str) -> str:
    """`--gpus`'s value, as CUDA_VISIBLE_DEVICES takes it: indices or GPU-/MIG- UUIDs, comma-separated (CUDA
    would hide every GPU after an id it cannot read)."""
    if not all(re.fullmatch(r"\d+|(GPU|MIG)-[\w-]+", part) for part in text.split(",")):
        raise argparse.ArgumentTypeError(f"GPU ids are comma-separated indices (or GPU-/MIG- UUIDs), got {text!r}")
    return text


def non_negative(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid float value: {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text!r}")
    return value


def model_name(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return text


def _add_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=port_number, default=8000)
    p.add_argument("--gpus", type=gpu_ids, default=None, help="GPU ids to use, e.g. 0,1 (sets CUDA_VISIBLE_DEVICES)")
    p.add_argument("--config", default=None, help="YAML config: a path, or a shipped config's name (default: the shipped <model>.yaml if any; `mstar configs` lists them)")
    p.add_argument("--model-path", default=None, help="local checkpoint folder or file instead of the default")
    p.add_argument("--load-format", choices=("auto", "dummy"), default="auto", help="dummy: random weights")
    p.add_argument("--tiny", action="store_true", help="the model's tiny debug flavour")
    p.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    p.add_argument("--api-key-file", default=None,
                   help="require 'Authorization: Bearer <key>' on every route but /health, the key being this "
                        "file's first line (or set MSTAR_API_KEY); never printed")
    p.add_argument("--api-key", default=None, help=argparse.SUPPRESS)  # refused: see read_api_key
    p.add_argument("--served-model-name", type=model_name, default=None, help="the name clients use (default: the model's)")
    for flag, (key, kind, what) in MODEL_FLAGS.items():
        p.add_argument(flag, type=kind, default=None, help=f"{what} (model_kwargs.{key}; the YAML wins if it sets it)")
    p.add_argument("--quantization", choices=("fp8", "fp8_block"), default=None,
                   help="weights of the model's quantizable components in FP8 (E4M3; fp8: per-channel scales, "
                        "fp8_block: 128x128 blocks), quantized on load; YAML `quantization:` wins per component")
    p.add_argument("--tensor-parallel-size", type=int, default=None,
                   help="split the model's tensor-parallel components over this many GPUs (the others on GPU 0); "
                        "the node_groups of a --config YAML win if it has them")
    p.add_argument("--shutdown-timeout", type=non_negative, default=30.0,
                   help="seconds that SIGTERM or Ctrl-C lets open requests finish before they are ended with an "
                        "error and the server exits (default 30)")
    p.add_argument("--ui", action=argparse.BooleanOptionalAction, default=None,
                   help="the browser playground at / (default: on when --host is local: 127.0.0.1, localhost, ::1)")
    p.add_argument("--mode", choices=("auto", "inproc", "multiproc"), default="auto",
                   help="workers as threads of this process, or one process per worker; auto: one process per "
                        "worker when CUDA is available (the HTTP server and the workers then never share a GIL), "
                        "threads otherwise")
    p.add_argument("--ray-address", default=None, metavar="ADDRESS",
                   help="run each worker as an actor of the Ray cluster at ADDRESS (or auto: the one this machine "
                        "belongs to), placed by the config's ray section; this process is the head (needs mstar[ray])")


def build_parser() -> argparse.ArgumentParser:
    """The `mstar` argument parser with its subcommands."""
    from mstar.cli import bench

    parser = Parser(prog="mstar", description="Serve and benchmark composite multimodal models.")
    parser.add_argument("--version", action="version", version=f"mstar {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run an HTTP server for one model")
    serve.add_argument("model", nargs="?", default=None, help=f"registered model name, or an out-of-tree package.module:Class (default {DEFAULT_MODEL})")
    _add_serve_arguments(serve)
    serve.set_defaults(func=run_serve)
    models = sub.add_parser("models", help="list registered models and their modalities")
    models.set_defaults(func=list_models)
    configs = sub.add_parser("configs", help="list the shipped configs (usable by name with --config)")
    configs.set_defaults(func=list_configs)
    bench.add_parser(sub)
    return parser


def list_models(args: argparse.Namespace) -> int:
    """Print each registered model with its input and output modalities, and the voices of one that speaks."""
    from mstar.models.registry import get_model_class, model_names

    for name in model_names():
        cls = get_model_class(name)
        voices = f"   voices: {', '.join(cls.voices)}" if cls.voices else ""
        sys.stdout.write(f"{name:<16} in: {', '.join(cls.input_modalities):<28} "
                         f"out: {', '.join(cls.output_modalities)}{voices}\n")
    return 0


def list_configs(args: argparse.Namespace) -> int:
    """Print each shipped config's name and its first comment line."""
    from mstar.config import SHIPPED_CONFIGS, shipped_configs

    for name in shipped_configs():
        first = (SHIPPED_CONFIGS / f"{name}.yaml").read_text().splitlines()[:1]
        about = first[0].lstrip("# ") if first and first[0].startswith("#") else ""
        sys.stdout.write(f"{name:<26} {about}\n")
    return 0


def apply_model_flags(config, args: argparse.Namespace):
    """`config` with the vLLM-style flags given (MODEL_FLAGS) set in its model_kwargs; a key the YAML
    already sets keeps the YAML's value, and the conflict is logged."""
    import dataclasses

    from mstar.config import ConfigError
    from mstar.models.registry import get_model_class

    given = {flag: getattr(args, _dest(flag)) for flag in MODEL_FLAGS if getattr(args, _dest(flag)) is not None}
    if not given:
        return config
    fields = {f.name for f in dataclasses.fields(get_model_class(config.model).make_config())}
    kwargs = dict(config.model_kwargs)
    for flag, value in given.items():
        key = MODEL_FLAGS[flag][0]
        if key not in fields:
            raise ConfigError(f"{flag}: model {config.model!r} has no setting {key!r}")
        if key in kwargs and kwargs[key] != value:
            logger.warning("%s %s ignored: %s sets model_kwargs.%s to %r", flag, value, config.source, key, kwargs[key])
            continue
        kwargs[key] = value
    return dataclasses.replace(config, model_kwargs=kwargs)


def apply_quantization_flag(config, args: argparse.Namespace):
    """`config` with --quantization set for every component the model can quantize (`Model.quantizable`)
    that the YAML's `quantization:` leaves unset; ConfigError for a model with none."""
    import dataclasses

    from mstar.config import ConfigError
    from mstar.models.registry import get_model_class

    if args.quantization is None:
        return config
    components = get_model_class(config.model).quantizable
    if not components:
        raise ConfigError(f"--quantization {args.quantization}: model {config.model!r} has no component that can "
                          "be quantized")
    values = {name: args.quantization for name in components} | config.quantization
    return dataclasses.replace(config, quantization=values)


def apply_parallel_flags(config, args: argparse.Namespace, chosen: bool = True):
    """`config` with --tensor-parallel-size N placed as node_groups: the components that declare
    `tensor_parallel` split over ranks 0..N-1, every other one on rank 0. A YAML `chosen` with --config
    that places components itself keeps its placement, and the conflict is logged; a shipped default's
    placement (every component on rank 0) gives way to the flag."""
    import dataclasses

    from mstar.config import ConfigError, NodeGroup
    from mstar.runtime.build import build_model

    size = args.tensor_parallel_size
    if size is None or size == 1:
        return config
    if size < 1:
        raise ConfigError(f"--tensor-parallel-size {size}: give a number of GPUs >= 1")
    if config.node_groups and chosen:
        logger.warning("--tensor-parallel-size %d ignored: %s places the components (node_groups)", size, config.source)
        return config
    graph = build_model(config, tiny=args.tiny, load_format=args.load_format, model_path=args.model_path).graph()
    split = [name for name, spec in graph.components.items() if spec.tensor_parallel]
    if not split:
        raise ConfigError(f"--tensor-parallel-size: model {config.model!r} has no tensor-parallel component; "
                          "remove the flag (or place replicas with node_groups in a YAML config)")
    rest = [name for name in graph.components if name not in split]
    groups = [NodeGroup(split, list(range(size)), tp_size=size)] + ([NodeGroup(rest, [0])] if rest else [])
    config = dataclasses.replace(config, node_groups=groups)
    config.validate()
    return config


def _dest(flag: str) -> str:
    """The attribute argparse stores `flag` under."""
    return flag.removeprefix("--").replace("-", "_")


def resolve_config(model: str | None, config_path: str | None):
    """The config to serve: the given file or shipped name, else the shipped <model>.yaml, else the
    model on rank 0."""
    from mstar.config import SHIPPED_CONFIGS, config_from_dict, load_config

    if config_path is not None:
        return load_config(config_path, model=model)
    model = model or DEFAULT_MODEL
    default = SHIPPED_CONFIGS / f"{model}.yaml"
    if default.is_file():
        logger.info("using %s", default)
        return load_config(default, model=model)
    return config_from_dict({"model": model}, source=f"<defaults for {model}>")


def serve_config(args: argparse.Namespace):
    """The config to serve, the flags applied: --config's, else the first of the model's shipped configs
    (`<model>.yaml`, then its variants for smaller cards, `<model>_<N>gb.yaml`) that fits the GPUs' memory."""
    from mstar.runtime.memory_plan import fitting_config, memory_variants

    model = getattr(args, "model", None)
    names = [args.config] if args.config is not None else [None, *memory_variants(model or DEFAULT_MODEL)]
    configs = [apply_parallel_flags(apply_quantization_flag(apply_model_flags(resolve_config(model, name), args), args),
                                    args, chosen=args.config is not None) for name in names]
    return fitting_config(configs, tiny=args.tiny, model_path=args.model_path)


def read_api_key(args: argparse.Namespace) -> str | None:
    """The key from --api-key-file, else MSTAR_API_KEY, else None; a key on the command line is refused
    since every user of the machine can read it in the process list."""
    if args.api_key is not None:
        raise SystemExit("mstar: --api-key would show the key in the process list; put it in a file and pass "
                         "--api-key-file FILE, or set MSTAR_API_KEY")
    if args.api_key_file is None:
        return envs.api_key()
    try:
        lines = Path(args.api_key_file).read_text().splitlines()
    except OSError as exc:
        raise SystemExit(f"mstar: cannot read --api-key-file: {exc}") from None
    if not lines or not lines[0].strip():
        raise SystemExit(f"mstar: --api-key-file {args.api_key_file} is empty; its first line is the key")
    return lines[0].strip()


def snippets(base_url: str, model: str, api_key: str | None, max_model_len: int | None = None,
             ui: bool = False, outputs: tuple[str, ...] = ("text",)) -> str:
    """Copy-paste examples for curl, the mstar SDK and the OpenAI client for what the model makes (`outputs`:
    chat for text, else speech, images, videos or the native /generate); a key shows as $MSTAR_API_KEY.
    A token model's context is the limit its engine enforces, as /v1/models and the 400s quote it."""
    context = f"   (max_model_len: {max_model_len} tokens)" if max_model_len is not None else ""
    auth = " -H \"Authorization: Bearer $MSTAR_API_KEY\"" if api_key else ""
    key = 'os.environ["MSTAR_API_KEY"]' if api_key else repr("none")
    playground = f"\n  playground in a browser: {base_url}/\n" if ui else ""
    head = f"""
mstar is serving {model!r} at {base_url}{context}   (docs: {base_url}/docs, metrics: {base_url}/metrics)
{playground}"""
    client = f"""  from openai import OpenAI
  client = OpenAI(base_url="{base_url}/v1", api_key={key})"""
    if "text" in outputs:
        return head + f"""
  curl {base_url}/v1/chat/completions{auth} -H 'Content-Type: application/json' \\
       -d '{{"model": "{model}", "messages": [{{"role": "user", "content": "Hello!"}}]}}'

  from mstar.client import MStarClient
  print(MStarClient("{base_url}", api_key={key}).chat("Hello!").text)

{client}
  print(client.chat.completions.create(model="{model}", messages=[{{"role": "user", "content": "Hello!"}}]))
"""
    route, body, call = {
        "audio": ("audio/speech", f'{{"model": "{model}", "input": "Hello!"}}\' -o hello.wav',
                  f'client.audio.speech.create(model="{model}", input="Hello!").write_to_file("hello.wav")'),
        "image": ("images/generations", f'{{"model": "{model}", "prompt": "a red fox"}}\'',
                  f'print(client.images.generate(model="{model}", prompt="a red fox").data[0].b64_json[:60])'),
        "video": ("videos", f'{{"model": "{model}", "prompt": "a red fox"}}\'',
                  f'print(client.videos.create_and_poll(model="{model}", prompt="a red fox").status)'),
    }.get(next((o for o in ("audio", "image", "video") if o in outputs), ""), (None, None, None))
    if route is None:  # latents, actions: only the native endpoint carries them
        return head + f"""
  curl -N {base_url}/generate{auth} -H 'Content-Type: application/json' -d '{{"text": ..., "media": [...], "options": {{...}}}}'
  (the request each model takes, with a script and a curl line per route: examples/README.md in the source tree)
"""
    return head + f"""
  curl {base_url}/v1/{route}{auth} -H 'Content-Type: application/json' \\
       -d '{body}

{client}
  {call}
"""


def run_serve(args: argparse.Namespace) -> int:
    """Start the runtime, serve it with uvicorn until interrupted, then shut the runtime down."""
    from mstar.runtime.launcher import Runtime
    from mstar.runtime.memory_plan import MemoryPlanError
    from mstar.runtime.process import stacks_on_sigusr1
    from mstar.server.app import create_app
    from mstar.server.routes_playground import wants_playground

    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    api_key = read_api_key(args)
    check_port_free(args.host, args.port)  # before minutes of loading, not after
    stacks_on_sigusr1()
    if args.gpus:
        os.environ["CUDA_VISIBLE_DEVICES"] = args.gpus
    if os.getcwd() not in sys.path:  # 'module:Class' models import from here as under `python -m`, shadowing nothing
        sys.path.append(os.getcwd())
    try:
        check_route_packages()
        if args.ray_address and importlib.util.find_spec("ray") is None:
            raise ModuleNotFoundError("No module named 'ray'", name="ray")
        runtime = Runtime(serve_config(args), mode=args.mode, tiny=args.tiny, load_format=args.load_format,
                          model_path=args.model_path, ray_address=args.ray_address)
    except ModuleNotFoundError as exc:  # an optional dependency of this model or route
        if args.log_level == "DEBUG":
            raise
        raise SystemExit(missing_package_line(exc)) from None
    except MemoryPlanError as exc:  # refused before loading: the line says what would fit, a traceback adds nothing
        raise SystemExit(f"mstar: {exc}") from None
    except (ValueError, KeyError, FileNotFoundError) as exc:  # a config, model name or checkpoint mistake
        if args.log_level == "DEBUG":
            raise
        message = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        raise SystemExit(f"mstar: {message}\n(--log-level DEBUG shows the traceback)") from None
    stacks_on_sigusr1(runtime.worker_pids)  # from now on the workers dump theirs too
    try:
        ui = wants_playground(args.host, args.ui)
        app = create_app(runtime, api_key=api_key, model_name=args.served_model_name, ui=ui)
        host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
        # the name the app answers to, which for a 'module:Class' model is the class's, not the spec
        sys.stderr.write(snippets(f"http://{host}:{args.port}", app.state.mstar.model_name, api_key,
                                  runtime.processor.max_model_len, ui, runtime.model.output_modalities))
        serve_until_stopped(app, runtime, args)
    finally:
        runtime.shutdown()
    if runtime.fatal:
        logger.error("exiting: %s", runtime.fatal)
        return 1
    return 0


def check_port_free(host: str, port: int) -> None:
    """Exit with one line when `host:port` cannot be listened on."""
    import errno
    import socket

    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds it
        try:
            sock.bind((host, port))
        except OSError as exc:
            fix = {errno.EADDRINUSE: "pass another --port",
                   errno.EACCES: "pass a --port above 1023 (lower ones need privileges)"}.get(
                exc.errno, "check --host (an address of this machine, or 0.0.0.0)")
            raise SystemExit(f"mstar: cannot listen on {host}:{port}: {exc.strerror}; {fix}") from None


def serve_until_stopped(app, runtime, args: argparse.Namespace) -> None:
    """Run uvicorn until a signal or a fatal runtime error. The first signal starts the drain: /ready turns
    503, no new connection is taken, and requests still open a second before the timeout end with an error;
    a second signal ends them at once (each client still gets its last line)."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            if runtime.draining:  # impatient: end the open requests now rather than cancel them mid-write
                runtime.end_open_requests()
                return
            runtime.drain(max(0.0, args.shutdown_timeout - 1.0))
            super().handle_exit(sig, frame)
            self._captured_signals.clear()  # uvicorn would re-raise it on exit, before runtime.shutdown() ran

    server = Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level.lower(),
                                   timeout_graceful_shutdown=args.shutdown_timeout))
    runtime.on_fatal(lambda: setattr(server, "should_exit", True))
    server.run()


def main(argv: list[str] | None = None) -> int:
    """Entry point of `mstar`."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except BrokenPipeError:  # a listing's reader (`| head`) has what it wanted
        if args.command not in ("models", "configs"):
            raise
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit's flush cannot fail again
        return 0


def serve_main(argv: list[str] | None = None) -> int:
    """Entry point of `mstar-serve --config x.yaml` (the model comes from the config)."""
    parser = Parser(prog="mstar-serve", description="Serve the model a config file names.")
    parser.add_argument("--version", action="version", version=f"mstar {__version__}")
    parser.add_argument("--model", default=None, help="override the config's model")
    _add_serve_arguments(parser)
    args = parser.parse_args(argv)
    if args.config is None and args.model is None:
        parser.error("give --config FILE_OR_SHIPPED_NAME (or --model NAME)")
    return run_serve(args)


if __name__ == "__main__":
    sys.exit(main())
