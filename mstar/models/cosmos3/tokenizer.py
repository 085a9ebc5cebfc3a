"""Cosmos3's tiny offline tokenizer folder (for `--tiny` and tests).

A byte-level BPE trained on a few sentences, holding the special tokens the generator's prompts name,
with Qwen3-VL's chat template (`QWEN3_VL_CHAT_TEMPLATE` of `models/common/chat_templates.py`: the
reasoner's and the generator's layout, no default system turn); a checkpoint's own template wins over it.
"""

from __future__ import annotations

from pathlib import Path

from mstar.models.common.chat_templates import QWEN3_VL_CHAT_TEMPLATE

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                  "<|image_pad|>", "<|video_pad|>")
_CORPUS = (
    "You are a helpful assistant who will generate images from a give prompt.",
    "You are a helpful assistant who will generate videos from a give prompt.",
    "A robot arm picks up a red cube from the table and places it in a bowl; the camera is still.",
    "A cat and a dog bake a cake in a sunny kitchen. Waves crash on a rocky shore at sunset.",
    "The video is 2.0 seconds long and is of 24 FPS. This image is of 720x1280 resolution.",
    "This video is not of 480x832 resolution. blurred details, worst quality, low quality",
    '{"cinematography": {"framing": "first-person"}, "actions": [{"time": "0:00-0:02", "description": ""}]}',
)
TINY_VOCAB = 512  # the tiny generator's embedding rows; the tiny tokenizer's ids all fit
_VERSION = 1  # bump when write_tiny_tokenizer's output changes


def write_tiny_tokenizer(out_dir: str | Path) -> Path:
    """A byte-level BPE folder whose ids fit TINY_VOCAB, `<|im_end|>` its eos, with the chat template."""
    from mstar.models.common.tokenizer_build import train_byte_level_bpe, write_tokenizer_folder

    tok = train_byte_level_bpe(_CORPUS, vocab_size=TINY_VOCAB - 32, special_tokens=SPECIAL_TOKENS)
    assert tok.get_vocab_size() <= TINY_VOCAB
    config = {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
              "chat_template": QWEN3_VL_CHAT_TEMPLATE, "clean_up_tokenization_spaces": False}
    return write_tokenizer_folder(out_dir, tok, config, generation_eos_ids=[tok.token_to_id("<|im_end|>")])


def tiny_tokenizer_folder(cache_dir: str | Path | None = None) -> Path:
    """The tiny tokenizer folder, built once per machine (`cached_folder`)."""
    from mstar.models.common.tokenizer_build import cached_folder

    return cached_folder(f"tiny-cosmos3-v{_VERSION}", write_tiny_tokenizer, cache_dir)
