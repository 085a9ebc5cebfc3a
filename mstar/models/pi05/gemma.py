"""The two Gemma stacks of Pi0.5: the PaliGemma language model over the prefix, the action expert over
the action tokens.

Layer i of the expert attends the prefix's layer-i keys and values and its own action tokens, all of
them bidirectionally (openpi's attention mask gives the action block sight of the whole prefix and of
itself; the prefix never sees the actions, so its keys and values are computed once per chunk). The
language model's layers only ever serve those keys and values: the last layer's attention output and
MLP are never computed, and its final norm and head are not built. The expert's attention reads each robot's
valid prefix keys and its action keys only, never the padding of a batch's prefixes (`flow_attention.py`,
where the fused kernels serve; else SDPA under a mask).

Scaling follows the checkpoint's training code (openpi): token embeddings are multiplied by sqrt(width)
at lookup, image tokens and action tokens enter unscaled. The expert's norms are adaptive (adaRMS): a
dense layer of the time condition gives each norm a scale, a shift and a gate on its residual branch.

Where the fused kernels serve, each residual add and the norm after it are one Triton kernel (`norm_kernel.py`,
through `fused_norm`) and the MLP's GELU-and-mul is one (`fused_ops.gelu_and_mul`); else the PyTorch forms here.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from mstar.kernels.guard import KernelGuard
from mstar.layers.fused import FUSED
from mstar.layers.linear import linear
from mstar.layers.mlp import GatedMLP
from mstar.layers.rope import RopeSpec, RotaryEmbedding, apply_rotary
from mstar.models.pi05.config import GemmaShape

KV = tuple[torch.Tensor, torch.Tensor]  # keys, values [B, L, KV heads, head_dim]
Modulation = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # an adaRMS norm's 1 + scale, shift, gate [N, 1, W]
_FLOW_ATTENTION = KernelGuard("flow attention")
_NORM = KernelGuard("Pi0.5 norm")


def attention_bias(valid: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Which keys are seen, valid [B, L], as SDPA's additive mask in the queries' `dtype` (0 or -inf): what
    SDPA makes of a boolean mask on every call (a `where` kernel each), made once for all the calls. Its rows
    start 16-element aligned, else the memory-efficient kernel copies it in every call."""
    width = -(-valid.shape[-1] // 16) * 16
    bias = torch.zeros((*valid.shape[:-1], width), dtype=dtype, device=valid.device)[..., :valid.shape[-1]]
    return bias.masked_fill_(~valid, float("-inf"))


def rms_normed(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) in float32 (one fused kernel where PyTorch has one)."""
    return F.rms_norm(x.float(), (x.shape[-1],), eps=eps)


def fused_norm(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor | None, eps: float,
               branch: torch.Tensor | None = None, gate: torch.Tensor | None = None,
               plus_one: bool = False) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`norm_kernel.modulated_rms_norm` over x [..., W] (scale, shift, gate [N, W]; branch like x): (normed,
    x + gate * branch), shaped like x, where the fused kernels serve x and x and the branch are contiguous;
    else None (or once the kernel has failed to build or launch: `KernelGuard`), and the caller's PyTorch
    form serves."""
    if FUSED.ops_for(x) is None or not x.is_contiguous() or (branch is not None and not branch.is_contiguous()):
        return None
    from mstar.models.pi05.norm_kernel import modulated_rms_norm

    width = x.shape[-1]
    rows = None if branch is None else branch.view(-1, width)
    gate = None if gate is None else gate.to(x.dtype)  # the PyTorch form multiplies in x's dtype

    def kernel() -> tuple[torch.Tensor, torch.Tensor]:
        normed, summed = modulated_rms_norm(x.view(-1, width), scale, shift, eps, rows, gate, plus_one)
        return normed.view(x.shape), summed.view(x.shape)

    return _NORM.run(kernel, lambda: None)


def row_linear(x: torch.Tensor, module: nn.Linear) -> torch.Tensor:
    """module(x) over x's rows as one 2-D matmul, so `linear` may pick the skinny GEMM where it was timed
    faster (the expert's 50 action rows a robot are few enough)."""
    return linear(x.reshape(-1, x.shape[-1]), module).view(*x.shape[:-1], module.out_features)


class GemmaNorm(nn.Module):
    """Gemma's RMSNorm: x / rms(x) * (1 + weight), in float32."""

    def __init__(self, width: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = fused_norm(x, self.weight[None], None, self.eps, plus_one=True)
        if fused is not None:
            return fused[0]
        return (rms_normed(x, self.eps) * (1.0 + self.weight.float())).to(x.dtype)

    def add_forward(self, x: torch.Tensor, branch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + branch, its norm): a residual branch added and the next norm applied (one kernel where the
        fused kernels serve)."""
        fused = fused_norm(x, self.weight[None], None, self.eps, branch, plus_one=True)
        if fused is not None:
            return fused[1], fused[0]
        x = x + branch
        return x, self(x)


class AdaRMSNorm(nn.Module):
    """RMSNorm modulated by a condition: (x / rms(x) * (1 + scale) + shift, gate), where `dense(cond)`
    gives scale, shift and gate per row of the batch."""

    def __init__(self, width: int, cond_width: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.dense = nn.Linear(cond_width, 3 * width)

    def modulation(self, cond: torch.Tensor) -> Modulation:
        """cond [N, C] -> (1 + scale, shift) in float32 and gate, each [N, 1, W]: what `modulate` applies."""
        scale, shift, gate = self.dense(cond.to(self.dense.weight.dtype))[:, None].chunk(3, dim=-1)
        return 1.0 + scale.float(), shift.float(), gate

    def modulate(self, x: torch.Tensor, modulation: Modulation) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, L, W] under a `modulation` of B rows (or one, shared) -> (normed [B, L, W], gate)."""
        scale, shift, gate = modulation
        fused = fused_norm(x, scale[:, 0], shift[:, 0], self.eps)
        if fused is not None:
            return fused[0], gate.to(x.dtype)
        normed = torch.empty_like(x)  # the float32 result rounded to x's dtype as it is stored: no cast kernel
        return torch.addcmul(shift, rms_normed(x, self.eps), scale, out=normed), gate.to(x.dtype)

    def add_modulate(self, x: torch.Tensor, branch: torch.Tensor, gate: torch.Tensor,
                     modulation: Modulation) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x + gate * branch (a gated residual branch [B, L, W], `gate` [B or 1, 1, W]), then `modulate` of
        that -> (x + gate * branch, normed, this norm's gate); one kernel where the fused kernels serve."""
        scale, shift, next_gate = modulation
        fused = fused_norm(x, scale[:, 0], shift[:, 0], self.eps, branch, gate[:, 0])
        if fused is not None:
            return fused[1], fused[0], next_gate.to(x.dtype)
        x = torch.addcmul(x, branch, gate)
        return x, *self.modulate(x, modulation)

    def forward(self, x: torch.Tensor, cond: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, L, W], cond [B, C] -> (normed [B, L, W], gate [B, 1, W])."""
        return self.modulate(x, self.modulation(cond))


class GemmaAttention(nn.Module):
    """Query, key and value projections (one matmul, no biases) with RoPE, and the output projection."""

    def __init__(self, shape: GemmaShape) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = shape.num_heads, shape.num_kv_heads, shape.head_dim
        self.qkv = nn.Linear(shape.width, (shape.num_heads + 2 * shape.num_kv_heads) * shape.head_dim, bias=False)
        self.o = nn.Linear(shape.num_heads * shape.head_dim, shape.width, bias=False)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                strided: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, L, W], cos/sin [B * L, head_dim] -> q [B, L, H, D], k and v [B, L, KV, D] (q and k rotated).
        `strided`: q and k are rotated together (one launch where the fused kernels serve) and returned as
        views of one [B, L, H + KV, D] tensor, for the flow's attention, which reads any token stride; else
        q is contiguous, as `attend`'s query rows need to be a view of it."""
        batch, length, _ = x.shape
        heads, kv, dim = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = row_linear(x, self.qkv).view(batch * length, heads + 2 * kv, dim)
        if strided:
            qk = apply_rotary(qkv[:, :heads + kv], cos, sin)
            q, k = qk[:, :heads], qk[:, heads:]
        else:
            q, k = apply_rotary(qkv[:, :heads], cos, sin), apply_rotary(qkv[:, heads:heads + kv], cos, sin)
        return (q.view(batch, length, heads, dim), k.view(batch, length, kv, dim),
                qkv[:, heads + kv:].view(batch, length, kv, dim))

    def attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, key_bias: torch.Tensor) -> torch.Tensor:
        """Every query [B, Lq, H, D] over the keys [B, Lk, KV, D] that `key_bias` [B, Lk] (`attention_bias`)
        leaves seen -> [B, Lq, W]."""
        batch, length = q.shape[:2]
        kv, groups = self.num_kv_heads, self.num_heads // self.num_kv_heads
        # the query heads of one KV head become rows of one attention (the mask is per key, not per query),
        # so keys and values are read in place, not copied per query head; rows in (position, head) order
        # make every reshape a view when there is one KV head (Gemma's)
        rows = q.view(batch, length, kv, groups, self.head_dim).transpose(1, 2).reshape(
            batch, kv, length * groups, self.head_dim)
        out = F.scaled_dot_product_attention(rows, keys.transpose(1, 2), values.transpose(1, 2),
                                             attn_mask=key_bias[:, None, None, :])
        out = out.view(batch, kv, length, groups, self.head_dim).transpose(1, 2)
        return row_linear(out.reshape(batch, length, self.num_heads * self.head_dim), self.o)

    def attend_prefix(self, q: torch.Tensor, prefix: KV, prefix_len: torch.Tensor, k: torch.Tensor,
                      v: torch.Tensor) -> torch.Tensor:
        """The action queries q [B, C, H, D] over each robot's first prefix_len [B] prefix keys and values
        (`prefix`, [B, P, KV, D]) and the actions' own k and v [B, C, KV, D] -> [B, C, W]. Where the fused
        kernels serve, one kernel reads those keys alone (`valid_keys_attention`); else (or once that kernel
        has failed to build or launch: `KernelGuard`) SDPA over all P + C keys masks the padding."""
        if FUSED.ops_for(q) is not None:
            from mstar.models.pi05.flow_attention import valid_keys_attention

            out = _FLOW_ATTENTION.run(lambda: valid_keys_attention(q, *prefix, prefix_len, k, v), lambda: None)
            if out is not None:
                return row_linear(out.flatten(2), self.o)
        prefix_k, prefix_v = prefix
        positions = torch.arange(prefix_k.shape[1] + k.shape[1], device=q.device)[None, :]
        valid = (positions < prefix_len[:, None]) | (positions >= prefix_k.shape[1])
        keys, values = torch.cat([prefix_k.to(k.dtype), k], dim=1), torch.cat([prefix_v.to(v.dtype), v], dim=1)
        return self.attend(q, keys, values, attention_bias(valid, q.dtype))


class PrefixLayer(nn.Module):
    """A PaliGemma decoder layer."""

    def __init__(self, shape: GemmaShape) -> None:
        super().__init__()
        self.norm1 = GemmaNorm(shape.width, shape.rms_norm_eps)
        self.attn = GemmaAttention(shape)
        self.norm2 = GemmaNorm(shape.width, shape.rms_norm_eps)
        self.mlp = GatedMLP(shape.width, shape.mlp_dim, activation="gelu_tanh")


class PrefixLM(nn.Module):
    """The prefix (image tokens, then the prompt's token embeddings) -> every layer's keys and values."""

    def __init__(self, shape: GemmaShape, vocab_size: int) -> None:
        super().__init__()
        self.shape = shape
        self.embed = nn.Embedding(vocab_size, shape.width)
        self.layers = nn.ModuleList(PrefixLayer(shape) for _ in range(shape.depth))
        self.rotary = RotaryEmbedding(RopeSpec(shape.head_dim, shape.rope_theta))

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings scaled by sqrt(width), the scale rounded to the weights' dtype as Gemma does."""
        scale = torch.tensor(math.sqrt(self.shape.width), dtype=self.embed.weight.dtype).item()  # a host number
        return self.embed(ids) * scale

    @torch.no_grad()
    def forward(self, x: torch.Tensor, valid: torch.Tensor, positions: torch.Tensor,
                store: Callable[[int, torch.Tensor, torch.Tensor], None]) -> None:
        """Prefix embeddings x [B, L, W] (rows past a prefix's end invalid in `valid` [B, L]) at `positions`
        [B, L]: `store(layer, keys, values)` receives each layer's keys and values [B, L, KV, D]."""
        cos, sin = self.rotary(positions.reshape(-1))
        x = x.to(self.embed.weight.dtype)
        bias = attention_bias(valid, x.dtype)
        normed = self.layers[0].norm1(x)
        for index, layer in enumerate(self.layers):
            q, k, v = layer.attn.project(normed, cos, sin)
            store(index, k, v)
            if index == len(self.layers) - 1:
                break  # the last layer's output feeds nothing
            x, normed = layer.norm2.add_forward(x, layer.attn.attend(q, k, v, bias))
            x, normed = self.layers[index + 1].norm1.add_forward(x, layer.mlp(normed))


class ExpertLayer(nn.Module):
    """An action-expert layer: adaRMS norms gating both residual branches."""

    def __init__(self, shape: GemmaShape) -> None:
        super().__init__()
        self.norm1 = AdaRMSNorm(shape.width, shape.width, shape.rms_norm_eps)
        self.attn = GemmaAttention(shape)
        self.norm2 = AdaRMSNorm(shape.width, shape.width, shape.rms_norm_eps)
        self.mlp = GatedMLP(shape.width, shape.mlp_dim, activation="gelu_tanh")


def time_embedding(t: torch.Tensor, width: int, min_period: float, max_period: float) -> torch.Tensor:
    """Sine-cosine embedding [B, width] of flow times t [B], computed in float64 and returned in float32."""
    fraction = torch.linspace(0.0, 1.0, width // 2, dtype=torch.float64, device=t.device)
    period = min_period * (max_period / min_period) ** fraction
    angles = (2 * math.pi / period)[None, :] * t.double()[:, None]
    return torch.cat([angles.sin(), angles.cos()], dim=1).float()


class ActionExpert(nn.Module):
    """Noisy actions x_t [B, C, A] at flow time t [B] -> velocity [B, C, A], attending a prefix's keys
    and values layer by layer."""

    def __init__(self, shape: GemmaShape, action_dim: int, min_period: float, max_period: float) -> None:
        super().__init__()
        self.shape, self.periods = shape, (min_period, max_period)
        self.action_in = nn.Linear(action_dim, shape.width)
        self.time_in = nn.Linear(shape.width, shape.width)
        self.time_out = nn.Linear(shape.width, shape.width)
        self.layers = nn.ModuleList(ExpertLayer(shape) for _ in range(shape.depth))
        self.norm = AdaRMSNorm(shape.width, shape.width, shape.rms_norm_eps)
        self.action_out = nn.Linear(shape.width, action_dim)
        self.rotary = RotaryEmbedding(RopeSpec(shape.head_dim, shape.rope_theta))

    def condition(self, t: torch.Tensor) -> torch.Tensor:
        """The adaRMS condition [B, W] of flow times t [B]: the time embedding through a two-layer SiLU MLP."""
        emb = time_embedding(t, self.shape.width, *self.periods).to(self.time_in.weight.dtype)
        return F.silu(self.time_out(F.silu(self.time_in(emb))))

    def modulations(self, cond: torch.Tensor) -> list[Modulation]:
        """Every adaRMS norm's modulation under cond [N, W]: each layer's two norms, then the final norm."""
        per_layer = [m for layer in self.layers for m in (layer.norm1.modulation(cond), layer.norm2.modulation(cond))]
        return [*per_layer, self.norm.modulation(cond)]

    def context(self, chunk: int, prefix_len: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(cos, sin) of action tokens at positions prefix_len [B] onwards, and prefix_len: what every step of a
        chunk shares."""
        positions = prefix_len[:, None] + torch.arange(chunk, device=prefix_len.device)[None, :]
        cos, sin = self.rotary(positions.reshape(-1))
        return cos, sin, prefix_len

    @torch.no_grad()
    def forward(self, x_t: torch.Tensor, t: torch.Tensor, prefix: Callable[[int], KV],
                prefix_len: torch.Tensor) -> torch.Tensor:
        """`prefix(layer)` gives that layer's prefix keys and values [B, P, KV, D], of which each robot's first
        prefix_len [B] are its own; the action tokens sit at positions prefix_len onwards. Float32 out."""
        context = self.context(x_t.shape[1], prefix_len)
        return self.velocity(x_t, self.modulations(self.condition(t)), context, prefix)

    def velocity(self, x_t: torch.Tensor, modulations: list[Modulation],
                 context: tuple[torch.Tensor, torch.Tensor, torch.Tensor], prefix: Callable[[int], KV]) -> torch.Tensor:
        """`forward` with the time's `modulations` and the chunk's `context` given (float32 out)."""
        x = self.action_in(x_t.to(self.action_in.weight.dtype))
        return self.action_out(self._layers(x, modulations, context, prefix)).float()

    def hidden(self, x: torch.Tensor, cond: torch.Tensor, positions: torch.Tensor, prefix: Callable[[int], KV],
               prefix_len: torch.Tensor) -> torch.Tensor:
        """The layers and final norm over action tokens x [B, C, W] at `positions` [B, C] under `cond` [B, W]."""
        cos, sin = self.rotary(positions.reshape(-1))
        return self._layers(x, self.modulations(cond), (cos, sin, prefix_len), prefix)

    def _layers(self, x: torch.Tensor, modulations: list[Modulation],
                context: tuple[torch.Tensor, torch.Tensor, torch.Tensor], prefix: Callable[[int], KV]) -> torch.Tensor:
        cos, sin, prefix_len = context
        norms = [norm for layer in self.layers for norm in (layer.norm1, layer.norm2)] + [self.norm]
        normed, gate = norms[0].modulate(x, modulations[0])
        for index, layer in enumerate(self.layers):  # each residual add fused with the norm after it
            q, k, v = layer.attn.project(normed, cos, sin, strided=True)
            attended = layer.attn.attend_prefix(q, prefix(index), prefix_len, k, v)
            x, normed, gate = norms[2 * index + 1].add_modulate(x, attended, gate, modulations[2 * index + 1])
            x, normed, gate = norms[2 * index + 2].add_modulate(x, layer.mlp(normed), gate, modulations[2 * index + 2])
        return normed
