"""Pi0.5 shapes: the SigLIP vision tower, the Gemma prefix, the action expert and the flow settings.

`Pi05Config.from_lerobot` reads a lerobot `config.json` (`PI05Config` keys: the Gemma variants by name,
the image resolution, chunk size, padded state and action widths, flow steps, time-embedding periods,
and the input/output features that name the cameras and give the robot's real state and action sizes).
The full-size constants are lerobot/pi05_base's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mstar.layers.siglip import SiglipShape

CAMERA_PREFIX = "observation.images."  # lerobot's image feature names: CAMERA_PREFIX + camera


@dataclass(frozen=True)
class GemmaShape:
    """One Gemma decoder stack (openpi's `gemma.Config`)."""

    width: int
    depth: int
    mlp_dim: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"Gemma: num_heads {self.num_heads} must be a multiple of num_kv_heads {self.num_kv_heads}")


GEMMA_VARIANTS = {  # lerobot's `paligemma_variant` / `action_expert_variant` names
    "gemma_2b": GemmaShape(width=2048, depth=18, mlp_dim=16_384, num_heads=8, num_kv_heads=1, head_dim=256),
    "gemma_300m": GemmaShape(width=1024, depth=18, mlp_dim=4096, num_heads=8, num_kv_heads=1, head_dim=256),
}


@dataclass(frozen=True)
class Pi05Config:
    """A Pi0.5 policy: its networks, its robot (cameras, state and action sizes) and its flow."""

    vision: SiglipShape
    llm: GemmaShape  # the PaliGemma language model that reads the prefix
    expert: GemmaShape  # the action expert: same depth and heads, its own width
    vocab_size: int = 257_152
    cameras: tuple[str, ...] = ("base_0_rgb", "left_wrist_0_rgb", "right_wrist_0_rgb")
    state_dim: int = 32  # the robot's state entries (padded to max_state_dim for the prompt)
    action_dim: int = 32  # the robot's action entries (the first of max_action_dim)
    chunk_size: int = 50  # actions per chunk
    max_state_dim: int = 32
    max_action_dim: int = 32
    num_steps: int = 10  # Euler steps from noise (t = 1) to actions (t = 0)
    min_period: float = 4e-3  # of the sinusoidal time embedding
    max_period: float = 4.0
    max_prompt_tokens: int = 200  # the tokenized task and state are cut to this many tokens

    def __post_init__(self) -> None:
        if self.llm.depth != self.expert.depth or self.llm.head_dim != self.expert.head_dim \
                or self.llm.num_kv_heads != self.expert.num_kv_heads or self.llm.num_heads != self.expert.num_heads:
            raise ValueError("the action expert attends the prefix's keys and values layer by layer: its depth, "
                             "heads, KV heads and head_dim must equal the language model's")
        if self.expert.width % 2:
            raise ValueError(f"the time embedding needs an even expert width, got {self.expert.width}")
        if not 0 < self.state_dim <= self.max_state_dim or not 0 < self.action_dim <= self.max_action_dim:
            raise ValueError(f"state_dim {self.state_dim} / action_dim {self.action_dim} must be in "
                             f"[1, {self.max_state_dim}] / [1, {self.max_action_dim}]")
        if not self.cameras:
            raise ValueError("a Pi0.5 policy needs at least one camera")

    @property
    def max_prefix_tokens(self) -> int:
        """Tokens of the longest prefix: every camera's image tokens and the longest prompt."""
        return len(self.cameras) * self.vision.tokens + self.max_prompt_tokens

    @classmethod
    def from_lerobot(cls, cfg: dict[str, Any]) -> Pi05Config:
        """From a lerobot `config.json` dict (`"type": "pi05"`); missing keys take lerobot's defaults."""
        if cfg.get("type", "pi05") != "pi05":
            raise ValueError(f"config.json is of a {cfg.get('type')!r} policy, not pi05")
        variants = (cfg.get("paligemma_variant", "gemma_2b"), cfg.get("action_expert_variant", "gemma_300m"))
        if unknown := [v for v in variants if v not in GEMMA_VARIANTS]:
            raise ValueError(f"unknown Gemma variant {unknown}; known: {sorted(GEMMA_VARIANTS)}")
        size = cfg.get("image_resolution") or [224, 224]
        if size[0] != size[1]:
            raise ValueError(f"image_resolution {size} is not square (PaliGemma takes square images)")
        inputs = cfg.get("input_features") or {}
        cameras = tuple(name.removeprefix(CAMERA_PREFIX) for name, f in inputs.items() if f.get("type") == "VISUAL")
        cameras += tuple(f"empty_camera_{i}" for i in range(int(cfg.get("empty_cameras", 0))))
        max_state, max_action = int(cfg.get("max_state_dim", 32)), int(cfg.get("max_action_dim", 32))
        state = (inputs.get("observation.state") or {}).get("shape") or [max_state]
        action = ((cfg.get("output_features") or {}).get("action") or {}).get("shape") or [max_action]
        return cls(
            vision=SiglipShape(image_size=int(size[0])), llm=GEMMA_VARIANTS[variants[0]],
            expert=GEMMA_VARIANTS[variants[1]], cameras=cameras or cls.cameras, state_dim=int(state[-1]),
            action_dim=int(action[-1]), chunk_size=int(cfg.get("chunk_size", 50)), max_state_dim=max_state,
            max_action_dim=max_action, num_steps=int(cfg.get("num_inference_steps", 10)),
            min_period=float(cfg.get("min_period", 4e-3)), max_period=float(cfg.get("max_period", 4.0)),
            max_prompt_tokens=int(cfg.get("tokenizer_max_length", 200)))


PI05_BASE = Pi05Config(SiglipShape(), GEMMA_VARIANTS["gemma_2b"], GEMMA_VARIANTS["gemma_300m"])
