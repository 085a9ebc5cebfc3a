"""Checkpoint names of V-JEPA 2 and V-JEPA 2-AC, and building the loaded networks.

Layouts read:
- a Hugging Face folder (transformers' `VJEPA2Model` or `VJEPA2ForVideoClassification`: config.json and
  safetensors; a classifier's keys carry the prefix `vjepa2.`); its separate query, key and value
  projections fill our fused qkv by rows;
- the upstream layout (`vjepa2.models`): an encoder's `blocks.N.attn.qkv`, the AC predictor's
  `predictor_blocks.N...`. In a V-JEPA 2-AC folder the predictor sits in `ac_predictor/` (its
  safetensors and a config.json of `ACPredictorConfig` fields); the upstream `.pt` file holds both
  under "encoder" and "predictor".
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mstar.models.common.loading import fill_dummy_weights, iter_checkpoint_tensors, load_named_tensors
from mstar.models.common.meta import build_on_meta
from mstar.models.vjepa2.config import ACPredictorConfig, ViTShape, VJEPA2Config

Mapped = tuple[str, int] | None  # (our parameter, first row it fills), or None: not part of what we build
AC_FOLDER = "ac_predictor"  # the AC predictor's subfolder of a V-JEPA 2-AC checkpoint folder

_HF_BLOCK = {  # a transformers block's module names -> ours, and which third of the fused qkv rows
    "attention.query": ("attn.qkv", 0), "attention.key": ("attn.qkv", 1), "attention.value": ("attn.qkv", 2),
    "attention.proj": ("attn.proj", 0), "self_attn.q_proj": ("attn.qkv", 0), "self_attn.k_proj": ("attn.qkv", 1),
    "self_attn.v_proj": ("attn.qkv", 2), "self_attn.out_proj": ("attn.proj", 0), "layer_norm1": ("norm1", 0),
    "layer_norm2": ("norm2", 0), "norm1": ("norm1", 0), "norm2": ("norm2", 0), "mlp.fc1": ("mlp.fc1", 0),
    "mlp.fc2": ("mlp.fc2", 0),
}
_CROSS = "pooler.cross_attention_layer."
_HF_PARTS = {  # part -> (its key prefixes, its block prefix, our block list, fixed module names)
    "encoder": (("encoder.",), "encoder.layer.", "blocks",
                {"encoder.embeddings.patch_embeddings.proj": "patch_embed", "encoder.layernorm": "norm"}),
    "predictor": (("predictor.",), "predictor.layer.", "blocks",
                  {"predictor.embeddings.predictor_embeddings": "embed", "predictor.embeddings.mask_tokens": "mask_tokens",
                   "predictor.layernorm": "norm", "predictor.proj": "proj"}),
    "classifier": (("pooler.", "classifier."), "pooler.self_attention_layers.", "layers",
                   {"pooler.query_tokens": "query_tokens", f"{_CROSS}layer_norm1": "cross.norm1",
                    f"{_CROSS}layer_norm2": "cross.norm2", f"{_CROSS}mlp.fc1": "cross.mlp.fc1",
                    f"{_CROSS}mlp.fc2": "cross.mlp.fc2", f"{_CROSS}cross_attn.q_proj": "cross.q", "classifier": "head"}),
}


def hf_mapper(config: VJEPA2Config, part: str) -> Callable[[str], Mapped]:
    """Names of a Hugging Face checkpoint -> `part`'s ("encoder", "predictor" or "classifier")
    parameters; other parts' tensors map to None, and an unknown name of this part to itself (so the
    loader reports it)."""
    prefixes, layer_prefix, group, fixed = _HF_PARTS[part]
    width = config.predictor.vit.hidden_size if part == "predictor" else config.encoder.vit.hidden_size

    def mapper(name: str) -> Mapped:
        name = name.removeprefix("vjepa2.")
        if not name.startswith(prefixes):
            return None
        if name in fixed:  # a bare parameter (mask tokens, the pooler's query)
            return fixed[name], 0
        stem, _, leaf = name.rpartition(".")
        if stem in fixed:
            return f"{fixed[stem]}.{leaf}", 0
        if stem in (f"{_CROSS}cross_attn.k_proj", f"{_CROSS}cross_attn.v_proj"):
            return f"cross.kv.{leaf}", width * stem.endswith("v_proj")
        index, _, inner = stem.removeprefix(layer_prefix).partition(".")
        if stem.startswith(layer_prefix) and inner in _HF_BLOCK:
            ours, third = _HF_BLOCK[inner]
            return f"{group}.{index}.{ours}.{leaf}", third * width
        return name, 0

    return mapper


def upstream_encoder_mapper(name: str) -> Mapped:
    """The upstream encoder's names (`module.`/`backbone.` prefixes dropped) -> ours."""
    name = name.replace("module.", "").replace("backbone.", "")
    if name == "pos_embed":
        return None  # a sin-cos table the RoPE checkpoints keep but never use
    return name.replace("patch_embed.proj.", "patch_embed."), 0


