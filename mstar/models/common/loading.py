"""Checkpoint loading shared by every model: find the files, stream tensors, copy them into a model.

Sources: a local folder (HF layout: config.json + *.safetensors, sharded with
model.safetensors.index.json), a Hub repo id (downloaded with huggingface_hub when online), a GGUF
file (dequantized, llama architecture), or `load_format="dummy"` (seeded random weights, no files).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mstar.layers.fp8 import FP8_DTYPE, Fp8Linear, quantize_per_channel

logger = logging.getLogger(__name__)

LOAD_FORMATS = ("auto", "dummy")  # auto: safetensors or GGUF, whichever the checkpoint holds
# What a download fetches: configs, tokenizers and safetensors weights (never duplicate .bin copies).
HUB_PATTERNS = ("*.json", "*.safetensors", "*.txt", "*.model", "*.jinja")

# checkpoint name -> (parameter, where in it: a row offset, or an index tuple such as (expert, rows)), or that
# and which part of the checkpoint tensor to take (a tensor-parallel rank's rows); None: skip it
NameMapper = Callable[[str], "tuple[str, Any] | tuple[str, Any, tuple[int | slice, ...]] | None"]

_WEIGHT_G = (".weight_g", ".parametrizations.weight.original0")  # weight-norm pair names: g
_WEIGHT_V = (".weight_v", ".parametrizations.weight.original1")  # and v


class CheckpointNotFoundError(FileNotFoundError):
    """No checkpoint where the user pointed; the message says where we looked and what to pass."""


def resolve_checkpoint(path_or_repo_id: str | Path, allow_patterns: Iterable[str] = HUB_PATTERNS) -> Path:
    """A local folder or file as is; otherwise a Hub repo id downloaded (or found in the HF cache).

    Raises CheckpointNotFoundError at once when the path does not exist, or when the Hub cannot be
    reached (offline, HF_HUB_OFFLINE=1) and the repo is not cached.
    """
    path = Path(path_or_repo_id).expanduser()
    if path.exists():
        return path
    text = str(path_or_repo_id)
    if not _looks_like_repo_id(text):
        raise CheckpointNotFoundError(
            f"checkpoint {text!r} not found: no such local path ({path.resolve()}). "
            "Pass --model-path with a local folder holding config.json and *.safetensors."
        )
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError

    try:
        return Path(snapshot_download(text, allow_patterns=list(allow_patterns)))
    except (OSError, ValueError, HfHubHTTPError) as exc:
        raise CheckpointNotFoundError(
            f"checkpoint {text!r} not found: it is not a local path ({path.resolve()}) and the Hugging Face "
            f"Hub could not provide it ({type(exc).__name__}; offline or HF_HUB_OFFLINE=1 and not in the "
            "HF cache). Pass --model-path with a local folder holding config.json and *.safetensors."
        ) from exc


def deployment_checkpoint(model_path: str | Path | None, tiny: bool, load_format: str, model: str,
                          example: str) -> Path | None:
    """A deployment's checkpoint: `model_path` resolved, or None for random weights (tiny, or load_format
    dummy). ValueError naming `model` and `example` (what --model-path takes) when neither is given."""
    if model_path is not None:
        return resolve_checkpoint(model_path)
    if not tiny and load_format != "dummy":
        raise ValueError(f"{model} needs --model-path ({example}), or --load-format dummy, or --tiny")
    return None


def read_config_json(path: str | Path, fix: str) -> dict[str, Any]:
    """The JSON object at `path` (a folder: its config.json); FileNotFoundError naming the file and `fix`."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no {path.name} at {path}; {fix}")
    return json.loads(path.read_text())


def _looks_like_repo_id(text: str) -> bool:
    parts = text.split("/")
    return 1 <= len(parts) <= 2 and all(parts) and not text.startswith((".", "~")) and "\\" not in text


