"""BAGEL's Mixture-of-Transformers LLM: Qwen2 layers with two full sets of weights, one shared attention.

Every layer holds an understanding expert (text and ViT tokens) and a generation expert (VAE latent
tokens): separate norms, q/k/v/o projections (qk-normed), and MLPs. The tokens of a packed sequence
are routed by kind; each expert runs only on its own rows (save a denoising block's two markers, which
the generation expert computes too: `Routing`), and all rows meet in one attention over the sequence. Module names follow the checkpoint (`language_model.model.*`), with q/k/v and
gate/up fused into one projection each (weights.py places the checkpoint's tensors).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from mstar.layers.attention import normed_rotated_qk
from mstar.layers.linear import linear
from mstar.layers.mlp import GatedMLP
from mstar.layers.norm import RMSNorm
from mstar.layers.rope import RopeSpec, RotaryEmbedding
from mstar.models.bagel.config import BagelConfig, LLMConfig
from mstar.models.bagel.embeddings import PositionEmbedding, TimestepEmbedder

Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # (layer, q, k, v) -> out
Rope = tuple[torch.Tensor, torch.Tensor]  # cos, sin [T, D] of some rows


@dataclass(frozen=True)
class Routing:
    """Which rows of a packed batch the generation expert takes (`gen`); the understanding expert takes
    the rest (`und`). `gen` None: every row is an understanding row. `gen_takes_all`: the understanding
    rows are few (a denoising block's two markers), so the generation expert runs on every row and the
    understanding expert's results replace its own on those few, instead of gathering and scattering
    the many generation rows around every projection."""

    und: torch.Tensor | None = None  # [Tu] int64 rows; None with gen None: all rows
    gen: torch.Tensor | None = None  # [Tg] int64 rows
    gen_takes_all: bool = False

    @classmethod
    def of(cls, is_gen: torch.Tensor, device: torch.device | None = None) -> Routing:
        """From a bool mask [T] of generation rows, rows moved to `device`; a host mask is read without
        waiting for the device."""
        if not bool(is_gen.any()):
            return cls()
        und, gen = torch.nonzero(~is_gen).flatten(), torch.nonzero(is_gen).flatten()
        return cls(und=und.to(device, non_blocking=True), gen=gen.to(device, non_blocking=True),
                   gen_takes_all=und.numel() * 32 <= is_gen.numel())

    def split(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The rows of x each expert computes: (understanding, generation; None when there are none)."""
        if self.gen is None:
            return x, None
        assert self.und is not None
        return x[self.und], x if self.gen_takes_all else x[self.gen]

    def apply(self, x: torch.Tensor, und: Callable[[torch.Tensor], torch.Tensor],
              gen: Callable[[torch.Tensor], torch.Tensor], width: int | None = None) -> torch.Tensor:
        """und(x) on understanding rows and gen(x) on generation rows (on every row with `gen_takes_all`,
        where those of the understanding rows are then replaced)."""
        if self.gen is None:
            return und(x)
        assert self.und is not None
        if self.gen_takes_all:
            out = gen(x).to(x.dtype)
        else:
            out = x.new_empty((x.shape[0], width or x.shape[1]))
            out[self.gen] = gen(x[self.gen]).to(out.dtype)
        if self.und.numel():
            out[self.und] = und(x[self.und]).to(out.dtype)
        return out


class ExpertAttention(nn.Module):
    """One expert's q/k/v (with bias) and o (without) projections and its q/k RMS norms."""

    def __init__(self, cfg: LLMConfig) -> None:
        super().__init__()
        self.q_size, self.kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=True)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def qkv(self, x: torch.Tensor, head_dim: int, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """[T, (Hq + 2 Hkv) * D]: q and k normed per head and rotated by cos/sin [T, D], v as projected."""
        qkv = linear(x, self.qkv_proj)
        qk = qkv[:, : self.q_size + self.kv_size].view(x.shape[0], -1, head_dim)
        normed_rotated_qk(qk, self.q_norm, self.k_norm, self.q_size // head_dim, cos, sin, out=qk)  # in place
        return qkv


class MoTLayer(nn.Module):
    """A pre-norm decoder layer whose norms, attention projections and MLP exist once per expert."""

    def __init__(self, cfg: LLMConfig, layer: int) -> None:
        super().__init__()
        self.layer, self.cfg = layer, cfg
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.input_layernorm_moe_gen = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm_moe_gen = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = ExpertAttention(cfg)
        self.self_attn_moe_gen = ExpertAttention(cfg)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size)
        self.mlp_moe_gen = GatedMLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x: torch.Tensor, routing: Routing, rope: tuple[Rope, Rope | None], attend: Attend) -> torch.Tensor:
        """`rope`: (cos, sin) of the understanding rows and of the generation rows (`Routing.split`)."""
        cfg, und, gen = self.cfg, self.self_attn, self.self_attn_moe_gen
        d, (und_rope, gen_rope) = cfg.head_dim, rope
        width = und.q_size + 2 * und.kv_size
        qkv = routing.apply(x, lambda h: und.qkv(self.input_layernorm(h), d, *und_rope),
                            lambda h: gen.qkv(self.input_layernorm_moe_gen(h), d, *gen_rope), width)
        q, k, v = qkv.split([und.q_size, und.kv_size, und.kv_size], dim=-1)
        t = x.shape[0]
        q, k, v = q.view(t, cfg.num_heads, d), k.view(t, cfg.num_kv_heads, d), v.view(t, cfg.num_kv_heads, d)
        attn = attend(self.layer, q, k, v).reshape(t, -1)
        x = x + routing.apply(attn, lambda a: linear(a, und.o_proj), lambda a: linear(a, gen.o_proj),
                              cfg.hidden_size)
        return x + routing.apply(x, lambda h: self.mlp(self.post_attention_layernorm(h)),
                                 lambda h: self.mlp_moe_gen(self.post_attention_layernorm_moe_gen(h)))


