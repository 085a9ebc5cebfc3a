"""Checkpoint names of Qwen3-Omni's thinker text model and talker backbone -> our modules.

The Hub checkpoint stores one tensor per expert (`mlp.experts.{e}.gate_proj.weight`, ...) under
`thinker.` / `talker.` prefixes; transformers 5 may also hold them stacked (`mlp.experts.gate_up_proj`).
Both load into our stacked experts; q/k/v and gate/up land in the fused projections. Encoders, the
code predictor and Code2Wav have their own loaders and are skipped here. A tensor-parallel thinker rank
(`Qwen3OmniThinker.tp`) takes its rows of q/k/v, its columns of o_proj and its experts only.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from mstar.layers.attention import HeadShard
from mstar.models.common import loading
from mstar.models.qwen3_omni.config import MoETextConfig, OmniConfig
from mstar.models.qwen3_omni.talker import Qwen3OmniTalker, build_talker
from mstar.models.qwen3_omni.thinker import Qwen3OmniThinker, build_thinker

logger = logging.getLogger(__name__)

Index = tuple[int | slice, ...]
Mapper = Callable[[str], "tuple | None"]  # checkpoint name -> (parameter, index into it[, part of the tensor]), None: skip

_EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")
_THINKER_SKIP = ("audio_tower.", "visual.")
_TALKER_SKIP = ("code_predictor.",)


def _decoder_mapper(text: MoETextConfig, tp: HeadShard | None = None, split_attention: bool = True
                    ) -> Callable[[str], tuple]:
    """Names inside one decoder (thinker or talker), prefix already stripped; with `tp`, one rank's share
    (its experts, and with `split_attention` its heads)."""
    q, kv, i_moe = text.num_heads * text.head_dim, text.num_kv_heads * text.head_dim, text.moe_intermediate_size
    dense = {"gate": (0, text.intermediate_size), "up": (text.intermediate_size, 2 * text.intermediate_size)}
    shared = {"gate": (0, text.shared_expert_intermediate_size),
              "up": (text.shared_expert_intermediate_size, 2 * text.shared_expert_intermediate_size)}
    attn = {"q_proj": (0, q), "k_proj": (q, q + kv), "v_proj": (q + kv, q + 2 * kv)}
    index, size = (tp.index, tp.size) if tp is not None else (0, 1)
    heads_split = tp is not None and split_attention
    experts = text.num_experts // size
    part_q, part_kv = (q // size, kv // size) if heads_split else (q, kv)
    first = index * experts
    # with tp: where each of q/k/v lands in this rank's fused qkv, and which of its rows this rank takes
    local_attn = {"q_proj": (0, part_q, index * part_q), "k_proj": (part_q, part_q + part_kv, index * part_kv),
                  "v_proj": (part_q + part_kv, part_q + 2 * part_kv, index * part_kv)}

    def mapper(name: str) -> tuple | None:
        if m := _EXPERT.search(name):
            e, which = int(m.group(1)) - first, m.group(2)
            if tp is not None and not 0 <= e < experts:
                return None  # another rank's expert
            base = name[: m.start()] + ".mlp.experts."
            if which == "down":
                return base + "down_proj", (e,)
            lo = 0 if which == "gate" else i_moe
            return base + "gate_up_proj", (e, slice(lo, lo + i_moe))
        if tp is not None and name.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")):
            return name, (), (slice(first, first + experts),)  # stacked (transformers 5 layout)
        for part, (lo, hi) in attn.items():
            if f".self_attn.{part}." in name:
                if not heads_split:
                    return name.replace(part, "qkv_proj"), (slice(lo, hi),)
                dst_lo, dst_hi, src = local_attn[part]
                return name.replace(part, "qkv_proj"), (slice(dst_lo, dst_hi),), (slice(src, src + dst_hi - dst_lo),)
        if heads_split and name.endswith(".self_attn.o_proj.weight"):
            return name, (), (slice(None), slice(index * part_q, (index + 1) * part_q))
        for owner, table in ((".mlp.shared_expert.", shared), (".mlp.", dense)):
            for which, (lo, hi) in table.items():
                if f"{owner}{which}_proj." in name:
                    return name.replace(f"{owner}{which}_proj.", f"{owner}gate_up_proj."), (slice(lo, hi),)
        return name, ()

    return mapper


def thinker_mapper(model: Qwen3OmniThinker) -> Mapper:
    """Maps `thinker.model.*` / `thinker.lm_head.*` (or the same without `thinker.`) to the thinker (one
    rank's share of it when it is tensor-parallel)."""
    inner = _decoder_mapper(model.config.text, model.tp, model.split_attention)

    def mapper(name: str) -> tuple | None:
        if name.startswith(("talker.", "code2wav.")):
            return None
        name = name.removeprefix("thinker.")
        if name.startswith(_THINKER_SKIP) or name.endswith("rotary_emb.inv_freq"):
            return None
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            return None
        return inner(name)

    return mapper


def talker_mapper(model: Qwen3OmniTalker) -> Mapper:
    """Maps `talker.*` (code predictor excluded) to the talker backbone."""
    inner = _decoder_mapper(model.config.text)

    def mapper(name: str) -> tuple[str, Index] | None:
        if not name.startswith("talker.") or name.startswith("talker.code_predictor."):
            return None
        return inner(name.removeprefix("talker."))

    return mapper


def load_thinker(path: str | Path, load_format: str = "auto", dtype: torch.dtype | None = None,
                 device: str | torch.device = "cpu", progress: bool = True, tp: HeadShard | None = None,
                 split_attention: bool = True, quantization: str | None = None) -> Qwen3OmniThinker:
    """The thinker text model of a checkpoint folder or Hub id (`load_format="dummy"`: random weights);
    with `tp`, that rank's share of it (heads too with `split_attention`); with `quantization`, its decoder
    linears and routed experts in FP8, quantized as they load (`build_thinker`)."""
    root = loading.resolve_checkpoint(path)
    model = build_thinker(OmniConfig.from_path(root).thinker, dtype, device, tp, split_attention, quantization)
    _fill(model, root, load_format, thinker_mapper(model), progress)
    return model


def load_talker(path: str | Path, load_format: str = "auto", dtype: torch.dtype | None = None,
                device: str | torch.device = "cpu", progress: bool = True,
                quantization: str | None = None) -> Qwen3OmniTalker:
    """The talker backbone (with its projections and codec head) of a checkpoint folder or Hub id; with
    `quantization`, its decoder linears and routed experts in FP8 (`build_talker`)."""
    root = loading.resolve_checkpoint(path)
    config = OmniConfig.from_path(root)
    if config.talker is None:
        raise ValueError(f"{root} has no talker (enable_audio_output is false); it cannot produce speech")
    model = build_talker(config.talker, dtype, device, quantization)
    _fill(model, root, load_format, talker_mapper(model), progress)
    return model


def _fill(model: nn.Module, root: Path, load_format: str, mapper: Mapper, progress: bool) -> None:
    if load_format not in loading.LOAD_FORMATS:
        raise ValueError(f"unknown load_format {load_format!r}; choose one of {loading.LOAD_FORMATS}")
    if load_format == "dummy":
        loading.fill_dummy_weights(model)
    else:
        loading.load_named_tensors(model, loading.iter_checkpoint_tensors(root, progress=progress), mapper)
    logger.info("loaded %s (%s) from %s", type(model).__name__, load_format, root)
