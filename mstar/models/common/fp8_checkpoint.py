"""FP8 checkpoints in the Hugging Face formats, loaded as they are (no dequantize-requantize).

Two formats, told apart by config.json's `quantization_config.quant_method`:
  "fp8"                 transformers' fine-grained FP8 (Qwen3-*-FP8, DeepSeek-V3): E4M3 `weight` and
                        float32 `weight_scale_inv` [N/bn, K/bk] for `weight_block_size` [bn, bk];
                        W = weight * weight_scale_inv per block (the name notwithstanding, it multiplies).
  "compressed-tensors"  llm-compressor's FP8 ("float-quantized"): E4M3 `weight` and float32 `weight_scale`
                        [N, 1] for the "channel" strategy (or a block grid for "block"); W = weight * scale.
Activations must be dynamic (scaled at run time): a checkpoint with static activation scales is refused.
Which layers are FP8 is read off the checkpoint (the linears that have a scale tensor), so the formats'
ignore lists (`modules_to_not_convert`, `ignore`) need no interpreting.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from mstar.layers.fp8 import empty_fp8_linears
from mstar.models.common import loading


@dataclass(frozen=True)
class Fp8Format:
    """How an FP8 checkpoint stores its scales."""

    block: tuple[int, int] | None  # scale block shape [rows, cols]; None: one scale per output channel
    scale_suffix: str  # the scale tensor's name beside `<layer>.weight`


def fp8_format(hf_config: dict[str, Any]) -> Fp8Format | None:
    """The FP8 format config.json declares; None for an unquantized checkpoint; ValueError naming what is
    unsupported (another quant_method, static activation scales, a per-tensor or non-E4M3 scheme)."""
    qc = hf_config.get("quantization_config")
    if qc is None:
        return None
    method = qc.get("quant_method")
    if method == "fp8":
        return _finegrained(qc)
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    raise ValueError(f"quantization_config.quant_method {method!r} is not supported; mstar loads 'fp8' "
                     "(block scales) and 'compressed-tensors' FP8 checkpoints")


def _finegrained(qc: dict[str, Any]) -> Fp8Format:
    if qc.get("activation_scheme", "dynamic") != "dynamic":
        raise ValueError(f"FP8 checkpoint with activation_scheme {qc['activation_scheme']!r}: only dynamic "
                         "activation scales are supported")
    if qc.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"FP8 checkpoint in {qc['fmt']!r}: only e4m3 weights are supported")
    block = qc.get("weight_block_size")
    if not block:
        raise ValueError("FP8 checkpoint without weight_block_size (per-tensor scales): not supported; use a "
                         "block-scaled or per-channel checkpoint, or the bf16 one with --quantization fp8")
    return Fp8Format(tuple(block), ".weight_scale_inv")


def _compressed_tensors(qc: dict[str, Any]) -> Fp8Format:
    if qc.get("format") not in ("float-quantized", "naive-quantized"):
        raise ValueError(f"compressed-tensors format {qc.get('format')!r}: only FP8 ('float-quantized') is "
                         "supported")
    blocks = set()
    for name, group in qc.get("config_groups", {}).items():
        weights, acts = group.get("weights") or {}, group.get("input_activations")
        if weights.get("num_bits") != 8 or weights.get("type") != "float":
            raise ValueError(f"compressed-tensors group {name}: weights of {weights.get('num_bits')} bits "
                             f"{weights.get('type')!r}; only 8-bit float (FP8) is supported")
        if acts and not acts.get("dynamic"):
            raise ValueError(f"compressed-tensors group {name}: static activation scales; only dynamic "
                             "activations are supported")
        strategy = weights.get("strategy")
        if strategy == "channel":
            blocks.add(None)
        elif strategy == "block":
            blocks.add(tuple(weights["block_structure"]))
        else:
            raise ValueError(f"compressed-tensors group {name}: weight strategy {strategy!r}; only 'channel' "
                             "and 'block' are supported")
    if len(blocks) != 1:
        raise ValueError(f"compressed-tensors checkpoint with {len(blocks)} weight scale layouts; one is supported")
    return Fp8Format(blocks.pop(), ".weight_scale")


def scale_mapper(mapper: loading.NameMapper, fmt: Fp8Format) -> loading.NameMapper:
    """`mapper` extended to scale tensors: `<layer>.<scale_suffix>` goes where `<layer>.weight` goes, as
    `weight_scale` at the matching row of the scale grid (a fused layer's parts must start on a block)."""
    rows = 1 if fmt.block is None else fmt.block[0]

    def mapped(name: str) -> Any:
        if not name.endswith(fmt.scale_suffix):
            return mapper(name)
        weight = name.removesuffix(fmt.scale_suffix) + ".weight"
        target = mapper(weight)
        if target is None:
            return None
        param, where = target[0], target[1]
        if len(target) != 2 or not isinstance(where, int):
            raise ValueError(f"{name}: FP8 scales of a split or indexed weight ({param}) are not supported")
        if where % rows:
            raise ValueError(f"{name}: its layer starts at row {where} of {param}, not on a {rows}-row scale "
                             "block; this model's fused layers cannot hold these block scales")
        return param.removesuffix(".weight") + ".weight_scale", where // rows

    return mapped


def quantized_layers(names: Iterable[str], mapper: loading.NameMapper, fmt: Fp8Format) -> set[str]:
    """The model's layers (module paths) that checkpoint tensors `names` give FP8 scales to."""
    layers = set()
    for name in names:
        target = scale_mapper(mapper, fmt)(name) if name.endswith(fmt.scale_suffix) else None
        if target is not None:
            layers.add(target[0].removesuffix(".weight_scale"))
    return layers


def tensor_names(path: Path) -> list[str]:
    """The tensor names of a safetensors checkpoint (read from the file headers, no data)."""
    from safetensors import safe_open

    kind, files = loading.weight_files(path)
    if kind != "safetensors":
        raise ValueError(f"an FP8 checkpoint must be safetensors, got {kind} at {path}")
    names = []
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            names.extend(handle.keys())
    return names


def load_fp8_checkpoint(model: nn.Module, path: Path, fmt: Fp8Format, mapper: loading.NameMapper,
                        progress: bool = True) -> set[str]:
    """Load the FP8 checkpoint at `path` into `model` as it is: the layers it quantizes become `Fp8Linear`
    of its scale layout, the rest load as usual; the FP8 layers' names. ValueError as `load_named_tensors`."""
    layers = quantized_layers(tensor_names(path), mapper, fmt)
    empty_fp8_linears(model, layers, fmt.block)
    loading.load_named_tensors(model, loading.iter_checkpoint_tensors(path, progress=progress),
                               scale_mapper(mapper, fmt))
    return layers
