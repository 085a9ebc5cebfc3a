"""The decoder layer of Qwen3-Omni's thinker and talker: the shared block (`layers.decoder`) with
qk-normed GQA attention and a sparse MoE (or dense MLP) block."""

from __future__ import annotations

from torch import nn

from mstar.layers.attention import AttentionSpec, HeadShard
from mstar.layers.decoder import DecoderLayer
from mstar.layers.fp8 import empty_fp8_linears, method_block, quantizable_linears
from mstar.layers.mlp import GatedMLP
from mstar.layers.moe import ExpertShard, SparseMoE, StackedExperts
from mstar.models.qwen3_omni.config import MoETextConfig


def moe_decoder_layer(config: MoETextConfig, layer_idx: int, sparse: bool, tp: HeadShard | None = None,
                      split_attention: bool = True) -> DecoderLayer:
    """Layer `layer_idx`. With `tp` (rank `tp.index` of `tp.size`), the MoE block holds this rank's share of
    the experts and, with `split_attention`, the attention its share of the heads, each summed over the
    group by one all-reduce; otherwise attention and a dense MLP run whole on every rank. The residual
    stream is the same on every rank."""
    spec = AttentionSpec(
        hidden_size=config.hidden_size, num_heads=config.num_heads, num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim, qkv_bias=config.attention_bias, o_bias=config.attention_bias,
        qk_norm=True, norm_eps=config.rms_norm_eps,
    )
    if sparse:
        moe = config.moe_spec()
        mlp = SparseMoE(moe, None if tp is None else ExpertShard(tp.index, tp.size, moe.num_experts, tp.group))
    else:
        mlp = GatedMLP(config.hidden_size, config.intermediate_size)
    return DecoderLayer(spec, layer_idx, mlp, tp if split_attention else None)


ROUTER_GATES = ("mlp.gate", "mlp.shared_expert_gate")  # routing decisions stay in the model dtype


def empty_fp8_layers(layers: nn.ModuleList, quantization: str) -> list[str]:
    """The attention projections, dense MLPs and shared experts of `layers` swapped for empty `Fp8Linear`s
    of `quantization`'s scales, and the routed experts made FP8 with one scale per row whatever the
    setting (`StackedExperts.to_fp8`: what the MoE kernels apply), all quantized as they load; the routers
    and the shared expert's gate keep the model dtype (a rounding there can change which experts run).
    The linear layers' names (module paths inside `layers`)."""
    names = [n for n in quantizable_linears(layers) if not n.endswith(ROUTER_GATES)]
    empty_fp8_linears(layers, set(names), method_block(quantization))
    for module in layers.modules():
        if isinstance(module, StackedExperts):
            module.to_fp8()
    return names
