"""Spoken chat answers: `modalities: ["text", "audio"]` with `audio: {voice, format}`.

Following OpenAI, the text of a spoken answer is its transcript: a non-streaming answer has
`message.audio = {id, data, transcript, expires_at}` (data: base64 audio in the requested format,
wav when unset) and no `content`; a stream sends `delta.audio.transcript` text pieces and `delta.audio.data`
pieces (base64 s16le PCM, mono: a stream takes `format` pcm16 alone, as OpenAI's does), plus `sample_rate`, an
mstar extension: the model's rate, not resampled to OpenAI's 24 kHz. Asked for, `logprobs` are the
transcript's tokens' (a stream's go with the transcript piece that carries their text).
"""

from __future__ import annotations

import base64
import time

import numpy as np
from starlette.concurrency import run_in_threadpool

from mstar.server import logprobs
from mstar.server.adapters import RequestError, RequestStream, merge
from mstar.server.media import encode_audio, pcm_s16le
from mstar.server.protocol_openai import (
    ChatChunkChoice,
    ChatCompletionAudio,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    DeltaAudio,
    StreamOptions,
    new_id,
)
from mstar.server.streaming import SSE_DONE, sse

AUDIO_TTL_S = 3600  # `expires_at`: the server keeps nothing, so this is only what clients may assume


def check_spoken(state, body: ChatCompletionRequest) -> bool:
    """True when the request asks for audio; 400 when the model cannot speak."""
    if "audio" not in body.output_modalities():
        return False
    outputs = state.runtime.model.output_modalities
    if "audio" not in outputs:
        raise RequestError(400, f"model {state.model_name!r} produces {', '.join(outputs)}, not audio; "
                                "remove 'audio' from modalities", "modalities")
    return True


async def spoken_answers(streams: list[RequestStream], fmt: str, rate: int) -> list[tuple[str, ChatCompletionAudio]]:
    """Each stream's transcript and its audio encoded as `fmt` (wav, mp3, flac, opus, aac, pcm16)."""
    texts: list[str] = ["" for _ in streams]
    pieces: list[list[np.ndarray]] = [[] for _ in streams]
    async for index, item in merge(streams):
        if item.name == "text":
            texts[index] += item.value
        elif item.name == "audio":
            pieces[index].append(np.asarray(item.value, dtype=np.float32).reshape(-1))
    out = []
    for text, parts in zip(texts, pieces):
        samples = np.concatenate(parts) if parts else np.zeros(0, np.float32)
        if samples.size == 0:
            raise RequestError(500, "the model produced no audio for this chat answer")
        data = await run_in_threadpool(encode_audio, samples, rate, "pcm" if fmt == "pcm16" else fmt)
        audio = ChatCompletionAudio(data=base64.b64encode(data).decode(), transcript=text,
                                    expires_at=int(time.time()) + AUDIO_TTL_S)
        out.append((text, audio))
    return out


async def spoken_sse(streams: list[RequestStream], model: str, stream_options: StreamOptions, rate: int, usage,
                     with_logprobs: bool = False):
    """The SSE events of a streamed spoken answer (see the module doc); `usage` is a callable."""
    cid, pad = new_id("chatcmpl"), stream_options.pad_to()
    audio_ids = [new_id("audio") for _ in streams]
    pending = logprobs.Pending(len(streams))

    def chunk(index: int, delta: ChatDelta, finish: str | None = None, text: bool = False) -> bytes:
        # a transcript piece carries its tokens' entries, which came just before it; the end carries any left
        lp = logprobs.chat(streams[index].decoder, pending.take(index)) if with_logprobs and text else None
        return sse(ChatCompletionChunk(id=cid, model=model, choices=[
            ChatChunkChoice(index=index, delta=delta, finish_reason=finish, logprobs=lp)]), pad)

    for i in range(len(streams)):
        yield chunk(i, ChatDelta(role="assistant"))
    async for index, item in merge(streams):
        if item.name == "logprobs":
            pending.add(index, item.value)
        elif item.name == "text" and item.value:
            yield chunk(index, ChatDelta(audio=DeltaAudio(id=audio_ids[index], transcript=item.value)), text=True)
        elif item.name == "audio":
            pcm = pcm_s16le(np.asarray(item.value, dtype=np.float32).reshape(-1))
            yield chunk(index, ChatDelta(audio=DeltaAudio(id=audio_ids[index], data=base64.b64encode(pcm).decode(),
                                                          sample_rate=rate)))
    expires = int(time.time()) + AUDIO_TTL_S
    for i, stream in enumerate(streams):
        yield chunk(i, ChatDelta(audio=DeltaAudio(id=audio_ids[i], expires_at=expires)),
                    stream.finish_reason or "stop", text=True)
    if stream_options.include_usage:
        yield sse(ChatCompletionChunk(id=cid, model=model, choices=[], usage=usage(streams)), pad)
    yield SSE_DONE


def chat_media(state, body: ChatCompletionRequest) -> list[dict]:
    """The media parts of every message, decoded under the server's media policy, in order (the
    processor request's "media"). Blocking: call from a thread."""
    from mstar.server.media import decode_audio, decode_image, decode_pcm16, decode_video
    from mstar.server.protocol_openai_messages import AudioURLPart, ImageURLPart, InputAudioPart

    policy, media = state.policy("/v1/chat/completions"), []
    for message in body.messages:
        for part in message.media_parts():
            if isinstance(part, ImageURLPart):
                media.append({"type": "image", "data": decode_image(part.image_url.url, policy)})
                continue
            if isinstance(part, InputAudioPart | AudioURLPart):
                if isinstance(part, InputAudioPart) and part.input_audio.format == "pcm16":
                    audio = decode_pcm16(part.input_audio.data, policy)
                else:
                    audio = decode_audio(part.input_audio.data if isinstance(part, InputAudioPart)
                                         else part.audio_url.url, policy)
                media.append({"type": "audio", "data": audio.mono(), "sample_rate": audio.sample_rate})
                continue
            video = decode_video(part.video_url.url, policy)
            media.append(video.media_item())
    return media
