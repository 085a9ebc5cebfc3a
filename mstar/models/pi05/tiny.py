"""A tiny Pi0.5 for CPU tests and `--tiny` runs: random weights, the full architecture at toy widths.

Three cameras of 32x32 pixels (16 patches of 8x8 each), a 2-layer Gemma prefix of width 64 and a 2-layer
expert of width 32 (both 2 query heads and one KV head of 16 channels), chunks of 10 actions, and a small
SentencePiece-style tokenizer (`<s>` first) over the prompts' vocabulary.
"""

from __future__ import annotations

from pathlib import Path

from mstar.layers.siglip import SiglipShape
from mstar.models.pi05.config import GemmaShape, Pi05Config

TINY_VOCAB = 1024  # the tiny tokenizer's ids (259 base pieces and 400 merges) all fit


def tiny_config() -> Pi05Config:
    """The tiny policy: 7-D actions, 8-D states padded to 32, 10 Euler steps."""
    return Pi05Config(
        vision=SiglipShape(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=48, patch_size=8, image_size=32),
        llm=GemmaShape(width=64, depth=2, mlp_dim=96, num_heads=2, num_kv_heads=1, head_dim=16),
        expert=GemmaShape(width=32, depth=2, mlp_dim=64, num_heads=2, num_kv_heads=1, head_dim=16),
        vocab_size=TINY_VOCAB, state_dim=8, action_dim=7, chunk_size=10, max_prompt_tokens=160)


def _corpus() -> list[str]:
    words = "Task: State: Action: pick up the red cube and place it in bowl open drawer close fold towel push"
    numbers = " ".join(str(n) for n in range(256))
    return [words, numbers, f"Task: pick up the cube, State: {numbers};\nAction: "] * 4


def tiny_tokenizer_folder(cache_dir: str | Path | None = None) -> Path:
    """A tokenizer folder (tokenizer.json and tokenizer_config.json), built once per machine."""
    from mstar.models.common.tokenizer_build import (
        cached_folder,
        train_sentencepiece_bpe,
        write_tokenizer_folder,
    )

    def build(folder: Path) -> None:
        tok = train_sentencepiece_bpe(_corpus(), vocab_size=400)
        assert tok.get_vocab_size() <= TINY_VOCAB
        write_tokenizer_folder(folder, tok, {"bos_token": "<s>", "eos_token": "</s>", "pad_token": None})

    return cached_folder("pi05-tiny-v1", build, cache_dir)
