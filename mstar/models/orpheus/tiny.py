"""Tiny Orpheus for CPU tests and `--tiny`: a tiny Llama LM, a tiny SNAC, the tiny tokenizer.

The tiny token layout puts the custom tokens right after the tiny tokenizer's vocabulary and
uses a 64-entry codebook, so the LM vocabulary stays under a thousand ids.

Random weights would make the LM emit tokens that are almost never audio codes at their frame
place, and the vocoder would have nothing to decode. `shape_audio_lm` biases the embedding and the
output head so that a token of frame place p is most likely followed by one of place p + 1 (and
start-of-speech by place 0; code 0, which the original decoder drops, is left out): the LM then
speaks well-formed frames, while the choice inside a
place still depends on the whole network. Used for tiny and dummy weights only.
"""

from __future__ import annotations

from typing import Any

import torch

from mstar.models.orpheus.snac import SnacConfig
from mstar.models.orpheus.tokens import FRAME, OrpheusTokens

TINY_CODEBOOK = 64

TINY_SNAC = SnacConfig(encoder_dim=4, decoder_dim=32, codebook_size=TINY_CODEBOOK, codebook_dim=4)


def tiny_tokens(tokenizer) -> OrpheusTokens:
    """The tiny layout over the tiny tokenizer (custom tokens from its vocabulary size on)."""
    return OrpheusTokens(base=tokenizer.vocab_size, codebook_size=TINY_CODEBOOK,
                         end_of_text=tokenizer.eos_token_id, bos=tokenizer.bos_token_id)


def tiny_lm_hf_config(tokens: OrpheusTokens) -> dict[str, Any]:
    """A tiny Llama-3-style (llama3 rope scaling) HF config.json dict sized for `tokens`."""
    from mstar.models.llama.tiny import tiny_hf_config

    return {**tiny_hf_config("llama3"), "vocab_size": tokens.vocab_size, "max_position_embeddings": 2048,
            "bos_token_id": tokens.bos, "eos_token_id": tokens.end_of_speech}


@torch.no_grad()
def shape_audio_lm(model: torch.nn.Module, tokens: OrpheusTokens, seed: int = 0, strength: float = 3.0,
                   margin: float = 25.0) -> None:
    """Bias an HF-layout Llama (ours or transformers') toward well-formed audio frames (module doc).

    `strength`: per-element size of the place direction added to audio-token embeddings (large
    against what the layers add makes the frame order firmer); `margin`: the logit lead of the
    next place's tokens.
    """
    params = dict(model.named_parameters())
    embed, head = params["model.embed_tokens.weight"], params.get("lm_head.weight", params["model.embed_tokens.weight"])
    hidden = embed.shape[1]
    gen = torch.Generator().manual_seed(seed + 7)
    dirs = torch.nn.functional.normalize(torch.randn(FRAME, hidden, generator=gen), dim=-1).to(embed.device)
    params["model.norm.weight"].fill_(1.0)  # keep the final hidden state along the place direction
    for place in range(FRAME):
        lo = tokens.audio_offset + place * tokens.codebook_size
        rows = slice(lo + 1, lo + tokens.codebook_size)  # not code 0: the original decoder drops it
        embed[rows] += (strength * hidden**0.5 * dirs[place]).to(embed.dtype)
        # A final state along dirs[place - 1] (after RMSNorm its norm is sqrt(hidden)) scores `margin`.
        if head is not embed:
            head[rows] += (margin / hidden**0.5 * dirs[place - 1]).to(head.dtype)
    embed[tokens.start_of_speech] += (strength * hidden**0.5 * dirs[FRAME - 1]).to(embed.dtype)
