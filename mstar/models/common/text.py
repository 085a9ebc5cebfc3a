"""The text tokenizer: a `tokenizers` backend plus what a checkpoint folder says about it.

A Hugging Face checkpoint folder holds `tokenizer.json` (the model), `tokenizer_config.json` (bos/eos/pad
tokens, `added_tokens_decoder`, `chat_template`, `clean_up_tokenization_spaces`), optionally the chat
template in `chat_template.jinja` or `chat_template.json`, and `generation_config.json` whose
`eos_token_id` (an int or a list) adds to the end-of-sequence ids.

Missing chat template: `apply_chat_template` raises `ChatTemplateError` naming where it looked; there is
no silent ChatML fallback (a wrong template gives fluent nonsense), but `CHATML_TEMPLATE` can be passed.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mstar.models.common.chat_template import compile_template, render_chat, select_template
from mstar.models.common.token_files import load_chat_templates, read_json, token_content

logger = logging.getLogger(__name__)

_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")

# HF's `clean_up_tokenization_spaces`: undo the spaces word-piece era tokenizers put before punctuation.
# No token of a served vocabulary spans more characters, so a text this many times the context that
# is over the context in its first so many characters need not be tokenized whole.
CHARS_PER_TOKEN_BOUND = 32
_CLEANUPS = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
             (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # sentencepiece's byte tokens


def _byte_level_alphabet() -> dict[str, int]:
    """The byte-level BPE alphabet (GPT-2's): each byte is one printable character, printable ASCII and
    Latin-1 as themselves and the rest shifted past 255; returned as character -> byte."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = [b for b in range(256) if b not in kept]
    chars = {b: chr(b) for b in kept} | {b: chr(256 + i) for i, b in enumerate(shifted)}
    return {c: b for b, c in chars.items()}


_BYTE_OF_CHAR = _byte_level_alphabet()


@dataclass(frozen=True)
class TokenizerConfig:
    """What `tokenizer_config.json` (and friends) declare around the `tokenizer.json` model."""

    special_tokens: dict[str, str] = field(default_factory=dict)
    """bos_token/eos_token/unk_token/pad_token name -> token text, only those set."""
    chat_templates: dict[str, str] = field(default_factory=dict)
    """template name -> jinja source; a single template is stored as 'default'."""
    generation_eos_ids: tuple[int, ...] = ()
    """extra end-of-sequence ids from generation_config.json."""
    clean_up_tokenization_spaces: bool = False
    """apply HF's punctuation space clean-up in `decode` (Llama-3 checkpoints set it)."""


class Tokenizer:
    """Encodes text to ids and back, and renders chat prompts, like the checkpoint's HF fast tokenizer."""

    def __init__(self, backend, config: TokenizerConfig | None = None) -> None:
        self.backend = backend
        """the `tokenizers.Tokenizer`"""
        self.config = config or TokenizerConfig()
        added = backend.get_added_tokens_decoder()
        self._special_ids = frozenset(i for i, t in added.items() if t.special)
        self._added_ids = frozenset(added)
        self._byte_level = backend.decoder is not None and b'"ByteLevel"' in backend.decoder.__getstate__()

    @classmethod
    def from_pretrained(cls, path: str | Path) -> Tokenizer:
        """Load from a checkpoint folder, or from the vocabulary and chat template embedded in a `.gguf` file;
        raises FileNotFoundError naming the folder if tokenizer.json is absent."""
        from tokenizers import Tokenizer as Backend

        folder = Path(path)
        if folder.is_file() and folder.suffix == ".gguf":
            return cls.from_gguf(folder)
        if not (folder / "tokenizer.json").is_file():
            raise FileNotFoundError(f"no tokenizer.json in {folder}; pass the checkpoint folder that holds "
                                    "tokenizer.json (and tokenizer_config.json), or a .gguf file")
        backend = Backend.from_file(str(folder / "tokenizer.json"))
        raw = read_json(folder / "tokenizer_config.json")
        gen = read_json(folder / "generation_config.json").get("eos_token_id")
        gen_ids = tuple(gen if isinstance(gen, list) else [gen] if gen is not None else [])
        return cls._from_parts(backend, raw, load_chat_templates(folder, raw), gen_ids)

    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        """The tokenizer a GGUF file embeds (vocabulary, merges, special tokens, chat template)."""
        from tokenizers import Tokenizer as Backend

        from mstar.models.common.gguf_checkpoint import open_gguf
        from mstar.models.common.gguf_tokenizer import gguf_tokenizer

        tokenizer_json, raw = gguf_tokenizer(open_gguf(Path(path)))
        templates = {"default": raw["chat_template"]} if raw.get("chat_template") else {}
        return cls._from_parts(Backend.from_str(tokenizer_json), raw, templates, ())

    @classmethod
    def _from_parts(cls, backend: Any, raw: dict[str, Any], templates: dict[str, str],
                    gen_ids: Sequence[int]) -> Tokenizer:
        from tokenizers import AddedToken

        present = backend.get_added_tokens_decoder()
        for idx, spec in sorted((raw.get("added_tokens_decoder") or {}).items(), key=lambda kv: int(kv[0])):
            if int(idx) not in present:  # declared only in the config: add it as HF does
                token = AddedToken(spec["content"], special=spec.get("special", False),
                                   normalized=spec.get("normalized", False),
                                   lstrip=spec.get("lstrip", False), rstrip=spec.get("rstrip", False))
                (backend.add_special_tokens if token.special else backend.add_tokens)([token])
        specials = {n: token_content(raw[n]) for n in _SPECIAL_NAMES if raw.get(n) is not None}
        config = TokenizerConfig(special_tokens=specials, chat_templates=templates,
                                 generation_eos_ids=tuple(int(i) for i in gen_ids),
                                 clean_up_tokenization_spaces=bool(raw.get("clean_up_tokenization_spaces", False)))
        return cls(backend, config)

    # ---- vocabulary ----
    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        """The id of a token's text, or None."""
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        """The text of a token id (byte-level form), or None."""
        return self.backend.id_to_token(token_id)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for, exactly: a token holding part of a multi-byte character gives
        that part (its decoded text would be U+FFFD); an added token gives its text's UTF-8."""
        piece = self.backend.id_to_token(token_id)
        if piece is None:
            return b""
        if token_id not in self._added_ids:
            if self._byte_level and all(c in _BYTE_OF_CHAR for c in piece):
                return bytes(_BYTE_OF_CHAR[c] for c in piece)
            if match := _BYTE_FALLBACK.fullmatch(piece):
                return bytes([int(match.group(1), 16)])
            if not self._byte_level:
                return piece.replace("\u2581", " ").encode()  # sentencepiece's word marker is a space
        return piece.encode()

    def _special_id(self, name: str) -> int | None:
        text = self.config.special_tokens.get(name)
        return None if text is None else self.backend.token_to_id(text)

    @property
    def bos_token_id(self) -> int | None:
        """The beginning-of-sequence id, if the checkpoint declares one."""
        return self._special_id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        """The tokenizer's own end-of-sequence id (see also `eos_token_ids`)."""
        return self._special_id("eos_token")

    @property
    def pad_token_id(self) -> int | None:
        """The padding id, if declared."""
        return self._special_id("pad_token")

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every id that ends generation: the tokenizer's eos then generation_config's, without repeats."""
        ids = [self.eos_token_id] + list(self.config.generation_eos_ids)
        return tuple(dict.fromkeys(i for i in ids if i is not None))

    @property
    def special_ids(self) -> frozenset[int]:
        """Ids of added tokens marked special (those `skip_special_tokens` drops)."""
        return self._special_ids

    # ---- text ----
    def encode(self, text: str, add_special_tokens: bool = True, max_tokens: int | None = None) -> list[int]:
        """Token ids of `text`; `add_special_tokens` applies the checkpoint's post-processor (e.g. a bos).
        With `max_tokens`, a text that cannot fit is refused (ValueError) after tokenizing a prefix only,
        so a huge prompt costs little memory and time."""
        cut = None if max_tokens is None else max_tokens * CHARS_PER_TOKEN_BOUND
        if cut is not None and len(text) > cut:
            head = self.backend.encode(text[:cut], add_special_tokens=add_special_tokens).ids
            if len(head) > max_tokens:  # the whole text has at least len(head) - 1 tokens
                raise ValueError(f"the prompt has over {len(head) - 1} tokens in its first {cut} characters "
                                 f"(of {len(text)}), more than the model's context of {max_tokens} tokens; "
                                 "shorten it")
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False,
               clean_up_tokenization_spaces: bool | None = None) -> str:
        """Text of `ids`; clean-up defaults to the checkpoint's `clean_up_tokenization_spaces`."""
        text = self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        cleanup = self.config.clean_up_tokenization_spaces if clean_up_tokenization_spaces is None \
            else clean_up_tokenization_spaces
        if cleanup:
            for before, after in _CLEANUPS:
                text = text.replace(before, after)
        return text

    # ---- chat ----
    @property
    def chat_template(self) -> str | None:
        """The default chat template source, if any."""
        return self.config.chat_templates.get("default")

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                            tools: Sequence[Mapping[str, Any]] | None = None, *,
                            chat_template: str | None = None, **kwargs: Any) -> str:
        """Render a conversation to the prompt text, as transformers' `apply_chat_template(tokenize=False)`.

        `messages`: dicts (or pydantic models) with `role` and `content` (a string or a list of parts such
        as {"type": "text", "text": ...} or {"type": "image"}); other keys (tool_calls, name...) pass
        through. `tools`: JSON schemas. `chat_template`: a template name or source overriding the
        checkpoint's. Extra kwargs (e.g. `enable_thinking`, `documents`) reach the template, and override
        the special token variables. Raises ChatTemplateError if no template exists or it refuses.
        """
        source = select_template(self.config.chat_templates, chat_template, tools is not None)
        variables = {**self.config.special_tokens, **kwargs}
        return render_chat(source, messages, add_generation_prompt=add_generation_prompt, tools=tools,
                           **variables)

    def warm(self) -> None:
        """The first use's one-time work, ahead of requests: compile every chat template and render the
        default one (jinja2 imports and parses on first use), encode and decode a short text."""
        for name, source in self.config.chat_templates.items():
            try:
                compile_template(source)
                if name == "default":
                    self.apply_chat_template([{"role": "user", "content": "warm up"}])
            except Exception as exc:  # noqa: BLE001 - a template that fails, fails its requests, not startup
                logger.warning("chat template %r fails on a one-message chat (%s); requests that use it may fail",
                               name, exc)
        self.decode(self.encode("warm up", add_special_tokens=False))

    def __repr__(self) -> str:
        return (f"Tokenizer(vocab_size={self.vocab_size}, eos_token_ids={self.eos_token_ids}, "
                f"chat_template={'yes' if self.config.chat_templates else 'no'})")

