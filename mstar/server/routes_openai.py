"""OpenAI-compatible text routes: /v1/models, /v1/chat/completions, /v1/completions.

`n` runs n separate requests (seed + i when a seed is given); streams interleave their choices.
"""

from __future__ import annotations

import json
from functools import partial
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from mstar.server import logprobs
from mstar.server.adapters import RequestStream, merge, start_request
from mstar.server.app import ServerState, get_state
from mstar.server.chat_audio import chat_media, check_spoken, spoken_answers, spoken_sse
from mstar.server.forms import json_body, read_json
from mstar.server.openapi import SSE
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
    ModelCard,
    ModelList,
    SamplingParams,
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


@router.get("/v1/models")
async def list_models(request: Request) -> ModelList:
    """The one model this server runs, with its context length when it has one."""
    state = get_state(request)
    processor = state.runtime.processor
    return ModelList(data=[ModelCard(id=state.model_name, max_model_len=processor.max_model_len,
                                     voices=list(processor.voices))])


def _options(state: ServerState, params: SamplingParams, index: int) -> dict[str, Any]:
    opts = {**params.extra_options(), **params.sampling_options()}
    opts.pop("stream_options", None)
    if params.seed is not None:
        opts["seed"] = params.seed + index
    if "modalities" in state.runtime.model.default_options:
        opts["modalities"] = params.output_modalities() if isinstance(params, ChatCompletionRequest) else ["text"]
    if isinstance(params, ChatCompletionRequest) and params.audio is not None and params.audio.voice:
        opts["voice"] = params.audio.voice
    top = logprobs.wanted(params)
    if top is not None:
        opts["logprobs"] = top
    if isinstance(params, ChatCompletionRequest) and (structured := params.structured_outputs()) is not None:
        opts["structured_outputs"] = json.dumps(structured)  # a string: schemas nest deeper than options may
    opts.pop("response_format", None)
    return opts


async def _start_n(state: ServerState, requests: list[dict[str, Any]], params: SamplingParams) -> list[RequestStream]:
    streams: list[RequestStream] = []
    try:
        for i, req in enumerate(requests):
            streams.append(await start_request(state, req, _options(state, params, i)))
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
    messages = [m.model_dump(exclude_none=True) for m in body.messages]
    chat_request: dict[str, Any] = {"messages": messages}
    media = await run_in_threadpool(chat_media, state, body)
    if media:
        chat_request["media"] = media
    streams = await _start_n(state, [chat_request] * body.n, body)
    model = body.model or state.model_name
    with_logprobs = logprobs.wanted(body) is not None
    if spoken:
        return await _spoken(request, body, streams, model, state.runtime.processor.sample_rate)
    if not body.stream:
        texts = await unless_disconnected(request, _texts(streams), streams)
        choices = [ChatChoice(index=i, message=ChatResponseMessage(content=t), finish_reason=s.finish_reason,
                              logprobs=logprobs.chat(s.decoder, s.decoder.logprobs) if with_logprobs else None)
                   for i, (t, s) in enumerate(zip(texts, streams))]
        resp = ChatCompletion(model=model, choices=choices, usage=_usage(streams))
        return Response(resp.model_dump_json(), media_type="application/json")
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    sse_body = partial(_chat_sse, streams, model, include_usage, with_logprobs)
    return ClosingStreamingResponse(guarded(sse_body, sse_error), streams, media_type="text/event-stream")


async def _spoken(request: Request, body: ChatCompletionRequest, streams: list[RequestStream], model: str,
                  rate: int) -> Response:
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return ClosingStreamingResponse(guarded(lambda: spoken_sse(streams, model, include_usage, rate, _usage),
                                                sse_error), streams, media_type="text/event-stream")
    fmt = body.audio.format if body.audio is not None else "wav"
    answers = await unless_disconnected(request, spoken_answers(streams, fmt, rate), streams)
    choices = [ChatChoice(index=i, message=ChatResponseMessage(audio=audio), finish_reason=s.finish_reason)
               for i, ((_, audio), s) in enumerate(zip(answers, streams))]
    resp = ChatCompletion(model=model, choices=choices, usage=_usage(streams))
    return Response(resp.model_dump_json(), media_type="application/json")


