"""A tiny Qwen3-Omni config.json dict (thinker + talker) for CPU tests and `--tiny` runs.

Same structure and token-id roles as Qwen/Qwen3-Omni-30B-A3B-Instruct, small sizes: 2-layer MoE
decoders with 8 experts, a 320-token thinker vocabulary whose top ids are the special tokens.
"""

from __future__ import annotations

import copy
from typing import Any

_ROPE = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2], "interleaved": True,
         "mrope_interleaved": True}

_SPECIAL = {"im_start": 300, "im_end": 301, "user": 302, "assistant": 303, "system": 304, "audio_start": 305,
            "audio_end": 306, "audio": 307, "vision_start": 308, "vision_end": 309, "image": 310, "video": 311,
            "tts_pad": 312, "tts_bos": 313, "tts_eos": 314}
_MEDIA_IDS = {"audio_token_id": _SPECIAL["audio"], "image_token_id": _SPECIAL["image"],
              "video_token_id": _SPECIAL["video"], "vision_start_token_id": _SPECIAL["vision_start"],
              "audio_start_token_id": _SPECIAL["audio_start"], "audio_end_token_id": _SPECIAL["audio_end"],
              "position_id_per_seconds": 13}

_THINKER_TEXT = {
    "vocab_size": 320, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "moe_intermediate_size": 32,
    "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True, "decoder_sparse_step": 1,
    "mlp_only_layers": [1], "rms_norm_eps": 1e-6, "rope_parameters": _ROPE, "max_position_embeddings": 4096,
}
_TALKER_TEXT = {
    "vocab_size": 96, "hidden_size": 48, "intermediate_size": 80, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "moe_intermediate_size": 24,
    "shared_expert_intermediate_size": 40, "num_experts": 8, "num_experts_per_tok": 3, "norm_topk_prob": True,
    "rms_norm_eps": 1e-6, "rope_parameters": _ROPE, "max_position_embeddings": 4096,
}

TINY_HF_CONFIG: dict[str, Any] = {
    "model_type": "qwen3_omni_moe",
    "architectures": ["Qwen3OmniMoeForConditionalGeneration"],
    "dtype": "float32",
    "enable_audio_output": True,
    **{f"{k}_token_id": _SPECIAL[k] for k in ("im_start", "im_end", "user", "assistant", "system",
                                               "tts_pad", "tts_bos", "tts_eos")},
    "thinker_config": {
        **_MEDIA_IDS,
        "text_config": _THINKER_TEXT,
        "audio_config": {"d_model": 32, "encoder_layers": 1, "encoder_attention_heads": 2, "encoder_ffn_dim": 64,
                         "output_dim": 64, "num_mel_bins": 16, "downsample_hidden_size": 8, "n_window": 50},
        "vision_config": {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                          "out_hidden_size": 64, "deepstack_visual_indexes": [0, 1], "patch_size": 4,
                          "spatial_merge_size": 2, "temporal_patch_size": 2, "num_position_embeddings": 64},
    },
    "talker_config": {
        **_MEDIA_IDS,
        "text_config": _TALKER_TEXT,
        "code_predictor_config": {"vocab_size": 64, "hidden_size": 48, "intermediate_size": 64,
                                  "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
                                  "head_dim": 16, "num_code_groups": 4},
        "num_code_groups": 4, "thinker_hidden_size": 64, "accept_hidden_layer": 2, "spatial_merge_size": 2,
        "codec_pad_id": 80, "codec_bos_id": 81, "codec_eos_token_id": 82, "codec_nothink_id": 83,
        "codec_think_bos_id": 84, "codec_think_eos_id": 85,
        "speaker_id": {"chelsie": 86, "ethan": 87, "aiden": 88},
    },
}


def tiny_hf_config() -> dict[str, Any]:
    """A deep copy of the tiny config.json dict (safe to modify)."""
    return copy.deepcopy(TINY_HF_CONFIG)


def special_token_ids() -> dict[str, int]:
    """Role -> id of the tiny vocabulary's special tokens (im_start, user, image, audio, tts_pad, ...)."""
    return dict(_SPECIAL)


# The whole model (thinker, talker with code predictor, Code2Wav) at tiny size. The talker's codec
# vocabulary is the codebook plus 1024 special ids, as in the checkpoint: the talker never samples
# the top 1024 ids except codec EOS (the reference's suppress_tokens).
TINY_CODEBOOK = 64
_TINY_CODEC_IDS = {"codec_pad_id": 1050, "codec_bos_id": 1051, "codec_eos_token_id": 1052, "codec_nothink_id": 1053,
                   "codec_think_bos_id": 1054, "codec_think_eos_id": 1055}
_TINY_SPEAKERS = {"chelsie": 1056, "ethan": 1057, "aiden": 1058}
_TINY_CODE2WAV = {
    "codebook_size": TINY_CODEBOOK, "num_quantizers": 4, "hidden_size": 32, "intermediate_size": 48,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "sliding_window": 4,
    "rms_norm_eps": 1e-5, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "upsampling_ratios": [2], "upsample_rates": [2, 3], "decoder_dim": 16,
}


def tiny_omni_hf_config(token_ids: dict[str, int] | None = None, thinker_vocab: int | None = None) -> dict[str, Any]:
    """The tiny config.json dict of the whole model (thinker, talker, code predictor, Code2Wav).

    `token_ids` (role -> id, the keys of `special_token_ids()`) and `thinker_vocab` replace the
    thinker's special ids and vocabulary, e.g. with those of the real Qwen tokenizer.
    """
    cfg = tiny_hf_config()
    ids = {**_SPECIAL, **(token_ids or {})}
    media = {"audio_token_id": ids["audio"], "image_token_id": ids["image"], "video_token_id": ids["video"],
             "vision_start_token_id": ids["vision_start"], "audio_start_token_id": ids["audio_start"],
             "audio_end_token_id": ids["audio_end"], "vision_end_token_id": ids["vision_end"]}
    for k in ("im_start", "im_end", "user", "assistant", "system", "tts_pad", "tts_bos", "tts_eos"):
        cfg[f"{k}_token_id"] = ids[k]
    cfg["thinker_config"].update(media)
    if thinker_vocab is not None:
        cfg["thinker_config"]["text_config"]["vocab_size"] = thinker_vocab
    talker = cfg["talker_config"]
    talker.update(media)
    talker.update(_TINY_CODEC_IDS)
    talker["speaker_id"] = dict(_TINY_SPEAKERS)
    talker["text_config"]["vocab_size"] = TINY_CODEBOOK + 1024
    talker["code_predictor_config"]["vocab_size"] = TINY_CODEBOOK
    cfg["code2wav_config"] = copy.deepcopy(_TINY_CODE2WAV)
    return cfg
