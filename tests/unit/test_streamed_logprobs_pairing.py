"""Each streamed chunk carries the logprob entries of exactly the tokens whose text it holds, on every text
stream route (chat, completions, spoken chat's transcript, /generate). The worst interleaving is driven, not
waited for: every event of the answer is in the request's queue before the route runs, so merge's pump decodes
the whole answer before the first chunk is written (a route reading the decoder's state then sent entries one
chunk early). Byte tokens of one character and stop-string lookahead hold text back: their entries go with the
chunk that finally carries that text."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from mstar.conductor.request_state import FinishEvent, OutputEvent
from mstar.models.common.text import Tokenizer
from mstar.models.llama.processor import TextProcessor
from mstar.models.llama.tiny import tiny_tokenizer_folder
from mstar.server.adapters import RequestStream
from mstar.server.chat_audio import spoken_sse
from mstar.server.protocol import LogprobsChunk, TextChunk, Usage, parse_chunk
from mstar.server.protocol_openai import StreamOptions
from mstar.server.routes_native import ArrayForm, _ndjson
from mstar.server.routes_openai import _chat_sse, _completion_sse

ANSWER = "The fox é runs END now"  # "é" is two byte tokens


class _Metrics:
    def first_output(self, seconds: float) -> None: ...
    def inter_output(self, seconds: float, output: str | None = None) -> None: ...
    def first_of(self, output: str, seconds: float) -> None: ...
    def finished(self, reason, status: int, prompt: int, generated: int) -> None: ...


class _Runtime:
    def __init__(self, processor: TextProcessor) -> None:
        self.processor, self.cancelled = processor, []

    def cancel(self, rid: str) -> None:
        self.cancelled.append(rid)


class _State:
    def __init__(self, processor: TextProcessor) -> None:
        self.runtime, self.metrics, self.model_name = _Runtime(processor), _Metrics(), "tiny"


@pytest.fixture(scope="module")
def processor() -> TextProcessor:
    return TextProcessor(Tokenizer.from_pretrained(tiny_tokenizer_folder()), max_model_len=64)


def _logprob(i: int) -> float:
    return -(i + 1) / 8  # each token its own value (exact in float32), so an entry names its token


def _stream(processor: TextProcessor, ids: list[int], options: dict, reason: str) -> RequestStream:
    """A request whose every event already waits in its queue: one step's text, then its logprob values."""
    stream = RequestStream(_State(processor), "r", {"prompt_ids": torch.tensor([1, 2])}, options)
    for i, token in enumerate(ids):
        for name, value in (("text", [token]), ("logprob", [_logprob(i)]), ("top_ids", [token]),
                            ("top_logprobs", [_logprob(i)])):
            stream.sink(OutputEvent("r", name, i, torch.tensor(value)))
    stream.sink(FinishEvent("r", reason))
    return stream


def _events(processor, ids, options, reason, route) -> tuple[list, RequestStream]:
    async def run():
        stream = _stream(processor, ids, options, reason)
        return [e async for e in route([stream])], stream

    return asyncio.run(run())


def _expected(processor, ids: list[int], texts: list[str]) -> list[list[int]]:
    """The token indices behind each non-empty text, read off the tokens' bytes (a text ends on a token)."""
    groups, at = [], 0
    for text in texts:
        group, got = [], b""
        while got != text.encode():
            assert len(got) < len(text.encode()), f"{text!r} does not end on a token boundary"
            got += processor.tokenizer.token_bytes(ids[at])
            group.append(at)
            at += 1
        groups.append(group)
    return groups


CASES = {  # options, finish reason, the answer's text, the tokens (by index) the final chunk carries
    "length": ({"logprobs": 1}, "length", ANSWER, None),
    # "E" may begin "Ex" and waits for "N"; " n" may begin "now": " " goes, "n" waits, "ow" matches and the
    # request stops there ("ow"'s values come after the cut and are dropped, as in a whole answer)
    "stop": ({"logprobs": 1, "stop": ["Ex", "now"]}, "stop", "The fox é runs END ", "n"),
}


