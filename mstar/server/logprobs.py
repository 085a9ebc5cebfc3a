"""Log-probabilities for the text routes: what a request asks of the engine, and the engine's values
(`OutputDecoder.logprobs`, or a stream's "logprobs" items) in the shapes of chat (`ChoiceLogprobs`),
completions (`CompletionLogprobs`) and /generate (`LogprobsChunk`, chat's shape)."""

from __future__ import annotations

from mstar.models.base import OutputDecoder, TokenLogprobs
from mstar.server.protocol import LogprobsChunk, TokenLogprob, TopLogprob
from mstar.server.protocol_openai import (
    ChatCompletionRequest,
    ChoiceLogprobs,
    CompletionLogprobs,
    CompletionRequest,
    SamplingParams,
)


def wanted(params: SamplingParams) -> int | None:
    """The engine's `logprobs` option for a request: None (none), or how many alternatives with each
    token's own (chat: `top_logprobs` once `logprobs` is true; completions: `logprobs`)."""
    if isinstance(params, ChatCompletionRequest):
        return (params.top_logprobs or 0) if params.logprobs else None
    return params.logprobs if isinstance(params, CompletionRequest) else None


class Pending:
    """Each stream's entries, taken from its "logprobs" items, until the chunk that carries their text: the
    decoder sends a group's entries just before its text (`TextDecoder`), so a chunk sends the entries of the
    tokens whose text it holds, never an entry whose text is still on its way."""

    def __init__(self, count: int) -> None:
        self.entries: list[list[TokenLogprobs]] = [[] for _ in range(count)]

    def add(self, index: int, entry: TokenLogprobs) -> None:
        self.entries[index].append(entry)

    def take(self, index: int) -> list[TokenLogprobs]:
        entries, self.entries[index] = self.entries[index], []
        return entries


def token(decoder: OutputDecoder, entry: TokenLogprobs) -> TokenLogprob:
    """One token's entry with its alternatives, in chat's shape."""
    def top(token_id: int, logprob: float) -> TopLogprob:
        return TopLogprob(token=decoder.token_text(token_id), logprob=logprob, bytes=list(decoder.token_bytes(token_id)))

    return TokenLogprob(**top(entry.token_id, entry.logprob).model_dump(),
                        top_logprobs=[top(i, lp) for i, lp in entry.top])


def chat(decoder: OutputDecoder, entries: list[TokenLogprobs]) -> ChoiceLogprobs:
    """Entries as a chat choice's `logprobs`."""
    return ChoiceLogprobs(content=[token(decoder, e) for e in entries])


def chunk(decoder: OutputDecoder, entry: TokenLogprobs, output: str, seq: int) -> LogprobsChunk:
    """One token's entry as a /generate chunk."""
    return LogprobsChunk(output=output, seq=seq, content=[token(decoder, entry)])


def completion(decoder: OutputDecoder, entries: list[TokenLogprobs], offset: int) -> CompletionLogprobs:
    """Entries as a completion choice's `logprobs`, text offsets counted from `offset`."""
    tokens = [decoder.token_text(e.token_id) for e in entries]
    offsets = []
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    return CompletionLogprobs(tokens=tokens, token_logprobs=[e.logprob for e in entries],
                              top_logprobs=[{decoder.token_text(i): lp for i, lp in e.top} for e in entries],
                              text_offset=offsets)
