"""Streaming detokenization: token ids in, only newly completed text out, with stop strings.

Why not decode token by token: a byte-level BPE token can hold half of a UTF-8 character (emoji, CJK),
and sentencepiece decoders drop the leading space of the first token they see. So each step decodes a
short window that starts at the previously emitted tokens and emits the difference between the window's
text with and without the new tokens; a window whose text ends in U+FFFD is an incomplete character and
waits for more tokens. Concatenating the pieces gives `tokenizer.decode(all_ids)` (without the HF
punctuation clean-up).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

logger = logging.getLogger(__name__)

_REPLACEMENT = "\ufffd"
# A UTF-8 character spans at most 4 bytes, so at most 4 tokens can be waiting for one; past this many
# held tokens the bytes are invalid for good and are emitted as U+FFFD rather than stalling the stream.
_MAX_HELD_TOKENS = 16
# Prompt tokens kept as left context so the first generated token decodes as it would after the prompt.
_PROMPT_CONTEXT = 6


class IncrementalDetokenizer:
    """Turns one request's generated token ids into text pieces as they become final.

    `push(ids)` returns the newly completed text (maybe ""); `flush()` returns the rest at the end. With
    `stop` strings, text is cut before the first stop string (kept if `include_stop_str_in_output`),
    `finished` becomes True, `finish_reason` "stop" and `stop_reason` the matched string; text that could
    begin a stop string is held back until it can no longer. `prompt_ids` (optional) are left context:
    then a sentencepiece first token keeps its leading space, as it would inside the full sequence.
    """

    def __init__(self, tokenizer, *, skip_special_tokens: bool = True, stop: Sequence[str] = (),
                 include_stop_str_in_output: bool = False, prompt_ids: Sequence[int] = ()) -> None:
        if isinstance(stop, str):
            raise TypeError(f"stop must be a list of strings, got the string {stop!r}; pass [{stop!r}]")
        if any(not s for s in stop):
            raise ValueError(f"stop strings must be non-empty, got {list(stop)!r}")
        self._backend = getattr(tokenizer, "backend", tokenizer)  # our Tokenizer or a tokenizers.Tokenizer
        self._skip = skip_special_tokens
        self.stop = tuple(stop)
        self.include_stop_str_in_output = include_stop_str_in_output
        self._ids: list[int] = list(prompt_ids[-_PROMPT_CONTEXT:])
        self._prefix = 0  # window start: tokens already emitted, decoded only as context
        self._read = len(self._ids)  # tokens before this index have been emitted
        self._held = ""  # decoded text held back because it may start a stop string
        self.finished = False
        """True after a stop string matched or `flush()` ran."""
        self.finish_reason: str | None = None
        """"stop" when a stop string matched, else None (eos and length are the engine's to report)."""
        self.stop_reason: str | None = None
        """The stop string that matched."""

    @property
    def holding(self) -> bool:
        """True while text or tokens already pushed are held back (an incomplete character, a possible stop
        string): the pieces returned so far then end inside the pushed tokens' text."""
        return bool(self._held) or (not self.finished and self._read < len(self._ids))

    def push(self, token_ids: Sequence[int] | int) -> str:
        """Add generated ids; return the text they complete. After `finished`, returns "" and ignores ids."""
        if self.finished:
            return ""
        self._ids.extend([token_ids] if isinstance(token_ids, int) else token_ids)
        return self._cut_at_stop(self._held + self._decode_new(final=False), final=False)

    def flush(self) -> str:
        """End of generation: return everything still held (incomplete bytes decode as U+FFFD)."""
        if self.finished:
            return ""
        text = self._cut_at_stop(self._held + self._decode_new(final=True), final=True)
        self.finished = True
        return text

    def _decode(self, ids: list[int]) -> str:
        return self._backend.decode(ids, skip_special_tokens=self._skip)

    def _decode_new(self, final: bool) -> str:
        if self._read >= len(self._ids):
            return ""
        before = self._decode(self._ids[self._prefix:self._read])
        end, after = self._complete_end(final)
        if end is None or len(after) < len(before):
            return ""
        if not after.startswith(before):  # decoders are prefix-stable in practice; log if one is not
            logger.debug("detokenizer window not prefix-stable: %r -> %r", before, after)
        self._prefix, self._read = self._read, end
        return after[len(before):]

    def _complete_end(self, final: bool) -> tuple[int | None, str]:
        """The last token boundary (within a character's worth of tokens) where the text is complete."""
        total = len(self._ids)
        after = self._decode(self._ids[self._prefix:])
        if final or total - self._read > _MAX_HELD_TOKENS:
            return total, after
        for end in range(total, max(self._read, total - 4), -1):
            if end < total:
                after = self._decode(self._ids[self._prefix:end])
            if not after.endswith(_REPLACEMENT):
                return end, after
        return None, after

    def _cut_at_stop(self, text: str, final: bool) -> str:
        self._held = ""
        if not self.stop or not text:
            return text
        hit = min(((text.find(s), -len(s), s) for s in self.stop if s in text), default=None)
        if hit is not None:
            index, _, matched = hit
            self.finished, self.finish_reason, self.stop_reason = True, "stop", matched
            return text[:index + len(matched)] if self.include_stop_str_in_output else text[:index]
        keep = 0 if final else _stop_prefix_length(text, self.stop)
        self._held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep]


def _stop_prefix_length(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string (0 if none)."""
    longest = min(len(text), max(len(s) for s in stops) - 1)
    for k in range(longest, 0, -1):
        tail = text[-k:]
        if any(s.startswith(tail) for s in stops):
            return k
    return 0
