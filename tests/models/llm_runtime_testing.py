"""Helpers for the LLM runtime tests: tiny HF checkpoints with the tiny tokenizer, HF greedy references."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

PROMPTS = [
    "Hello, how are you today?",
    "The capital of France is",
    "def add(a, b):",
    "A quick brown fox jumps over the lazy dog; the user asks and the assistant answers. " * 3,
    "1 2 3 4 5",
    "Rome",
    "the assistant answers the user",
    "The capital of Italy is Rome. The capital of France is Paris. Hello",
]


def make_checkpoint(arch: str, path: Path, seed: int = 0):
    """Save a tiny random HF model `arch` (vocab sized for the tiny tokenizer) plus the tokenizer to `path`."""
    import transformers

    from mstar.models.common.text import Tokenizer
    from mstar.models.llama.tiny import tiny_hf_config, tiny_tokenizer_folder

    tok_dir = tiny_tokenizer_folder()
    tokenizer = Tokenizer.from_pretrained(tok_dir)
    cfg = {**tiny_hf_config(arch), "vocab_size": tokenizer.vocab_size, "eos_token_id": tokenizer.eos_token_id}
    config_cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
                  "qwen3": transformers.Qwen3Config}[cfg["model_type"]]
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(config_cls(**cfg), dtype=torch.float32).eval()
    with torch.no_grad():  # random norms/biases too, and weights large enough for varied greedy text
        for name, param in hf.named_parameters():
            if param.ndim == 1:
                param.copy_((1.0 if "norm" in name else 0.0) + 0.1 * torch.randn_like(param))
            else:
                param.normal_(0.0, 0.3)
    hf.save_pretrained(path)
    for file in tok_dir.iterdir():
        shutil.copy(file, path / file.name)
    return hf, tokenizer


def hf_greedy(hf, prompt_ids: list[int], new_tokens: int) -> list[int]:
    """transformers' greedy `generate`, eos ignored, new token ids only."""
    hf.generation_config.eos_token_id = None  # generate past eos, as ignore_eos does
    ids = torch.tensor([prompt_ids])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                      pad_token_id=0)
    new = out[0, len(prompt_ids):].tolist()
    assert len(new) == new_tokens, f"transformers stopped after {len(new)} tokens"
    return new


def token_ids(handle) -> list[int]:
    """The raw token ids a request streamed as output "text" (submit() handles give tensors)."""
    return [int(t) for event in handle for t in event.value.reshape(-1).tolist() if event.name == "text"]