async def _chat_sse(streams: list[RequestStream], model: str, include_usage: bool, with_logprobs: bool):
    cid = new_id("chatcmpl")
    cursor = logprobs.Cursor(streams)

    def chunk(index: int, delta: ChatDelta, finish: str | None = None) -> bytes:
        # a token's text goes out with its logprobs (the decoder holds it until they come)
        lp = logprobs.chat(streams[index].decoder, cursor.take(index)) if with_logprobs else None
        return sse(ChatCompletionChunk(id=cid, model=model, choices=[
            ChatChunkChoice(index=index, delta=delta, finish_reason=finish, logprobs=lp)]))

    for i in range(len(streams)):
        yield chunk(i, ChatDelta(role="assistant", content=""))
    finished = set()
    async for index, item in merge(streams):
        if item.name == "text" and item.value:
            yield chunk(index, ChatDelta(content=item.value))
        for i, stream in enumerate(streams):  # a stream's finish is known once its last item went out
            if stream.done and i not in finished and stream.finish_reason is not None:
                finished.add(i)
                yield chunk(i, ChatDelta(), stream.finish_reason)
    for i, stream in enumerate(streams):
        if i not in finished:
            yield chunk(i, ChatDelta(), stream.finish_reason or "stop")
    if include_usage:
        yield sse(ChatCompletionChunk(id=cid, model=model, choices=[], usage=_usage(streams)))
    yield SSE_DONE


@router.post("/v1/completions", response_model=None, openapi_extra=json_body(CompletionRequest), responses={200: {
    "model": Completion, "content": {"text/event-stream": SSE},
    "description": "one completion; with `stream: true` an SSE stream of completion chunks"}})
async def completions(request: Request) -> Response:
    """Plain-text completion of one or more prompts (n choices each)."""
    body = await read_json(request, CompletionRequest)
    state = get_state(request)
    state.check_model(body.model, "text", "/v1/completions")
    prompts = body.prompts()
    reqs = [{"text": p} for p in prompts for _ in range(body.n)]
    streams = await _start_n(state, reqs, body)
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
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return ClosingStreamingResponse(
        guarded(partial(_completion_sse, streams, model, prefixes, include_usage, body.n, body.logprobs is not None),
                sse_error), streams, media_type="text/event-stream")


async def _completion_sse(streams: list[RequestStream], model: str, prefixes: list[str], include_usage: bool,
                          n: int, with_logprobs: bool):
    cid = new_id("cmpl")
    cursor = logprobs.Cursor(streams)
    offsets = [len(prefix) for prefix in prefixes]  # where each choice's next text starts

    def choice(index: int, text: str, finish: str | None = None) -> CompletionChoice:
        lp = None
        if with_logprobs:
            lp = logprobs.completion(streams[index].decoder, cursor.take(index), offsets[index])
            offsets[index] += sum(len(t) for t in lp.tokens)
        return CompletionChoice(index=index, text=text, finish_reason=finish, logprobs=lp)

    for i, prefix in enumerate(prefixes):
        if prefix:
            yield sse(Completion(id=cid, model=model, choices=[CompletionChoice(index=i, text=prefix)]))
    async for index, item in merge(streams):
        if item.name == "text" and item.value:
            yield sse(Completion(id=cid, model=model, choices=[choice(index, item.value)]))
    for i, stream in enumerate(streams):
        yield sse(Completion(id=cid, model=model, choices=[choice(i, "", stream.finish_reason or "stop")]))
    if include_usage:
        usage = Usage(prompt_tokens=sum(s.prompt_tokens for s in streams[::n]),
                      completion_tokens=sum(s.decoder.completion_tokens for s in streams))
        yield sse(Completion(id=cid, model=model, usage=usage))
    yield SSE_DONE
