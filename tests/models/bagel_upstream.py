"""A plain, unbatched BAGEL written from the upstream code's semantics, over weights in the checkpoint layout.

It follows ByteDance-Seed/Bagel's `InterleaveInferencer.interleave_inference` and the `Bagel` methods it calls:
one forward per context update (`forward_cache_update_text` / `_vit` / `_vae`, each a whole segment with the
past keys and values concatenated in front: causal for text, bidirectional for an image), the three
contexts built as the inferencer builds them (deep copies), `generate_text` (greedy, starting from
<|im_start|>) and `generate_image` with `_forward_flow`'s three branches, guidance and renorm. Weights are
read by their checkpoint names (`ema`), the ViT is written out from SigLIP's definition, the VAE is
diffusers' AutoencoderKL (the posterior mean). Two choices that upstream leaves to chance are fixed as
mstar fixes them: the noise comes from a generator seeded with the request's seed, and a thought joins the
image context as the token ids generated (upstream decodes them to text and tokenizes that again).
"""

from __future__ import annotations

import copy
import math

import numpy as np
import torch
import torch.nn.functional as F

from mstar.models.bagel.config import BagelConfig, TokenIds

GEN_THINK = ("You should first think about the planning process in the mind and then generate the image. \n"
             "The planning process is enclosed within <think> </think> tags, i.e. <think> planning process here "
             "</think> image here")
