"""Test helpers for BAGEL: the upstream checkpoint's tensor names and shapes, random weights in that layout,
and conversions of those weights into the layouts of transformers' and diffusers' reference modules.

The names and shapes are read off the upstream code (ByteDance-Seed/Bagel: `Bagel.__init__`, `qwen2_navit`'s
`Qwen2MoTDecoderLayer` and `PackedAttentionMoT`, `siglip_navit` with `rope=False` and the patch
embedding converted to a Linear, `modeling_utils`' connector and embedders) and FLUX's `AutoEncoder`.
"""

from __future__ import annotations

from pathlib import Path

import torch

from mstar.models.bagel.config import BagelConfig


def llm_shapes(cfg: BagelConfig) -> dict[str, tuple[int, ...]]:
    """`ema.safetensors` names and shapes of the language model and the generation heads."""
    llm, hidden = cfg.llm, cfg.llm.hidden_size
    q, kv, inter = llm.num_heads * llm.head_dim, llm.num_kv_heads * llm.head_dim, llm.intermediate_size
    out = {"language_model.model.embed_tokens.weight": (llm.vocab_size, hidden),
           "language_model.model.norm.weight": (hidden,), "language_model.model.norm_moe_gen.weight": (hidden,),
           "language_model.lm_head.weight": (llm.vocab_size, hidden)}
    for i in range(llm.num_layers):
        pre = f"language_model.model.layers.{i}."
        for gen in ("", "_moe_gen"):
            out[f"{pre}input_layernorm{gen}.weight"] = (hidden,)
            out[f"{pre}post_attention_layernorm{gen}.weight"] = (hidden,)
            for name, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
                out[f"{pre}self_attn.{name}{gen}.weight"] = (rows, hidden)
                out[f"{pre}self_attn.{name}{gen}.bias"] = (rows,)
            out[f"{pre}self_attn.o_proj{gen}.weight"] = (hidden, q)
            out[f"{pre}self_attn.q_norm{gen}.weight"] = (llm.head_dim,)
            out[f"{pre}self_attn.k_norm{gen}.weight"] = (llm.head_dim,)
            out[f"{pre}mlp{gen}.gate_proj.weight"] = (inter, hidden)
            out[f"{pre}mlp{gen}.up_proj.weight"] = (inter, hidden)
            out[f"{pre}mlp{gen}.down_proj.weight"] = (hidden, inter)
    latent = cfg.patch_latent_dim
    out.update({"time_embedder.mlp.0.weight": (hidden, cfg.timestep_dim), "time_embedder.mlp.0.bias": (hidden,),
                "time_embedder.mlp.2.weight": (hidden, hidden), "time_embedder.mlp.2.bias": (hidden,),
                "vae2llm.weight": (hidden, latent), "vae2llm.bias": (hidden,),
                "llm2vae.weight": (latent, hidden), "llm2vae.bias": (latent,),
                "latent_pos_embed.pos_embed": (cfg.max_latent_size**2, hidden)})
    return out


def vit_shapes(cfg: BagelConfig) -> dict[str, tuple[int, ...]]:
    """`ema.safetensors` names and shapes of the ViT, the connector and the ViT-side LLM position table."""
    vit, hidden = cfg.vit, cfg.llm.hidden_size
    d, pre = vit.hidden_size, "vit_model.vision_model."
    out = {f"{pre}embeddings.patch_embedding.weight": (d, vit.patch_dim), f"{pre}embeddings.patch_embedding.bias": (d,),
           f"{pre}embeddings.position_embedding.weight": (vit.grid_side**2, d),
           f"{pre}post_layernorm.weight": (d,), f"{pre}post_layernorm.bias": (d,)}
    for i in range(vit.num_layers):
        layer = f"{pre}encoder.layers.{i}."
        for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
            out[f"{layer}self_attn.{name}.weight"] = (d, d)
            out[f"{layer}self_attn.{name}.bias"] = (d,)
        for name in ("layer_norm1", "layer_norm2"):
            out[f"{layer}{name}.weight"], out[f"{layer}{name}.bias"] = (d,), (d,)
        out[f"{layer}mlp.fc1.weight"], out[f"{layer}mlp.fc1.bias"] = (vit.intermediate_size, d), (vit.intermediate_size,)
        out[f"{layer}mlp.fc2.weight"], out[f"{layer}mlp.fc2.bias"] = (d, vit.intermediate_size), (d,)
    out.update({"connector.fc1.weight": (hidden, d), "connector.fc1.bias": (hidden,),
                "connector.fc2.weight": (hidden, hidden), "connector.fc2.bias": (hidden,),
                "vit_pos_embed.pos_embed": (cfg.vit_max_patches_per_side**2, hidden)})
    return out