def _check(processor, ids, pieces: list[tuple[str, list[float]]], case: str, decoder) -> None:
    """`pieces`: each chunk's text and its entries' logprobs, the finish chunk's last."""
    _, _, text, rest = CASES[case]
    assert "".join(t for t, _ in pieces) == text
    texts = [t for t, _ in pieces if t]
    groups = _expected(processor, ids, texts)
    carried = [lps for t, lps in pieces if t]
    assert carried == [[_logprob(i) for i in g] for g in groups]  # each piece, its own tokens' entries
    assert all(not lps for t, lps in pieces[:-1] if not t)
    done = sum(len(g) for g in groups)
    tail = [] if rest is None else [done]  # the stop string's first token: its text cut, its entry last
    assert pieces[-1][1] == [_logprob(i) for i in tail]
    every = [lp for _, lps in pieces for lp in lps]
    assert every == [e.logprob for e in decoder.logprobs] == [_logprob(i) for i in range(len(every))]


def _ids(processor) -> list[int]:
    return processor.tokenizer.encode(ANSWER, add_special_tokens=False)


@pytest.mark.parametrize("case", list(CASES))
def test_each_chat_chunk_carries_the_entries_of_its_own_text(processor, case):
    options, reason, _, _ = CASES[case]
    ids = _ids(processor)
    route = lambda s: _chat_sse(s, "m", StreamOptions(), True, None)  # noqa: E731
    events, stream = _events(processor, ids, options, reason, route)
    choices = [json.loads(e.decode().removeprefix("data: "))["choices"][0] for e in events[1:-1]]
    pieces = [(c["delta"].get("content") or "", [t["logprob"] for t in c["logprobs"]["content"]]) for c in choices]
    for c in choices:  # a chat entry names its token by text and bytes
        got = b"".join(bytes(t["bytes"]) for t in c["logprobs"]["content"])
        assert not c["delta"].get("content") or got == c["delta"]["content"].encode()
    assert choices[-1]["finish_reason"] == reason
    _check(processor, ids, pieces, case, stream.decoder)


@pytest.mark.parametrize("case", list(CASES))
def test_each_completion_and_transcript_chunk_carries_the_entries_of_its_own_text(processor, case):
    options, reason, _, _ = CASES[case]
    ids = _ids(processor)
    completion = lambda s: _completion_sse(s, "m", [""], StreamOptions(), 1, True)  # noqa: E731
    events, stream = _events(processor, ids, options, reason, completion)
    choices = [json.loads(e.decode().removeprefix("data: "))["choices"][0] for e in events[:-1]]
    _check(processor, ids, [(c["text"], c["logprobs"]["token_logprobs"]) for c in choices], case, stream.decoder)
    usage = lambda streams: Usage()  # noqa: E731
    spoken = lambda s: spoken_sse(s, "m", StreamOptions(), 24000, usage, True)  # noqa: E731
    events, stream = _events(processor, ids, options, reason, spoken)
    choices = [json.loads(e.decode().removeprefix("data: "))["choices"][0] for e in events[1:-1]]
    _check(processor, ids, [(c["delta"]["audio"].get("transcript") or "",
                             [t["logprob"] for t in (c.get("logprobs") or {"content": []})["content"]])
                            for c in choices], case, stream.decoder)


@pytest.mark.parametrize("case", list(CASES))
def test_generate_sends_a_texts_entries_just_before_it(processor, case):
    options, reason, _, _ = CASES[case]
    ids = _ids(processor)
    route = lambda s: _ndjson(s[0], {"text", "logprobs"}, 24000, 25.0, ArrayForm())  # noqa: E731
    lines, stream = _events(processor, ids, options, reason, route)
    pieces, entries = [], []
    for chunk in map(parse_chunk, lines[:-1]):
        if isinstance(chunk, LogprobsChunk):
            entries += [t.logprob for t in chunk.content]
        elif isinstance(chunk, TextChunk):
            pieces.append((chunk.delta, entries))
            entries = []
    _check(processor, ids, [*pieces, ("", entries)], case, stream.decoder)
