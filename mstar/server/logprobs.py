"""Log-probabilities for the OpenAI routes: what a request asks of the engine, and the engine's values
(`OutputDecoder.logprobs`) in the shapes of chat (`ChoiceLogprobs`) and completions (`CompletionLogprobs`)."""

from __future__ import annotations

from mstar.models.base import OutputDecoder, TokenLogprobs
from mstar.server.adapters import RequestStream
from mstar.server.protocol_openai import (
    ChatCompletionRequest,
    ChoiceLogprobs,
    CompletionLogprobs,
    CompletionRequest,
    SamplingParams,
    TokenLogprob,
    TopLogprob,
)


def wanted(params: SamplingParams) -> int | None:
    """The engine's `logprobs` option for a request: None (none), or how many alternatives with each
    token's own (chat: `top_logprobs` once `logprobs` is true; completions: `logprobs`)."""
    if isinstance(params, ChatCompletionRequest):
        return (params.top_logprobs or 0) if params.logprobs else None
    return params.logprobs if isinstance(params, CompletionRequest) else None


class Cursor:
    """Hands out each stream's logprob entries once, in order, as its chunks go out."""

    def __init__(self, streams: list[RequestStream]) -> None:
        self.streams, self.sent = streams, [0] * len(streams)

    def take(self, index: int) -> list[TokenLogprobs]:
        entries = self.streams[index].decoder.logprobs[self.sent[index]:]
        self.sent[index] += len(entries)
        return entries


def chat(decoder: OutputDecoder, entries: list[TokenLogprobs]) -> ChoiceLogprobs:
    """Entries as a chat choice's `logprobs`."""
    def token(token_id: int, logprob: float) -> TopLogprob:
        text = decoder.token_text(token_id)
        return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode()))

    return ChoiceLogprobs(content=[
        TokenLogprob(**token(e.token_id, e.logprob).model_dump(), top_logprobs=[token(i, lp) for i, lp in e.top])
        for e in entries])


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
