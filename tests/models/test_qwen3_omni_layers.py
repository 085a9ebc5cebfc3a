"""MoE block and M-RoPE position ids of Qwen3-Omni vs transformers' reference."""

import types

import pytest
import torch

from mstar.layers.moe import MoESpec, SparseMoE
from mstar.models.qwen3_omni.config import OmniConfig
from mstar.models.qwen3_omni.positions import audio_output_length, mrope_positions
from mstar.models.qwen3_omni.tiny import special_token_ids, tiny_hf_config

transformers = pytest.importorskip("transformers")
from transformers.models.qwen3_omni_moe import configuration_qwen3_omni_moe as C  # noqa: E402
from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as M  # noqa: E402

SP = special_token_ids()


def _hf_text_config(shared: bool, norm_topk: bool):
    cfg = tiny_hf_config()["talker_config" if shared else "thinker_config"]["text_config"]
    cfg["norm_topk_prob"] = norm_topk
    return (C.Qwen3OmniMoeTalkerTextConfig if shared else C.Qwen3OmniMoeTextConfig)(**cfg)


@pytest.mark.parametrize("shared,norm_topk", [(False, True), (True, True), (True, False)])
def test_moe_block_matches_reference_on_both_paths(shared, norm_topk):
    torch.manual_seed(0)
    cfg = _hf_text_config(shared, norm_topk)
    hf = (M.Qwen3OmniMoeTalkerTextSparseMoeBlock if shared else M.Qwen3OmniMoeThinkerTextSparseMoeBlock)(cfg)
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.5)
    spec = MoESpec(cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size,
                   norm_topk, cfg.shared_expert_intermediate_size if shared else 0)
    ours = SparseMoE(spec)
    with torch.no_grad():
        ours.gate.weight.copy_(hf.gate.weight)
        ours.experts.gate_up_proj.copy_(hf.experts.gate_up_proj)
        ours.experts.down_proj.copy_(hf.experts.down_proj)
        if shared:
            s = hf.shared_expert
            ours.shared_expert.gate_up_proj.weight.copy_(torch.cat([s.gate_proj.weight, s.up_proj.weight]))
            ours.shared_expert.down_proj.weight.copy_(s.down_proj.weight)
            ours.shared_expert_gate.weight.copy_(hf.shared_expert_gate.weight)
    x = torch.randn(1, 37, cfg.hidden_size)
    with torch.no_grad():
        want = hf(x)[0]
        for path in ("loop", "grouped"):
            ours.force_path = path
            torch.testing.assert_close(ours(x[0]), want, atol=1e-5, rtol=1e-5)


def _rope_reference(ids, **kw):
    """The reference's get_rope_index on a stand-in `self` carrying the tiny config's ids."""
    base = M.Qwen3OmniMoePreTrainedModelForConditionalGeneration
    th = tiny_hf_config()["thinker_config"]
    fake = types.SimpleNamespace(spatial_merge_size=2, config=types.SimpleNamespace(
        **{k: th[k] for k in ("image_token_id", "video_token_id", "audio_token_id", "vision_start_token_id",
                               "audio_start_token_id", "position_id_per_seconds")},
        audio_config=types.SimpleNamespace(n_window=50)))
    fake.get_llm_pos_ids_for_vision = types.MethodType(base.get_llm_pos_ids_for_vision, fake)
    ids = torch.tensor(ids)[None]
    pos, delta = base.get_rope_index(fake, ids, attention_mask=torch.ones_like(ids), **kw)
    return pos[:, 0], float(delta)


def _block(start, token, n, end):
    return [SP[start], *[SP[token]] * n, SP[end]]


CASES = {
    "image": ([1, 2, *_block("vision_start", "image", 4, "vision_end"), 3, 4],
              {"image_grid_thw": [[1, 4, 4]]}),
    "image_audio_video": ([5, *_block("vision_start", "image", 6, "vision_end"), 6,
                           *_block("audio_start", "audio", audio_output_length(60), "audio_end"), 7,
                           *_block("vision_start", "video", 8, "vision_end"), 8, 9],
                          {"image_grid_thw": [[1, 4, 6]], "video_grid_thw": [[2, 4, 4]],
                           "audio_feature_lengths": [60], "video_second_per_grid": [1.0]}),
    "fractional_video": ([5, *_block("vision_start", "video", 12, "vision_end"), 6],
                         {"video_grid_thw": [[3, 4, 4]], "video_second_per_grid": [0.5]}),
    "audio_in_video": ([5, SP["vision_start"], SP["audio_start"], *[SP["video"]] * 8,
                        *[SP["audio"]] * audio_output_length(250), SP["audio_end"], SP["vision_end"], 6],
                       {"video_grid_thw": [[2, 4, 4]], "audio_feature_lengths": [250],
                        "video_second_per_grid": [2.0], "use_audio_in_video": True}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_mrope_positions_match_reference_get_rope_index(case):
    ids, kw = CASES[case]
    ref_kw = {"image_grid_thw": kw.get("image_grid_thw"), "video_grid_thw": kw.get("video_grid_thw"),
              "use_audio_in_video": kw.get("use_audio_in_video", False)}
    ref_kw = {k: torch.tensor(v) if isinstance(v, list) else v for k, v in ref_kw.items()}
    if "audio_feature_lengths" in kw:
        ref_kw["audio_seqlens"] = torch.tensor(kw["audio_feature_lengths"])
    if "video_second_per_grid" in kw:
        ref_kw["second_per_grids"] = torch.tensor(kw["video_second_per_grid"])
    want, want_delta = _rope_reference(ids, **ref_kw)
    tokens = OmniConfig.from_hf(tiny_hf_config()).thinker.tokens
    got, delta = mrope_positions(ids, tokens, **kw)
    assert got.shape == (3, len(ids))
    torch.testing.assert_close(got.double(), want.double(), atol=0, rtol=0)
    assert delta == pytest.approx(want_delta)
    assert (got.dtype == torch.long) == (case != "fractional_video")


def test_text_only_positions_are_plain():
    tokens = OmniConfig.from_hf(tiny_hf_config()).thinker.tokens
    pos, delta = mrope_positions([1, 2, 3], tokens)
    assert pos.tolist() == [[0, 1, 2]] * 3 and delta == 0


def test_moe_graph_capturable_only_on_the_grouped_path():
    from mstar.layers.moe import MoESpec, SparseMoE, moe_graph_capturable

    moe = SparseMoE(MoESpec(hidden_size=8, num_experts=4, top_k=2, intermediate_size=16))
    holder = torch.nn.Sequential(torch.nn.Linear(8, 8), moe)
    assert moe_graph_capturable(torch.nn.Linear(8, 8))  # no MoE: nothing stops a capture
    assert not moe_graph_capturable(holder)  # CPU float32: the per-expert loop syncs the host
    moe.force_path = "grouped"
    assert moe_graph_capturable(holder)
    moe.force_path = "loop"
    assert not moe_graph_capturable(holder)
