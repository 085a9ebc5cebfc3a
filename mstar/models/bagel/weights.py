"""Checkpoint names of BAGEL-7B-MoT and building the loaded networks of each component.

`ema.safetensors` holds the LLM (`language_model.model.*`, `language_model.lm_head.*`), the generation heads
(`time_embedder.*`, `vae2llm.*`, `llm2vae.*`, `latent_pos_embed.*`), the ViT (`vit_model.vision_model.*`,
its patch embedding already a Linear over (patch row, column, channel)), the connector (`connector.*`) and
`vit_pos_embed.*`; `ae.safetensors` holds the FLUX autoencoder under its own names. Each component reads
its own tensors and skips the others'. Separate q/k/v (and gate/up) tensors land at row offsets of our
fused projections; the generation expert's `*_moe_gen` tensors go to its own modules.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import nn

from mstar.layers import siglip
from mstar.layers.fp8 import empty_fp8_decoder, method_block
from mstar.models.bagel.config import EMA_WEIGHTS, VAE_WEIGHTS, BagelConfig
from mstar.models.bagel.llm import BagelLLM
from mstar.models.bagel.vae import FluxVAE
from mstar.models.bagel.vit import VisionTower
from mstar.models.common import loading
from mstar.models.common.meta import build_on_meta

logger = logging.getLogger(__name__)

_LLM_HEADS = ("time_embedder.", "vae2llm.", "llm2vae.", "latent_pos_embed.")
_VIT_PARTS = ("connector.", "vit_pos_embed.")


def llm_mapper(cfg: BagelConfig) -> loading.NameMapper:
    """Maps an `ema.safetensors` name to (parameter of `BagelLLM`, row offset); None for the ViT's tensors."""
    llm = cfg.llm
    q, kv = llm.num_heads * llm.head_dim, llm.num_kv_heads * llm.head_dim
    attn = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", q), "v_proj": ("qkv_proj", q + kv),
            "o_proj": ("o_proj", 0), "q_norm": ("q_norm", 0), "k_norm": ("k_norm", 0)}
    mlp = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", llm.intermediate_size),
           "down_proj": ("down_proj", 0)}
    layer = re.compile(r"language_model\.model\.layers\.(\d+)\.(self_attn|mlp|mlp_moe_gen)\.(\w+?)(_moe_gen)?\."
                       r"(weight|bias)")

    def mapper(name: str) -> tuple[str, int] | None:
        if name.startswith(("vit_model.", *_VIT_PARTS)):
            return None
        if name.startswith(_LLM_HEADS):
            return name, 0
        if name == "language_model.lm_head.weight":
            return "language_model.lm_head.weight", 0
        match = layer.fullmatch(name)
        if match:
            index, block, part, gen, kind = match.groups()
            target, offset = (attn if block == "self_attn" else mlp).get(part, (part, 0))
            module = "self_attn_moe_gen" if gen else block  # the checkpoint keeps the gen attention in self_attn
            return f"language_model.layers.{index}.{module}.{target}.{kind}", offset
        return name.replace("language_model.model.", "language_model.", 1), 0  # embeddings, norms, layer norms

    return mapper


def vit_mapper(cfg: BagelConfig) -> loading.NameMapper:
    """Maps an `ema.safetensors` name to (parameter of `VisionTower`, row offset); None for the LLM's tensors."""
    prefix = "vit_model.vision_model."

    def mapper(name: str) -> tuple[str, int] | None:
        if name.startswith(_VIT_PARTS):
            return name, 0
        if not name.startswith(prefix):
            return None
        target, offset = siglip.checkpoint_name(name[len(prefix):], cfg.vit.hidden_size)
        return "vit." + target, offset

    return mapper


def vae_mapper(name: str) -> tuple[str, int]:
    """`ae.safetensors` names are ours."""
    return name, 0


