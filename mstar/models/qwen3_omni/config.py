"""Configs of Qwen3-Omni's thinker text model and talker backbone, parsed from the HF config.json.

`OmniConfig.from_hf(config_dict)` reads the layout of Qwen/Qwen3-Omni-30B-A3B-Instruct (both the
Hub file, with `rope_scaling`/`rope_theta`, and the transformers-5 form with `rope_parameters`).
Sizes of the full checkpoint are in `FULL_SIZES`; tiny random configs for tests in `tiny.py`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mstar.layers.moe import MoESpec
from mstar.models.common.loading import read_config_json
from mstar.models.common.serve_config import checkpoint_dtype
from mstar.models.qwen3_omni.mrope import MRopeSpec

# The full checkpoint's main sizes (for docs, benchmarks and a sanity test of the parser).
FULL_SIZES = {
    "thinker": {"num_layers": 48, "hidden_size": 2048, "num_experts": 128, "top_k": 8, "heads": (32, 4),
                "head_dim": 128, "moe_intermediate_size": 768, "vocab_size": 152064},
    "talker": {"num_layers": 20, "hidden_size": 1024, "num_experts": 128, "top_k": 6, "heads": (16, 2),
               "head_dim": 128, "moe_intermediate_size": 384, "shared_expert_intermediate_size": 768,
               "vocab_size": 3072},
}


@dataclass(frozen=True)
class MoETextConfig:
    """A Qwen3-MoE decoder (thinker text model or talker backbone)."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope: MRopeSpec
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    intermediate_size: int = 0  # dense MLP layers (mlp_only_layers / decoder_sparse_step); talker projections
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    shared_expert_intermediate_size: int = 0  # talker: a shared expert behind a sigmoid gate
    rms_norm_eps: float = 1e-6
    attention_bias: bool = False
    dtype: torch.dtype = torch.bfloat16

    def __post_init__(self) -> None:
        if self.num_kv_heads <= 0 or self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads ({self.num_heads}) must be a positive multiple of "
                             f"num_key_value_heads ({self.num_kv_heads})")
        if self.rope.head_dim != self.head_dim:
            raise ValueError(f"rope head_dim {self.rope.head_dim} != head_dim {self.head_dim}")

    def is_sparse(self, layer: int) -> bool:
        """Whether decoder layer `layer` (0-based) uses the MoE block rather than a dense MLP."""
        return (layer not in self.mlp_only_layers and self.num_experts > 0
                and (layer + 1) % self.decoder_sparse_step == 0)

    def moe_spec(self) -> MoESpec:
        """The MoE block of this decoder."""
        return MoESpec(self.hidden_size, self.num_experts, self.top_k, self.moe_intermediate_size,
                       self.norm_topk_prob, self.shared_expert_intermediate_size)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], dtype: torch.dtype = torch.bfloat16) -> MoETextConfig:
        """Parse a `text_config` dict; ValueError naming the field for what we do not support."""
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {cfg['hidden_act']!r} is not supported; only 'silu'")
        if cfg.get("use_sliding_window") or cfg.get("sliding_window"):
            raise ValueError("sliding-window attention is not supported for Qwen3-Omni decoders")
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        return cls(
            vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"], num_layers=cfg["num_hidden_layers"],
            num_heads=heads, num_kv_heads=cfg.get("num_key_value_heads", heads), head_dim=head_dim,
            rope=_rope(cfg, head_dim),
            num_experts=cfg.get("num_experts", cfg.get("num_local_experts", 0)),
            top_k=cfg["num_experts_per_tok"], moe_intermediate_size=cfg["moe_intermediate_size"],
            intermediate_size=cfg.get("intermediate_size", 0), norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
            decoder_sparse_step=cfg.get("decoder_sparse_step", 1),
            mlp_only_layers=tuple(cfg.get("mlp_only_layers") or ()),
            shared_expert_intermediate_size=cfg.get("shared_expert_intermediate_size", 0) or 0,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6), attention_bias=bool(cfg.get("attention_bias", False)),
            dtype=dtype,
        )


def _rope(cfg: dict[str, Any], head_dim: int) -> MRopeSpec:
    params = dict(cfg.get("rope_scaling") or {})
    params.update(cfg.get("rope_parameters") or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"rope_type {rope_type!r} is not supported for Qwen3-Omni; only 'default' (M-RoPE)")
    theta = params.get("rope_theta", cfg.get("rope_theta", 1_000_000.0))
    sections = tuple(params.get("mrope_section", (24, 20, 20)))
    interleaved = bool(params.get("interleaved", params.get("mrope_interleaved", True)))
    return MRopeSpec(head_dim, float(theta), sections, interleaved)  # type: ignore[arg-type]


