"""Accuracy of FP8 weights against the unquantized ones on SmolLM2-135M-Instruct (real weights, CPU).

For each prompt of a fixed set (chat-formatted), the unquantized model (float32, the GGUF's values)
greedily writes --new-tokens tokens; then every variant reads prompt + that continuation once (teacher
forcing) and is scored at each continuation position against the reference's next-token distribution:
  agreement  share of positions where the variant's argmax is the reference's token
  mean KL    KL(p_ref || p_variant) in nats, averaged over positions
  same text  prompts whose free-running greedy continuation equals the reference's
Variants: "fp8" (per-channel scales), "fp8_block" (128x128 blocks), and "bf16" (weights rounded to bfloat16)
as a yardstick. Everything computes in float32 with the emulated FP8 linear (layers/fp8.py), which the GPU
kernels must reproduce.

    python3 benchmarks/fp8_accuracy.py [--new-tokens 24] [--out benchmarks/results/fp8_accuracy_cpu.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install

from benchmarks.chat_prompts import CHAT_PROMPTS as PROMPTS  # noqa: E402

VARIANTS = ("fp8", "fp8_block", "bf16")


class CausalAttention:
    """Causal attention over one sequence, keeping each layer's keys and values so that greedy decoding
    feeds one token a step."""

    def __init__(self) -> None:
        self.cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if layer in self.cache:
            k, v = torch.cat([self.cache[layer][0], k]), torch.cat([self.cache[layer][1], v])
        self.cache[layer] = (k, v)
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        # query i sits at position len(k) - len(q) + i and sees keys up to it
        mask = torch.ones(q.shape[0], k.shape[0], dtype=torch.bool).tril(diagonal=k.shape[0] - q.shape[0])
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask)
        return out.transpose(0, 1)


@torch.no_grad()
def logits(model, ids: list[int], start: int = 0, attn: CausalAttention | None = None) -> torch.Tensor:
    """float32 logits [len(ids), vocab] of `ids` at positions start.. (after `attn`'s cached ones)."""
    t = torch.tensor(ids)
    return model.compute_logits(model(t, torch.arange(start, start + len(ids)), attn or CausalAttention()))


def greedy(model, prompt: list[int], new_tokens: int) -> list[int]:
    """`new_tokens` greedy tokens after `prompt` (the prompt once, then one token a step)."""
    attn = CausalAttention()
    out = [int(logits(model, prompt, 0, attn)[-1].argmax())]
    while len(out) < new_tokens:
        out.append(int(logits(model, out[-1:], len(prompt) + len(out) - 1, attn)[-1].argmax()))
    return out


def score(reference, variant, prompts: list[list[int]], continuations: list[list[int]],
          free_running: bool = True) -> dict[str, float]:
    """Agreement, mean KL and (with `free_running`) the same-text share of `variant` against `reference`,
    whose greedy `continuations` of `prompts` are given."""
    agree, kls, same = [], [], 0
    for prompt, cont in zip(prompts, continuations, strict=True):
        ids = prompt + cont
        window = slice(len(prompt) - 1, len(ids) - 1)  # positions that predict the continuation
        ref, var = logits(reference, ids)[window], logits(variant, ids)[window]
        agree.append((var.argmax(-1) == torch.tensor(cont)).float())
        kls.append((ref.softmax(-1) * (ref.log_softmax(-1) - var.log_softmax(-1))).sum(-1))
        same += free_running and greedy(variant, prompt, len(cont)) == cont
    scores = {"agreement": torch.cat(agree).mean().item(), "mean_kl": torch.cat(kls).mean().item(),
              "max_kl": torch.cat(kls).max().item()}
    return scores | ({"same_text": same / len(prompts)} if free_running else {})


def load(variant: str | None):
    """SmolLM2-135M-Instruct in float32: unquantized (None), FP8 (`fp8`, `fp8_block`) or bf16-rounded weights."""
    from mstar.models.common.smollm2 import ensure_smollm2_checkpoint
    from mstar.models.llama.weights import load_model

    path = ensure_smollm2_checkpoint()
    quantization = variant if variant in ("fp8", "fp8_block") else None
    model = load_model(path, dtype=torch.float32, progress=False, quantization=quantization)
    if variant == "bf16":
        with torch.no_grad():
            for module in model.model.layers.modules():
                if isinstance(module, torch.nn.Linear):
                    module.weight.copy_(module.weight.bfloat16())
    return model


def prompt_ids(prompts: list[str]) -> list[list[int]]:
    """The chat-formatted token ids of each prompt, as the server builds them."""
    from mstar.models.common.smollm2 import ensure_smollm2_checkpoint
    from mstar.models.common.text import Tokenizer

    tok = Tokenizer.from_pretrained(ensure_smollm2_checkpoint())
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True),
                       add_special_tokens=False) for p in prompts]


def measure(variants: tuple[str, ...] = VARIANTS, new_tokens: int = 24,
            free_running: bool = True) -> dict[str, dict[str, float]]:
    """variant -> its scores against the unquantized model over PROMPTS."""
    reference, prompts = load(None), prompt_ids(PROMPTS)
    continuations = [greedy(reference, prompt, new_tokens) for prompt in prompts]
    return {variant: score(reference, load(variant), prompts, continuations, free_running) for variant in variants}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    results = {"benchmark": "fp8_accuracy", "model": "SmolLM2-135M-Instruct",
               "command": "python3 benchmarks/fp8_accuracy.py " + " ".join(sys.argv[1:]),
               "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}",
               "prompts": len(PROMPTS), "new_tokens": args.new_tokens,
               "variants": measure(tuple(args.variants), args.new_tokens)}
    for name, r in results["variants"].items():
        print(f"{name:<10} agreement {r['agreement']:.4f}  mean KL {r['mean_kl']:.5f}  max KL {r['max_kl']:.4f}  "
              f"same text {r['same_text']:.3f}")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
