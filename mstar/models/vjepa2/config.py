"""V-JEPA 2 shapes: the encoder, the mask predictor, the classifier head and the AC predictor.

`VJEPA2Config.from_hf` reads a Hugging Face `config.json` (transformers' `VJEPA2Config` keys); the AC
predictor has no Hugging Face config, so `ACPredictorConfig` keeps the upstream constructor's names.
The full-size constants are the published checkpoints' shapes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


def rope_axis_dim(head_dim: int) -> int:
    """Channels per RoPE axis (frame, row, column): the largest even number <= head_dim / 3."""
    return 2 * ((head_dim // 3) // 2)


@dataclass(frozen=True)
class ViTShape:
    """One stack of pre-norm transformer blocks."""

    hidden_size: int
    num_layers: int
    num_heads: int
    mlp_ratio: float = 4.0
    layer_norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not a multiple of num_heads {self.num_heads}")
        if rope_axis_dim(self.head_dim) == 0:
            raise ValueError(f"head_dim {self.head_dim} is too small for three RoPE axes (needs >= 6)")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def mlp_size(self) -> int:
        return int(self.hidden_size * self.mlp_ratio)


@dataclass(frozen=True)
class EncoderConfig:
    """The video ViT: tubelets of `tubelet_size` frames x `patch_size`^2 pixels, 3D RoPE."""

    vit: ViTShape
    patch_size: int = 16
    tubelet_size: int = 2
    in_chans: int = 3
    crop_size: int = 256  # the input side the checkpoint was trained at (inputs may differ)
    frames_per_clip: int = 64

    @property
    def grid(self) -> int:
        """Patches per side at `crop_size`."""
        return self.crop_size // self.patch_size


@dataclass(frozen=True)
class MaskPredictorConfig:
    """The predictor that fills masked tubelets from context tubelets (V-JEPA 2's pretraining head)."""

    vit: ViTShape
    num_mask_tokens: int = 10


@dataclass(frozen=True)
class ClassifierConfig:
    """An attentive pooler (self-attention layers, then one learned query) and a linear head."""

    num_pooler_layers: int
    labels: tuple[str, ...]

    @property
    def num_labels(self) -> int:
        return len(self.labels)


@dataclass(frozen=True)
class VJEPA2Config:
    """A V-JEPA 2 checkpoint: encoder, mask predictor and, for a video classifier, its head."""

    encoder: EncoderConfig
    predictor: MaskPredictorConfig
    classifier: ClassifierConfig | None = None

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> VJEPA2Config:
        """From a transformers `config.json` dict (missing keys take transformers' defaults)."""
        eps = float(hf.get("layer_norm_eps", 1e-6))
        if hf.get("hidden_act", "gelu") != "gelu" or not hf.get("qkv_bias", True):
            raise ValueError("only hidden_act='gelu' with qkv_bias=True is supported (every V-JEPA 2 checkpoint)")
        patch = hf.get("patch_size", 16)
        encoder = EncoderConfig(
            vit=ViTShape(hf.get("hidden_size", 1024), hf.get("num_hidden_layers", 24), hf.get("num_attention_heads", 16),
                         float(hf.get("mlp_ratio", 4.0)), eps),
            patch_size=patch if isinstance(patch, int) else int(patch[0]), tubelet_size=hf.get("tubelet_size", 2),
            in_chans=hf.get("in_chans", 3), crop_size=hf.get("crop_size", 256),
            frames_per_clip=hf.get("frames_per_clip", 64))
        predictor = MaskPredictorConfig(
            vit=ViTShape(hf.get("pred_hidden_size", 384), hf.get("pred_num_hidden_layers", 12),
                         hf.get("pred_num_attention_heads", 12), float(hf.get("pred_mlp_ratio", 4.0)), eps),
            num_mask_tokens=hf.get("pred_num_mask_tokens", 10))
        classifier = None
        if "VJEPA2ForVideoClassification" in (hf.get("architectures") or ()):
            id2label = {int(k): str(v) for k, v in (hf.get("id2label") or {}).items()}
            labels = tuple(id2label.get(i, f"LABEL_{i}") for i in range(hf.get("num_labels", len(id2label) or 2)))
            classifier = ClassifierConfig(hf.get("num_pooler_layers", 3), labels)
        return cls(encoder, predictor, classifier)


@dataclass(frozen=True)
class ACPredictorConfig:
    """V-JEPA 2-AC's predictor: per frame, `cond_tokens` (action, state[, extrinsics]) then the frame's
    patch tokens, attended block-causally over frames."""

    embed_dim: int = 1408  # the encoder's width (ViT-g)
    vit: ViTShape = field(default_factory=lambda: ViTShape(1024, 24, 16, 4.0, 1e-6))
    action_dim: int = 7
    img_size: tuple[int, int] = (256, 256)
    patch_size: int = 16
    tubelet_size: int = 2
    num_frames: int = 64  # frames of a training clip (the upstream attention mask's extent)
    use_extrinsics: bool = False

    @property
    def grid(self) -> tuple[int, int]:
        """(rows, columns) of patches per frame."""
        return self.img_size[0] // self.patch_size, self.img_size[1] // self.patch_size

    @property
    def tokens_per_frame(self) -> int:
        rows, cols = self.grid
        return rows * cols

    @property
    def cond_tokens(self) -> int:
        """Conditioning tokens in front of each frame's patches."""
        return 3 if self.use_extrinsics else 2


def _hf(hidden: int, layers: int, heads: int, mlp_ratio: float, **extra: Any) -> dict[str, Any]:
    return {"hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads, "mlp_ratio": mlp_ratio,
            "patch_size": 16, "tubelet_size": 2, "crop_size": 256, "frames_per_clip": 64, "pred_hidden_size": 384,
            "pred_num_hidden_layers": 12, "pred_num_attention_heads": 12, "pred_num_mask_tokens": 10, **extra}


# config.json of facebook/vjepa2-vitl-fpc64-256 and facebook/vjepa2-vitg-fpc64-256 (the shapes that matter)
VITL_FPC64_256 = _hf(1024, 24, 16, 4.0, architectures=["VJEPA2Model"])
VITG_FPC64_256 = _hf(1408, 40, 22, 48 / 11, architectures=["VJEPA2Model"])
AC_VITG = ACPredictorConfig()  # vjepa2-ac-vitg's predictor: 24 layers, width 1024, 16 heads, 7-D actions
