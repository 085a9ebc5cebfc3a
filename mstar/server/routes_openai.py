"""OpenAI-compatible text routes: /v1/models, /v1/chat/completions, /v1/completions.

`n` runs n separate requests (seed + i when a seed is given); streams interleave their choices.
Chat `tools`: the model's processor says how its template writes calls (`Processor.tool_format`); a forced
call (`tool_choice` required or named) is a grammar over that format, and unless `tool_choice` is none the
answer's calls are parsed out of its text into `tool_calls` (finish_reason "tool_calls").
"""

from __future__ import annotations

import json
from functools import partial
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from mstar.models.common.tool_calls import CallArgs, Piece, ToolCall, ToolCallFormat
from mstar.server import logprobs
from mstar.server.adapters import RequestError, RequestStream, merge, start_request
from mstar.server.app import ServerState, get_state
from mstar.server.chat_audio import chat_media, check_spoken, spoken_answers, spoken_sse
from mstar.server.forms import json_body, read_json
from mstar.server.openai_fields import model_options, voice_option
from mstar.server.openapi import SSE, errors
from mstar.server.protocol import Usage
from mstar.server.protocol_openai import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    ChatResponseMessage,
    Completion,
    CompletionChoice,
    CompletionRequest,
    FunctionCall,
    ModelCard,
    ModelList,
    SamplingParams,
    StreamOptions,
    ToolCallDelta,
    ToolCallOut,
    new_id,
)
from mstar.server.streaming import (
    SSE_DONE,
    ClosingStreamingResponse,
    guarded,
    sse,
    sse_error,
    unless_disconnected,
)

router = APIRouter()


def _model_card(state: ServerState) -> ModelCard:
    processor, model = state.runtime.processor, state.runtime.model
    return ModelCard(id=state.model_name, max_model_len=processor.max_model_len, voices=list(processor.voices),
                     input_modalities=list(model.input_modalities), output_modalities=list(model.output_modalities),
                     reports_progress="report_progress" in model.default_options)


@router.head("/v1/models", include_in_schema=False)  # `curl -I` and health checks: the GET's headers, no body
@router.get("/v1/models")
async def list_models(request: Request) -> ModelList:
    """The one model this server runs, with its context length when it has one, its voices and modalities."""
    return ModelList(data=[_model_card(get_state(request))])


@router.head("/v1/models/{model_id}", include_in_schema=False)
@router.get("/v1/models/{model_id}", responses=errors(404))
async def retrieve_model(model_id: str, request: Request) -> ModelCard:
    """The served model's card (as in GET /v1/models); another name is a 404."""
    state = get_state(request)
    state.check_model(model_id)
    return _model_card(state)


def _options(state: ServerState, params: SamplingParams, route: str) -> dict[str, Any]:
    """The model options the request's generations share (`_start_n` gives each its seed), its fields checked
    (`openai_fields`)."""
    chat = isinstance(params, ChatCompletionRequest)
    opts = model_options(state, route, params, params.extra_options(), params.sampling_options(),
                         owned=() if chat else ("modalities",))
    if "modalities" in state.runtime.model.default_options:
        opts["modalities"] = params.output_modalities() if chat else ["text"]
    if chat and params.audio is not None and params.audio.voice:
        opts.update(voice_option(state, params.audio.voice))
    top = logprobs.wanted(params)
    if top is not None:
        opts["logprobs"] = top
    if chat and (structured := _structured(state, params)) is not None:
        opts["structured_outputs"] = json.dumps(structured)  # a string: schemas nest deeper than options may
    return opts


def _structured(state: ServerState, body: ChatCompletionRequest) -> dict[str, Any] | None:
    """The chat answer's grammar: a forced tool call's, else response_format's, else None. As OpenAI documents
    `tool_choice`, "required" calls one or more functions (exactly one when `parallel_tool_calls` is false)
    and a named function is called exactly once."""
    forced = body.forced_tool()
    if forced is None:
        return body.structured_outputs()
    several = forced == "" and body.parallel_tool_calls is not False
    return _tool_format(state).grammar(body.tool_dicts(), forced or None, several=several)


