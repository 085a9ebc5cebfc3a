"""Orpheus requests <-> tensors: text and voice -> the prompt ids; audio chunks -> float32 samples.

Options: `voice` (one of VOICES), the sampling keys (defaults temperature 0.6, top_p 0.8,
repetition_penalty 1.3, max_tokens 1200; max_tokens counts LM tokens, 7 per 2048 samples), `seed`.
OpenAI's `speed` and `instructions` have no Orpheus meaning and are refused rather than ignored.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from mstar.engines.sampling import SamplingParams
from mstar.models.base import Processor
from mstar.models.orpheus.tokens import VOICES, OrpheusTokens


class OrpheusProcessor(Processor):
    """Builds `prompt_ids` from `{"text": ...}` (or the last user message) and the request's voice."""

    generated_stream = "codes"  # the LM's sampled tokens, streamed to the vocoder (model.py)

    def __init__(self, tokenizer, tokens: OrpheusTokens, max_model_len: int, sample_rate: int) -> None:
        self.tokenizer = tokenizer
        self.tokens = tokens
        self.max_model_len = max_model_len
        self.sample_rate = sample_rate

    def warm(self) -> None:
        self.tokenizer.warm()

    def inputs(self, request: Mapping[str, Any], options: dict[str, Any]) -> dict[str, torch.Tensor]:
        text = request.get("text")
        if not text and request.get("messages"):
            text = _last_user_text(request["messages"])
        if not isinstance(text, str) or not text.strip():
            raise ValueError("orpheus needs non-empty text to speak: pass 'text' (or a user message)")
        if request.get("media"):
            raise ValueError("orpheus takes text only; remove the media parts of the request")
        voice = options.get("voice", VOICES[0])
        ids = self.tokens.prompt_ids(self.tokenizer.encode(f"{voice}: {text}", add_special_tokens=True,
                                                             max_tokens=self.max_model_len))
        budget = options.get("max_tokens") or 0
        if len(ids) + budget > self.max_model_len:
            raise ValueError(f"the {len(ids)}-token prompt plus max_tokens={budget} exceeds the context of "
                             f"{self.max_model_len} tokens; shorten the text or lower max_tokens")
        return {"prompt_ids": torch.tensor(ids, dtype=torch.long)}

    @property
    def voices(self) -> tuple[str, ...]:
        return VOICES

    def validate_options(self, options: Mapping[str, Any]) -> None:
        voice = options.get("voice", VOICES[0])
        if voice not in VOICES:
            raise ValueError(f"unknown voice {voice!r}; orpheus voices are: {', '.join(VOICES)}")
        if options.get("speed", 1.0) != 1.0:
            raise ValueError(f"speed={options['speed']!r}: orpheus cannot change the speaking rate; use 1.0")
        if options.get("instructions"):
            raise ValueError("orpheus takes no instructions; put emotion tags like <laugh> in the text instead")
        params = SamplingParams.from_options(dict(options), SamplingParams())
        if params.max_tokens is None:
            raise ValueError("max_tokens must be set for orpheus (LM tokens; 7 make 2048 samples)")

    def decode_output(self, name: str, tensor: torch.Tensor, options: Mapping[str, Any]) -> Any:
        if name == "audio":
            return tensor.detach().float().cpu().numpy()
        return tensor.detach().cpu().numpy()


def _last_user_text(messages: list[Mapping[str, Any]]) -> str | None:
    for message in reversed(messages):
        if message.get("role") != "user":
            continue
        content = message.get("content") or ""
        if isinstance(content, str):
            return content
        return " ".join(p.get("text", "") for p in content if p.get("type") == "text")
    return None
