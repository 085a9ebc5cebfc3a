"""Helpers for Qwen3-Omni parity tests: tiny HF reference models saved in the Hub layout."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
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


def media_chat_request() -> dict:
    """A chat turn with an image (48x64 gradient) and 1.25 s of a 2 kHz tone at 16 kHz, then a question."""
    y, x = np.mgrid[0:48, 0:64]
    image = np.stack([x * 4, y * 5, (x + y) * 2], -1).astype(np.uint8)
    t = np.arange(20000) / 16000
    content = [{"type": "image_url"}, {"type": "input_audio"}, {"type": "text", "text": "What is this?"}]
    return {"messages": [{"role": "user", "content": content}],
            "media": [{"type": "image", "data": image},
                      {"type": "audio", "data": (0.3 * np.sin(2e3 * t)).astype(np.float32), "sample_rate": 16000}]}