def _tool_format(state: ServerState) -> ToolCallFormat:
    """The served model's tool-call format; a 400 when its chat template writes no calls."""
    fmt = state.runtime.processor.tool_format
    if fmt is None:
        raise RequestError(400, f"model {state.model_name!r} has no tool-call format in its chat template; "
                                "leave tools out or use tool_choice none", "tools")
    return fmt


def _call_parser(state: ServerState, body: ChatCompletionRequest) -> ToolCallFormat | None:
    """The format that parses the answer's calls, or None when the answer is plain text."""
    return None if body.tool_mode() == "none" else _tool_format(state)


async def _start_n(state: ServerState, requests: list[dict[str, Any]], options: dict[str, Any],
                   seed: int | None) -> list[RequestStream]:
    streams: list[RequestStream] = []
    try:
        for i, req in enumerate(requests):
            opts = options if seed is None else {**options, "seed": seed + i}
            streams.append(await start_request(state, req, opts))
    except BaseException:
        for stream in streams:
            stream.close()
        raise
    return streams


def _usage(streams: list[RequestStream]) -> Usage:
    return Usage(prompt_tokens=streams[0].prompt_tokens if streams else 0,
                 completion_tokens=sum(s.decoder.completion_tokens for s in streams))


async def _texts(streams: list[RequestStream]) -> list[str]:
    texts = ["" for _ in streams]
    async for index, item in merge(streams):
        if item.name == "text":
            texts[index] += item.value
    return texts


@router.post("/v1/chat/completions", response_model=None, openapi_extra=json_body(ChatCompletionRequest), responses={200: {
    "model": ChatCompletion, "content": {"text/event-stream": SSE},
    "description": "one chat completion; with `stream: true` an SSE stream of chat.completion.chunk objects"}})
async def chat_completions(request: Request) -> Response:
    """Chat: text out, or text and audio with `modalities: ["text", "audio"]` (see `chat_audio`);
    streamed as SSE with `stream: true`."""
    body = await read_json(request, ChatCompletionRequest)  # inline media may be megabytes: parsed once
    state = get_state(request)
    state.check_model(body.model, "text", "/v1/chat/completions")
    spoken = check_spoken(state, body)
    options = _options(state, body, "/v1/chat/completions")
    messages = [m.model_dump(exclude_none=True) for m in body.messages]
    chat_request: dict[str, Any] = {"messages": messages}
    if body.tools:
        chat_request["tools"] = body.tool_dicts()
    calls = _call_parser(state, body)
    media = await run_in_threadpool(chat_media, state, body)
    if media:
        chat_request["media"] = media
    streams = await _start_n(state, [chat_request] * body.n, options, body.seed)
    model = body.model or state.model_name
    with_logprobs = logprobs.wanted(body) is not None
    if spoken:
        return await _spoken(request, body, streams, model, state.runtime.processor.sample_rate, with_logprobs)
    if not body.stream:
        texts = await unless_disconnected(request, _texts(streams), streams)
        choices = []
        for i, (text, stream) in enumerate(zip(texts, streams)):
            message, finish = _message(text, stream.finish_reason, calls)
            choices.append(ChatChoice(index=i, message=message, finish_reason=finish, logprobs=logprobs.chat(
                stream.decoder, stream.decoder.logprobs) if with_logprobs else None))
        resp = ChatCompletion(model=model, choices=choices, usage=_usage(streams))
        return Response(resp.model_dump_json(), media_type="application/json")
    sse_body = partial(_chat_sse, streams, model, body.stream_options or StreamOptions(), with_logprobs, calls)
    return ClosingStreamingResponse(guarded(sse_body, sse_error), streams, media_type="text/event-stream")


def _message(text: str, finish: str | None, calls: ToolCallFormat | None) -> tuple[ChatResponseMessage, str | None]:
    """The assistant message of one answer and its finish reason ("tool_calls" when it ended on calls)."""
    if calls is None:
        return ChatResponseMessage(content=text), finish
    content, found = calls.parse(text)
    if not found:
        return ChatResponseMessage(content=text), finish
    out = [ToolCallOut(function=FunctionCall(name=c.name, arguments=c.arguments)) for c in found]
    return ChatResponseMessage(content=content, tool_calls=out), "tool_calls" if finish == "stop" else finish


