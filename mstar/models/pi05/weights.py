"""Checkpoint names of lerobot's Pi0.5 (`PI05Policy.save_pretrained`: config.json, model.safetensors) and
building the loaded networks.

lerobot's names, with or without the policy's leading `model.`:
- `paligemma_with_expert.paligemma.model.vision_tower.vision_model.*`: SigLIP, our names but for the separate
  q/k/v projections, which fill our fused qkv by rows (`layers.siglip.checkpoint_name`);
  `...model.multi_modal_projector.linear`: the projector;
- `paligemma_with_expert.paligemma.model.language_model.*`: the Gemma prefix (q/k/v and gate/up fused by
  rows); the token embedding is `embed_tokens` or, saved tied, `paligemma.lm_head`;
- `paligemma_with_expert.gemma_expert.model.*`: the action expert, its norms adaptive (`*.dense`);
- `action_in_proj`, `action_out_proj`, `time_mlp_in`, `time_mlp_out` (older: `action_time_mlp_*`).
The older transformers layout (`paligemma.language_model.model.*`, `paligemma.vision_tower.*`) and the tower
without `vision_model.` (as transformers 5 saves it) read too.
`UNUSED` lists what inference never reads; every other name must land on a parameter.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch
from torch import nn

from mstar.layers import siglip
from mstar.models.common.loading import fill_dummy_weights, load_named_tensors, weight_files
from mstar.models.common.meta import build_on_meta
from mstar.models.pi05.config import Pi05Config
from mstar.models.pi05.prompt import Quantiles

Mapped = tuple[str, int] | None  # (our parameter in Pi05Network, first row it fills), or None: not read

_PALI = "paligemma_with_expert.paligemma."
_EXPERT = "paligemma_with_expert.gemma_expert."
_VISION = _PALI + "model.vision_tower.vision_model."
_LLM = _PALI + "model.language_model."
UNUSED = (  # never read at inference: the prefix's outputs (only its keys and values are), the expert's LM head
    _LLM + "norm.weight", _EXPERT + "lm_head.weight")
_OLD_LAYOUT = ((_PALI + "language_model.model.", _LLM), (_PALI + "language_model.lm_head.", _PALI + "lm_head."),
               (_PALI + "vision_tower.", _PALI + "model.vision_tower."),
               (_PALI + "multi_modal_projector.", _PALI + "model.multi_modal_projector."))
_TOP = {"action_in_proj": "policy.expert.action_in", "action_out_proj": "policy.expert.action_out",
        "time_mlp_in": "policy.expert.time_in", "time_mlp_out": "policy.expert.time_out",
        "action_time_mlp_in": "policy.expert.time_in", "action_time_mlp_out": "policy.expert.time_out",
        _PALI + "model.multi_modal_projector.linear": "vision.projector"}
_LAYER = re.compile(r"(.*\.layers)\.(\d+)\.(.+)\.(weight|bias)$")


def canonical(name: str) -> str:
    """A checkpoint name without the policy's `model.` and in the current transformers layout."""
    name = name.removeprefix("model.")
    for old, new in _OLD_LAYOUT:
        if name.startswith(old):
            name = new + name[len(old):]
            break
    tower = _PALI + "model.vision_tower."
    if name.startswith(tower) and not name.startswith(_VISION):  # transformers 5 saves the tower unwrapped
        name = _VISION + name[len(tower):]
    return name


def mapper(config: Pi05Config, names: Iterable[str]) -> Callable[[str], Mapped]:
    """lerobot checkpoint names -> Pi05Network parameters (the embedding from `embed_tokens` if `names`
    holds it, else from the tied `lm_head`); UNUSED names -> None; anything unknown -> itself (so the
    loader reports it)."""
    has_embed = any(canonical(n) == _LLM + "embed_tokens.weight" for n in names)
    vision_width, llm, expert = config.vision.hidden_size, config.llm, config.expert

    def gemma_rows(shape, inner: str) -> tuple[str, int] | None:
        q, kv = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
        table = {"self_attn.q_proj": ("attn.qkv", 0), "self_attn.k_proj": ("attn.qkv", q),
                 "self_attn.v_proj": ("attn.qkv", q + kv), "self_attn.o_proj": ("attn.o", 0),
                 "mlp.gate_proj": ("mlp.gate_up_proj", 0), "mlp.up_proj": ("mlp.gate_up_proj", shape.mlp_dim),
                 "mlp.down_proj": ("mlp.down_proj", 0), "input_layernorm": ("norm1", 0),
                 "post_attention_layernorm": ("norm2", 0), "input_layernorm.dense": ("norm1.dense", 0),
                 "post_attention_layernorm.dense": ("norm2.dense", 0)}
        return table.get(inner)

    def mapped(name: str) -> Mapped:
        key = canonical(name)
        if key in UNUSED or (has_embed and key == _PALI + "lm_head.weight"):
            return None
        if key in (_LLM + "embed_tokens.weight", _PALI + "lm_head.weight"):
            return "policy.llm.embed.weight", 0
        if key.startswith(_VISION):  # the tower's names are transformers' but for the fused q/k/v
            target, row = siglip.checkpoint_name(key[len(_VISION):], vision_width)
            return "vision." + target, row
        if key == _EXPERT + "model.norm.dense.weight" or key == _EXPERT + "model.norm.dense.bias":
            return "policy.expert.norm.dense." + key.rpartition(".")[2], 0
        stem, _, leaf = key.rpartition(".")
        if stem in _TOP:
            return f"{_TOP[stem]}.{leaf}", 0
        match = _LAYER.match(key)
        if match is None:
            return name, 0
        stack, index, inner, leaf = match.groups()
        for prefix, ours, shape in ((_LLM + "layers", "policy.llm", llm), (_EXPERT + "model.layers", "policy.expert",
                                                                              expert)):
            if stack == prefix and (rows := gemma_rows(shape, inner)) is not None:
                return f"{ours}.layers.{index}.{rows[0]}.{leaf}", rows[1]
        return name, 0

    return mapped