class MoTLanguageModel(nn.Module):
    """Embeddings, the MoT layers, the final norm of each expert and the text head (`lm_head`)."""

    def __init__(self, cfg: LLMConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(MoTLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.norm_moe_gen = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(RopeSpec(cfg.head_dim, cfg.rope_theta))

    @property
    def attention_scale(self) -> float:
        return self.cfg.head_dim ** -0.5

    def forward(self, x: torch.Tensor, positions: torch.Tensor, routing: Routing, attend: Attend) -> torch.Tensor:
        """Input embeddings [T, H] at rope `positions` [T] -> final hidden states [T, H], each row normed by
        its expert's final norm."""
        (und_cos, gen_cos), (und_sin, gen_sin) = (routing.split(t) for t in self.rotary(positions))
        rope = ((und_cos, und_sin), None if gen_cos is None or gen_sin is None else (gen_cos, gen_sin))
        for layer in self.layers:
            x = layer(x, routing, rope, attend)
        return routing.apply(x, self.norm, self.norm_moe_gen)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [N, vocab] of hidden states [N, H]."""
        return linear(hidden, self.lm_head).float()


class BagelLLM(nn.Module):
    """The `llm` component's network: the MoT LLM and the generation heads around it: flow timesteps
    (`time_embedder`), latent patches in (`vae2llm`) and velocities out (`llm2vae`), and the latent
    patches' 2D position table."""

    def __init__(self, cfg: BagelConfig) -> None:
        super().__init__()
        hidden = cfg.llm.hidden_size
        self.language_model = MoTLanguageModel(cfg.llm)
        self.time_embedder = TimestepEmbedder(hidden, cfg.timestep_dim)
        self.vae2llm = nn.Linear(cfg.patch_latent_dim, hidden)
        self.llm2vae = nn.Linear(hidden, cfg.patch_latent_dim)
        self.latent_pos_embed = PositionEmbedding(cfg.max_latent_size, hidden)

    def latent_embeds(self, latents: torch.Tensor, timesteps: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """LLM input rows [N, H] of latent patches [N, p * p * C] at flow times [N] and grid positions [N]."""
        x = linear(latents.to(self.vae2llm.weight.dtype), self.vae2llm)
        return x + self.time_embedder(timesteps).to(x.dtype) + self.latent_pos_embed(positions).to(x.dtype)

    def velocity(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 velocities [N, p * p * C] of generation rows' final hidden states [N, H]."""
        return linear(hidden, self.llm2vae).float()