async def _spoken(request: Request, body: ChatCompletionRequest, streams: list[RequestStream], model: str,
                  rate: int, with_logprobs: bool) -> Response:
    """A spoken answer; with logprobs, those of its transcript's tokens (the text the audio says)."""
    if body.stream:
        sse_body = partial(spoken_sse, streams, model, body.stream_options or StreamOptions(), rate, _usage,
                           with_logprobs)
        return ClosingStreamingResponse(guarded(sse_body, sse_error), streams, media_type="text/event-stream")
    fmt = (body.audio.format if body.audio is not None else None) or "wav"
    answers = await unless_disconnected(request, spoken_answers(streams, fmt, rate), streams)
    choices = [ChatChoice(index=i, message=ChatResponseMessage(audio=audio), finish_reason=s.finish_reason,
                          logprobs=logprobs.chat(s.decoder, s.decoder.logprobs) if with_logprobs else None)
               for i, ((_, audio), s) in enumerate(zip(answers, streams))]
    resp = ChatCompletion(model=model, choices=choices, usage=_usage(streams))
    return Response(resp.model_dump_json(), media_type="application/json")


class _ChatDeltas:
    """The deltas of each streamed choice's text: as it comes, or, with a call format, content and calls
    (a call's first delta carries its index, id and name; its arguments follow as pieces to append)."""

    def __init__(self, count: int, calls: ToolCallFormat | None) -> None:
        self.parsers = [calls.stream() if calls is not None else None for _ in range(count)]
        self.num_calls = [0] * count

    def text(self, index: int, text: str) -> list[ChatDelta]:
        parser = self.parsers[index]
        return [ChatDelta(content=text)] if parser is None else self._pieces(index, parser.push(text))

    def finish(self, index: int, reason: str) -> tuple[list[ChatDelta], str]:
        parser = self.parsers[index]
        tail = self._pieces(index, parser.finish()) if parser is not None else []
        return tail, "tool_calls" if self.num_calls[index] and reason == "stop" else reason

    def _pieces(self, index: int, pieces: list[Piece]) -> list[ChatDelta]:
        out = []
        for piece in pieces:
            if isinstance(piece, str):
                out.append(ChatDelta(content=piece))
                continue
            if isinstance(piece, CallArgs):
                out.append(self._call(self.num_calls[index] - 1, arguments=piece.text))
                continue
            self.num_calls[index] += 1
            k = self.num_calls[index] - 1
            out.append(self._call(k, new_id("call"), piece.name, ""))
            if isinstance(piece, ToolCall):
                out.append(self._call(k, arguments=piece.arguments))
        return out

    @staticmethod
    def _call(index: int, call_id: str | None = None, name: str | None = None, arguments: str = "") -> ChatDelta:
        first = call_id is not None
        return ChatDelta(tool_calls=[ToolCallDelta(index=index, id=call_id, type="function" if first else None,
                                                   function=FunctionCall(name=name, arguments=arguments))])


async def _chat_sse(streams: list[RequestStream], model: str, stream_options: StreamOptions, with_logprobs: bool,
                    calls: ToolCallFormat | None):
    cid, pad = new_id("chatcmpl"), stream_options.pad_to()
    pending = logprobs.Pending(len(streams))
    deltas = _ChatDeltas(len(streams), calls)

    def chunk(index: int, delta: ChatDelta, finish: str | None = None) -> bytes:
        # a text piece goes out with the entries of its tokens, which came just before it (logprobs.Pending)
        lp = logprobs.chat(streams[index].decoder, pending.take(index)) if with_logprobs else None
        return sse(ChatCompletionChunk(id=cid, model=model, choices=[
            ChatChunkChoice(index=index, delta=delta, finish_reason=finish, logprobs=lp)]), pad)

    def finish(index: int, reason: str) -> list[bytes]:
        tail, reason = deltas.finish(index, reason)
        return [chunk(index, d) for d in tail] + [chunk(index, ChatDelta(), reason)]

    for i in range(len(streams)):
        yield chunk(i, ChatDelta(role="assistant", content=""))
    # a stream's finish goes out when merge reports its end, after its last item: `stream.done` turns
    # true while items it flushed may still wait in merge's queue
    async for index, item in merge(streams, ends=True):
        if item is None:
            for event in finish(index, streams[index].finish_reason or "stop"):
                yield event
        elif item.name == "logprobs":
            pending.add(index, item.value)
        elif item.name == "text" and item.value:
            for delta in deltas.text(index, item.value):
                yield chunk(index, delta)
    if stream_options.include_usage:
        yield sse(ChatCompletionChunk(id=cid, model=model, choices=[], usage=_usage(streams)), pad)
    yield SSE_DONE


