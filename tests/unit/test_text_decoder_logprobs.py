"""A streamed answer's logprob entries go out complete: the route's `Cursor` hands out what the decoder holds
when a chunk leaves, and the next token's text may have been decoded by then, its logprobs still on their way
(the conductor delivers a step's outputs one event at a time)."""

from __future__ import annotations

import torch

from mstar.models.common.text import Tokenizer
from mstar.models.llama.processor import TextProcessor
from mstar.models.llama.tiny import tiny_tokenizer_folder
from mstar.server.logprobs import Cursor


class _Stream:
    def __init__(self, decoder) -> None:
        self.decoder = decoder


def _step(decoder, token: int, logprob: float, top: list[tuple[int, float]]) -> list[tuple[str, object]]:
    out = decoder.push("text", torch.tensor([token]))
    out += decoder.push("logprob", torch.tensor([logprob]))
    out += decoder.push("top_ids", torch.tensor([i for i, _ in top]))
    return out + decoder.push("top_logprobs", torch.tensor([v for _, v in top]))


def test_a_token_whose_logprobs_are_on_their_way_is_not_handed_out():
    processor = TextProcessor(Tokenizer.from_pretrained(tiny_tokenizer_folder()), max_model_len=64)
    decoder = processor.output_decoder({"logprobs": 2}, {"prompt_ids": torch.tensor([1, 2])})
    cursor = Cursor([_Stream(decoder)])
    first = _step(decoder, 40, -0.5, [(40, -0.5), (41, -1.5)])
    assert [name for name, _ in first][-1] == "logprobs"
    decoder.push("text", torch.tensor([42]))  # the next token's text, before its logprobs
    taken = cursor.take(0)
    assert [(e.token_id, e.logprob, e.top) for e in taken] == [(40, -0.5, [(40, -0.5), (41, -1.5)])]
    decoder.push("logprob", torch.tensor([-0.25]))
    decoder.push("top_ids", torch.tensor([42, 40]))
    assert cursor.take(0) == []  # still one value to come
    decoder.push("top_logprobs", torch.tensor([-0.25, -2.0]))
    assert [(e.token_id, e.logprob, e.top) for e in cursor.take(0)] == [(42, -0.25, [(42, -0.25), (40, -2.0)])]
    assert [e.token_id for e in decoder.logprobs] == [40, 42] and decoder.completion_tokens == 2
