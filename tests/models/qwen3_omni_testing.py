"""Helpers for Qwen3-Omni parity tests: tiny HF reference models saved in the Hub layout."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F


class FullAttention:
    """No cache: plain causal attention over the tokens of one full-recompute forward."""

    def forward(self, layer, q, k, v):
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True)
        return out.transpose(0, 1)


def randomize(module: torch.nn.Module, seed: int, std: float = 0.3) -> None:
    """Random weights, norms near 1 and non-zero biases, so that loading every tensor matters."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else std * noise)


def save_checkpoint(folder: Path, hf_parts: dict[str, torch.nn.Module], config: dict) -> None:
    """Write `config` and the HF parts' weights as saved by `save_pretrained` (Hub layout), each under
    its prefix ("thinker.", "talker."), into one model.safetensors."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    tensors = {}
    for prefix, part in hf_parts.items():
        part.save_pretrained(folder / prefix)
        with safe_open(str(folder / prefix / "model.safetensors"), "pt") as f:
            tensors.update({f"{prefix}.{k}": f.get_tensor(k) for k in f.keys()})
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config))
