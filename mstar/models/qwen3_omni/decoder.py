"""The decoder layer of Qwen3-Omni's thinker and talker: the shared block (`layers.decoder`) with
qk-normed GQA attention and a sparse MoE (or dense MLP) block."""

from __future__ import annotations

from mstar.layers.attention import AttentionSpec, HeadShard
from mstar.layers.decoder import DecoderLayer
from mstar.layers.mlp import GatedMLP
from mstar.layers.moe import ExpertShard, SparseMoE
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
