"""lerobot/pi05_base's checkpoint layout against our full-size networks on the meta device (#39).

The names and shapes are derived from lerobot's modeling code (`PI05Policy.state_dict()`: PaliGemma with
its SigLIP tower and projector, the Gemma-2B language model, the Gemma-300M expert whose norms are
adaptive `dense` layers and which keeps an LM head, the action and time projections) at the config of
lerobot/pi05_base. Every name must land on a parameter with its shape, every parameter must be filled
exactly once, and only the names `weights.UNUSED` lists may be skipped.
"""

from __future__ import annotations

import pytest
import torch

from mstar.models.common.loading import load_named_tensors
from mstar.models.pi05.config import PI05_BASE, Pi05Config
from mstar.models.pi05.network import Pi05Network
from mstar.models.pi05.weights import UNUSED, canonical, mapper

PALI = "paligemma_with_expert.paligemma."
EXPERT = "paligemma_with_expert.gemma_expert."

# config.json of lerobot/pi05_base (the keys that shape the networks and the robot)
PI05_BASE_JSON = {
    "type": "pi05", "paligemma_variant": "gemma_2b", "action_expert_variant": "gemma_300m", "dtype": "bfloat16",
    "chunk_size": 50, "n_action_steps": 50, "max_state_dim": 32, "max_action_dim": 32, "num_inference_steps": 10,
    "min_period": 0.004, "max_period": 4.0, "image_resolution": [224, 224], "tokenizer_max_length": 200,
    "input_features": {
        "observation.images.base_0_rgb": {"type": "VISUAL", "shape": [3, 224, 224]},
        "observation.images.left_wrist_0_rgb": {"type": "VISUAL", "shape": [3, 224, 224]},
        "observation.images.right_wrist_0_rgb": {"type": "VISUAL", "shape": [3, 224, 224]},
        "observation.state": {"type": "STATE", "shape": [32]}},
    "output_features": {"action": {"type": "ACTION", "shape": [32]}},
}


def lerobot_keys(cfg: Pi05Config) -> dict[str, tuple[int, ...]]:
    """`PI05Policy.state_dict()` names (without the policy's `model.`) and shapes at `cfg`."""
    keys: dict[str, tuple[int, ...]] = {}
    v, width, mlp = cfg.vision, cfg.vision.hidden_size, cfg.vision.intermediate_size
    tower = PALI + "model.vision_tower.vision_model."
    keys[tower + "embeddings.patch_embedding.weight"] = (width, 3, v.patch_size, v.patch_size)
    keys[tower + "embeddings.patch_embedding.bias"] = (width,)
    keys[tower + "embeddings.position_embedding.weight"] = (v.tokens, width)
    for i in range(v.num_layers):
        s = f"{tower}encoder.layers.{i}."
        for name, shape in (("layer_norm1", (width,)), ("layer_norm2", (width,))):
            keys[s + name + ".weight"], keys[s + name + ".bias"] = shape, shape
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            keys[f"{s}self_attn.{proj}.weight"], keys[f"{s}self_attn.{proj}.bias"] = (width, width), (width,)
        keys[s + "mlp.fc1.weight"], keys[s + "mlp.fc1.bias"] = (mlp, width), (mlp,)
        keys[s + "mlp.fc2.weight"], keys[s + "mlp.fc2.bias"] = (width, mlp), (width,)
    keys[tower + "post_layernorm.weight"] = keys[tower + "post_layernorm.bias"] = (width,)
    keys[PALI + "model.multi_modal_projector.linear.weight"] = (cfg.llm.width, width)
    keys[PALI + "model.multi_modal_projector.linear.bias"] = (cfg.llm.width,)
    llm = PALI + "model.language_model."
    keys[llm + "embed_tokens.weight"] = keys[PALI + "lm_head.weight"] = (cfg.vocab_size, cfg.llm.width)
    keys.update(_gemma_layers(llm + "layers.", cfg.llm, adaptive=False))
    keys[llm + "norm.weight"] = (cfg.llm.width,)
    e = cfg.expert
    keys.update(_gemma_layers(EXPERT + "model.layers.", e, adaptive=True))
    keys[EXPERT + "model.norm.dense.weight"], keys[EXPERT + "model.norm.dense.bias"] = (3 * e.width, e.width), (3 * e.width,)
    keys[EXPERT + "lm_head.weight"] = (cfg.vocab_size, e.width)
    for name, shape in (("action_in_proj", (e.width, cfg.max_action_dim)), ("action_out_proj", (cfg.max_action_dim, e.width)),
                        ("time_mlp_in", (e.width, e.width)), ("time_mlp_out", (e.width, e.width))):
        keys[name + ".weight"], keys[name + ".bias"] = shape, (shape[0],)
    return keys