@dataclass(frozen=True)
class MultimodalTokens:
    """Placeholder and marker token ids, and the timing that the rotary positions of media use."""

    audio_token_id: int
    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    audio_start_token_id: int
    position_id_per_seconds: float = 13
    spatial_merge_size: int = 2
    audio_n_window: int = 50  # the audio encoder's window: sets its output length for a feature length
    audio_end_token_id: int | None = None  # closes a video's audio track (use_audio_in_video)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], vision: dict[str, Any], audio: dict[str, Any]) -> MultimodalTokens:
        """From a thinker or talker config dict (plus the vision/audio encoder dicts for their sizes)."""
        return cls(cfg["audio_token_id"], cfg["image_token_id"], cfg["video_token_id"],
                   cfg["vision_start_token_id"], cfg["audio_start_token_id"],
                   cfg.get("position_id_per_seconds", 13), vision.get("spatial_merge_size", 2),
                   audio.get("n_window", 50), cfg.get("audio_end_token_id"))


@dataclass(frozen=True)
class ThinkerConfig:
    """The thinker's text model and what its inputs look like."""

    text: MoETextConfig
    tokens: MultimodalTokens
    num_deepstack: int = 3  # visual features added after the first `num_deepstack` layers
    tie_word_embeddings: bool = False


@dataclass(frozen=True)
class TalkerConfig:
    """The talker backbone with its input projections and codec ids."""

    text: MoETextConfig
    tokens: MultimodalTokens
    thinker_hidden_size: int
    accept_hidden_layer: int  # thinker layer whose hidden states feed multimodal prompt positions
    num_code_groups: int
    codec_ids: dict[str, int]  # pad, bos, eos, nothink, think_bos, think_eos
    speakers: dict[str, int]  # lower-case name -> codec id


@dataclass(frozen=True)
class OmniConfig:
    """Thinker, talker and the chat-level token ids that join them."""

    thinker: ThinkerConfig
    talker: TalkerConfig | None
    token_ids: dict[str, int]  # im_start, im_end, system, user, assistant, tts_pad, tts_bos, tts_eos

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> OmniConfig:
        """Parse the top-level config.json dict of a Qwen3-Omni checkpoint."""
        if cfg.get("model_type") != "qwen3_omni_moe":
            raise ValueError(f"model_type {cfg.get('model_type')!r} is not a Qwen3-Omni checkpoint "
                             "(expected 'qwen3_omni_moe')")
        dtype = checkpoint_dtype(cfg)
        th = cfg["thinker_config"]
        vision, audio = th.get("vision_config", {}), th.get("audio_config", {})
        thinker = ThinkerConfig(MoETextConfig.from_hf(th["text_config"], dtype),
                                MultimodalTokens.from_hf(th, vision, audio),
                                len(vision.get("deepstack_visual_indexes", (8, 16, 24))),
                                bool(th.get("tie_word_embeddings", False)))
        talker = None
        if cfg.get("enable_audio_output", True) and "talker_config" in cfg:
            talker = _talker(cfg["talker_config"], vision, audio, dtype)
        names = ("im_start", "im_end", "system", "user", "assistant", "tts_pad", "tts_bos", "tts_eos")
        return cls(thinker, talker, {n: cfg[f"{n}_token_id"] for n in names})

    @classmethod
    def from_path(cls, path: str | Path) -> OmniConfig:
        """The config of a checkpoint folder (its config.json)."""
        return cls.from_hf(read_config_json(Path(path) / "config.json", "pass a Qwen3-Omni checkpoint folder"))


def _talker(cfg: dict[str, Any], vision: dict[str, Any], audio: dict[str, Any], dtype: torch.dtype) -> TalkerConfig:
    text = MoETextConfig.from_hf(cfg["text_config"], dtype)
    codec = {k: cfg[f"codec_{k}_id"] for k in ("pad", "bos", "nothink", "think_bos", "think_eos")}
    codec["eos"] = cfg["codec_eos_token_id"]
    tokens = MultimodalTokens.from_hf(cfg, {"spatial_merge_size": cfg.get("spatial_merge_size",
                                                                          vision.get("spatial_merge_size", 2))}, audio)
    return TalkerConfig(text, tokens, cfg["thinker_hidden_size"], cfg["accept_hidden_layer"],
                        cfg["num_code_groups"], codec, dict(cfg.get("speaker_id") or {}))
