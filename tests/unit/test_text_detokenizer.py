"""IncrementalDetokenizer: streamed pieces equal a full decode, no broken UTF-8, stop strings."""

import random

import pytest

from mstar.models.common.detokenizer import IncrementalDetokenizer
from mstar.models.common.text import Tokenizer
from mstar.models.common.tokenizer_build import (
    cached_tokenizer_folder,
    train_byte_level_bpe,
    train_sentencepiece_bpe,
)

TEXTS = [
    "Hello, world! It's 12345 apples.",
    "你好，世界！今日はいい天気ですね。안녕하세요 中文测试",
    "Ça va très bien: naïve café, Ångström, smörgåsbord, e\u0301",
    "emoji 😀🎉👍🏽 family 👨‍👩‍👧‍👦 flag 🇫🇷 end",
    "  leading spaces and\nnew lines\n\n  indented 🙂",
]
CORPUS = ["the quick brown fox jumps over the lazy dog", "hello world, hello there, it is nice"] * 10


@pytest.fixture(scope="module", params=["qwen2", "llama3", "byte_bpe", "sentencepiece"])
def tok(request):
    """A tokenizers.Tokenizer-backed Tokenizer of each family."""
    if request.param in ("qwen2", "llama3"):
        return Tokenizer.from_pretrained(cached_tokenizer_folder(request.param))
    if request.param == "byte_bpe":
        return Tokenizer(train_byte_level_bpe(CORPUS, vocab_size=400))
    return Tokenizer(train_sentencepiece_bpe(CORPUS, vocab_size=300))


def _stream(tok, ids, chunks=1, **kwargs):
    detok = IncrementalDetokenizer(tok, **kwargs)
    pieces = []
    i = 0
    rng = random.Random(len(ids))
    while i < len(ids):
        n = chunks if chunks > 0 else rng.randint(1, 4)
        pieces.append(detok.push(ids[i:i + n]))
        i += n
    pieces.append(detok.flush())
    return pieces, detok


@pytest.mark.parametrize("chunks", [1, 0])  # one token at a time, then random chunk sizes
def test_stream_equals_full_decode(tok, chunks):
    for text in TEXTS:
        ids = tok.encode(text)
        pieces, detok = _stream(tok, ids, chunks)
        assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True), text
        assert all("\ufffd" not in p for p in pieces), pieces
        assert detok.finished and detok.finish_reason is None


def test_multibyte_text_is_held_then_released(tok):
    ids = tok.encode("😀")  # 4 UTF-8 bytes; byte-level vocabularies split it
    ids = [i for i in ids if i not in tok.special_ids]
    pieces, _ = _stream(tok, ids)
    if len(ids) > 1:
        assert pieces[0] == ""
    assert "".join(pieces) == "😀" and pieces.count("😀") == 1


def test_sentencepiece_leading_spaces_and_bytes():
    tok = Tokenizer(train_sentencepiece_bpe(CORPUS, vocab_size=300))
    ids = tok.encode("hello there 😀 fox 你好")
    assert any(tok.id_to_token(i) == "<0xF0>" for i in ids)  # emoji went through byte fallback
    pieces, _ = _stream(tok, ids)
    assert pieces[1] == "hello" and pieces[2].startswith(" th")  # pieces[0] is <s>, skipped
    assert "".join(pieces) == "hello there 😀 fox 你好"
    # With the prompt as context, the first generated word keeps its space.
    prompt, gen = ids[:2], ids[2:]
    pieces, _ = _stream(tok, gen, prompt_ids=prompt)
    assert pieces[0].startswith(" th") and "".join(pieces) == " there 😀 fox 你好"
    pieces, _ = _stream(tok, gen)
    assert "".join(pieces) == "there 😀 fox 你好" == tok.decode(gen)


def test_matches_transformers_decode_sentencepiece():
    transformers = pytest.importorskip("transformers")
    tok = Tokenizer(train_sentencepiece_bpe(CORPUS, vocab_size=300))
    ref = transformers.PreTrainedTokenizerFast(tokenizer_object=tok.backend)
    for text in TEXTS:
        ids = tok.encode(text)
        pieces, _ = _stream(tok, ids)
        assert "".join(pieces) == ref.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def test_flush_releases_incomplete_bytes():
    tok = Tokenizer(train_sentencepiece_bpe(CORPUS, vocab_size=300))
    ids = [tok.token_to_id(f"<0x{b:02X}>") for b in "😀".encode()[:2]]
    detok = IncrementalDetokenizer(tok)
    assert detok.push(ids) == ""
    assert detok.flush() == tok.decode(ids) and "\ufffd" in tok.decode(ids)


def test_special_tokens_kept_or_skipped():
    tok = Tokenizer.from_pretrained(cached_tokenizer_folder("qwen2"))
    ids = tok.encode("a<|im_end|>b")
    assert "".join(_stream(tok, ids)[0]) == "ab"
    assert "".join(_stream(tok, ids, skip_special_tokens=False)[0]) == "a<|im_end|>b"


def _spanning_stop(tok, text, stop):
    """Assert `stop` is split over several tokens of `text`, so the test exercises a spanning match."""
    ids = tok.encode(text, add_special_tokens=False)
    assert not any(stop in tok.decode([i]) for i in ids)
    return ids


@pytest.mark.parametrize("chunks", [1, 0])
def test_stop_string_spanning_tokens(tok, chunks):
    text = "The answer is forty-two. ### Then more text follows 😀"
    for stop in ("is forty", "### Then", "two. #", "😀"):
        ids = _spanning_stop(tok, text, stop) if stop != "😀" else tok.encode(text, add_special_tokens=False)
        pieces, detok = _stream(tok, ids, chunks, stop=["never", stop])
        assert "".join(pieces) == text[:text.index(stop)]
        assert detok.finished and detok.finish_reason == "stop" and detok.stop_reason == stop
        assert detok.push(ids[:3]) == "" and detok.flush() == ""


def test_stop_string_at_start_and_included(tok):
    text = "Hello world, hello there"
    ids = tok.encode(text, add_special_tokens=False)
    pieces, detok = _stream(tok, ids, stop=["Hello"])
    assert pieces[0] == "" and "".join(pieces) == "" and detok.stop_reason == "Hello"
    pieces, detok = _stream(tok, ids, stop=["o, h", "world"], include_stop_str_in_output=True)
    assert "".join(pieces) == "Hello world"  # earliest match wins; the stop string is kept


def test_possible_stop_prefix_held_then_released():
    tok = Tokenizer.from_pretrained(cached_tokenizer_folder("qwen2"))
    ids = tok.encode("we ST arrived at STO and stopped ST")
    detok = IncrementalDetokenizer(tok, stop=["STOP"])
    pieces = []
    for i in ids:
        pieces.append(detok.push(i))
        assert not "".join(pieces).endswith(("S", "ST", "STO")), pieces  # held back while ambiguous
    assert "".join(pieces) == "we ST arrived at STO and stopped "
    assert detok.flush() == "ST" and not detok.finish_reason  # released at the end, no stop matched


def test_bad_stop_arguments():
    tok = Tokenizer(train_byte_level_bpe(CORPUS, vocab_size=300))
    with pytest.raises(TypeError, match="list of strings"):
        IncrementalDetokenizer(tok, stop="x")
    with pytest.raises(ValueError, match="non-empty"):
        IncrementalDetokenizer(tok, stop=[""])
