"""A streamed chat answer's finish chunk goes out after the stream's last text: a stream turns `done`
when its finish arrives, while the text the decoder flushed then may still wait in merge's queue."""

from __future__ import annotations

import asyncio
import json

from mstar.server.adapters import Item
from mstar.server.protocol_openai import StreamOptions
from mstar.server.routes_openai import _chat_sse


class _FlushingStream:
    """Like a RequestStream at its finish: `done` and `finish_reason` are set before the flushed text."""

    def __init__(self, texts: list[str], reason: str) -> None:
        self.texts, self.reason = texts, reason
        self.done, self.finish_reason = False, None

    async def __aiter__(self):
        for seq, text in enumerate(self.texts[:-1]):
            yield Item("text", seq, text)
        self.done, self.finish_reason = True, self.reason
        yield Item("text", len(self.texts) - 1, self.texts[-1])

    def close(self) -> None:
        self.done = True


def _choices(streams) -> list[dict]:
    async def run():
        return [e async for e in _chat_sse(streams, "m", stream_options=StreamOptions(), with_logprobs=False,
                                           calls=None)]

    events = asyncio.run(run())
    assert events[-1].strip() == b"data: [DONE]"
    return [c for e in events[:-1] for c in json.loads(e.decode().removeprefix("data: "))["choices"]]


def test_finish_chunk_follows_the_flushed_text():
    choices = _choices([_FlushingStream(["Fo", "xes", " run"], "length")])
    assert "".join(c["delta"].get("content") or "" for c in choices) == "Foxes run"
    assert [c.get("finish_reason") for c in choices] == [None, None, None, None, "length"]


def test_each_choice_finishes_once_after_its_own_text():
    choices = _choices([_FlushingStream(["a", "b"], "stop"), _FlushingStream(["c", "d", "e"], "length")])
    for index, (text, reason) in enumerate([("ab", "stop"), ("cde", "length")]):
        mine = [c for c in choices if c["index"] == index]
        assert "".join(c["delta"].get("content") or "" for c in mine) == text
        assert [c.get("finish_reason") for c in mine if c.get("finish_reason")] == [reason]
        assert mine[-1].get("finish_reason") == reason
