"""The config.json dict of Qwen/Qwen3-Omni-30B-A3B-Instruct, for `--load-format dummy` without files.

Every value that shapes compute is the released checkpoint's. Sources, cross-checked against each
other: a public dump of the checkpoint's `Qwen3OmniMoeConfig` as transformers 5.7 loads it from the
model folder (every section, all keys), and a public Rust port's test copy of the released
config.json (the Hub-file form: `rope_theta` beside `rope_scaling`). The encoder sections are
`encoder_config.FULL_AUDIO` / `FULL_VISION`, which match both; the main decoder sizes agree with
`config.FULL_SIZES`. Keys are written in the Hub-file form, so the parsers read the same form as a
downloaded checkpoint.
"""

from __future__ import annotations

import copy
from typing import Any

from mstar.models.qwen3_omni.code2wav_config import Code2WavConfig
from mstar.models.qwen3_omni.code_predictor_config import CodePredictorConfig
from mstar.models.qwen3_omni.config import FULL_SIZES
from mstar.models.qwen3_omni.encoder_config import FULL_AUDIO, FULL_VISION

# Token ids of the checkpoint's tokenizer (Qwen2 vocabulary plus Qwen3-Omni's added tokens); the
# `tokenizer.token_ids` keys. `full_omni_hf_config` takes the ids looked up in the served tokenizer.
FULL_TOKEN_IDS: dict[str, int] = {
    "im_start": 151644, "im_end": 151645, "user": 872, "assistant": 77091, "system": 8948,
    "audio_start": 151669, "audio_end": 151670, "audio": 151675, "vision_start": 151652, "vision_end": 151653,
    "image": 151655, "video": 151656, "tts_pad": 151671, "tts_bos": 151672, "tts_eos": 151673,
}

# Both decoders: interleaved M-RoPE over (t, h, w) = (24, 20, 20) frequencies, theta 1e6.
_MROPE = {"interleaved": True, "mrope_interleaved": True, "mrope_section": [24, 20, 20], "rope_type": "default",
          "type": "default"}
_DECODER_COMMON = {"hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 1000000, "rope_scaling": _MROPE,
                   "attention_bias": False, "use_sliding_window": False, "sliding_window": None,
                   "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True,
                   "max_position_embeddings": 65536, "head_dim": 128, "tie_word_embeddings": False}


def _thinker_text() -> dict[str, Any]:
    size = FULL_SIZES["thinker"]
    heads, kv_heads = size["heads"]
    return {**copy.deepcopy(_DECODER_COMMON), "vocab_size": size["vocab_size"], "hidden_size": size["hidden_size"],
            "intermediate_size": 768,  # as in the checkpoint; unused (every thinker layer is sparse)
            "num_hidden_layers": size["num_layers"], "num_attention_heads": heads, "num_key_value_heads": kv_heads,
            "moe_intermediate_size": size["moe_intermediate_size"], "num_experts": size["num_experts"],
            "num_experts_per_tok": size["top_k"], "shared_expert_intermediate_size": 0, "use_qk_norm": True}


def _talker_text() -> dict[str, Any]:
    size = FULL_SIZES["talker"]
    heads, kv_heads = size["heads"]
    return {**copy.deepcopy(_DECODER_COMMON), "vocab_size": size["vocab_size"], "hidden_size": size["hidden_size"],
            "intermediate_size": 2048,  # the mid width of text_projection / hidden_projection
            "num_hidden_layers": size["num_layers"], "num_attention_heads": heads, "num_key_value_heads": kv_heads,
            "moe_intermediate_size": size["moe_intermediate_size"], "num_experts": size["num_experts"],
            "num_experts_per_tok": size["top_k"],
            "shared_expert_intermediate_size": size["shared_expert_intermediate_size"]}


def _code_predictor() -> dict[str, Any]:
    cp = CodePredictorConfig.full()
    return {"vocab_size": cp.vocab_size, "hidden_size": cp.hidden_size, "intermediate_size": cp.intermediate_size,
            "num_hidden_layers": cp.num_layers, "num_attention_heads": cp.num_heads,
            "num_key_value_heads": cp.num_kv_heads, "head_dim": cp.head_dim, "hidden_act": "silu",
            "rms_norm_eps": cp.rms_norm_eps, "rope_theta": int(cp.rope_theta), "rope_scaling": None,
            "num_code_groups": cp.num_code_groups, "attention_bias": False, "max_position_embeddings": 32768,
            "use_sliding_window": False, "sliding_window": None}