def weight_files(path: Path) -> tuple[str, list[Path]]:
    """("safetensors" | "gguf", files) holding the weights of the checkpoint at `path`."""
    if path.is_file():
        if path.suffix in (".gguf", ".safetensors"):
            return path.suffix[1:], [path]
        raise CheckpointNotFoundError(f"{path} is neither a .safetensors nor a .gguf file")
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return "safetensors", [path / name for name in sorted(set(weight_map.values()))]
    if files := sorted(path.glob("*.safetensors")):
        return "safetensors", files
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return "gguf", ggufs
    if ggufs:
        raise CheckpointNotFoundError(
            f"several GGUF files in {path}: {[g.name for g in ggufs]}; pass one file"
        )
    raise CheckpointNotFoundError(
        f"no weights in {path} (looked for model.safetensors.index.json, *.safetensors, *.gguf). "
        "Pass --model-path with a Hugging Face safetensors checkpoint folder, or --load-format dummy."
    )


def iter_checkpoint_tensors(path: Path, progress: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF tensor name, CPU tensor) for every weight of the checkpoint at `path`."""
    kind, files = weight_files(path)
    if kind == "gguf":
        from mstar.models.common.gguf_checkpoint import iter_gguf_tensors

        yield from iter_gguf_tensors(files[0], progress=progress)
    else:
        yield from iter_safetensors(files, progress=progress)


def iter_component_tensors(folder: Path, progress: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """Tensors of one component folder: transformers names its index model.safetensors.index.json,
    diffusers diffusion_pytorch_model.safetensors.index.json; either, or plain *.safetensors files."""
    index = folder / "diffusion_pytorch_model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return iter_safetensors([folder / f for f in files], progress=progress)
    return iter_checkpoint_tensors(folder, progress=progress)


def iter_safetensors(files: list[Path], progress: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream tensors from safetensors files with one progress bar (per tensor) on stderr."""
    from safetensors import safe_open
    from tqdm import tqdm

    handles = [safe_open(str(f), framework="pt", device="cpu") for f in files]
    total = sum(len(list(h.keys())) for h in handles)
    with tqdm(total=total, desc="Loading weights", unit="tensor", disable=not progress) as bar:
        for handle in handles:
            for name in handle.keys():
                yield name, handle.get_tensor(name)
                bar.update(1)


def load_named_tensors(
    model: nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor]], mapper: NameMapper
) -> None:
    """Copy checkpoint tensors into `model`'s parameters (casting dtype, moving device).

    `mapper` places each tensor at a row offset of a parameter (fused qkv, gate_up fill from several
    tensors) or at an index tuple (one expert of stacked MoE weights); a third element takes only that
    part of the checkpoint tensor (a tensor-parallel rank's rows or columns). A full-precision tensor for
    an `Fp8Linear`'s weight or FP8 stacked experts is quantized on load (`_QuantizeOnLoad`). Raises ValueError listing
    unexpected names, shape mismatches and parameters left (partly) unfilled.
    """
    params = dict(model.named_parameters())
    filled: dict[str, int] = dict.fromkeys(params, 0)
    staging = _QuantizeOnLoad(model)
    unexpected: list[str] = []
    with torch.no_grad():
        for name, tensor in named_tensors:
            target = mapper(name)
            if target is None:
                continue
            param_name, where = target[0], target[1]
            if len(target) == 3:
                tensor = tensor[target[2]]
            if param_name not in params:
                unexpected.append(name)
                continue
            data = staging.buffer(param_name, tensor) if staging.takes(param_name, tensor) else params[param_name].data
            dst = _at(data, where, tensor)
            if dst.shape != tensor.shape:
                raise ValueError(
                    f"checkpoint tensor {name} has shape {tuple(tensor.shape)} but {param_name}"
                    f"[{where}] expects {tuple(dst.shape)}: config.json does not match the weights"
                )
            if staging.takes_rows(param_name, tensor):
                scale_dst = _at(params[staging.rows[param_name]].data, where, tensor)
                scale_name = staging.copy_rows(param_name, dst, scale_dst, tensor)
                filled[scale_name] += tensor[..., 0].numel()
            else:
                dst.copy_(tensor)
            filled[param_name] += tensor.numel()
            if staging.takes(param_name, tensor) and filled[param_name] == data.numel():
                scale_name = staging.quantize(param_name)
                filled[scale_name] = params[scale_name].numel()
    _check_filled(params, filled, unexpected)


