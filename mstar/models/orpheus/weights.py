"""Checkpoints of Orpheus: the LM (a Llama checkpoint folder, loaded by mstar.models.llama) and SNAC.

SNAC checkpoints (hubertsiuzdak/snac_24khz: config.json + pytorch_model.bin, or *.safetensors)
store weight-normed convolutions as (g, v) pairs; `fold_weight_norm` (models/common/loading.py) turns
each pair into the plain `weight` once at load.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from mstar.models.common.loading import fold_weight_norm, read_config_json
from mstar.models.orpheus.snac import SnacConfig, SnacDecoder

logger = logging.getLogger(__name__)

ORPHEUS_REPO = "canopylabs/orpheus-3b-0.1-ft"
SNAC_REPO = "hubertsiuzdak/snac_24khz"
SNAC_PATTERNS = ("*.json", "*.bin", "*.safetensors")
# Orpheus-3B's config.json (Llama-3.2-3B shape, vocabulary extended with audio tokens): used for
# --load-format dummy when no checkpoint folder is given.
ORPHEUS_3B_CONFIG = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 156940, "hidden_size": 3072,
    "intermediate_size": 8192, "num_hidden_layers": 28, "num_attention_heads": 24, "num_key_value_heads": 8,
    "head_dim": 128, "rms_norm_eps": 1e-5, "max_position_embeddings": 131072, "tie_word_embeddings": True,
    "rope_theta": 500000.0, "torch_dtype": "bfloat16", "bos_token_id": 128000, "eos_token_id": 128009,
    "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
}
_SKIPPED = ("encoder.", "quantizer.quantizers.")  # + in_proj: the decoder never encodes


def snac_folder(path_or_repo: str | Path | None) -> Path:
    """The SNAC checkpoint folder: a local folder, or a Hub repo id (default hubertsiuzdak/snac_24khz)."""
    from mstar.models.common.loading import resolve_checkpoint

    return resolve_checkpoint(path_or_repo or SNAC_REPO, allow_patterns=SNAC_PATTERNS)


def read_snac_config(folder: Path) -> SnacConfig:
    """The SnacConfig of a checkpoint folder's config.json."""
    return SnacConfig.from_dict(read_config_json(
        folder / "config.json", f"pass model_kwargs.snac_path with a SNAC folder holding config.json and "
        f"pytorch_model.bin (like {SNAC_REPO})"))


def _snac_tensors(folder: Path) -> dict[str, torch.Tensor]:
    if files := sorted(folder.glob("*.safetensors")):
        from safetensors.torch import load_file

        return {k: v for f in files for k, v in load_file(str(f)).items()}
    file = folder / "pytorch_model.bin"
    if not file.is_file():
        raise FileNotFoundError(f"no SNAC weights in {folder} (looked for *.safetensors and pytorch_model.bin)")
    return torch.load(file, map_location="cpu", weights_only=True)


def load_snac(cfg: SnacConfig, folder: Path | None, device: torch.device, seed: int = 0) -> SnacDecoder:
    """A SnacDecoder in float32 on `device`: weights from `folder`, or seeded random ones when None."""
    with torch.random.fork_rng(devices=[]):  # random init must not move the caller's generator
        torch.manual_seed(seed)
        module = SnacDecoder(cfg)
    if folder is not None:
        state = fold_weight_norm(_snac_tensors(folder).items())
        state = {k: v for k, v in state.items()
                 if not k.startswith(_SKIPPED[0]) and ".in_proj." not in k}
        missing, unexpected = module.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ValueError(f"SNAC checkpoint {folder} does not match its config: missing {missing[:5]}, "
                             f"unexpected {unexpected[:5]}")
        logger.info("loaded SNAC decoder from %s", folder)
    return module.to(device).eval()
