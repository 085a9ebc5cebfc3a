"""Qwen3-Omni requests <-> tensors.

Requests: chat `messages` (and `tools`, where the template lists them) are rendered with the checkpoint's
chat template (generation prompt added); a bare `text` (e.g. /v1/audio/speech input) is taken as one user message, after the
request's `media` when there are any (/v1/audio/transcriptions, native /generate). Walk inputs:
`prompt_ids` [n]; with media, the placeholders expanded and the encoders' inputs, `mm_mask`,
`mm_kinds` and M-RoPE `positions` (`media_inputs`; a video's sound track heard too unless option
`use_audio_in_video` is false), and option "media" set so the thinker lane
starts with `prefill_media`; for a speaking request also `talker_positions` [3, m], the M-RoPE
positions of the talker's prompt (the user turns' tokens then the 9 assistant rows, as the
reference's `get_rope_index` lays them out). Unset `thinker.max_tokens` means "until eos or the end
of the context": it is set to what the context leaves.

Option `structured_outputs` (engines/grammar.py) constrains the thinker's text, as for the Llama family; tool
calls are written as the template says (`tool_format`). Option `logprobs` (the thinker's, `resolve`) gives each
text token's log-probability and alternatives, as for the Llama family.

Outputs: "text" token ids -> UTF-8-safe text deltas (stop strings, usage); "audio" -> float32
samples at 24 kHz.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import cached_property
from typing import Any

import torch

from mstar.engines.sampling import SamplingParams
from mstar.models.base import OutputDecoder, Processor
from mstar.models.common.tool_calls import ToolCallFormat, template_format
from mstar.models.llama.processor import TextDecoder
from mstar.models.qwen3_omni import options as omni_options
from mstar.models.qwen3_omni.code2wav_config import SAMPLE_RATE
from mstar.models.qwen3_omni.config import OmniConfig
from mstar.models.qwen3_omni.options import MEDIA_OPTION
from mstar.models.qwen3_omni.positions import mrope_positions
from mstar.models.qwen3_omni.talker import _user_mask

ASSISTANT_ROWS = 9  # the talker prompt's assistant part: 3 role rows, 4 pads, tts_bos, first text


class OmniProcessor(Processor):
    """Tokenizes chats for the thinker, lays out the talker's positions, detokenizes text."""

    sample_rate = SAMPLE_RATE
    returns_logprobs = True  # the thinker's text tokens, for option logprobs (the talker's codes carry none)

    def __init__(self, tokenizer, omni: OmniConfig, max_model_len: int, media=None, grammars=None) -> None:
        self.tokenizer = tokenizer
        self.omni = omni
        self.max_model_len = max_model_len
        self.media = media  # media_inputs.MediaSpec; None: text only
        self.grammars = grammars  # the thinker's `Grammars` (models/common/grammar.py); None: refused
        self.follows_grammars = grammars is not None

    @cached_property
    def tool_format(self) -> ToolCallFormat | None:
        """How the chat template writes tool calls; None: it writes none."""
        return template_format(self.tokenizer)

    def warm(self) -> None:
        self.tokenizer.warm()

    def inputs(self, request: Mapping[str, Any], options: dict[str, Any]) -> dict[str, torch.Tensor]:
        media = list(request.get("media") or ())
        messages = request.get("messages")
        if not messages:
            text = request.get("text")
            if (not isinstance(text, str) or not text) and not media:
                raise ValueError("a qwen3_omni request needs non-empty 'messages' (chat) or 'text'")
            parts = [{"type": m.get("type")} for m in media] + ([{"type": "text", "text": text}] if text else [])
            messages = [{"role": "user", "content": parts if media else text}]
        prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=request.get("tools"))
        ids = self.tokenizer.encode(prompt, add_special_tokens=False, max_tokens=self.max_model_len)
        return self.prompt_inputs(ids, media, options)

    def prompt_inputs(self, ids: list[int] | torch.Tensor, media: list[Mapping[str, Any]],
                      options: dict[str, Any]) -> dict[str, torch.Tensor]:
        """Walk inputs of tokenized prompt `ids` with one placeholder per item of `media` (see the module
        doc); sets the request's "media" and default thinker.max_tokens options."""
        options.pop(MEDIA_OPTION, None)  # only this method decides which prefill walk runs
        ids = [int(t) for t in ids]
        rope: dict[str, Any] = {}
        if media:
            if self.media is None:
                raise ValueError("this qwen3_omni processor takes no media (built without encoder configs)")
            from mstar.models.qwen3_omni.media_inputs import media_prompt

            prepared = media_prompt(ids, media, self.media, self.omni.thinker.tokens,
                                    use_audio_in_video=bool(options.get("use_audio_in_video", True)))
            out, rope = prepared.inputs, prepared.rope
            options[MEDIA_OPTION] = list(prepared.kinds)
        else:
            out = {"prompt_ids": torch.tensor(ids, dtype=torch.long)}
        self._check_room(out["prompt_ids"].numel(), options)
        if "audio" in (options.get("modalities") or ()):
            out["talker_positions"] = self.talker_positions(out["prompt_ids"], **rope)
        return out

    def _check_room(self, n: int, options: dict[str, Any]) -> None:
        room = self.max_model_len - n
        max_tokens = options.get("thinker.max_tokens")
        if room < 1 or (max_tokens is not None and max_tokens > room):
            raise ValueError(f"the {n}-token prompt with max_tokens={max_tokens} does not fit the "
                             f"thinker's context of {self.max_model_len} tokens; shorten it (or its media) "
                             "or lower max_tokens")
        if max_tokens is None:
            options["thinker.max_tokens"] = room

    def talker_positions(self, ids: torch.Tensor, **rope: Any) -> torch.Tensor:
        """[3, m] M-RoPE positions of the talker prompt built from prompt `ids` [n] (`rope`: the media
        grids and lengths `positions.mrope_positions` takes, as the thinker's positions used)."""
        token_ids = self.omni.token_ids
        rope_ids = torch.cat([ids[_user_mask(ids, token_ids)],
                              torch.full((ASSISTANT_ROWS,), token_ids["tts_pad"], dtype=torch.long)])
        assert self.omni.talker is not None
        positions, _delta = mrope_positions(rope_ids, self.omni.talker.tokens, **rope)
        return positions

    @property
    def voices(self) -> tuple[str, ...]:
        return tuple(sorted(s.capitalize() for s in self.omni.talker.speakers)) if self.omni.talker else ()

    def validate_options(self, options: Mapping[str, Any]) -> None:
        speakers = self.omni.talker.speakers if self.omni.talker else {}
        omni_options.validate(options, speakers)
        if "audio" in (options.get("modalities") or ()) and self.omni.talker is None:
            raise ValueError("this checkpoint has no talker (enable_audio_output is false); ask for text only")
        if options.get("n", 1) != 1:
            raise ValueError(f"n={options['n']!r}: a single request generates one answer")
        # OpenAI speech's `speed` and `instructions` have no talker input to reach: refused, not ignored.
        if options.get("speed", 1.0) != 1.0:
            raise ValueError(f"speed={options['speed']!r}: the talker cannot change its speaking rate; use 1.0")
        if options.get("instructions"):
            raise ValueError("instructions: the talker takes no style instructions; say it in the text instead")
        if options.get("talker.structured_outputs") is not None:
            raise ValueError("talker.structured_outputs: only the thinker's text follows a grammar; set "
                             "structured_outputs (or thinker.structured_outputs)")
        spec = SamplingParams.from_options({"structured_outputs": options.get("thinker.structured_outputs")},
                                           SamplingParams()).structured_outputs
        if spec is not None:
            if self.grammars is None:
                raise ValueError("structured_outputs: this model does not constrain its output to a grammar")
            self.grammars.matcher(spec)  # a spec that cannot compile is refused here

    def decode_output(self, name: str, tensor: torch.Tensor, options: Mapping[str, Any]) -> Any:
        if name == "text":
            return self.tokenizer.decode(tensor.tolist(), skip_special_tokens=True)
        return tensor.detach().float().cpu().numpy()

    def output_decoder(self, options: Mapping[str, Any], inputs: Mapping[str, torch.Tensor]) -> OutputDecoder:
        return TextDecoder(self, omni_options.scoped(options, "thinker"), inputs)  # the text is the thinker's
