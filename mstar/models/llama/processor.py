"""Text requests <-> token ids for the dense decoder family.

Requests: `{"messages": [...]}` (and `"tools"`, OpenAI function tools the template lists for the model)
is rendered with the tokenizer's chat template (generation prompt added; the template supplies any bos) or `{"text": prompt}` is a raw completion prompt (encoded
with the tokenizer's special tokens, e.g. a bos). Both become the `prompt_ids` walk input.

Options: sampling keys are validated by `SamplingParams`; `stop` (list of strings) ends the text
at the first match (finish_reason "stop"); `max_tokens` left unset means "until eos or the end of
the context" (never a hidden cap). `n` > 1 is not a walk option: a server fans such a request out
as n requests, the i-th with seed `seed + i` when a seed is given, and merges the choices.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import cached_property
from typing import Any

import torch

from mstar.engines.sampling import SamplingParams
from mstar.models.base import OutputDecoder, Processor, TokenLogprobs
from mstar.models.common.detokenizer import IncrementalDetokenizer
from mstar.models.common.text import Tokenizer
from mstar.models.common.tool_calls import ToolCallFormat, template_format

LOGPROB_OUTPUTS = ("logprob", "top_ids", "top_logprobs")  # the engine's outputs for option `logprobs`
# the options a text model reads beside its engine's SAMPLING_OPTIONS: TextDecoder's, and `n` (only 1)
TEXT_OPTIONS = frozenset({"stop", "skip_special_tokens", "include_stop_str_in_output", "n"})


class TextProcessor(Processor):
    """Tokenizes prompts and detokenizes generated ids for one tokenizer and context length."""

    returns_logprobs = True

    def __init__(self, tokenizer: Tokenizer, max_model_len: int, grammars: Any = None) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.grammars = grammars  # `Grammars` of structured outputs (models/common/grammar.py); None: refused
        self.follows_grammars = grammars is not None

    def warm(self) -> None:
        self.tokenizer.warm()

    @cached_property
    def tool_format(self) -> ToolCallFormat | None:
        """How the chat template writes tool calls (models/common/tool_calls.py); None: it writes none."""
        return template_format(self.tokenizer)

    def inputs(self, request: Mapping[str, Any], options: dict[str, Any]) -> dict[str, torch.Tensor]:
        if request.get("media"):
            raise ValueError("this model takes text only; remove the media parts of the request")
        if request.get("messages"):
            prompt = self.tokenizer.apply_chat_template(text_messages(request["messages"]), add_generation_prompt=True,
                                                        tools=request.get("tools"))
            ids = self.tokenizer.encode(prompt, add_special_tokens=False, max_tokens=self.max_model_len)  # bos in it
        elif isinstance(request.get("text"), str) and request["text"]:
            ids = self.tokenizer.encode(request["text"], add_special_tokens=True, max_tokens=self.max_model_len)
        else:
            raise ValueError("a text request needs non-empty 'messages' (chat) or 'text' (completion)")
        self._check_length(len(ids), options.get("max_tokens"))
        return {"prompt_ids": torch.tensor(ids, dtype=torch.long)}

    def _check_length(self, prompt_len: int, max_tokens: Any) -> None:
        if prompt_len >= self.max_model_len:
            raise ValueError(f"the prompt has {prompt_len} tokens, which leaves no room under the model's "
                             f"context of {self.max_model_len} tokens; shorten it")
        if isinstance(max_tokens, int) and prompt_len + max_tokens > self.max_model_len:
            raise ValueError(f"max_tokens={max_tokens} plus the {prompt_len}-token prompt exceeds the model's "
                             f"context of {self.max_model_len} tokens; use max_tokens <= "
                             f"{self.max_model_len - prompt_len} or leave it unset")

    def validate_options(self, options: Mapping[str, Any]) -> None:
        params = SamplingParams.from_options(dict(options), SamplingParams())
        if params.structured_outputs is not None:
            if self.grammars is None:
                raise ValueError("structured_outputs: this model does not constrain its output to a grammar")
            self.grammars.matcher(params.structured_outputs)  # a spec that cannot compile is refused here
        stop = options.get("stop")
        if stop is not None and (isinstance(stop, str) or not isinstance(stop, list | tuple)
                                 or not all(isinstance(s, str) and s for s in stop)):
            raise ValueError(f"stop={stop!r}: use a list of non-empty strings")
        n = options.get("n", 1)
        if n != 1:
            raise ValueError(f"n={n!r}: a single request generates one sequence; submit n requests "
                             "(seeds seed+i) and merge them")

    def decode_output(self, name: str, tensor: torch.Tensor, options: Mapping[str, Any]) -> Any:
        if name == "text":
            return self.tokenizer.decode(tensor.tolist(), skip_special_tokens=True)
        return tensor.detach().cpu().numpy()

    def output_decoder(self, options: Mapping[str, Any], inputs: Mapping[str, torch.Tensor]) -> OutputDecoder:
        return TextDecoder(self, options, inputs)


class TextDecoder(OutputDecoder):
    """Streams text deltas (complete UTF-8 only), cuts at stop strings, counts usage.

    With option `logprobs` (k >= 0), each token's "logprob" (and k "top_ids" / "top_logprobs") outputs
    fill its entry, and text goes out in groups: the entries of some tokens as "logprobs" values (each a
    `TokenLogprobs`), then one "text" value, their text. A group closes once every entry in it is complete and
    the detokenizer holds none of its tokens' text back (an incomplete character, a possible stop string wait
    for the token that settles them), so a route pairing a text value with the entries just before it sends
    each token's logprobs with its text. Two groups differ from their tokens' text: a token with no text (a
    skipped special token) closes a group without text, and when a stop string matches, the last group holds
    the tokens the cut text began in. `logprobs` holds complete entries only, in order.
    """

    def __init__(self, processor: TextProcessor, options: Mapping[str, Any],
                 inputs: Mapping[str, torch.Tensor]) -> None:
        super().__init__(processor, options)
        prompt = inputs["prompt_ids"].tolist() if "prompt_ids" in inputs else []
        self.prompt_tokens = len(prompt)
        self.detokenizer = IncrementalDetokenizer(
            processor.tokenizer, skip_special_tokens=bool(options.get("skip_special_tokens", True)),
            stop=tuple(options.get("stop") or ()),
            include_stop_str_in_output=bool(options.get("include_stop_str_in_output", False)),
            prompt_ids=prompt)
        # None: no logprobs wanted, or a processor whose graph does not emit them (the Qwen3-Omni thinker's)
        self.top_logprobs: int | None = options.get("logprobs") if processor.returns_logprobs else None
        self._held = ""  # text of the group not yet handed out
        self._group: list[TokenLogprobs] = []  # complete entries of the group's tokens
        self._open: TokenLogprobs | None = None  # the entry of the last token, until its values have all come

    def push(self, name: str, value: torch.Tensor) -> list[tuple[str, Any]]:
        if name in LOGPROB_OUTPUTS:
            return self._push_logprobs(name, value)
        if name != "text":
            return super().push(name, value)
        if self.detokenizer.finished:  # tokens already in flight when a stop string matched
            return []
        ids = value.reshape(-1).tolist()
        self.completion_tokens += len(ids)
        text = self.detokenizer.push(ids)
        if self.detokenizer.finished:
            self.finish_reason = self.detokenizer.finish_reason
        if self.top_logprobs is None:
            return [("text", text)] if text else []
        assert len(ids) == 1 and self._open is None, "one token a step, its logprobs before the next"
        self._held += text
        if self.detokenizer.finished:  # the request stops here: this token's values will not be read
            return self._close()
        self._open = TokenLogprobs(ids[0])
        return []

    def _push_logprobs(self, name: str, value: torch.Tensor) -> list[tuple[str, Any]]:
        entry, values = self._open, value.reshape(-1).tolist()
        if entry is None:  # a token dropped after a stop string: its logprobs go with it
            return []
        if name == "logprob":
            entry.logprob = float(values[0])
        elif name == "top_ids":
            entry.top = [(int(t), 0.0) for t in values]
        else:
            entry.top = [(t, float(lp)) for (t, _), lp in zip(entry.top, values)]
        if name != ("logprob" if self.top_logprobs == 0 else "top_logprobs"):
            return []
        self._open = None
        self.logprobs.append(entry)
        self._group.append(entry)
        return [] if self.detokenizer.holding else self._close()

    def _close(self) -> list[tuple[str, Any]]:
        """The group's entries, then its text."""
        group, text = self._group, self._held
        self._group, self._held, self._open = [], "", None
        return [("logprobs", e) for e in group] + [("text", text)] * bool(text)

    def flush(self) -> list[tuple[str, Any]]:
        self._held += self.detokenizer.flush()
        return self._close()

    def token_text(self, token_id: int) -> str:
        return self.processor.tokenizer.decode([token_id], skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> bytes:
        return self.processor.tokenizer.token_bytes(token_id)


def text_messages(messages: list[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """`messages` with each list of text parts joined into one string by newlines, as vLLM joins them for
    templates that concatenate `content` as a string (every Llama-family template here does)."""
    return [{**m, "content": "\n".join(part.get("text") or "" for part in m["content"])}
            if isinstance(m.get("content"), list) else m for m in messages]
