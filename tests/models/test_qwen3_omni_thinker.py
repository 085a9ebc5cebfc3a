"""Qwen3-Omni thinker text model vs transformers' reference (tiny random config, float32)."""

import pytest
import torch

from mstar.engines.autoregressive import AutoregressiveEngine
from mstar.engines.base import StepItem
from mstar.engines.kv_cache.config import KVCacheConfig
from mstar.engines.sampling import SamplingParams
from mstar.models.common.loading import load_named_tensors
from mstar.models.qwen3_omni.config import OmniConfig
from mstar.models.qwen3_omni.positions import mrope_positions
from mstar.models.qwen3_omni.tiny import special_token_ids, tiny_hf_config
from mstar.models.qwen3_omni.weights import load_thinker, thinker_mapper
from tests.models.qwen3_omni_testing import FullAttention, randomize, save_checkpoint

transformers = pytest.importorskip("transformers")
SP = special_token_ids()


pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from transformers.models.qwen3_omni_moe import configuration_qwen3_omni_moe as C
    from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as M

    cfg = tiny_hf_config()
    hf = M.Qwen3OmniMoeThinkerForConditionalGeneration(C.Qwen3OmniMoeConfig(**cfg).thinker_config).eval()
    randomize(hf, seed=0)
    folder = tmp_path_factory.mktemp("omni")
    save_checkpoint(folder, {"thinker": hf}, cfg)
    return hf, load_thinker(folder, dtype=torch.float32, progress=False)


def test_config_parses_dense_and_sparse_layers():
    cfg = OmniConfig.from_hf(tiny_hf_config())
    text = cfg.thinker.text
    assert [text.is_sparse(i) for i in range(3)] == [True, False, True]  # mlp_only_layers=[1]
    assert cfg.thinker.num_deepstack == 2 and cfg.talker is not None and cfg.talker.accept_hidden_layer == 2


def test_text_logits_match_reference(pair):
    hf, ours = pair
    ids = torch.randint(0, 300, (13,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(input_ids=ids[None]).logits[0]
        got = ours.compute_logits(ours(ids, torch.arange(13), FullAttention()))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_stacked_expert_layout_loads_too(pair):
    hf, ours = pair
    state = {f"thinker.{k}": v for k, v in hf.state_dict().items()}  # transformers-5 in-memory names
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)
    before = {k: v.clone() for k, v in ours.state_dict().items()}
    load_named_tensors(ours, state.items(), thinker_mapper(ours))
    for k, v in ours.state_dict().items():
        assert torch.equal(v, before[k]), k


def _engine(model, **kw):
    return AutoregressiveEngine(model, KVCacheConfig(max_num_pages=64, page_size=4, attention_backend="sdpa"),
                                "cpu", default_sampling=SamplingParams(temperature=0.0), **kw)


def _drive(engine, item, steps):
    engine.submit(item)
    out = []
    while engine.has_work():
        for r in engine.step():
            assert r.error is None, r.error
            out.append(int(r.outputs["token"]))
            if not r.stop:
                engine.submit(StepItem(r.request_id, "decode", "llm", {"input_ids": r.outputs["token"]}))
    assert len(out) == steps
    return out


def test_greedy_tokens_through_engine_match_reference_generate(pair):
    hf, ours = pair
    ids = torch.randint(0, 300, (11,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = hf.generate(input_ids=ids[None], attention_mask=torch.ones(1, 11, dtype=torch.long),
                           max_new_tokens=8, do_sample=False)[0, 11:].tolist()
    item = StepItem("a", "prefill", "llm", {"input_ids": ids}, options={"max_tokens": 8})
    assert _drive(_engine(ours, max_batch_tokens=4), item, 8) == want


def _multimodal_prompt():
    """text, an image (grid 1x4x4 -> 4 tokens), text, an audio clip (60 frames -> 8 tokens), assistant turn."""
    image, audio = [SP["image"]] * 4, [SP["audio"]] * 8
    ids = ([SP["im_start"], SP["user"], 10, 11, SP["vision_start"], *image, SP["vision_end"], 12,
            SP["audio_start"], *audio, SP["audio_end"], 13, SP["im_end"], SP["im_start"], SP["assistant"], 14])
    return torch.tensor(ids), [[1, 4, 4]], [60]


def _reference_mm_greedy(hf, ids, embeds, mask, visual, deepstack, positions, steps):
    """Full recompute each step with the reference text model: media rows replaced, deepstack on visual rows."""
    text, out = hf.model, []
    pos, ids = positions.clone(), ids.clone()
    for _ in range(steps):
        x = text.embed_tokens(ids).clone()
        x[: len(mask)][mask] = embeds
        vis = torch.zeros(len(ids), dtype=torch.bool)
        vis[: len(visual)] = visual
        h = text(inputs_embeds=x[None], position_ids=pos[:, None], visual_pos_masks=vis[None],
                 deepstack_visual_embeds=list(deepstack)).last_hidden_state
        token = int(hf.lm_head(h[0, -1]).argmax())
        out.append(token)
        ids = torch.cat([ids, torch.tensor([token])])
        pos = torch.cat([pos, pos.max().expand(3, 1) + 1], dim=1)
    return out


def test_multimodal_embeddings_positions_and_deepstack_match_reference(pair):
    hf, ours = pair
    ids, grid, audio_lens = _multimodal_prompt()
    tokens = OmniConfig.from_hf(tiny_hf_config()).thinker.tokens
    positions, delta = mrope_positions(ids, tokens, image_grid_thw=grid, audio_feature_lengths=audio_lens)
    assert delta != 0  # the image's grid positions compress the sequence
    g = torch.Generator().manual_seed(3)
    mask = (ids == SP["image"]) | (ids == SP["audio"])
    visual = ids == SP["image"]
    embeds = torch.randn(int(mask.sum()), 64, generator=g)
    deepstack = 4 * torch.randn(2, int(visual.sum()), 64, generator=g)  # per deepstack layer, visual rows
    with torch.no_grad():
        want = _reference_mm_greedy(hf, ids, embeds, mask, visual, deepstack, positions, 6)
        assert want != _reference_mm_greedy(hf, ids, embeds, mask, visual, 0 * deepstack, positions, 6)
    features = torch.zeros(int(mask.sum()), 2, 64)
    features[visual[mask]] = deepstack.transpose(0, 1)  # rows aligned with the embeddings; zero for audio
    inputs = {"input_ids": ids, "input_embeds": embeds, "embeds_mask": mask, "positions": positions,
              "deepstack_embeds": features}
    item = StepItem("a", "prefill", "llm", inputs, options={"max_tokens": 6})
    assert _drive(_engine(ours, max_batch_tokens=8), item, 6) == want
