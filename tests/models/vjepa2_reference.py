"""The upstream V-JEPA 2-AC predictor (cc-vjepa2) for parity tests, and plain reference loops.

cc-vjepa2 imports `drop_path` from timm, which needs torchvision; where timm cannot be imported (no
torchvision build matches the CPU torch here) a stand-in module gives the identity `drop_path` that an
eval-mode predictor with drop_path_rate 0 computes anyway.
"""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from mstar.models.vjepa2.config import ACPredictorConfig, EncoderConfig


def upstream_ac_module():
    """`vjepa2.models.ac_predictor`, or a skip when cc-vjepa2 is not installed."""
    try:
        import timm.models.layers  # noqa: F401
    except ImportError:
        layers = types.ModuleType("timm.models.layers")
        layers.drop_path = lambda x, drop_prob=0.0, training=False, scale_by_keep=True: x
        stand_ins = {"timm": types.ModuleType("timm"), "timm.models": types.ModuleType("timm.models"),
                     "timm.models.layers": layers}
        added = [name for name in stand_ins if name not in sys.modules]
        sys.modules.update({name: stand_ins[name] for name in added})
        try:
            # cc-vjepa2's modules keep the drop_path they imported; the stand-ins leave sys.modules again, since
            # a spec-less `timm` there breaks importlib.util.find_spec("timm") in later tests (diffusers')
            import vjepa2.models.ac_predictor  # noqa: F401
            import vjepa2.models.vision_transformer  # noqa: F401
        except ImportError:
            pass
        finally:
            for name in added:
                sys.modules.pop(name, None)
    return pytest.importorskip("vjepa2.models.ac_predictor", reason="pip install --no-deps cc-vjepa2==0.0.3")


def upstream_predictor(config: ACPredictorConfig):
    """cc-vjepa2's VisionTransformerPredictorAC of `config`'s shape (eval mode)."""
    module = upstream_ac_module()
    return module.vit_ac_predictor(
        img_size=config.img_size, patch_size=config.patch_size, num_frames=config.num_frames,
        tubelet_size=config.tubelet_size, embed_dim=config.embed_dim, predictor_embed_dim=config.vit.hidden_size,
        depth=config.vit.num_layers, num_heads=config.vit.num_heads, action_embed_dim=config.action_dim,
        use_extrinsics=config.use_extrinsics).eval()


def upstream_encoder(config: EncoderConfig):
    """cc-vjepa2's RoPE VisionTransformer of `config`'s shape (eval mode); it takes clips [B, C, T, H, W]."""
    upstream_ac_module()  # the timm stand-in, or a skip
    from vjepa2.models.vision_transformer import VisionTransformer

    vit = config.vit
    return VisionTransformer(
        img_size=(config.crop_size, config.crop_size), patch_size=config.patch_size, num_frames=config.frames_per_clip,
        tubelet_size=config.tubelet_size, embed_dim=vit.hidden_size, depth=vit.num_layers, num_heads=vit.num_heads,
        mlp_ratio=vit.mlp_ratio, qkv_bias=True, use_rope=True, uniform_power=False, use_sdpa=True,
        norm_layer=lambda width: torch.nn.LayerNorm(width, eps=vit.layer_norm_eps)).eval()


def scipy_next_pose(pose: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
    """[B, 7] pose after [B, 7] action, with scipy's rotations (the checkpoint authors' planning demo)."""
    from scipy.spatial.transform import Rotation

    p, a = pose.double().numpy(), action.double().numpy()
    turned = [(Rotation.from_euler("xyz", da).as_matrix() @ Rotation.from_euler("xyz", th).as_matrix())
              for th, da in zip(p[:, 3:6], a[:, 3:6], strict=True)]
    angles = np.stack([Rotation.from_matrix(m).as_euler("xyz") for m in turned])
    new = np.concatenate([p[:, :3] + a[:, :3], angles, np.clip(p[:, 6:] + a[:, 6:], 0, 1)], axis=-1)
    return torch.from_numpy(new).to(pose.dtype)


def recompute_rollout(reference, latents: torch.Tensor, states: torch.Tensor, actions: torch.Tensor,
                      tokens_per_frame: int) -> torch.Tensor:
    """The upstream loop: every step re-runs the predictor over the whole growing context and keeps the
    last frame's prediction (layer-normed). latents [B, C, HW, E], states [B, C, 7], actions
    [B, C + H - 1, 7] -> predictions [B, H, HW, E]."""
    context = latents.shape[1]
    frames, poses, out = latents, states, []
    for step in range(actions.shape[1] - context + 1):
        acts = actions[:, :context + step]
        nxt = reference(frames.flatten(1, 2), acts, poses)[:, -tokens_per_frame:]
        nxt = F.layer_norm(nxt, (nxt.shape[-1],))
        out.append(nxt)
        frames = torch.cat([frames, nxt[:, None]], dim=1)
        poses = torch.cat([poses, scipy_next_pose(poses[:, -1], acts[:, -1])[:, None]], dim=1)
    return torch.stack(out, dim=1)


def random_frames(count: int, seed: int) -> np.ndarray:
    """`count` random 48x40 RGB frames, uint8 [count, 40, 48, 3]."""
    return np.random.default_rng(seed).integers(0, 256, (count, 40, 48, 3), dtype=np.uint8)


def request_images(frames: np.ndarray, goal: np.ndarray | None = None) -> dict:
    """A request's media: the frames as images, and the goal image named "goal" when given."""
    media = [{"type": "image", "data": f} for f in frames]
    if goal is not None:
        media.append({"type": "image", "data": goal, "name": "goal"})
    return {"media": media}