def upstream_ac_mapper(name: str) -> Mapped:
    """The upstream AC predictor's names -> ours."""
    name = name.replace("module.", "").replace("backbone.", "")
    for theirs, ours in (("predictor_blocks.", "blocks."), ("predictor_norm.", "norm."), ("predictor_proj.", "proj.")):
        if name.startswith(theirs):
            return ours + name[len(theirs):], 0
    return name, 0


# -- building --------------------------------------------------------------------------------------


def build(factory: Callable[[], nn.Module], dtype: torch.dtype, device: torch.device | str,
          tensors: Iterable[tuple[str, torch.Tensor]] | None, mapper: Callable[[str], Mapped] | None,
          seed: int = 0, std: float = 0.02) -> nn.Module:
    """`factory()` built once on `device` in `dtype`, loaded from `tensors` through `mapper`, or with
    seeded random weights when `tensors` is None."""
    module = build_on_meta(factory, dtype, device)
    if tensors is None:
        fill_dummy_weights(module, seed=seed, std=std)
    else:
        load_named_tensors(module, tensors, mapper)
    return module


def read_hf_config(folder: Path) -> VJEPA2Config:
    """The `VJEPA2Config` of a Hugging Face folder."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json in {folder}: pass a Hugging Face V-JEPA 2 folder "
                                "(facebook/vjepa2-vitl-fpc64-256 or the like)")
    return VJEPA2Config.from_hf(json.loads(path.read_text()))


def read_ac_config(folder: Path, embed_dim: int) -> ACPredictorConfig:
    """The AC predictor's config from `<folder>/ac_predictor/config.json` (missing: the published shape)."""
    path = Path(folder) / AC_FOLDER / "config.json"
    fields = json.loads(path.read_text()) if path.is_file() else {}
    vit = fields.pop("vit", None)
    if "img_size" in fields:
        fields["img_size"] = tuple(fields["img_size"])
    config = ACPredictorConfig(embed_dim=embed_dim, **fields)
    return config if vit is None else replace(config, vit=ViTShape(**vit))


def hf_tensors(folder: Path, progress: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of a Hugging Face folder (not its `ac_predictor/` subfolder)."""
    return iter_checkpoint_tensors(Path(folder), progress=progress)


def ac_tensors(folder: Path, progress: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """The AC predictor's tensors of a V-JEPA 2-AC folder."""
    return iter_checkpoint_tensors(Path(folder) / AC_FOLDER, progress=progress)


def upstream_tensors(path: Path, key: str) -> Iterator[tuple[str, torch.Tensor]]:
    """The "encoder" or "predictor" tensors of an upstream `.pt` checkpoint (read without unpickling code)."""
    state: dict[str, Any] = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    if key not in state:
        raise ValueError(f"{path} has no {key!r} entry (it has {sorted(state)}); pass an upstream V-JEPA 2-AC .pt")
    yield from state[key].items()


def part_factory(config: VJEPA2Config, part: str) -> Callable[[], nn.Module]:
    """What builds `part` ("encoder", "predictor" or "classifier") of a V-JEPA 2 checkpoint."""
    from mstar.models.vjepa2.classifier import VideoClassifier
    from mstar.models.vjepa2.encoder import MaskPredictor, VJEPA2Encoder

    if part == "encoder":
        return lambda: VJEPA2Encoder(config.encoder)
    if part == "predictor":
        return lambda: MaskPredictor(config.predictor, config.encoder.vit.hidden_size)
    if part == "classifier":
        if config.classifier is None:
            raise ValueError("this checkpoint has no classifier head (its config.json is not a "
                             "VJEPA2ForVideoClassification)")
        return lambda: VideoClassifier(config.classifier, config.encoder.vit)
    raise KeyError(f"V-JEPA 2 has no part {part!r}; parts are encoder, predictor, classifier")


def load_hf_part(folder: Path, part: str, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 progress: bool = True) -> nn.Module:
    """`part` of the Hugging Face V-JEPA 2 folder, loaded in `dtype` on `device`."""
    config = read_hf_config(folder)
    return build(part_factory(config, part), dtype, device, hf_tensors(folder, progress), hf_mapper(config, part))
