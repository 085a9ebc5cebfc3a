"""The ids of Qwen3-Omni's special tokens and role words in a tokenizer.

The offline Qwen3-Omni tokenizer folder (`omni_tokenizer_folder`) and its chat template
(`OMNI_CHAT_TEMPLATE`) live in `models/common` (`tokenizer_build.py`, `chat_templates.py`): the template
renders each image, audio and video part as its pad token between markers, and the processor then repeats
each pad token as many times as the encoder makes rows. A checkpoint's own template wins over it.
"""

from __future__ import annotations

SPECIAL_TEXTS = {"im_start": "<|im_start|>", "im_end": "<|im_end|>", "audio_start": "<|audio_start|>",
                 "audio_end": "<|audio_end|>", "audio": "<|audio_pad|>", "vision_start": "<|vision_start|>",
                 "vision_end": "<|vision_end|>", "image": "<|image_pad|>", "video": "<|video_pad|>",
                 "tts_pad": "<tts_pad>", "tts_bos": "<tts_text_bos>", "tts_eos": "<tts_text_eod>"}
ROLE_WORDS = ("user", "assistant", "system")  # plain BPE words whose ids the config names


def token_ids(tokenizer) -> dict[str, int]:
    """Role -> id of the special tokens and role words (the keys of `tiny.special_token_ids()`)."""
    ids = {name: tokenizer.token_to_id(text) for name, text in SPECIAL_TEXTS.items()}
    for word in ROLE_WORDS:
        (ids[word],) = tokenizer.encode(word, add_special_tokens=False)
    missing = [name for name, i in ids.items() if i is None]
    if missing:
        raise ValueError(f"the tokenizer lacks Qwen3-Omni's special tokens {missing}; use the checkpoint's tokenizer")
    return ids
