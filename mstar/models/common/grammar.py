"""Structured outputs over a model's tokenizer with xgrammar: the `Grammars` an engine masks logits with.

xgrammar gets the tokenizer's exact token bytes (`Tokenizer.token_bytes`), so any vocabulary we load works,
with special tokens given no text (a grammar never allows them; the end-of-sequence ids close it). JSON
schemas compile in strict mode with compact separators (`{"a":1,"b":[2,3]}`), so a grammar alone, even over
random weights, gives parseable JSON. Compiled grammars are kept per spec (`COMPILED_KEPT` of them).
xgrammar was chosen over llguidance by measured mask cost (docs/benchmarks.md); it is imported when the
first grammar is compiled, and a model without it refuses structured outputs with the install line.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any

import torch

COMPILED_KEPT = 64


class XGrammarMatcher:
    """One sequence's xgrammar matcher (the engine's `GrammarMatcher`), whose tokens also always continue
    valid UTF-8: xgrammar 0.2.9 lets a string hold UTF-16 surrogates (bytes ED A0-BF ..), which no decoder
    takes, so the bytes of a character begun by the previous token are carried and checked. Nor may a JSON
    string hold a raw control character (xgrammar lets one into a maxLength string), so in JSON kinds the
    matcher follows whether the text is inside a string (`_scan`); outside one the grammar places any
    control character, as a tagged separator's newline."""

    def __init__(self, matcher: Any, grammars: XGrammars, json_kind: bool) -> None:
        self._matcher = matcher
        self._grammars = grammars
        self._json = json_kind
        self._row = torch.zeros(1, grammars.words, dtype=torch.int32)  # xgrammar writes a row of its own width
        self._pending = b""  # the bytes of an unfinished character at the end of the text so far
        self._string: tuple[bool, bool] | None = (False, False) if json_kind else None  # (in a string, escaped)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(self._row, 0)
        self._row &= self._grammars.allowed_after(self._pending, self._string)
        bitmask[row, : self._row.shape[1]] = self._row[0]

    def accept(self, token_id: int) -> bool:
        if not self._matcher.accept_token(token_id):
            return False
        if token_id not in self._grammars.tokenizer.special_ids:
            data = self._grammars.tokenizer.token_bytes(token_id)
            self._pending = _unfinished_tail(self._pending + data)
            if self._string is not None:
                self._string = _scan(data, self._string)[:2]
        return True

    def is_finished(self) -> bool:
        return bool(self._matcher.is_terminated())


class XGrammars:
    """Matchers over one tokenizer's vocabulary (the engine's `Grammars`); safe to share between threads."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.words = -(-tokenizer.vocab_size // 32)  # int32 words of a bitmask row
        self._compiler: Any = None
        self._compiled: OrderedDict[str, Any] = OrderedDict()
        self._allowed: dict[tuple[bytes, tuple[bool, bool] | None], torch.Tensor] = {}
        self._lock = threading.Lock()

    def matcher(self, spec: str) -> XGrammarMatcher:
        """A fresh matcher for `spec` (JSON of one of json_schema, json_object, regex, choice)."""
        compiled = self._compile(spec)
        import xgrammar as xgr  # present: the compile above imported it

        return XGrammarMatcher(xgr.GrammarMatcher(compiled), self, spec.startswith(('{"json_schema"', '{"json_object"', '{"tagged_json"')))

    def allowed_after(self, pending: bytes, string: tuple[bool, bool] | None) -> torch.Tensor:
        """A bitmask row [1, words] of the tokens that continue valid UTF-8 after the unfinished character
        `pending` (special tokens always); given a JSON `string` state (in a string, escaped), none that puts a
        byte below 0x20 inside a string."""
        key = (pending, string)
        with self._lock:
            row = self._allowed.get(key)
        if row is None:
            tok = self.tokenizer
            ok = [i in tok.special_ids or (_utf8_prefix(pending + tok.token_bytes(i)) and (
                  string is None or _scan(tok.token_bytes(i), string)[2])) for i in range(tok.vocab_size)]
            row = _pack(ok, self.words)
            with self._lock:
                self._allowed[key] = row
        return row

    def _compile(self, spec: str) -> Any:
        with self._lock:
            if spec in self._compiled:
                self._compiled.move_to_end(spec)
                return self._compiled[spec]
            compiled = _compile(self._get_compiler(), json.loads(spec))
            self._compiled[spec] = compiled
            if len(self._compiled) > COMPILED_KEPT:
                self._compiled.popitem(last=False)
            return compiled

    def _get_compiler(self) -> Any:
        if self._compiler is None:
            try:
                import xgrammar as xgr
            except ImportError as exc:
                raise ValueError("structured_outputs need the xgrammar package on the server: "
                                 "pip install xgrammar (or mstar[all])") from exc
            tok = self.tokenizer
            specials = tok.special_ids
            vocab = [b"" if i in specials else tok.token_bytes(i) for i in range(tok.vocab_size)]
            info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=len(vocab),
                                     stop_token_ids=list(tok.eos_token_ids))
            self._compiler = xgr.GrammarCompiler(info)
        return self._compiler


def _compile(compiler: Any, spec: dict[str, Any]) -> Any:
    """xgrammar's compiled grammar of one spec; ValueError naming what it could not compile."""
    kind, body = next(iter(spec.items()))
    try:
        if kind == "json_schema":
            return compiler.compile_json_schema(json.dumps(body), any_whitespace=False, strict_mode=True)
        if kind == "json_object":
            return compiler.compile_json_schema(json.dumps({"type": "object"}), any_whitespace=False)
        if kind == "regex":
            return compiler.compile_regex(body)
        if kind == "tagged_json":
            return compiler.compile_grammar(_tagged_json(body))
        choices = " | ".join(json.dumps(c) for c in body)  # EBNF string literals take JSON's escapes
        return compiler.compile_grammar(f"root ::= {choices}")
    except (RuntimeError, ValueError, TypeError) as exc:
        raise ValueError(f"structured_outputs.{kind} cannot be compiled: {exc}") from None