def part_mapper(full: Callable[[str], Mapped], part: str) -> Callable[[str], Mapped]:
    """`full` narrowed to one part of Pi05Network ("vision" or "policy"), names relative to that part."""
    prefix = part + "."

    def mapped(name: str) -> Mapped:
        target = full(name)
        if target is None or not target[0].startswith(("vision.", "policy.")):
            return target  # skipped, or unknown: the loader reports it
        return (target[0][len(prefix):], target[1]) if target[0].startswith(prefix) else None

    return mapped


def _weight_files(folder: Path) -> list[Path]:
    """The folder's weight files, not the normalizer statistics lerobot saves beside them (`policy_*`)."""
    return [f for f in weight_files(Path(folder))[1] if not f.name.startswith("policy_")]


def checkpoint_names(folder: Path) -> list[str]:
    """Every tensor name of a checkpoint folder, read without loading a tensor."""
    from safetensors import safe_open

    names: list[str] = []
    for file in _weight_files(folder):
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            names.extend(handle.keys())
    return names


def tensors(folder: Path, wanted: Callable[[str], Mapped]) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of a checkpoint folder that `wanted` maps (others are never read)."""
    from safetensors import safe_open

    for file in _weight_files(folder):
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            for name in handle.keys():
                if wanted(name) is not None:
                    yield name, handle.get_tensor(name)


def build(factory: Callable[[], nn.Module], dtype: torch.dtype, device: torch.device | str,
          named: Iterable[tuple[str, torch.Tensor]] | None, name_map: Callable[[str], Mapped] | None,
          seed: int = 0, std: float = 0.02) -> nn.Module:
    """`factory()` on `device` in `dtype`, loaded from `named` through `name_map`, or seeded random weights
    (norm weights zero: Gemma's norms scale by 1 + weight) when `named` is None."""
    from mstar.models.pi05.gemma import GemmaNorm

    module = build_on_meta(factory, dtype, device)
    if torch.device(device).type == "meta":  # shapes only (a build that sizes the model): nothing to fill
        return module
    if named is None:
        fill_dummy_weights(module, seed=seed, std=std)
        generator = torch.Generator(device=device).manual_seed(seed + 1)
        with torch.no_grad():
            for sub in module.modules():
                if isinstance(sub, GemmaNorm):  # its weight is an offset from 1
                    sub.weight.normal_(0.0, std, generator=generator)
    else:
        load_named_tensors(module, named, name_map)
    return module


def load_part(folder: Path, config: Pi05Config, part: str, dtype: torch.dtype = torch.float32,
              device: torch.device | str = "cpu") -> nn.Module:
    """`part` ("vision" or "policy") of a lerobot Pi0.5 folder, loaded in `dtype` on `device`."""
    from mstar.models.pi05.network import PolicyNet
    from mstar.models.pi05.siglip import VisionTower

    name_map = part_mapper(mapper(config, checkpoint_names(folder)), part)
    factory = (lambda: VisionTower(config.vision, config.llm.width)) if part == "vision" else \
        (lambda: PolicyNet(config))
    return build(factory, dtype, device, tensors(folder, name_map), name_map)


def read_config(folder: Path) -> Pi05Config:
    """The `Pi05Config` of a lerobot folder's config.json."""
    from mstar.models.common.loading import read_config_json

    return Pi05Config.from_lerobot(read_config_json(folder, "pass a lerobot Pi0.5 folder (lerobot/pi05_base or a "
                                                            "fine-tune saved by lerobot)"))


def read_stats(folder: Path, feature: str) -> Quantiles:
    """`feature`'s ("observation.state" or "action") quantiles from the normalizer files lerobot saves beside
    the weights (`policy_*processor_step_*_normalizer_processor.safetensors`); identity when there are none."""
    from safetensors.torch import load_file

    for path in sorted(Path(folder).glob("policy_*processor_step_*normalizer_processor.safetensors")):
        stats = load_file(str(path))
        if f"{feature}.q01" in stats and f"{feature}.q99" in stats:
            return Quantiles(stats[f"{feature}.q01"].double().numpy(), stats[f"{feature}.q99"].double().numpy())
        if f"{feature}.mean" in stats:
            raise ValueError(f"{path.name} normalises {feature} by mean and std; Pi0.5 serving reads quantiles "
                             "(q01/q99, lerobot's QUANTILES mode)")
    return Quantiles()
