"""A streamed answer's logprob entries go out complete: the decoder hands a token's entry out only once its
last value has come, just before the text it goes with (the conductor delivers a step's outputs one event at a
time, so the next token's text may be decoded while its logprobs are still on their way)."""

from __future__ import annotations

import torch

from mstar.models.common.text import Tokenizer
from mstar.models.llama.processor import TextProcessor
from mstar.models.llama.tiny import tiny_tokenizer_folder


def _step(decoder, token: int, logprob: float, top: list[tuple[int, float]]) -> list[tuple[str, object]]:
    out = decoder.push("text", torch.tensor([token]))
    out += decoder.push("logprob", torch.tensor([logprob]))
    out += decoder.push("top_ids", torch.tensor([i for i, _ in top]))
    return out + decoder.push("top_logprobs", torch.tensor([v for _, v in top]))


def test_a_token_whose_logprobs_are_on_their_way_is_not_handed_out():
    processor = TextProcessor(Tokenizer.from_pretrained(tiny_tokenizer_folder()), max_model_len=64)
    decoder = processor.output_decoder({"logprobs": 2}, {"prompt_ids": torch.tensor([1, 2])})
    first = _step(decoder, 40, -0.5, [(40, -0.5), (41, -1.5)])
    assert [name for name, _ in first] == ["logprobs", "text"]
    assert [(e.token_id, e.logprob, e.top) for e in decoder.logprobs] == [(40, -0.5, [(40, -0.5), (41, -1.5)])]
    assert decoder.push("text", torch.tensor([42])) == []  # the next token's text, before its logprobs
    assert decoder.push("logprob", torch.tensor([-0.25])) == []
    assert decoder.push("top_ids", torch.tensor([42, 40])) == []  # still one value to come
    assert len(decoder.logprobs) == 1
    out = decoder.push("top_logprobs", torch.tensor([-0.25, -2.0]))
    assert [name for name, _ in out] == ["logprobs", "text"]
    assert (out[0][1].token_id, out[0][1].logprob, out[0][1].top) == (42, -0.25, [(42, -0.25), (40, -2.0)])
    assert out[1][1] == decoder.token_text(42)
    assert [e.token_id for e in decoder.logprobs] == [40, 42] and decoder.completion_tokens == 2