def _tagged_json(body: dict[str, Any]) -> Any:
    """xgrammar's grammar of one JSON value (strict, compact) between the literal texts begin and end; with a
    separator, of one or more such tagged values separated by it."""
    import xgrammar as xgr

    value = xgr.Grammar.from_json_schema(json.dumps(body["schema"]), any_whitespace=False, strict_mode=True)
    if "separator" in body:  # xgrammar's structural tag repeats a tag; its content is the value's EBNF
        tag = {"type": "tag", "begin": body["begin"], "content": {"type": "grammar", "grammar": str(value)},
               "end": body["end"]}
        return xgr.Grammar.from_structural_tag(json.dumps({"type": "structural_tag", "format": {
            "type": "tags_with_separator", "tags": [tag], "separator": body["separator"], "at_least_one": True}}))
    parts = [xgr.Grammar.from_ebnf(f"root ::= {json.dumps(body['begin'])}")] * bool(body["begin"]) + [value]
    parts += [xgr.Grammar.from_ebnf(f"root ::= {json.dumps(body['end'])}")] * bool(body["end"])
    return xgr.Grammar.concat(*parts) if len(parts) > 1 else value


def _utf8_prefix(data: bytes) -> bool:
    """Whether `data` is valid UTF-8 but for an unfinished last character."""
    try:
        data.decode()
    except UnicodeDecodeError as exc:
        return exc.reason == "unexpected end of data"
    return True


def _scan(data: bytes, state: tuple[bool, bool]) -> tuple[bool, bool, bool]:
    """JSON text `data` read from `state` (inside a string, after a backslash there): the state after it, and
    whether no byte below 0x20 fell inside a string."""
    inside, escaped = state
    clean = True
    for byte in data:
        if inside and byte < 0x20:
            clean = False
        if escaped:
            escaped = False
        elif inside and byte == 0x5C:  # backslash
            escaped = True
        elif byte == 0x22:  # quote
            inside = not inside
    return inside, escaped, clean


def _unfinished_tail(data: bytes) -> bytes:
    """The bytes of the unfinished last character of valid UTF-8 `data` (empty when it ends whole)."""
    try:
        data.decode()
    except UnicodeDecodeError as exc:
        return data[exc.start:]
    return b""


def _pack(ok: list[bool], words: int) -> torch.Tensor:
    """Booleans per token as an int32 bitmask row [1, words] (bit i of word w: token 32 * w + i)."""
    bits = torch.tensor(ok + [False] * (32 * words - len(ok)), dtype=torch.int64).reshape(words, 32)
    packed = (bits << torch.arange(32)).sum(1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)[None]