VLM_THINK = ("You should first think about the reasoning process in the mind and then provide the user with the "
             "answer. \nThe reasoning process is enclosed within <think> </think> tags, i.e. <think> reasoning "
             "process here </think> answer here")


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rotate(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    freqs = positions.float()[:, None] * inv[None]
    emb = torch.cat([freqs, freqs], -1)
    cos, sin = emb.cos()[:, None], emb.sin()[:, None]
    half = d // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


def resize_to(width: int, height: int, max_size: int, min_size: int, stride: int,
              max_pixels: int = 14 * 14 * 9 * 1024) -> tuple[int, int]:
    """upstream MaxLongEdgeMinShortEdgeResize's target size."""
    def scaled(w, h, s):
        return tuple(max(stride, int(round(round(v * s) / stride) * stride)) for v in (w, h))

    scale = max(min(max_size / max(width, height), 1.0), min_size / min(width, height))
    w, h = scaled(width, height, scale)
    if w * h > max_pixels:
        w, h = scaled(w, h, max_pixels / (w * h))
    if max(w, h) > max_size:
        w, h = scaled(w, h, max_size / max(w, h))
    return w, h


def transform(image: np.ndarray, sizes: tuple[int, int, int]) -> np.ndarray:
    """Resize (PIL bicubic, as torchvision resizes a PIL image) to the range `sizes` = (max, min, stride)."""
    from PIL import Image

    w, h = resize_to(image.shape[1], image.shape[0], *sizes)
    if (w, h) == (image.shape[1], image.shape[0]):
        return image
    return np.asarray(Image.fromarray(image).resize((w, h), Image.Resampling.BICUBIC))


def to_tensor(image: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.array(image, dtype=np.float32)).permute(2, 0, 1) / 127.5 - 1.0


def patchify(x: torch.Tensor, p: int) -> torch.Tensor:
    c, h, w = x.shape
    return torch.einsum("chpwq->hwpqc", x.reshape(c, h // p, p, w // p, p)).reshape(-1, p * p * c)


def flat_ids(h: int, w: int, side: int) -> torch.Tensor:
    return (torch.arange(h)[:, None] * side + torch.arange(w)).flatten()


class UpstreamBagel:
    """The reference (module docstring). `vae` is a diffusers AutoencoderKL holding the ae weights."""

    def __init__(self, cfg: BagelConfig, ema: dict[str, torch.Tensor], vae, tokenizer, ids: TokenIds,
                 vae_sizes: tuple[int, int, int], vit_sizes: tuple[int, int, int]) -> None:
        self.cfg, self.w, self.vae, self.tok, self.ids = cfg, ema, vae, tokenizer, ids
        self.vae_sizes, self.vit_sizes = vae_sizes, vit_sizes

    # -- the LLM (qwen2_navit forward_inference, mode und / gen) ---------------------------------------

    def llm(self, cache: dict, x: torch.Tensor, positions: torch.Tensor, gen: torch.Tensor, causal: bool,
            update: bool) -> torch.Tensor:
        c, w = self.cfg.llm, self.w
        heads, kvh, d = c.num_heads, c.num_kv_heads, c.head_dim
        und = ~gen
        for i in range(c.num_layers):
            p = f"language_model.model.layers.{i}."

            def expert(name: str, rows: torch.Tensor, is_gen: bool, p: str = p) -> torch.Tensor:
                base = f"{p}self_attn.{name}{'_moe_gen' if is_gen else ''}"
                return F.linear(rows, w[f"{base}.weight"], w[f"{base}.bias"])

            h = torch.zeros_like(x)
            h[und] = _rms(x[und], w[f"{p}input_layernorm.weight"])
            h[gen] = _rms(x[gen], w[f"{p}input_layernorm_moe_gen.weight"])
            q, k, v = (x.new_zeros(x.shape[0], n * d) for n in (heads, kvh, kvh))
            for rows, is_gen in ((und, False), (gen, True)):
                q[rows], k[rows], v[rows] = (expert(n, h[rows], is_gen) for n in ("q_proj", "k_proj", "v_proj"))
            q, k, v = q.view(-1, heads, d), k.view(-1, kvh, d), v.view(-1, kvh, d)
            for rows, suffix in ((und, ""), (gen, "_moe_gen")):
                q[rows] = _rms(q[rows], w[f"{p}self_attn.q_norm{suffix}.weight"])
                k[rows] = _rms(k[rows], w[f"{p}self_attn.k_norm{suffix}.weight"])
            q, k = _rotate(q, positions, c.rope_theta), _rotate(k, positions, c.rope_theta)
            past_k, past_v = cache["k"][i], cache["v"][i]
            keys = k if past_k is None else torch.cat([past_k, k])
            values = v if past_v is None else torch.cat([past_v, v])
            n, m = x.shape[0], keys.shape[0]
            mask = None
            if causal:  # flash-attention's bottom-right causal alignment
                mask = torch.arange(m)[None, :] <= (torch.arange(n)[:, None] + m - n)
            attn = F.scaled_dot_product_attention(
                q.transpose(0, 1), keys.repeat_interleave(heads // kvh, 1).transpose(0, 1),
                values.repeat_interleave(heads // kvh, 1).transpose(0, 1), attn_mask=mask).transpose(0, 1)
            attn = attn.reshape(n, -1)
            out = torch.zeros_like(x)
            out[und] = F.linear(attn[und], w[f"{p}self_attn.o_proj.weight"])
            out[gen] = F.linear(attn[gen], w[f"{p}self_attn.o_proj_moe_gen.weight"])
            x = x + out
            mlp_out = torch.zeros_like(x)
            for rows, suffix in ((und, ""), (gen, "_moe_gen")):
                hh = _rms(x[rows], w[f"{p}post_attention_layernorm{suffix}.weight"])
                g = F.linear(hh, w[f"{p}mlp{suffix}.gate_proj.weight"])
                u = F.linear(hh, w[f"{p}mlp{suffix}.up_proj.weight"])
                mlp_out[rows] = F.linear(F.silu(g) * u, w[f"{p}mlp{suffix}.down_proj.weight"])
            x = x + mlp_out
            if update:
                cache["k"][i], cache["v"][i] = keys, values
        out = torch.zeros_like(x)
        out[und] = _rms(x[und], w["language_model.model.norm.weight"])
        out[gen] = _rms(x[gen], w["language_model.model.norm_moe_gen.weight"])
        return out

    def embed(self, ids: list[int]) -> torch.Tensor:
        return self.w["language_model.model.embed_tokens.weight"][torch.tensor(ids)]

    def time_embed(self, t: torch.Tensor) -> torch.Tensor:
        half = self.cfg.timestep_dim // 2
        freqs = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float32) / half)
        args = t.float()[:, None] * freqs[None]
        h = torch.cat([torch.cos(args), torch.sin(args)], -1)
        h = F.silu(F.linear(h, self.w["time_embedder.mlp.0.weight"], self.w["time_embedder.mlp.0.bias"]))
        return F.linear(h, self.w["time_embedder.mlp.2.weight"], self.w["time_embedder.mlp.2.bias"])

    def latent_rows(self, latent: torch.Tensor, t: torch.Tensor, h: int, w: int) -> torch.Tensor:
        pos = self.w["latent_pos_embed.pos_embed"][flat_ids(h, w, self.cfg.max_latent_size)]
        return F.linear(latent, self.w["vae2llm.weight"], self.w["vae2llm.bias"]) + self.time_embed(t) + pos

    # -- the ViT (SigLIP, no rope, learned positions at the flattened grid ids) ----------------------

    def vit(self, image: torch.Tensor) -> torch.Tensor:
        c, w = self.cfg.vit, self.w
        p, pre = c.patch_size, "vit_model.vision_model."
        ids = flat_ids(image.shape[1] // p, image.shape[2] // p, self.cfg.vit_max_patches_per_side)
        x = F.linear(patchify(image, p), w[f"{pre}embeddings.patch_embedding.weight"],
                     w[f"{pre}embeddings.patch_embedding.bias"]) + w[f"{pre}embeddings.position_embedding.weight"][ids]
        for i in range(c.num_layers):
            lp = f"{pre}encoder.layers.{i}."

            def lin(name: str, y: torch.Tensor, lp: str = lp) -> torch.Tensor:
                return F.linear(y, w[f"{lp}{name}.weight"], w[f"{lp}{name}.bias"])

            h = F.layer_norm(x, (c.hidden_size,), w[f"{lp}layer_norm1.weight"], w[f"{lp}layer_norm1.bias"], c.layer_norm_eps)
            q, k, v = (lin(f"self_attn.{n}", h).view(-1, c.num_heads, c.hidden_size // c.num_heads).transpose(0, 1)
                       for n in ("q_proj", "k_proj", "v_proj"))
            x = x + lin("self_attn.out_proj", F.scaled_dot_product_attention(q, k, v).transpose(0, 1).reshape(x.shape))
            h = F.layer_norm(x, (c.hidden_size,), w[f"{lp}layer_norm2.weight"], w[f"{lp}layer_norm2.bias"], c.layer_norm_eps)
            x = x + lin("mlp.fc2", F.gelu(lin("mlp.fc1", h), approximate="tanh"))
        x = F.layer_norm(x, (c.hidden_size,), w[f"{pre}post_layernorm.weight"], w[f"{pre}post_layernorm.bias"],
                         c.layer_norm_eps)
        x = F.linear(F.gelu(F.linear(x, w["connector.fc1.weight"], w["connector.fc1.bias"]), approximate="tanh"),
                     w["connector.fc2.weight"], w["connector.fc2.bias"])
        return x + w["vit_pos_embed.pos_embed"][ids]

    # -- contexts (inferencer.update_context_text / _image) -------------------------------------------

    def new_context(self) -> dict:
        n = self.cfg.llm.num_layers
        return {"rope": 0, "cache": {"k": [None] * n, "v": [None] * n}}

    def add_text(self, ctx: dict, ids: list[int]) -> None:
        seq = [self.ids.bos, *ids, self.ids.eos]
        positions = torch.arange(ctx["rope"], ctx["rope"] + len(seq))
        self.llm(ctx["cache"], self.embed(seq), positions, torch.zeros(len(seq), dtype=torch.bool), True, True)
        ctx["rope"] += len(seq)

    def add_image(self, ctx: dict, image: np.ndarray, vae: bool) -> None:
        start, end = self.embed([self.ids.start_of_image]), self.embed([self.ids.end_of_image])
        if vae:
            pixels = to_tensor(transform(image, self.vae_sizes))
            h, w = pixels.shape[1] // self.cfg.latent_downsample, pixels.shape[2] // self.cfg.latent_downsample
            mean = self.vae.encode(pixels[None]).latent_dist.mean
            latent = patchify(((mean - self.vae.config.shift_factor) * self.vae.config.scaling_factor)[0], 2)
            self._add_block(ctx, torch.cat([start, self.latent_rows(latent, torch.zeros(1), h, w), end]), True)
        pixels = to_tensor(transform(image, self.vit_sizes))
        self._add_block(ctx, torch.cat([start, self.vit(pixels), end]), False)

    def _add_block(self, ctx: dict, x: torch.Tensor, gen_body: bool) -> None:
        gen = torch.zeros(x.shape[0], dtype=torch.bool)
        gen[1:-1] = gen_body
        self.llm(ctx["cache"], x, torch.full((x.shape[0],), ctx["rope"]), gen, False, True)
        ctx["rope"] += 1

    # -- generation ----------------------------------------------------------------------------------

    def gen_text(self, ctx: dict, max_tokens: int, logprobs: list | None = None) -> list[int]:
        """generate_text with max_length = max_tokens + 1 (greedy): the answer's ids without <|im_end|>; each
        step's log-softmax over the vocabulary appended to `logprobs` when given."""
        ctx = copy.deepcopy(ctx)
        token, out = self.ids.bos, []
        for _ in range(max_tokens + 1):
            out.append(token)
            hidden = self.llm(ctx["cache"], self.embed([token]), torch.tensor([ctx["rope"]]),
                              torch.zeros(1, dtype=torch.bool), True, True)
            ctx["rope"] += 1
            logits = F.linear(hidden, self.w["language_model.lm_head.weight"]).reshape(-1)
            token = int(logits.argmax(-1))
            if logprobs is not None:
                logprobs.append(logits.float().log_softmax(-1))
            if token == self.ids.eos:
                break
        return out[1:]

    def velocity(self, ctx: dict, x: torch.Tensor, t: float, h: int, w: int) -> torch.Tensor:
        seq = torch.cat([self.embed([self.ids.start_of_image]), self.latent_rows(x, torch.full((x.shape[0],), t), h, w),
                         self.embed([self.ids.end_of_image])])
        gen = torch.ones(seq.shape[0], dtype=torch.bool)
        gen[0] = gen[-1] = False
        out = self.llm(copy.deepcopy(ctx["cache"]), seq, torch.full((seq.shape[0],), ctx["rope"]), gen, False, False)
        return F.linear(out, self.w["llm2vae.weight"], self.w["llm2vae.bias"])[1:-1]

    def gen_image(self, gen: dict, cfg_text: dict, cfg_img: dict, h: int, w: int, seed: int, steps: int,
                  text_scale: float, img_scale: float, interval, shift: float, renorm_type: str,
                  renorm_min: float) -> list[torch.Tensor]:
        """generate_image: the latents after every Euler step."""
        x = torch.randn(h * w, self.cfg.patch_latent_dim, generator=torch.Generator().manual_seed(seed))
        ts = torch.linspace(1, 0, steps)
        ts = shift * ts / (1 + (shift - 1) * ts)
        dts, out = ts[:-1] - ts[1:], []
        for i, t in enumerate(ts[:-1]):
            on = t > interval[0] and t <= interval[1]
            ts_, is_ = (text_scale, img_scale) if on else (1.0, 1.0)
            v = self.velocity(gen, x, float(t), h, w)
            if ts_ > 1.0:
                v_text = self.velocity(cfg_text, x, float(t), h, w)
                v_img = self.velocity(cfg_img, x, float(t), h, w) if is_ > 1.0 else None
                v = _guided(v, v_text, v_img, ts_, is_, renorm_type, renorm_min)
            x = x - v * dts[i]
            out.append(x.clone())
        return out

    def decode(self, latent: torch.Tensor, h: int, w: int) -> np.ndarray:
        z = torch.einsum("nhwpqc->nchpwq", latent.reshape(1, h, w, 2, 2, -1)).reshape(1, -1, 2 * h, 2 * w)
        cfg = self.vae.config
        image = self.vae.decode(z / cfg.scaling_factor + cfg.shift_factor).sample
        return ((image * 0.5 + 0.5).clamp(0, 1)[0].permute(1, 2, 0) * 255).to(torch.uint8).numpy()

    # -- the inferencer ------------------------------------------------------------------------------

    @torch.no_grad()
    def interleave(self, items: list, think: bool, understanding: bool, max_tokens: int = 8,
                   size: tuple[int, int] | None = None, logprobs: list | None = None, **image_args) -> dict:
        """interleave_inference over text and uint8 images; {"text": ids} and/or {"steps", "image"}; `size`
        (height, width) of a generated image without input images; `logprobs` collects the text steps'
        log-softmax (`gen_text`); `image_args` go to `gen_image`."""
        gen = self.new_context()
        cfg_text, cfg_img = copy.deepcopy(gen), copy.deepcopy(gen)
        if think:
            prompt = self.tok.encode(VLM_THINK if understanding else GEN_THINK, add_special_tokens=False).ids
            self.add_text(gen, prompt)
            self.add_text(cfg_img, prompt)
        shape = None
        for item in items:
            if isinstance(item, str):
                cfg_text = copy.deepcopy(gen)
                ids = self.tok.encode(item, add_special_tokens=False).ids
                self.add_text(gen, ids)
                self.add_text(cfg_img, ids)
            else:
                image = transform(item, self.vae_sizes)
                self.add_image(gen, image, vae=not understanding)
                shape = image.shape[:2]
                cfg_text = copy.deepcopy(gen)
        result: dict = {}
        if understanding or think:
            result["text"] = self.gen_text(gen, max_tokens, logprobs)
            if not understanding:
                self.add_text(gen, result["text"])
        if not understanding:
            height, width = shape if shape is not None else size
            h, w = height // self.cfg.latent_downsample, width // self.cfg.latent_downsample
            result["steps"] = self.gen_image(gen, cfg_text, cfg_img, h, w, **image_args)
            result["image"] = self.decode(result["steps"][-1], h, w)
        return result


def _guided(v, v_text, v_img, text_scale, img_scale, renorm_type, renorm_min):
    """_forward_flow's guidance."""
    if renorm_type == "text_channel":
        v_text_ = v_text + text_scale * (v - v_text)
        scale = (torch.norm(v, dim=-1, keepdim=True) / (torch.norm(v_text_, dim=-1, keepdim=True) + 1e-8))
        v_t = v_text_ * scale.clamp(min=renorm_min, max=1.0)
        return v_img + img_scale * (v_t - v_img) if v_img is not None else v_t
    v_text_ = v_text + text_scale * (v - v_text)
    v_ = v_img + img_scale * (v_text_ - v_img) if v_img is not None else v_text_
    if renorm_type == "global":
        norm_v, norm_v_ = torch.norm(v), torch.norm(v_)
    else:
        norm_v, norm_v_ = torch.norm(v, dim=-1, keepdim=True), torch.norm(v_, dim=-1, keepdim=True)
    return v_ * (norm_v / (norm_v_ + 1e-8)).clamp(min=renorm_min, max=1.0)
