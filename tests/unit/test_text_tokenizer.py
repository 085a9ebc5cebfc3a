"""Tokenizer parity with transformers on real vocabularies (Qwen2, Llama 3) and a tiny trained BPE."""

import json

import pytest

from mstar.models.common.chat_template import ChatTemplateError
from mstar.models.common.chat_templates import CHATML_TEMPLATE, LLAMA3_TEMPLATE
from mstar.models.common.text import Tokenizer
from mstar.models.common.tokenizer_build import (
    cached_tokenizer_folder,
    train_byte_level_bpe,
    write_tokenizer_folder,
)

transformers = pytest.importorskip("transformers")

TEXTS = [
    "Hello, world! It's 2024-05-01: 12345 apples.",
    "你好，世界！今日はいい天気ですね。안녕하세요",
    "Привет! Ça va très bien, naïve café, Ångström, e\u0301",
    "def f(x):\n    return x**2  # 😀🎉👍🏽\n\n\n   spaces   ",
    "family 👨‍👩‍👧‍👦 flag 🇫🇷 <|im_start|>user<|im_end|> <|eot_id|><tool_call>",
    "\t\ttabs\r\nCRLF  trailing   ",
]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather <now> & later",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "  Be brief.  "}, {"role": "user", "content": "What's 2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3? 😀 你好"}],
    [{"role": "user", "content": [{"type": "text", "text": "Describe "}, {"type": "image"},
                                  {"type": "text", "text": " please"}]}],
    [{"role": "user", "content": "Weather in Paris?"},
     {"role": "assistant", "content": "", "tool_calls": [
         {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
     {"role": "tool", "content": "{\"temp\": 21}"}],
]


@pytest.fixture(scope="module", params=["qwen2", "llama3", "tiny"])
def pair(request, tmp_path_factory):
    """(our Tokenizer, transformers' tokenizer) loaded from the same folder."""
    if request.param == "tiny":
        tok = train_byte_level_bpe(TEXTS * 3 + ["the quick brown fox jumps over the lazy dog"] * 5)
        folder = write_tokenizer_folder(tmp_path_factory.mktemp("tiny"), tok, {
            "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": CHATML_TEMPLATE})
    else:
        folder = cached_tokenizer_folder(request.param)
    return Tokenizer.from_pretrained(folder), transformers.AutoTokenizer.from_pretrained(folder)


@pytest.mark.parametrize("add_special", [True, False])
def test_encode_decode_parity(pair, add_special):
    ours, ref = pair
    for text in TEXTS:
        ids = ours.encode(text, add_special_tokens=add_special)
        assert ids == ref.encode(text, add_special_tokens=add_special), text
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)


def test_special_ids(pair):
    ours, ref = pair
    assert ours.eos_token_id == ref.eos_token_id
    assert ours.bos_token_id == ref.bos_token_id
    assert ours.pad_token_id == ref.pad_token_id
    assert ours.vocab_size == len(ref)
    assert ours.special_ids == set(ref.all_special_ids) | {
        i for i, t in ref.added_tokens_decoder.items() if t.special}


def test_token_bytes_are_exact_pieces_of_the_text(pair):
    """Each token's bytes (logprobs' `bytes`) join to the text's UTF-8, pieces of characters included."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    ours, ref = pair
    byte_of = {c: b for b, c in bytes_to_unicode().items()}
    partial = 0
    for text in [*TEXTS[:4], "hieroglyphs 𓀀𓀁𓀂"]:
        ids = ours.encode(text, add_special_tokens=False)
        pieces = [ours.token_bytes(i) for i in ids]
        assert b"".join(pieces) == ours.decode(ids).encode(), text  # the text as normalized (Qwen's NFC)
        assert pieces == [bytes(byte_of[c] for c in ref.convert_ids_to_tokens(i)) for i in ids]
        partial += sum(_not_utf8(p) for p in pieces)
    assert partial > 0  # some token holds part of a character
    special = ours.eos_token_id
    assert ours.token_bytes(special) == ref.convert_ids_to_tokens(special).encode()


def _not_utf8(piece: bytes) -> bool:
    try:
        piece.decode()
    except UnicodeDecodeError:
        return True
    return False


def test_qwen2_and_llama3_known_ids():
    qwen = Tokenizer.from_pretrained(cached_tokenizer_folder("qwen2"))
    assert qwen.token_to_id("<|im_start|>") == 151644 and qwen.eos_token_ids == (151645, 151643)
    assert qwen.encode("Hello world") == [9707, 1879]
    assert qwen.decode(qwen.encode("<tool_call>x"), skip_special_tokens=True) == "<tool_call>x"  # not special
    llama = Tokenizer.from_pretrained(cached_tokenizer_folder("llama3"))
    assert llama.encode("Hello world") == [128000, 9906, 1917]
    assert llama.eos_token_ids == (128009, 128001, 128008)


def test_chat_template_parity(pair):
    ours, ref = pair
    for messages in CONVERSATIONS:
        for gen in (True, False):
            for tools in (None, TOOLS):
                got = ours.apply_chat_template(messages, add_generation_prompt=gen, tools=tools,
                                               date_string="1 Jan 2025")
                want = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen,
                                               tools=tools, date_string="1 Jan 2025")
                assert got == want, (messages, gen, tools)


def test_llama3_template_uses_strftime_now_and_tojson():
    tok = Tokenizer.from_pretrained(cached_tokenizer_folder("llama3"))
    text = tok.apply_chat_template([{"role": "user", "content": "x"}], tools=TOOLS)
    import datetime
    assert datetime.datetime.now().strftime("%d %b %Y")[-4:] in text
    assert "Weather <now> & later" in text  # tojson does not HTML-escape
    assert '\n    "type": "function"' in text  # tojson(indent=4)


def _folder(tmp_path, config, files=None):
    tok = train_byte_level_bpe(["hello world"] * 4, vocab_size=300)
    folder = write_tokenizer_folder(tmp_path, tok, config)
    for name, text in (files or {}).items():
        (folder / name).parent.mkdir(exist_ok=True)
        (folder / name).write_text(text)
    return Tokenizer.from_pretrained(folder)


def test_missing_template_is_a_clear_error(tmp_path):
    tok = _folder(tmp_path, {"eos_token": "<|im_end|>"})
    with pytest.raises(ChatTemplateError, match="no chat template.*CHATML_TEMPLATE"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], chat_template=CHATML_TEMPLATE)
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_template_files_and_named_templates(tmp_path):
    tok = _folder(tmp_path, {"chat_template": [{"name": "default", "template": "cfg"},
                                               {"name": "tool_use", "template": "tools:{{ tools|length }}"}]},
                  {"chat_template.json": json.dumps({"chat_template": "json {{ messages[0].role }}"}),
                   "additional_chat_templates/rag.jinja": "rag {{ documents[0].title }}"})
    msgs = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(msgs) == "json user"  # chat_template.json beats tokenizer_config
    assert tok.apply_chat_template(msgs, tools=TOOLS) == "tools:1"
    assert tok.apply_chat_template(msgs, chat_template="rag", documents=[{"title": "T", "text": "x"}]) == "rag T"
    tok = _folder(tmp_path / "b", {"chat_template": "cfg"}, {"chat_template.jinja": "jinja{{ eos_token }}"})
    assert tok.apply_chat_template(msgs) == "jinja"  # no eos configured: undefined renders empty


def test_template_raise_exception_and_sandbox(tmp_path):
    tok = _folder(tmp_path, {"eos_token": "<|im_end|>", "chat_template": LLAMA3_TEMPLATE})
    with pytest.raises(ChatTemplateError, match="roles are system, user, assistant"):
        tok.apply_chat_template([{"role": "narrator", "content": "x"}])
    with pytest.raises(ChatTemplateError):  # the sandbox refuses attribute tricks
        tok.apply_chat_template([{"role": "user", "content": "x"}],
                                chat_template="{{ messages.__class__.__mro__ }}")
    with pytest.raises(ChatTemplateError, match="empty conversation"):
        tok.apply_chat_template([])
    out = tok.apply_chat_template([{"role": "user", "content": "x"}], add_generation_prompt=False,
                                  chat_template="{% generation %}{{ eos_token }}{% endgeneration %}")
    assert out == "<|im_end|>"


def test_added_tokens_declared_only_in_config(tmp_path):
    tok = train_byte_level_bpe(["hello world"] * 4, vocab_size=300)
    new_id = tok.get_vocab_size()
    folder = write_tokenizer_folder(tmp_path, tok, {"eos_token": "<|im_end|>"})
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["added_tokens_decoder"][str(new_id)] = {"content": "<|audio|>", "special": True}
    config["added_tokens_decoder"][str(new_id + 1)] = {"content": "[[plain]]", "special": False}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    ours, ref = Tokenizer.from_pretrained(folder), transformers.AutoTokenizer.from_pretrained(folder)
    text = "hello<|audio|>world [[plain]]"
    ids = ours.encode(text)
    assert new_id in ids and new_id + 1 in ids and ids == ref.encode(text)
    assert ours.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)
    assert new_id in ours.special_ids and new_id + 1 not in ours.special_ids


def test_missing_tokenizer_json_names_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        Tokenizer.from_pretrained(tmp_path)


def test_a_prompt_far_over_the_context_is_refused_from_a_prefix(pair, monkeypatch):
    from mstar.models.common.text import CHARS_PER_TOKEN_BOUND

    ours, _ = pair
    text = "The quick brown fox jumps over the lazy dog. " * 2000  # 90,000 characters
    whole = ours.encode(text)
    assert ours.encode(text, max_tokens=len(whole) + 1) == whole  # fits: tokenized whole, same ids
    seen = []
    encode = ours.backend.encode
    monkeypatch.setattr(ours.backend, "encode", lambda t, **kw: seen.append(len(t)) or encode(t, **kw))
    with pytest.raises(ValueError, match="more than the model's context of 64 tokens"):
        ours.encode(text, max_tokens=64)
    assert seen == [64 * CHARS_PER_TOKEN_BOUND]  # only the prefix was tokenized
