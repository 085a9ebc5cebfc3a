"""Tiny V-JEPA 2 and V-JEPA 2-AC configs for CPU tests and `--tiny` runs (random weights).

The encoder dict uses transformers' config.json keys, so the same parser reads it as reads a real
folder. Heads are 16 wide: three 4-channel RoPE axes and 4 channels left unrotated, as the
full-size heads (64 wide: 3 x 20 + 4) have a remainder too.
"""

from __future__ import annotations

from typing import Any

from mstar.models.vjepa2.config import ACPredictorConfig, ViTShape, VJEPA2Config

TINY_HF: dict[str, Any] = {
    "architectures": ["VJEPA2Model"], "model_type": "vjepa2", "patch_size": 8, "crop_size": 32,
    "frames_per_clip": 4, "tubelet_size": 2, "hidden_size": 64, "in_chans": 3, "num_attention_heads": 4,
    "num_hidden_layers": 2, "mlp_ratio": 2.5, "layer_norm_eps": 1e-6, "qkv_bias": True, "hidden_act": "gelu",
    "num_pooler_layers": 1, "pred_hidden_size": 32, "pred_num_attention_heads": 2, "pred_num_hidden_layers": 2,
    "pred_num_mask_tokens": 3, "pred_mlp_ratio": 2.0, "pred_zero_init_mask_tokens": False,
}
TINY_LABELS = ("reach", "push", "grasp", "wave", "idle")
TINY_CLASSIFIER_HF: dict[str, Any] = {
    **TINY_HF, "architectures": ["VJEPA2ForVideoClassification"],
    "id2label": {str(i): name for i, name in enumerate(TINY_LABELS)}, "num_labels": len(TINY_LABELS),
}


def tiny_config(classifier: bool = True) -> VJEPA2Config:
    """The tiny encoder (2 layers, width 64, 32x32 crops of 8x8 patches) and mask predictor, with a
    5-label classifier head unless `classifier` is false."""
    return VJEPA2Config.from_hf(TINY_CLASSIFIER_HF if classifier else TINY_HF)


def tiny_ac_config(embed_dim: int = 64) -> ACPredictorConfig:
    """The tiny AC predictor: 2 layers of width 48 (3 heads of 16) over 4x4 patch grids, 7-D actions."""
    return ACPredictorConfig(embed_dim=embed_dim, vit=ViTShape(48, 2, 3, 4.0, 1e-6), img_size=(32, 32),
                             patch_size=8, num_frames=32)