def _code2wav() -> dict[str, Any]:
    c = Code2WavConfig.full()
    return {"codebook_size": c.codebook_size, "num_quantizers": c.num_quantizers, "hidden_size": c.hidden_size,
            "intermediate_size": c.intermediate_size, "num_hidden_layers": c.num_layers,
            "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads,
            "sliding_window": c.sliding_window, "rope_theta": int(c.rope_theta), "rms_norm_eps": c.rms_norm_eps,
            "attention_bias": False, "hidden_act": "silu", "layer_scale_initial_scale": 0.01,
            "upsampling_ratios": list(c.upsampling_ratios), "upsample_rates": list(c.upsample_rates),
            "decoder_dim": c.decoder_dim, "max_position_embeddings": 8000, "codebook_dim": 512,
            "num_semantic_quantizers": 1, "semantic_codebook_size": 4096,
            "vector_quantization_hidden_dimension": 512}


def _media_ids(ids: dict[str, int]) -> dict[str, Any]:
    return {"audio_token_id": ids["audio"], "image_token_id": ids["image"], "video_token_id": ids["video"],
            "vision_start_token_id": ids["vision_start"], "audio_start_token_id": ids["audio_start"],
            "audio_end_token_id": ids["audio_end"], "position_id_per_seconds": 13, "seconds_per_chunk": 2}


def _talker(ids: dict[str, int]) -> dict[str, Any]:
    cp = CodePredictorConfig.full()
    return {
        **_media_ids(ids),
        "text_config": _talker_text(),
        "code_predictor_config": _code_predictor(),
        "num_code_groups": cp.num_code_groups,
        "thinker_hidden_size": FULL_SIZES["thinker"]["hidden_size"],
        "accept_hidden_layer": 24,  # thinker layer whose states feed the talker's multimodal rows
        "spatial_merge_size": 2,
        # codec control ids sit above the 2048-entry codebook in the 3072-entry talker vocabulary
        "codec_pad_id": 2148, "codec_bos_id": 2149, "codec_eos_token_id": 2150, "codec_nothink_id": 2155,
        "codec_think_bos_id": 2156, "codec_think_eos_id": 2157,
        "speaker_id": {"chelsie": 2301, "ethan": 2302, "aiden": 2303},
        "tie_word_embeddings": False,
    }


def full_omni_hf_config(token_ids: dict[str, int] | None = None) -> dict[str, Any]:
    """A fresh config.json dict of Qwen3-Omni-30B-A3B-Instruct (thinker, encoders, talker, code
    predictor, Code2Wav), safe to modify.

    `token_ids` (role -> id, the keys of `FULL_TOKEN_IDS`) replace the special-token ids, e.g. with
    those looked up in the served tokenizer; the checkpoint's own ids are the default.
    """
    ids = {**FULL_TOKEN_IDS, **(token_ids or {})}
    thinker = {
        **_media_ids(ids),
        "vision_end_token_id": ids["vision_end"], "user_token_id": ids["user"],
        "text_config": _thinker_text(),
        "audio_config": copy.deepcopy(FULL_AUDIO),
        "vision_config": {**copy.deepcopy(FULL_VISION), "apply_vit_abs_pos_embed": True, "image_size": 768},
        "dtype": "bfloat16",
        "tie_word_embeddings": False,
    }
    return {
        "model_type": "qwen3_omni_moe",
        "architectures": ["Qwen3OmniMoeForConditionalGeneration"],
        "dtype": "bfloat16",
        "enable_audio_output": True,
        **{f"{k}_token_id": ids[k] for k in ("im_start", "im_end", "user", "assistant", "system",
                                               "tts_pad", "tts_bos", "tts_eos")},
        "thinker_config": thinker,
        "talker_config": _talker(ids),
        "code2wav_config": _code2wav(),
    }