def _at(data: torch.Tensor, where: Any, tensor: torch.Tensor) -> torch.Tensor:
    """The part of `data` a mapper's `where` names: rows from an offset, or an index."""
    return data[where : where + tensor.shape[0]] if isinstance(where, int) else data[where]


def _check_filled(params: dict[str, nn.Parameter], filled: dict[str, int], unexpected: list[str]) -> None:
    missing = [n for n, p in params.items() if filled[n] != p.numel()]
    if unexpected or missing:
        raise ValueError(
            f"checkpoint does not match the model: unexpected tensors {unexpected[:10]}"
            f"{' ...' if len(unexpected) > 10 else ''}; parameters not loaded {missing[:10]}"
            f"{' ...' if len(missing) > 10 else ''}. Check that the checkpoint is of this architecture."
        )


class _QuantizeOnLoad:
    """Full-precision checkpoint tensors bound for `Fp8Linear` weights: each layer's parts are gathered in a
    buffer of its `source_dtype` on its device and quantized into it (`Fp8Linear.set_weight`) once complete,
    then the buffer is freed. Checkpoints hold a layer's parts together, so about one layer is buffered at a
    time: the device holds the FP8 model plus one layer, never a full-precision model. An FP8 tensor (an FP8
    checkpoint, `fp8_checkpoint`) goes straight into the weight instead.

    FP8 stacked MoE experts (`StackedExperts.to_fp8`) have one scale per row, so each checkpoint tensor's
    rows are quantized as they arrive (`copy_rows`), with no buffer."""

    def __init__(self, model: nn.Module) -> None:
        from mstar.layers.moe import StackedExperts

        self.layers = {_join(name, "weight"): m for name, m in model.named_modules() if isinstance(m, Fp8Linear)}
        self.buffers: dict[str, torch.Tensor] = {}
        experts = [(name, m) for name, m in model.named_modules() if isinstance(m, StackedExperts)]
        self.rows = {_join(name, w): _join(name, s) for name, m in experts for w, s in m.row_scales().items()}
        self.row_dtype = {_join(name, w): m.source_dtype for name, m in experts for w in m.row_scales()}

    def takes_rows(self, param_name: str, tensor: torch.Tensor) -> bool:
        """Whether `tensor` is a full-precision part of FP8 stacked experts `param_name`."""
        return param_name in self.rows and tensor.dtype != FP8_DTYPE

    def copy_rows(self, param_name: str, dst: torch.Tensor, scale_dst: torch.Tensor, tensor: torch.Tensor) -> str:
        """Quantize `tensor`'s rows (rounded to the experts' dtype first) into `dst` and their scales into
        `scale_dst`; the scale's parameter name."""
        if scale_dst.shape != tensor.shape[:-1]:
            raise ValueError(f"{param_name}: FP8 row scales cannot follow a part split along its last dim")
        rows = tensor.to(device=dst.device, dtype=self.row_dtype[param_name]).reshape(-1, tensor.shape[-1])
        q, scale = quantize_per_channel(rows)
        dst.copy_(q.view(tensor.shape))
        scale_dst.copy_(scale.view(tensor.shape[:-1]))
        return self.rows[param_name]

    def takes(self, param_name: str, tensor: torch.Tensor) -> bool:
        """Whether `tensor` is a full-precision part of an `Fp8Linear`'s weight `param_name`."""
        return param_name in self.layers and tensor.dtype != FP8_DTYPE

    def buffer(self, param_name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The full-precision buffer that gathers the weight `param_name` (made at its first part)."""
        if param_name not in self.buffers:
            layer = self.layers[param_name]
            self.buffers[param_name] = torch.empty(layer.weight.shape, dtype=layer.source_dtype,
                                                   device=layer.weight.device)
        return self.buffers[param_name]

    def quantize(self, param_name: str) -> str:
        """Quantize the complete weight `param_name` into its layer, free its buffer; the scale's name."""
        self.layers[param_name].set_weight(self.buffers.pop(param_name))
        return param_name.removesuffix("weight") + "weight_scale"


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def fold_weight_norm(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """A state dict with every weight-norm (g, v) pair replaced by its plain `weight` = g * v / |v| (the norm
    over every dim but 0). Pairs are named `weight_g`/`weight_v` (older torch) or
    `parametrizations.weight.original0/1`."""
    plain, gs, vs = {}, {}, {}
    for name, tensor in named:
        dotted = "." + name  # so a top-level "weight_g" has an (empty) owner like any other
        if dotted.endswith(_WEIGHT_G):
            gs[_owner(dotted)] = tensor
        elif dotted.endswith(_WEIGHT_V):
            vs[_owner(dotted)] = tensor
        else:
            plain[name] = tensor
    if set(gs) != set(vs):
        raise ValueError(f"weight-norm pairs are incomplete for {sorted(set(gs) ^ set(vs))[:5]}")
    for prefix, g in gs.items():
        v = vs[prefix].float()
        norm = v.pow(2).sum(dim=tuple(range(1, v.dim())), keepdim=True).sqrt()
        plain[f"{prefix}.weight".lstrip(".")] = (v * (g.float() / norm)).to(vs[prefix].dtype)
    return plain


def _owner(name: str) -> str:
    """The module path of a dotted weight-norm tensor name ("" at the top level)."""
    cut = ".parametrizations." if ".parametrizations." in name else ".weight_"
    return name[1: name.rindex(cut)]


def fill_dummy_weights(model: nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Seeded random weights without files: normal(0, std) matrices, unit norm scales, zero biases
    (norm biases too) and zero for every other vector. An `Fp8Linear`'s weight is drawn in its
    `source_dtype` and quantized, so it equals the full-precision model's weight quantized; FP8 stacked
    experts are drawn and quantized one expert at a time (`_QuantizeOnLoad.copy_rows`)."""
    generators: dict[torch.device, torch.Generator] = {}  # random numbers drawn on each parameter's device
    fp8 = {_join(name, "weight"): m for name, m in model.named_modules() if isinstance(m, Fp8Linear)}
    rows = _QuantizeOnLoad(model)
    scales = {name + "_scale" for name in fp8} | set(rows.rows.values())  # set with their weight
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, param in params.items():
            if param.is_meta or name in scales:
                continue  # no storage to fill (a model built on the meta device to size or inspect it); a scale
            if param.ndim >= 2:
                if param.device not in generators:
                    generators[param.device] = torch.Generator(device=param.device).manual_seed(seed)
                generator = generators[param.device]
                if name in fp8:
                    drawn = torch.empty(param.shape, dtype=fp8[name].source_dtype, device=param.device)
                    fp8[name].set_weight(drawn.normal_(0.0, std, generator=generator))
                elif name in rows.rows:
                    for e in range(param.shape[0]):
                        drawn = torch.empty(param.shape[1:], dtype=rows.row_dtype[name], device=param.device)
                        rows.copy_rows(name, param[e], params[rows.rows[name]][e], drawn.normal_(0.0, std, generator=generator))
                else:
                    param.normal_(0.0, std, generator=generator)
            elif name.endswith(".weight") and "norm" in name.rsplit(".", 2)[-2]:
                param.fill_(1.0)  # norm scales; norm biases (LayerNorm) fall through to zero
            else:
                param.zero_()
