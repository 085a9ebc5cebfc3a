"""References for the Pi0.5 tests: transformers' PI0 at our tiny shapes (the parts Pi0 and Pi0.5 share),
a lerobot-named checkpoint folder written from it, and a plain Pi0.5 written from lerobot's semantics.

The plain policy (`plain_sample_actions`) follows lerobot's `PI05Pytorch.sample_actions` step by step on
one concatenated sequence per robot: the prefix (images, then the prompt's scaled embeddings) under
lerobot's `make_att_2d_masks` (prefix-LM: every prefix token sees the whole prefix), each Euler step
running the expert's tokens over the prefix's cached keys and values (`denoise_step`: action tokens see
the prefix and each other), with the adaptive norms' gated residuals (`_gated_residual`) and the
sinusoidal time embedding through the time MLP. It shares no code with mstar's networks.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F

from mstar.models.pi05.config import Pi05Config

_PALI = "paligemma_with_expert.paligemma."
_EXPERT = "paligemma_with_expert.gemma_expert."


def pi0_config(config: Pi05Config):
    """transformers' PI0Config at `config`'s shapes (the image token is the id after the vocabulary)."""
    import transformers

    llm, expert, vision = config.llm, config.expert, config.vision
    gemma = {"model_type": "gemma", "hidden_activation": "gelu_pytorch_tanh", "vocab_size": config.vocab_size}
    return transformers.PI0Config(
        vlm_config={
            "model_type": "paligemma", "image_token_id": config.vocab_size, "projection_dim": llm.width,
            "text_config": {**gemma, "hidden_size": llm.width, "num_hidden_layers": llm.depth,
                            "intermediate_size": llm.mlp_dim, "num_attention_heads": llm.num_heads,
                            "num_key_value_heads": llm.num_kv_heads, "head_dim": llm.head_dim},
            "vision_config": {"model_type": "siglip_vision_model", "hidden_size": vision.hidden_size,
                              "intermediate_size": vision.intermediate_size, "num_hidden_layers": vision.num_layers,
                              "num_attention_heads": vision.num_heads, "patch_size": vision.patch_size,
                              "image_size": vision.image_size, "vision_use_head": False}},
        dit_config={**gemma, "hidden_size": expert.width, "num_hidden_layers": expert.depth,
                    "intermediate_size": expert.mlp_dim, "num_attention_heads": expert.num_heads,
                    "num_key_value_heads": expert.num_kv_heads, "head_dim": expert.head_dim},
        chunk_size=config.chunk_size, max_state_dim=config.max_state_dim, max_action_dim=config.max_action_dim)


def randomize(module: torch.nn.Module, seed: int) -> None:
    """Non-trivial values everywhere (norm scales near 1, Gemma's near 0), so a mis-mapped tensor shows."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            siglip_scale = param.ndim == 1 and name.endswith("weight") and ("layer_norm" in name or "layernorm" in name)
            param.copy_(1 + 0.1 * noise if siglip_scale else 0.2 * noise)


def tiny_pi0(config: Pi05Config, seed: int = 0):
    """transformers' PI0ForConditionalGeneration at `config`'s shapes, randomized, float32, eval."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.PI0ForConditionalGeneration(pi0_config(config)).eval()
    randomize(model, seed + 1)
    return model


def lerobot_state_dict(pi0, seed: int = 0) -> dict[str, torch.Tensor]:
    """PI0's shared weights under lerobot's Pi0.5 names. The expert's plain norms become adaptive ones
    that ignore the condition (dense weight 0, bias = (weight, 0 shift, 1 gate)), so it computes what
    PI0's expert computes; the Pi0.5-only tensors (time MLP, action projections) are seeded random."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in pi0.state_dict().items():
        if name.startswith("model.vlm.lm_head") or "sinusoid" in name or "rotary" in name:
            continue
        if name.startswith("model.vlm.vision_tower.") and ".vision_model." not in name:
            out[_PALI + "model.vision_tower.vision_model." + name.removeprefix("model.vlm.vision_tower.")] = tensor
        elif name.startswith("model.vlm."):
            out[_PALI + "model." + name.removeprefix("model.vlm.")] = tensor
        elif name.startswith("model.dit.") and "norm" in name and not name.startswith("model.dit.embed"):
            stem = _EXPERT + "model." + name.removeprefix("model.dit.").removesuffix(".weight")
            width = tensor.shape[0]
            out[stem + ".dense.weight"] = torch.zeros(3 * width, width)
            out[stem + ".dense.bias"] = torch.cat([tensor, torch.zeros(width), torch.ones(width)])
        elif name.startswith("model.dit.layers."):
            out[_EXPERT + "model." + name.removeprefix("model.dit.")] = tensor
    gen = torch.Generator().manual_seed(seed)
    expert_width = pi0.config.dit_config.hidden_size
    action = pi0.config.max_action_dim
    for name, shape in (("action_in_proj", (expert_width, action)), ("action_out_proj", (action, expert_width)),
                        ("time_mlp_in", (expert_width, expert_width)), ("time_mlp_out", (expert_width, expert_width))):
        out[name + ".weight"] = 0.2 * torch.randn(shape, generator=gen)
        out[name + ".bias"] = 0.2 * torch.randn(shape[0], generator=gen)
    return out


def adaptive_expert_norms(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """`state` with every adaRMS dense layer random, so the time condition really modulates the expert."""
    gen = torch.Generator().manual_seed(seed)
    return {name: (0.2 * torch.randn(t.shape, generator=gen) if ".dense." in name else t)
            for name, t in state.items()}


def write_folder(state: dict[str, torch.Tensor], folder: Path, prefix: str = "model.") -> Path:
    """A lerobot-style checkpoint folder (model.safetensors, names under `prefix`)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    save_file({prefix + k: v.contiguous() for k, v in state.items()}, str(folder / "model.safetensors"))
    return folder


# -- the plain Pi0.5 -------------------------------------------------------------------------------


def _rms(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """x [B, H, L, D] rotated at positions [B, L] (rotate-half)."""
    dim = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, dim, 2).float() / dim)
    angles = positions.float()[:, None, :, None] * inv
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    half = dim // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


def _heads(x: torch.Tensor, weight: torch.Tensor, heads: int, dim: int) -> torch.Tensor:
    return (x @ weight.T).view(x.shape[0], x.shape[1], heads, dim).transpose(1, 2)


def _attend(q, k, v, mask) -> torch.Tensor:
    """Eager attention as lerobot's: additive mask, float32 softmax; k/v repeated over query heads."""
    k = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
    v = v.repeat_interleave(q.shape[1] // v.shape[1], 1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    scores = scores + torch.where(mask[:, None], 0.0, -2.3819763e38)
    return (scores.softmax(-1) @ v).transpose(1, 2).flatten(2)


def _mlp(x, sd, stem):
    return F.gelu(x @ sd[stem + "mlp.gate_proj.weight"].T, approximate="tanh") * (x @ sd[stem + "mlp.up_proj.weight"].T) \
        @ sd[stem + "mlp.down_proj.weight"].T


def _siglip(images, sd, cfg: Pi05Config) -> torch.Tensor:
    v = _PALI + "model.vision_tower.vision_model."
    x = F.conv2d(images, sd[v + "embeddings.patch_embedding.weight"], sd[v + "embeddings.patch_embedding.bias"],
                 stride=cfg.vision.patch_size).flatten(2).transpose(1, 2)
    x = x + sd[v + "embeddings.position_embedding.weight"]
    heads, width = cfg.vision.num_heads, cfg.vision.hidden_size
    for i in range(cfg.vision.num_layers):
        s = f"{v}encoder.layers.{i}."
        h = F.layer_norm(x, (width,), sd[s + "layer_norm1.weight"], sd[s + "layer_norm1.bias"], 1e-6)
        qkv = [(h @ sd[f"{s}self_attn.{n}_proj.weight"].T + sd[f"{s}self_attn.{n}_proj.bias"])
               .view(*h.shape[:2], heads, -1).transpose(1, 2) for n in "qkv"]
        att = (qkv[0] @ qkv[1].transpose(-1, -2) / math.sqrt(width // heads)).softmax(-1) @ qkv[2]
        x = x + att.transpose(1, 2).flatten(2) @ sd[s + "self_attn.out_proj.weight"].T + sd[s + "self_attn.out_proj.bias"]
        h = F.layer_norm(x, (width,), sd[s + "layer_norm2.weight"], sd[s + "layer_norm2.bias"], 1e-6)
        h = F.gelu(h @ sd[s + "mlp.fc1.weight"].T + sd[s + "mlp.fc1.bias"], approximate="tanh")
        x = x + h @ sd[s + "mlp.fc2.weight"].T + sd[s + "mlp.fc2.bias"]
    x = F.layer_norm(x, (width,), sd[v + "post_layernorm.weight"], sd[v + "post_layernorm.bias"], 1e-6)
    proj = _PALI + "model.multi_modal_projector.linear."
    return x @ sd[proj + "weight"].T + sd[proj + "bias"]


def _sinusoid(t: torch.Tensor, dim: int, min_period: float, max_period: float) -> torch.Tensor:
    fraction = torch.linspace(0.0, 1.0, dim // 2, dtype=torch.float64)
    period = min_period * (max_period / min_period) ** fraction
    x = (1.0 / period * 2 * math.pi)[None, :] * t[:, None]
    return torch.cat([x.sin(), x.cos()], 1).float()


def plain_sample_actions(sd: dict[str, torch.Tensor], cfg: Pi05Config, images: torch.Tensor, prompt_ids: torch.Tensor,
                         noise: torch.Tensor, num_steps: int) -> torch.Tensor:
    """One robot: images [N, 3, S, S] in [-1, 1], prompt ids [T], noise [C, A] -> actions [C, A] (t 1 -> 0)."""
    llm, ex = cfg.llm, cfg.expert
    embed = sd[_PALI + "model.language_model.embed_tokens.weight"]
    prefix = torch.cat([_siglip(images, sd, cfg).flatten(0, 1), embed[prompt_ids] * math.sqrt(llm.width)])[None]
    length = prefix.shape[1]
    pad, att = torch.ones(1, length, dtype=torch.bool), torch.zeros(1, length, dtype=torch.long)
    cumsum = att.cumsum(1)  # lerobot's make_att_2d_masks
    mask = (cumsum[:, None, :] <= cumsum[:, :, None]) & pad[:, None, :] & pad[:, :, None]
    positions = pad.long().cumsum(1) - 1
    cache = []
    x = prefix
    for i in range(llm.depth):
        s = f"{_PALI}model.language_model.layers.{i}."
        h = _rms(x) * (1 + sd[s + "input_layernorm.weight"])
        q = _rope(_heads(h, sd[s + "self_attn.q_proj.weight"], llm.num_heads, llm.head_dim), positions)
        k = _rope(_heads(h, sd[s + "self_attn.k_proj.weight"], llm.num_kv_heads, llm.head_dim), positions)
        v = _heads(h, sd[s + "self_attn.v_proj.weight"], llm.num_kv_heads, llm.head_dim)
        cache.append((k, v))
        x = x + _attend(q, k, v, mask) @ sd[s + "self_attn.o_proj.weight"].T
        x = x + _mlp(_rms(x) * (1 + sd[s + "post_attention_layernorm.weight"]), sd, s)
    x_t, dt = noise[None].float(), -1.0 / num_steps
    chunk = x_t.shape[1]
    suffix_mask = torch.ones(1, chunk, length + chunk, dtype=torch.bool)  # prefix pad mask, then actions' own block
    suffix_pos = length + torch.arange(chunk)[None]
    for step in range(num_steps):
        t = torch.tensor([1.0 + step * dt])
        cond = _sinusoid(t, ex.width, cfg.min_period, cfg.max_period)
        cond = F.silu(F.silu(cond @ sd["time_mlp_in.weight"].T + sd["time_mlp_in.bias"]) @ sd["time_mlp_out.weight"].T
                      + sd["time_mlp_out.bias"])
        y = x_t @ sd["action_in_proj.weight"].T + sd["action_in_proj.bias"]
        for i in range(ex.depth):
            s = f"{_EXPERT}model.layers.{i}."
            h, gate = _ada(y, cond, sd, s + "input_layernorm.dense.")
            q = _rope(_heads(h, sd[s + "self_attn.q_proj.weight"], ex.num_heads, ex.head_dim), suffix_pos)
            k = _rope(_heads(h, sd[s + "self_attn.k_proj.weight"], ex.num_kv_heads, ex.head_dim), suffix_pos)
            v = _heads(h, sd[s + "self_attn.v_proj.weight"], ex.num_kv_heads, ex.head_dim)
            keys, values = torch.cat([cache[i][0], k], 2), torch.cat([cache[i][1], v], 2)
            y = y + (_attend(q, keys, values, suffix_mask) @ sd[s + "self_attn.o_proj.weight"].T) * gate
            h, gate = _ada(y, cond, sd, s + "post_attention_layernorm.dense.")
            y = y + _mlp(h, sd, s) * gate
        y = _ada(y, cond, sd, _EXPERT + "model.norm.dense.")[0]
        x_t = x_t + dt * (y @ sd["action_out_proj.weight"].T + sd["action_out_proj.bias"])
    return x_t[0]


def _ada(x, cond, sd, stem):
    scale, shift, gate = (cond @ sd[stem + "weight"].T + sd[stem + "bias"])[:, None].chunk(3, -1)
    return _rms(x) * (1 + scale) + shift, gate