def build_llm(cfg: BagelConfig, dtype: torch.dtype, device: str | torch.device,
              quantization: str | None = None) -> BagelLLM:
    """The LLM with uninitialised weights. With `quantization` ("fp8", "fp8_block"; layers/fp8.py) every decoder
    layer's linears of both experts (q/k/v, o, gate/up, down) are empty `Fp8Linear`s, quantized as their weights
    load: they hold almost all of the LLM's weights and FLOPs. The rest keeps `dtype`: embeddings, norms and
    `lm_head` (as for the other LLMs), and the generation heads (`time_embedder`, `vae2llm`, `llm2vae`), which
    touch the latents and the flow time directly and are a fraction of a percent of the FLOPs."""
    def make() -> BagelLLM:
        llm = BagelLLM(cfg)
        if quantization is not None:
            empty_fp8_decoder(llm.language_model.layers, method_block(quantization))
        return llm

    module = build_on_meta(make, dtype, device)
    assert isinstance(module, BagelLLM)
    return module


def build_vit(cfg: BagelConfig, dtype: torch.dtype, device: str | torch.device) -> VisionTower:
    module = build_on_meta(lambda: VisionTower(cfg.vit, cfg.llm.hidden_size, cfg.vit_max_patches_per_side),
                           dtype, device)
    assert isinstance(module, VisionTower)
    return module


def build_vae(cfg: BagelConfig, dtype: torch.dtype, device: str | torch.device) -> FluxVAE:
    module = build_on_meta(lambda: FluxVAE(cfg.vae), dtype, device)
    assert isinstance(module, FluxVAE)
    return module


PARTS: dict[str, tuple[Callable[..., nn.Module], Callable[[BagelConfig], Callable], str]] = {
    "llm": (build_llm, llm_mapper, EMA_WEIGHTS),
    "vit": (build_vit, vit_mapper, EMA_WEIGHTS),
    "vae": (build_vae, lambda cfg: vae_mapper, VAE_WEIGHTS),
}


def load_part(part: str, cfg: BagelConfig, folder: Path | None, dtype: torch.dtype, device: str | torch.device,
              seed: int = 0, std: float = 0.02, quantization: str | None = None) -> nn.Module:
    """Component `part` ("llm", "vit" or "vae") in eval mode: its tensors from `folder`, or seeded random
    weights when `folder` is None (the position tables then hold their sine-cosine values). `quantization`
    (the llm only: `build_llm`) quantizes as the weights load or are drawn; ValueError for another part."""
    build, mapper, file = PARTS[part]
    if quantization is not None and part != "llm":
        raise ValueError(f"bagel {part!r} cannot be quantized ({quantization!r}); only the llm can")
    module = build_llm(cfg, dtype, device, quantization) if part == "llm" else build(cfg, dtype, device)
    if folder is None:
        fill_random(module, seed, std)
        return module
    path = folder / file
    if not path.is_file():
        raise loading.CheckpointNotFoundError(f"no {file} in {folder}; pass --model-path with a BAGEL-7B-MoT folder "
                                              "(or --load-format dummy for random weights)")
    logger.info("loading BAGEL %s from %s", part, path)
    names = mapper(cfg)
    loading.load_named_tensors(module, _read(path, names), names)
    return module


def _read(path: Path, mapper: loading.NameMapper) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of `path` that `mapper` places, read one at a time (ema.safetensors holds the LLM's and the
    ViT's tensors: each component reads only its own)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt", device="cpu") as handle:
        for name in handle.keys():
            if mapper(name) is not None:
                yield name, handle.get_tensor(name)


def fill_random(module: nn.Module, seed: int, std: float) -> None:
    """Seeded random weights (`loading.fill_dummy_weights`) with the fixed position tables filled properly."""
    from mstar.models.bagel.embeddings import PositionEmbedding

    loading.fill_dummy_weights(module, seed=seed, std=std)
    for sub in module.modules():
        if isinstance(sub, PositionEmbedding):
            sub.reset()
