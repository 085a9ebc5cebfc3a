"""Tiny Cosmos3 configs for CPU tests and `--tiny` runs, in the checkpoint's own config.json keys.

The tiny generator keeps every part of the full one (both towers, GQA, the interleaved 3D mRoPE,
the sound tower and the domain-aware action tower) at a few thousand parameters per layer.
"""

from __future__ import annotations

from typing import Any

from mstar.models.cosmos3.tokenizer import TINY_VOCAB

TINY_TRANSFORMER: dict[str, Any] = {
    "_class_name": "Cosmos3OmniTransformer", "hidden_size": 48, "head_dim": 16, "num_attention_heads": 4,
    "num_key_value_heads": 2, "intermediate_size": 64, "num_hidden_layers": 2, "vocab_size": TINY_VOCAB,
    "latent_channel": 16, "latent_patch_size": 2, "patch_latent_dim": 64, "rope_theta": 5000000.0,
    "rope_axes_dim": [4, 2, 2], "base_fps": 24, "enable_fps_modulation": True,
    "unified_3d_mrope_reset_spatial_ids": True, "unified_3d_mrope_temporal_modality_margin": 15000,
    "rms_norm_eps": 1e-6, "timestep_scale": 0.001, "attention_bias": False, "hidden_act": "silu",
    "qk_norm_for_text": True, "use_und_k_norm_for_gen": False, "action_gen": True, "action_dim": 16,
    "num_embodiment_domains": 21, "sound_gen": True, "sound_dim": 8, "sound_latent_fps": 25.0,
}
# A flow-matching UniPC scheduler as the Cosmos3 pipelines configure it.
SCHEDULER: dict[str, Any] = {
    "_class_name": "UniPCMultistepScheduler", "num_train_timesteps": 1000, "flow_shift": 5.0,
    "solver_order": 2, "solver_type": "bh2", "prediction_type": "flow_prediction", "use_flow_sigmas": True,
    "predict_x0": True, "lower_order_final": True, "disable_corrector": [], "final_sigmas_type": "zero",
    "timestep_spacing": "linspace",
}
TINY_VAE_CHANNELS = TINY_TRANSFORMER["latent_channel"]
# A tiny AVAE sound decoder (diffusers Cosmos3AVAEAudioTokenizer keys): 8 latent channels, 20 samples per step at
# 8 kHz (a rate AAC takes, so tiny videos mux their sound).
TINY_SOUND: dict[str, Any] = {
    "_class_name": "Cosmos3AVAEAudioTokenizer", "sampling_rate": 8000, "vocoder_input_dim": TINY_TRANSFORMER["sound_dim"],
    "dec_dim": 4, "dec_c_mults": [1, 2], "dec_strides": [4, 5], "dec_out_channels": 2, "encoder_enabled": False,
}


def tiny_config():
    """The tiny Cosmos3 generator config (2 layers of hidden 48, 16 latent channels) and its scheduler."""
    from mstar.models.common.unipc import UniPCConfig
    from mstar.models.cosmos3.config import Cosmos3Config, Cosmos3TransformerConfig

    return Cosmos3Config(transformer=Cosmos3TransformerConfig.from_hf({**TINY_TRANSFORMER, "dtype": "float32"}),
                         scheduler=UniPCConfig.from_hf(SCHEDULER))
