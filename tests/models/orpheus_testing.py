"""Helpers for the Orpheus runtime tests: a tiny HF checkpoint (transformers layout) plus a tiny SNAC folder."""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict
from pathlib import Path

import torch

from mstar.config import config_file


def yaml_config(name: str, **overrides) -> dict:
    """mstar/configs/<name>.yaml as a dict, on CPU, with a small KV pool; `overrides` replace top-level keys."""
    import yaml

    data = yaml.safe_load(config_file(name).read_text())
    return {**data, "device": "cpu", "kv_cache": {"max_num_pages": 256, "page_size": 16}, **overrides}


def make_checkpoint(path: Path, seed: int = 0):
    """A tiny Orpheus: transformers LlamaForCausalLM (random, audio-shaped), the tiny tokenizer, a tiny SNAC.

    Returns (HF model, OrpheusTokens, model_kwargs to load it through --model-path).
    """
    import transformers

    from mstar.models.common.text import Tokenizer
    from mstar.models.llama.tiny import tiny_tokenizer_folder
    from mstar.models.orpheus.tiny import TINY_SNAC, shape_audio_lm, tiny_lm_hf_config, tiny_tokens
    from mstar.models.orpheus.weights import load_snac

    tok_dir = tiny_tokenizer_folder()
    tokens = tiny_tokens(Tokenizer.from_pretrained(tok_dir))
    torch.manual_seed(seed)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**tiny_lm_hf_config(tokens))).float().eval()
    with torch.no_grad():
        for param in hf.parameters():
            if param.ndim == 1:
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            else:
                param.normal_(0.0, 0.1)
        shape_audio_lm(hf, tokens, seed=seed)
    hf.save_pretrained(path)
    for file in tok_dir.iterdir():
        shutil.copy(file, path / file.name)
    snac_dir = path / "snac"
    snac_dir.mkdir()
    (snac_dir / "config.json").write_text(json.dumps(asdict(TINY_SNAC)))
    torch.save(load_snac(TINY_SNAC, None, torch.device("cpu"), seed=seed + 1).state_dict(), snac_dir / "pytorch_model.bin")
    return hf, tokens, {"audio_token_base": tokens.base, "snac_path": str(snac_dir)}
