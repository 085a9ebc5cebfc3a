"""Checkpoint names of the Cosmos3 generator and building it loaded.

Diffusers layout: `<root>/transformer/` (Cosmos3OmniTransformer, sharded safetensors with
diffusion_pytorch_model.safetensors.index.json). Per layer, the understanding tower's `to_q/to_k/to_v`
and the generation tower's `add_q_proj/add_k_proj/add_v_proj` land at row offsets of each tower's
fused `qkv`, `gate_proj`/`up_proj` at row offsets of `gate_up_proj`. The reasoner's own tensors (its
output head `lm_head` and its final norm `norm`) are not the generator's: `READ_BY_REASONER` names them.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from pathlib import Path

import torch

from mstar.models.common import loading
from mstar.models.common.meta import build_on_meta
from mstar.models.cosmos3.config import Cosmos3TransformerConfig
from mstar.models.cosmos3.transformer import Cosmos3Generator

logger = logging.getLogger(__name__)

READ_BY_REASONER = ("lm_head.weight", "norm.weight")  # the reasoner's head and final norm
_LAYER = re.compile(r"layers\.(\d+)\.(.+)")


def _tower_parts(config: Cosmos3TransformerConfig) -> dict[str, tuple[str, int]]:
    """Checkpoint layer-local prefix -> (our layer-local prefix, row offset)."""
    q, kv, inter = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim, config.intermediate_size
    parts = {}
    for tower, names in (("und", ("to_q", "to_k", "to_v", "to_out", "norm_q", "norm_k", "input_layernorm",
                                   "post_attention_layernorm", "mlp")),
                         ("gen", ("add_q_proj", "add_k_proj", "add_v_proj", "to_add_out", "norm_added_q",
                                  "norm_added_k", "input_layernorm_moe_gen", "post_attention_layernorm_moe_gen",
                                  "mlp_moe_gen"))):
        to_q, to_k, to_v, out, norm_q, norm_k, attn_norm, mlp_norm, mlp = names
        parts.update({
            f"self_attn.{to_q}.": (f"{tower}.qkv.", 0), f"self_attn.{to_k}.": (f"{tower}.qkv.", q),
            f"self_attn.{to_v}.": (f"{tower}.qkv.", q + kv), f"self_attn.{out}.": (f"{tower}.o.", 0),
            f"self_attn.{norm_q}.": (f"{tower}.q_norm.", 0), f"self_attn.{norm_k}.": (f"{tower}.k_norm.", 0),
            f"{attn_norm}.": (f"{tower}.attn_norm.", 0), f"{mlp_norm}.": (f"{tower}.mlp_norm.", 0),
            f"{mlp}.gate_proj.": (f"{tower}.mlp.gate_up_proj.", 0),
            f"{mlp}.up_proj.": (f"{tower}.mlp.gate_up_proj.", inter),
            f"{mlp}.down_proj.": (f"{tower}.mlp.down_proj.", 0),
        })
    return parts


def generator_mapper(config: Cosmos3TransformerConfig) -> loading.NameMapper:
    """Maps a diffusers Cosmos3OmniTransformer tensor name to (parameter of `Cosmos3Generator`, row offset);
    None for the reasoner's tensors."""
    parts = _tower_parts(config)

    def mapper(name: str) -> tuple[str, int] | None:
        if name in READ_BY_REASONER:
            return None
        if name == "embed_tokens.weight":
            return "embed.weight", 0
        if name == "norm_moe_gen.weight":
            return "gen_norm.weight", 0
        match = _LAYER.fullmatch(name)
        if match:
            rest = match.group(2)
            for old, (new, offset) in parts.items():
                if rest.startswith(old):
                    return f"layers.{match.group(1)}.{new}{rest[len(old):]}", offset
        return name, 0  # the modality heads keep their names; an unknown one is reported by the loader

    return mapper


def build_generator(config: Cosmos3TransformerConfig, dtype: torch.dtype | None = None,
                    device: str | torch.device = "cpu") -> Cosmos3Generator:
    """A generator in `dtype` (the timestep embedder stays float32, as the reference keeps it) on
    `device`, weights UNINITIALISED."""
    model = build_on_meta(lambda: Cosmos3Generator(config), dtype or config.dtype, device)
    assert isinstance(model, Cosmos3Generator)
    model.time_embedder.float()
    return model


def load_generator(root: str | Path, load_format: str = "auto", dtype: torch.dtype | None = None,
                   device: str | torch.device = "cpu", progress: bool = True) -> Cosmos3Generator:
    """The generator of the pipeline folder or Hub repo `root` (its transformer/ sub-folder)."""

    folder = component_folder(root, "transformer")
    config = Cosmos3TransformerConfig.from_hf(loading.read_config_json(folder, "pass a Cosmos3 pipeline folder"))
    model = build_generator(config, dtype, device)
    if load_format == "dummy":
        loading.fill_dummy_weights(model)
    else:
        loading.load_named_tensors(model, loading.iter_component_tensors(folder, progress), generator_mapper(config))
    logger.info("loaded the Cosmos3 generator (%s) from %s", load_format, folder)
    return model


def component_folder(root: str | Path, name: str) -> Path:
    """`root`'s sub-folder `name`; CheckpointNotFoundError says what a Cosmos3 folder holds."""
    folder = loading.resolve_checkpoint(root) / name
    if not folder.is_dir():
        raise loading.CheckpointNotFoundError(
            f"no {name}/ folder in {folder.parent}; pass a Diffusers-format Cosmos3 folder (e.g. nvidia/Cosmos3-Nano) "
            "holding transformer/, vae/, scheduler/ and text_tokenizer/")
    return folder


def checkpoint_shapes(model_factory: Callable[[], torch.nn.Module]) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor of a reference module built on the meta device (no memory)."""
    with torch.device("meta"):
        module = model_factory()
    return {name: tuple(t.shape) for name, t in module.state_dict().items()}
