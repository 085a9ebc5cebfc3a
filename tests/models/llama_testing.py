"""Test helpers for the dense decoder family: a dense attention backend and HF reference models."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F


class DenseAttention:
    """Reference attention backend: per-sequence, per-layer K/V lists, causal SDPA in float32.

    `prepare(seq_ids, query_lens)` describes the packed batch (sequences one after another);
    a sequence's cache grows with each step it appears in.
    """

    def __init__(self) -> None:
        self.cache: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
        self.seq_ids: list[str] = ["seq"]
        self.query_lens: list[int] | None = None

    def prepare(self, seq_ids: list[str], query_lens: list[int]) -> None:
        self.seq_ids, self.query_lens = seq_ids, query_lens

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        lens = self.query_lens or [q.shape[0]]
        outs, start = [], 0
        for seq_id, n in zip(self.seq_ids, lens, strict=True):
            outs.append(
                self._attend(seq_id, layer, q[start : start + n], k[start : start + n], v[start : start + n])
            )
            start += n
        assert start == q.shape[0], "query_lens must cover the packed batch"
        return torch.cat(outs)

    def _attend(self, seq_id: str, layer: int, q, k, v) -> torch.Tensor:
        layers = self.cache.setdefault(seq_id, {})
        if layer in layers:
            k = torch.cat([layers[layer][0], k])
            v = torch.cat([layers[layer][1], v])
        layers[layer] = (k, v)
        n_new, n_all = q.shape[0], k.shape[0]
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        # query i sits at position n_all - n_new + i and sees keys up to it
        mask = torch.ones(n_new, n_all, dtype=torch.bool, device=q.device).tril(diagonal=n_all - n_new)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).float(), k.transpose(0, 1).float(), v.transpose(0, 1).float(), attn_mask=mask
        )
        return out.transpose(0, 1).to(q.dtype)


def save_hf_model(name: str, path: Path, seed: int = 0, max_shard_size: str | None = None):
    """Build the tiny HF reference model `name` (random, fp32), save it to `path`, return it."""
    import transformers

    from mstar.models.llama.tiny import tiny_hf_config

    cfg = tiny_hf_config(name)
    config_cls = {
        "llama": transformers.LlamaConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
    }[cfg["model_type"]]
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(config_cls(**cfg), dtype=torch.float32).eval()
    with torch.no_grad():  # HF init leaves biases 0 and norms 1; randomise them so loading them is tested
        for pname, param in hf.named_parameters():
            if param.ndim == 1:
                param.copy_((1.0 if "norm" in pname else 0.0) + 0.1 * torch.randn_like(param))
            else:
                param.normal_(0.0, 0.3)  # large enough that greedy text does not collapse to one token
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    hf.save_pretrained(path, **kwargs)
    return hf


def greedy(model, prompt: list[int], steps: int) -> list[int]:
    """Greedy generation with our model and a DenseAttention: prefill, then one token per step."""
    attn = DenseAttention()
    ids = torch.tensor(prompt)
    hidden = model(ids, torch.arange(len(prompt)), attn)
    out = [int(model.compute_logits(hidden[-1:]).argmax(-1))]
    for _ in range(steps - 1):
        pos = len(prompt) + len(out) - 1
        hidden = model(torch.tensor(out[-1:]), torch.tensor([pos]), attn)
        out.append(int(model.compute_logits(hidden).argmax(-1)))
    return out