def vae_shapes(cfg: BagelConfig) -> dict[str, tuple[int, ...]]:
    """`ae.safetensors` names and shapes (FLUX's AutoEncoder)."""
    v = cfg.vae
    widths = [v.ch * m for m in v.ch_mult]
    out: dict[str, tuple[int, ...]] = {}

    def conv(name: str, cin: int, cout: int, k: int) -> None:
        out[f"{name}.weight"], out[f"{name}.bias"] = (cout, cin, k, k), (cout,)

    def norm(name: str, c: int) -> None:
        out[f"{name}.weight"], out[f"{name}.bias"] = (c,), (c,)

    def resnet(name: str, cin: int, cout: int) -> None:
        norm(f"{name}.norm1", cin)
        conv(f"{name}.conv1", cin, cout, 3)
        norm(f"{name}.norm2", cout)
        conv(f"{name}.conv2", cout, cout, 3)
        if cin != cout:
            conv(f"{name}.nin_shortcut", cin, cout, 1)

    def mid(name: str, c: int) -> None:
        resnet(f"{name}.block_1", c, c)
        norm(f"{name}.attn_1.norm", c)
        for part in ("q", "k", "v", "proj_out"):
            conv(f"{name}.attn_1.{part}", c, c, 1)
        resnet(f"{name}.block_2", c, c)

    conv("encoder.conv_in", 3, v.ch, 3)
    cin = v.ch
    for i, w in enumerate(widths):
        for j in range(v.num_res_blocks):
            resnet(f"encoder.down.{i}.block.{j}", cin, w)
            cin = w
        if i < len(widths) - 1:
            conv(f"encoder.down.{i}.downsample.conv", w, w, 3)
    mid("encoder.mid", widths[-1])
    norm("encoder.norm_out", widths[-1])
    conv("encoder.conv_out", widths[-1], 2 * v.z_channels, 3)
    conv("decoder.conv_in", v.z_channels, widths[-1], 3)
    mid("decoder.mid", widths[-1])
    cin = widths[-1]
    for i in reversed(range(len(widths))):
        for j in range(v.num_res_blocks + 1):
            resnet(f"decoder.up.{i}.block.{j}", cin, widths[i])
            cin = widths[i]
        if i > 0:
            conv(f"decoder.up.{i}.upsample.conv", widths[i], widths[i], 3)
    norm("decoder.norm_out", widths[0])
    conv("decoder.conv_out", widths[0], 3, 3)
    return out


def random_state(shapes: dict[str, tuple[int, ...]], seed: int, scale: float = 0.2) -> dict[str, torch.Tensor]:
    """Non-trivial values everywhere (norm scales around 1), so a mis-mapped tensor cannot hide."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in shapes.items():
        noise = torch.randn(shape, generator=gen)
        is_scale = len(shape) == 1 and name.endswith("weight") and "norm" in name
        out[name] = 1 + 0.1 * noise if is_scale else scale * noise
    return out


def write_checkpoint(folder: Path, cfg_dicts: tuple[dict, dict], ema: dict[str, torch.Tensor],
                     ae: dict[str, torch.Tensor]) -> Path:
    """A BAGEL-7B-MoT-layout folder: llm_config.json, vit_config.json, ema.safetensors, ae.safetensors."""
    import json

    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "llm_config.json").write_text(json.dumps(cfg_dicts[0]))
    (folder / "vit_config.json").write_text(json.dumps(cfg_dicts[1]))
    save_file({k: v.contiguous() for k, v in ema.items()}, str(folder / "ema.safetensors"))
    save_file({k: v.contiguous() for k, v in ae.items()}, str(folder / "ae.safetensors"))
    return folder


def diffusers_vae_state(ae: dict[str, torch.Tensor], cfg: BagelConfig) -> dict[str, torch.Tensor]:
    """FLUX autoencoder tensors renamed to diffusers' AutoencoderKL layout."""
    levels = len(cfg.vae.ch_mult)
    out = {}
    for name, value in ae.items():
        new = name
        for old, repl in (("down.", "down_blocks."), ("mid.block_1", "mid_block.resnets.0"),
                          ("mid.block_2", "mid_block.resnets.1"), ("mid.attn_1.norm", "mid_block.attentions.0.group_norm"),
                          ("mid.attn_1.q", "mid_block.attentions.0.to_q"), ("mid.attn_1.k", "mid_block.attentions.0.to_k"),
                          ("mid.attn_1.v", "mid_block.attentions.0.to_v"),
                          ("mid.attn_1.proj_out", "mid_block.attentions.0.to_out.0"),
                          (".block.", ".resnets."), ("downsample.conv", "downsamplers.0.conv"),
                          ("upsample.conv", "upsamplers.0.conv"), ("nin_shortcut", "conv_shortcut"),
                          ("norm_out", "conv_norm_out")):
            new = new.replace(old, repl)
        if new.startswith("decoder.up."):  # diffusers numbers the decoder's levels from the coarsest
            _, _, level, rest = new.split(".", 3)
            new = f"decoder.up_blocks.{levels - 1 - int(level)}.{rest}"
        if ".attentions.0.to_" in new and value.ndim == 4:
            value = value[:, :, 0, 0]  # diffusers' attention projections are Linears
        out[new] = value
    return out