def _gemma_layers(prefix: str, g, adaptive: bool) -> dict[str, tuple[int, ...]]:
    keys = {}
    q, kv = g.num_heads * g.head_dim, g.num_kv_heads * g.head_dim
    for i in range(g.depth):
        s = f"{prefix}{i}."
        keys.update({s + "self_attn.q_proj.weight": (q, g.width), s + "self_attn.k_proj.weight": (kv, g.width),
                     s + "self_attn.v_proj.weight": (kv, g.width), s + "self_attn.o_proj.weight": (g.width, q),
                     s + "mlp.gate_proj.weight": (g.mlp_dim, g.width), s + "mlp.up_proj.weight": (g.mlp_dim, g.width),
                     s + "mlp.down_proj.weight": (g.width, g.mlp_dim)})
        for norm in ("input_layernorm", "post_attention_layernorm"):
            if adaptive:
                keys[f"{s}{norm}.dense.weight"], keys[f"{s}{norm}.dense.bias"] = (3 * g.width, g.width), (3 * g.width,)
            else:
                keys[f"{s}{norm}.weight"] = (g.width,)
    return keys


@pytest.fixture(scope="module")
def network() -> Pi05Network:
    with torch.device("meta"):
        return Pi05Network(PI05_BASE)


def test_config_json_reads_as_pi05_base() -> None:
    assert Pi05Config.from_lerobot(PI05_BASE_JSON) == PI05_BASE
    assert PI05_BASE.cameras == ("base_0_rgb", "left_wrist_0_rgb", "right_wrist_0_rgb")
    assert PI05_BASE.max_prefix_tokens == 3 * 256 + 200


@pytest.mark.parametrize("saved", ["tied head dropped", "embedding dropped", "both, under model."])
def test_every_checkpoint_key_lands_on_a_parameter(network: Pi05Network, saved: str) -> None:
    keys = lerobot_keys(PI05_BASE)
    assert len(keys) == 813  # 812 in a safetensors file, which keeps one of the tied embedding and LM head
    if saved == "tied head dropped":
        keys.pop(PALI + "lm_head.weight")
    elif saved == "embedding dropped":
        keys.pop(PALI + "model.language_model.embed_tokens.weight")
    else:
        keys = {"model." + k: s for k, s in keys.items()}
    name_map = mapper(PI05_BASE, keys)
    skipped = {canonical(k) for k in keys if name_map(k) is None}
    assert skipped <= set(UNUSED) | {PALI + "lm_head.weight"}
    # raises on a shape mismatch, an unknown name, or a parameter not filled exactly once
    load_named_tensors(network, ((k, torch.empty(s, device="meta")) for k, s in keys.items()), name_map)


def test_full_size_parameter_count(network: Pi05Network) -> None:
    total = sum(p.numel() for p in network.parameters())
    assert 3.2e9 < total < 3.4e9, total  # lerobot's ~3.6B less the expert's unused 263M LM head
    assert sum(p.numel() for p in network.vision.parameters()) == pytest.approx(4.15e8, rel=0.01)  # so400m + projector