@router.post("/v1/completions", response_model=None, openapi_extra=json_body(CompletionRequest), responses={200: {
    "model": Completion, "content": {"text/event-stream": SSE},
    "description": "one completion; with `stream: true` an SSE stream of completion chunks"}})
async def completions(request: Request) -> Response:
    """Plain-text completion of one or more prompts (n choices each)."""
    body = await read_json(request, CompletionRequest)
    state = get_state(request)
    state.check_model(body.model, "text", "/v1/completions")
    options = _options(state, body, "/v1/completions")
    prompts = body.prompts()
    reqs = [{"text": p} for p in prompts for _ in range(body.n)]
    streams = await _start_n(state, reqs, options, body.seed)
    model = body.model or state.model_name
    prefixes = [p if body.echo else "" for p in prompts for _ in range(body.n)]
    if not body.stream:
        texts = await unless_disconnected(request, _texts(streams), streams)
        choices = [CompletionChoice(index=i, text=prefixes[i] + t, finish_reason=s.finish_reason,
                                    logprobs=None if body.logprobs is None else
                                    logprobs.completion(s.decoder, s.decoder.logprobs, len(prefixes[i])))
                   for i, (t, s) in enumerate(zip(texts, streams))]
        usage = Usage(prompt_tokens=sum(s.prompt_tokens for s in streams[:: body.n]),
                      completion_tokens=sum(s.decoder.completion_tokens for s in streams))
        resp = Completion(model=model, choices=choices, usage=usage)
        return Response(resp.model_dump_json(), media_type="application/json")
    stream_options = body.stream_options or StreamOptions()
    return ClosingStreamingResponse(
        guarded(partial(_completion_sse, streams, model, prefixes, stream_options, body.n, body.logprobs is not None),
                sse_error), streams, media_type="text/event-stream")


async def _completion_sse(streams: list[RequestStream], model: str, prefixes: list[str],
                          stream_options: StreamOptions, n: int, with_logprobs: bool):
    cid, pad = new_id("cmpl"), stream_options.pad_to()
    pending = logprobs.Pending(len(streams))
    offsets = [len(prefix) for prefix in prefixes]  # where each choice's next text starts

    def choice(index: int, text: str, finish: str | None = None) -> CompletionChoice:
        lp = None
        if with_logprobs:
            lp = logprobs.completion(streams[index].decoder, pending.take(index), offsets[index])
            offsets[index] += sum(len(t) for t in lp.tokens)
        return CompletionChoice(index=index, text=text, finish_reason=finish, logprobs=lp)

    for i, prefix in enumerate(prefixes):
        if prefix:
            yield sse(Completion(id=cid, model=model, choices=[CompletionChoice(index=i, text=prefix)]), pad)
    async for index, item in merge(streams):
        if item.name == "logprobs":
            pending.add(index, item.value)
        elif item.name == "text" and item.value:
            yield sse(Completion(id=cid, model=model, choices=[choice(index, item.value)]), pad)
    for i, stream in enumerate(streams):
        yield sse(Completion(id=cid, model=model, choices=[choice(i, "", stream.finish_reason or "stop")]), pad)
    if stream_options.include_usage:
        usage = Usage(prompt_tokens=sum(s.prompt_tokens for s in streams[::n]),
                      completion_tokens=sum(s.decoder.completion_tokens for s in streams))
        yield sse(Completion(id=cid, model=model, usage=usage), pad)
    yield SSE_DONE
