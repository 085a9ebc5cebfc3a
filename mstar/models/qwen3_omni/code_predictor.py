"""Qwen3-Omni's code predictor: fills codebooks 1..G-1 of a speech frame from the talker's state.

Per frame the talker gives its last hidden state and the frame's first code. The predictor runs a
small dense transformer over [talker state, embedding of the first code] and then one token per
residual codebook, each with its own embedding and head: a fixed loop of G-1 steps over a KV held
in local tensors of static shape, so a whole batch of frames (of different requests) runs at once
and `predict` can be captured in a CUDA graph per batch size.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mstar.engines.base import CapturePlan, StatelessBase
from mstar.engines.cuda_graphs import to_device_async
from mstar.kernels.guard import KernelGuard
from mstar.layers.attention import normed_rotated_qk
from mstar.layers.fused import FUSED
from mstar.layers.linear import linear
from mstar.layers.mlp import GatedMLP
from mstar.layers.norm import RMSNorm
from mstar.layers.rope import RopeSpec, RotaryEmbedding
from mstar.models.qwen3_omni.code_predictor_config import CodePredictorConfig
from mstar.models.qwen3_omni.code_predictor_sampling import (
    CodePredictorSampling,
    SamplingTensors,
    build_sampling_tensors,
    sample_and_embed,
)

KVCache = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values [B, kv_heads, G, head_dim]
_STEP_ATTENTION = KernelGuard("step_attention")


class _Attention(nn.Module):
    """GQA self-attention with qk-norm; writes its keys/values into the caller's static cache."""

    def __init__(self, cfg: CodePredictorConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.q_size, self.kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.attention_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: tuple[torch.Tensor, torch.Tensor], start: int, b: int) -> torch.Tensor:
        """x [b * t, hidden], the rows of b
        sequences at positions start..start+t-1 (sequence-major), with cos/sin [b * t, head_dim] per
        row -> [b * t, hidden]."""
        cfg, d = self.cfg, self.cfg.head_dim
        t, nq, nkv = x.shape[0] // b, cfg.num_heads, cfg.num_kv_heads
        assert t == 1 or start == 0, "a multi-token step must start at position 0 (causal mask alignment)"
        heads = linear(x, self.qkv_proj).view(b * t, nq + 2 * nkv, d)
        if t == 1:
            return linear(self._one_token(heads, cos, sin, cache, start).reshape(b, self.q_size), self.o_proj)
        qk = normed_rotated_qk(heads[:, :nq + nkv], self.q_norm, self.k_norm, nq, cos, sin)
        q, k = qk.split([nq, nkv], dim=1)
        keys, values = cache
        keys[:, :, :t] = k.view(b, t, nkv, d).transpose(1, 2)
        values[:, :, :t] = heads[:, nq + nkv:].view(b, t, nkv, d).transpose(1, 2)
        out = F.scaled_dot_product_attention(
            q.reshape(b, t, nq, d).transpose(1, 2), keys[:, :, :t], values[:, :, :t], is_causal=True,
            enable_gqa=nq != nkv,
        ).transpose(1, 2)
        return linear(out.reshape(b * t, self.q_size), self.o_proj)

    def _one_token(self, heads: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   cache: tuple[torch.Tensor, torch.Tensor], start: int) -> torch.Tensor:
        """Attention of one token per sequence at position `start` (heads [b, Hq + 2 Hkv, D], every
        row's cos/sin the same): its k/v written into the cache, the output [b, Hq, D]. One launch where
        the fused kernels serve (`models/qwen3_omni/step_attention.py`), else qk-norm rotary, two cache copies and SDPA."""
        cfg, d = self.cfg, self.cfg.head_dim
        nq, nkv, b = cfg.num_heads, cfg.num_kv_heads, heads.shape[0]
        keys, values = cache

        def unfused() -> torch.Tensor:
            qk = normed_rotated_qk(heads[:, :nq + nkv], self.q_norm, self.k_norm, nq, cos, sin)
            keys[:, :, start] = qk[:, nq:]
            values[:, :, start] = heads[:, nq + nkv:]
            # One query per sequence sees every cached position: no mask, and the query heads of a kv
            # head (consecutive, as GQA repeats kv heads) become that head's queries, so SDPA needs no
            # GQA expansion and takes a fused kernel.
            out = F.scaled_dot_product_attention(qk[:, :nq].reshape(b, nkv, nq // nkv, d), keys[:, :, :start + 1],
                                                 values[:, :, :start + 1])
            return out.reshape(b, nq, d)

        if FUSED.ops_for(heads) is None or self.q_norm.eps != self.k_norm.eps or cos[0].stride(0) != 1:
            return unfused()
        from mstar.models.qwen3_omni.step_attention import step_attention, supports

        if not supports(nq, nkv, d, keys.shape[2]) or keys.stride(3) != 1 or keys.stride() != values.stride():
            return unfused()
        return _STEP_ATTENTION.run(lambda: step_attention(heads, self.q_norm.weight, self.k_norm.weight, cos[0], sin[0],
                                                          keys, values, start, nq, self.q_norm.eps), unfused)


class _Layer(nn.Module):
    def __init__(self, cfg: CodePredictorConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = _Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                cache: tuple[torch.Tensor, torch.Tensor], start: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream is residual + h ([b * t, hidden]; residual None: h alone); returns the
        layer's (mlp output, residual stream before it), so each residual add runs fused with the norm
        that follows it (see `_Attention.forward` for the rows)."""
        if residual is None:
            normed, residual = self.input_layernorm(h), h
        else:
            normed, residual = self.input_layernorm.add_forward(h, residual)
        attn = self.self_attn(normed, cos, sin, cache, start, b)
        normed, residual = self.post_attention_layernorm.add_forward(attn, residual)
        return self.mlp(normed), residual


class CodePredictor(StatelessBase, nn.Module):
    """The stateless `code_predictor` component.

    Inputs per request: `talker_hidden` [hidden] (the talker's final, normed hidden state at the
    position that produced the frame's first code), `first_code` [1] (that code, a talker codec id)
    and optionally `frame_index` [] (needed only by seeded sampling). Outputs: `codes` [1, G] int64
    (the frame's G codes, first code included: one item of the stream Code2Wav consumes) and
    `codec_embed_sum` [hidden] (the sum of the frame's G code embeddings: the talker's next input
    before it adds the thinker's text state).
    """

    def __init__(self, cfg: CodePredictorConfig, default_sampling: CodePredictorSampling | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.default_sampling = default_sampling or CodePredictorSampling()
        self.layers = nn.ModuleList(_Layer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.codec_embedding = nn.ModuleList(
            nn.Embedding(cfg.vocab_size, cfg.hidden_size) for _ in range(cfg.num_residual)
        )
        self.lm_head = nn.ModuleList(
            nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False) for _ in range(cfg.num_residual)
        )
        # A copy of the talker's codec embedding: the predictor's second input is the first code's.
        self.talker_codec_embedding = nn.Embedding(cfg.talker_vocab_size, cfg.hidden_size)
        self.rotary = RotaryEmbedding(RopeSpec(head_dim=cfg.head_dim, theta=cfg.rope_theta))
        self._rope: tuple[tuple, tuple[torch.Tensor, torch.Tensor]] | None = None  # (key, (cos, sin) of 0..G-1)

    def capture_plans(self) -> list[CapturePlan]:
        """`predict` for all-greedy batches (key False) and for sampled ones (True, with the noise input).
        The inner loop is 15 steps of every layer plus sampling: hundreds of small kernels per frame, which
        a slow host would otherwise launch one by one at every talker step."""
        cfg = self.cfg
        example = (((cfg.hidden_size,), self.norm.weight.dtype), ((), torch.long),
                   ((), torch.float32), ((), torch.long), ((), torch.float32))

        def greedy(hidden, first, temperature, top_k, top_p):
            return self.predict(hidden, first, SamplingTensors(temperature, top_k, top_p, None))

        def sampled(hidden, first, temperature, top_k, top_p, noise):
            return self.predict(hidden, first, SamplingTensors(temperature, top_k, top_p, noise))

        return [CapturePlan(False, greedy, example),
                CapturePlan(True, sampled, (*example, ((cfg.num_residual, cfg.vocab_size), torch.float32)))]

    def _predict(self, hidden: torch.Tensor, first: torch.Tensor, sampling: SamplingTensors
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """`predict`, replayed from a captured graph when one holds the batch (outputs copied out of
        the graph's buffers, which the next replay overwrites)."""
        args = [hidden, first, sampling.temperature, sampling.top_k, sampling.top_p]
        if sampling.noise is not None:
            args.append(sampling.noise)
        replayed = self.graphs.replay(sampling.noise is not None, *args)
        if replayed is None:
            return self.predict(hidden, first, sampling)
        codes, embed_sum = replayed
        return codes.clone(), embed_sum.clone()

    def predict(self, talker_hidden: torch.Tensor, first_code: torch.Tensor, sampling: SamplingTensors
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """talker_hidden [B, hidden], first_code [B] -> (codes [B, G] int64, codec_embed_sum [B, hidden]).

        Static shapes for a given B and no host syncs: safe to capture in a CUDA graph.
        """
        cfg, b = self.cfg, talker_hidden.shape[0]
        dtype, device = self.norm.weight.dtype, self.norm.weight.device
        cos, sin = self._rope_rows(device)
        # every position a step reads was written by an earlier step (or by itself): no zero fill
        cache: KVCache = [
            (torch.empty(b, cfg.num_kv_heads, cfg.num_code_groups, cfg.head_dim, dtype=dtype, device=device),
             torch.empty(b, cfg.num_kv_heads, cfg.num_code_groups, cfg.head_dim, dtype=dtype, device=device))
            for _ in self.layers
        ]
        embed = self.talker_codec_embedding(first_code)
        x = torch.stack([talker_hidden.to(dtype), embed], dim=1).view(2 * b, -1)  # rows: (sequence, position)
        embed_sum, codes, start = embed, [first_code], 0
        for step in range(cfg.num_residual):
            t = x.shape[0] // b
            # per row: its position's cos/sin (a stride-0 view when every row sits at one position)
            rows_cos = cos[start:start + t].repeat(b, 1) if t > 1 else cos[start:start + 1].expand(b, -1)
            rows_sin = sin[start:start + t].repeat(b, 1) if t > 1 else sin[start:start + 1].expand(b, -1)
            h, residual = x, None
            for layer, layer_cache in zip(self.layers, cache):
                h, residual = layer(h, residual, rows_cos, rows_sin, layer_cache, start, b)
            if t > 1:  # only each sequence's last row feeds the head
                h, residual = h.view(b, t, -1)[:, -1].contiguous(), residual.view(b, t, -1)[:, -1].contiguous()
            logits = linear(self.norm.add_forward(h, residual)[0], self.lm_head[step])
            # the code, its embedding (the next step's input) and the frame's running sum of them
            code, x, embed_sum = sample_and_embed(logits, sampling, step, self.codec_embedding[step].weight, embed_sum)
            codes.append(code)
            start += t
        return torch.stack(codes, dim=1), embed_sum

    def _rope_rows(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [G, head_dim] of positions 0..G-1, made once per device (not a handful of kernels in
        every frame); inside a CUDA-graph capture they are made but not kept (the capture's pool owns them)."""
        inv = self.rotary.inv_freq
        key = (device, inv.dtype, inv.data_ptr(), inv._version)  # made anew if the module was moved or cast
        if self._rope is None or self._rope[0] != key:
            rows = self.rotary(torch.arange(self.cfg.num_code_groups, device=device))
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                return rows
            self._rope = (key, rows)
        return self._rope[1]

    @torch.no_grad()
    def run_batch(self, walk: str, node: str, inputs: Sequence[Mapping[str, torch.Tensor]],
                  options: Sequence[Mapping[str, Any]]) -> list[dict[str, torch.Tensor]]:
        """One frame per request, all in one `predict` call (the stateless engine's interface)."""
        hidden, first = self._gather(inputs)
        params = [CodePredictorSampling.from_options(o, self.default_sampling) for o in options]
        # only seeded rows need their frame index on the host: reading a device scalar is a host sync
        frames = [int(x["frame_index"]) if "frame_index" in x and p.seed is not None and p.temperature > 0
                  else None for x, p in zip(inputs, params)]
        sampling = build_sampling_tensors(params, frames, self.cfg.num_residual, self.cfg.vocab_size,
                                          hidden.device)
        codes, embed_sum = self._predict(hidden, first, sampling)
        return [{"codes": codes[i:i + 1], "codec_embed_sum": embed_sum[i]} for i in range(len(inputs))]

    def _gather(self, inputs: Sequence[Mapping[str, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        for x in inputs:
            if x["talker_hidden"].numel() != self.cfg.hidden_size or x["first_code"].numel() != 1:
                raise ValueError(
                    f"code_predictor expects talker_hidden with {self.cfg.hidden_size} values and one first_code, "
                    f"got shapes {tuple(x['talker_hidden'].shape)} and {tuple(x['first_code'].shape)}"
                )
        device = self.norm.weight.device
        hidden = torch.stack([_on(x["talker_hidden"].reshape(-1), device) for x in inputs])
        first = torch.cat([x["first_code"].reshape(1) for x in inputs]).long()  # host (the talker's ids) or device
        return hidden, _on(first, device)


def _on(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` on `device`; a host tensor travels in a pinned, non-blocking copy (a pageable one waits for the GPU)."""
    return t if t.device == device else to_device_async(t, device)
