"""Qwen3-Omni requests <-> tensors.

Requests: chat `messages` are rendered with the checkpoint's chat template (generation prompt
added); a bare `text` (e.g. /v1/audio/speech input) is taken as one user message. Walk inputs:
`prompt_ids` [n]; for a speaking request also `talker_positions` [3, m], the M-RoPE positions of
the talker's prompt (the user turns' tokens then the 9 assistant rows, as the reference's
`get_rope_index` lays them out). Unset `thinker.max_tokens` means "until eos or the end of the
context": it is set to what the context leaves.

Outputs: "text" token ids -> UTF-8-safe text deltas (stop strings, usage); "audio" -> float32
samples at 24 kHz.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from mstar.models.base import OutputDecoder, Processor
from mstar.models.llama.processor import TextDecoder
from mstar.models.qwen3_omni import options as omni_options
from mstar.models.qwen3_omni.code2wav_config import SAMPLE_RATE
from mstar.models.qwen3_omni.config import OmniConfig
from mstar.models.qwen3_omni.positions import mrope_positions
from mstar.models.qwen3_omni.talker import _user_mask

ASSISTANT_ROWS = 9  # the talker prompt's assistant part: 3 role rows, 4 pads, tts_bos, first text


class OmniProcessor(Processor):
    """Tokenizes chats for the thinker, lays out the talker's positions, detokenizes text."""

    sample_rate = SAMPLE_RATE

    def __init__(self, tokenizer, omni: OmniConfig, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.omni = omni
        self.max_model_len = max_model_len

    def inputs(self, request: Mapping[str, Any], options: dict[str, Any]) -> dict[str, torch.Tensor]:
        if request.get("media"):
            raise ValueError("image, audio and video inputs are not wired into qwen3_omni yet; send text")
        messages = request.get("messages")
        if not messages:
            text = request.get("text")
            if not isinstance(text, str) or not text:
                raise ValueError("a qwen3_omni request needs non-empty 'messages' (chat) or 'text'")
            messages = [{"role": "user", "content": text}]
        prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        ids = torch.tensor(self.tokenizer.encode(prompt, add_special_tokens=False), dtype=torch.long)
        room = self.max_model_len - ids.numel()
        max_tokens = options.get("thinker.max_tokens")
        if room < 1 or (max_tokens is not None and max_tokens > room):
            raise ValueError(f"the {ids.numel()}-token prompt with max_tokens={max_tokens} does not fit the "
                             f"thinker's context of {self.max_model_len} tokens; shorten it or lower max_tokens")
        if max_tokens is None:
            options["thinker.max_tokens"] = room
        out = {"prompt_ids": ids}
        if "audio" in (options.get("modalities") or ()):
            out["talker_positions"] = self.talker_positions(ids)
        return out

    def talker_positions(self, ids: torch.Tensor) -> torch.Tensor:
        """[3, m] M-RoPE positions of the talker prompt built from prompt `ids` [n]."""
        token_ids = self.omni.token_ids
        rope_ids = torch.cat([ids[_user_mask(ids, token_ids)],
                              torch.full((ASSISTANT_ROWS,), token_ids["tts_pad"], dtype=torch.long)])
        assert self.omni.talker is not None
        positions, _delta = mrope_positions(rope_ids, self.omni.talker.tokens)
        return positions

    def validate_options(self, options: Mapping[str, Any]) -> None:
        speakers = self.omni.talker.speakers if self.omni.talker else {}
        omni_options.validate(options, speakers)
        if "audio" in (options.get("modalities") or ()) and self.omni.talker is None:
            raise ValueError("this checkpoint has no talker (enable_audio_output is false); ask for text only")
        if options.get("n", 1) != 1:
            raise ValueError(f"n={options['n']!r}: a single request generates one answer")

    def decode_output(self, name: str, tensor: torch.Tensor, options: Mapping[str, Any]) -> Any:
        if name == "text":
            return self.tokenizer.decode(tensor.tolist(), skip_special_tokens=True)
        return tensor.detach().float().cpu().numpy()

    def output_decoder(self, options: Mapping[str, Any], inputs: Mapping[str, torch.Tensor]) -> OutputDecoder:
        return TextDecoder(self, options, inputs)
