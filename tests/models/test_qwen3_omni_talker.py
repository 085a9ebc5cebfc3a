"""Qwen3-Omni talker backbone and its prompt construction vs transformers' reference (tiny, float32)."""

import types

import pytest
import torch

from mstar.engines.autoregressive import AutoregressiveEngine
from mstar.engines.base import StepItem
from mstar.engines.extras import ForwardExtras
from mstar.engines.kv_cache.config import KVCacheConfig
from mstar.engines.sampling import SamplingParams
from mstar.models.qwen3_omni.talker import build_prompt, step_embeds, tts_embeds
from mstar.models.qwen3_omni.tiny import special_token_ids, tiny_hf_config
from mstar.models.qwen3_omni.weights import load_talker, load_thinker
from tests.models.qwen3_omni_testing import FullAttention, randomize, save_checkpoint

transformers = pytest.importorskip("transformers")
SP = special_token_ids()


pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from transformers.models.qwen3_omni_moe import configuration_qwen3_omni_moe as C
    from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as M

    cfg = tiny_hf_config()
    hf_cfg = C.Qwen3OmniMoeConfig(**cfg)
    thinker = M.Qwen3OmniMoeThinkerForConditionalGeneration(hf_cfg.thinker_config).eval()
    talker = M.Qwen3OmniMoeTalkerForConditionalGeneration(hf_cfg.talker_config).eval()
    randomize(thinker, seed=0)
    randomize(talker, seed=1)
    folder = tmp_path_factory.mktemp("omni")
    save_checkpoint(folder, {"thinker": thinker, "talker": talker}, cfg)
    ours = load_talker(folder, dtype=torch.float32, progress=False)
    return types.SimpleNamespace(hf_cfg=hf_cfg, thinker=thinker, talker=talker, ours=ours,
                                 our_thinker=load_thinker(folder, dtype=torch.float32, progress=False))


def _hf_logits(talker, embeds, positions):
    out = talker(inputs_embeds=embeds[None], position_ids=positions[:, None],
                 attention_mask=torch.ones(1, embeds.shape[0], dtype=torch.long), output_hidden_states=True)
    return out.logits[0], out.hidden_states[0][-1][0]


def test_talker_logits_and_final_hidden_match_reference(models):
    g = torch.Generator().manual_seed(0)
    embeds = torch.randn(10, 48, generator=g)
    positions = torch.cat([torch.arange(4).expand(3, -1), torch.tensor([[4, 4, 4], [4, 4, 5], [4, 5, 4]]),
                           torch.arange(7, 10).expand(3, -1)], dim=1)
    extras = ForwardExtras(embeds=embeds, embeds_rows=torch.arange(10), capture=frozenset({-1}))
    with torch.no_grad():
        want, want_hidden = _hf_logits(models.talker, embeds, positions)
        got = models.ours.compute_logits(models.ours(torch.zeros(10, dtype=torch.long), positions,
                                                     FullAttention(), extras))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(extras.captured[-1], want_hidden, atol=1e-4, rtol=1e-4)


def test_talker_decode_steps_fed_by_embeddings_through_engine(models):
    """Prefill from embeddings with 3-row positions, then one embedding per step: logits argmax and the
    final hidden state (the code predictor's input) match a full recompute by the reference."""
    g = torch.Generator().manual_seed(1)
    prompt = torch.randn(9, 48, generator=g)
    positions = torch.cat([torch.arange(3).expand(3, -1), torch.tensor([[3, 3, 3, 3], [3, 3, 4, 4], [3, 4, 3, 4]]),
                           torch.tensor([[5, 6]] * 3)], dim=1)
    steps = [torch.randn(1, 48, generator=g) for _ in range(3)]
    engine = AutoregressiveEngine(models.ours, KVCacheConfig(max_num_pages=32, page_size=4), "cpu",
                                  default_sampling=SamplingParams(temperature=0.0), max_batch_tokens=4)
    engine.submit(StepItem("a", "talk", "talker", {"input_ids": torch.full((9,), 81), "input_embeds": prompt,
                                                   "positions": positions}, options={"return_hidden": -1}))
    embeds, pos = prompt, positions
    for i in range(4):
        while not (out := engine.step()):
            pass
        (r,) = out
        assert r.error is None, r.error
        with torch.no_grad():
            want, want_hidden = _hf_logits(models.talker, embeds, pos)
        assert int(r.outputs["token"]) == int(want[-1].argmax())
        torch.testing.assert_close(r.outputs["hidden"][0, -1], want_hidden[-1], atol=1e-4, rtol=1e-4)

        if i < 3:
            engine.submit(StepItem("a", "talk", "talker", {"input_ids": r.outputs["token"], "input_embeds": steps[i]},
                                   options={"return_hidden": -1}))
            embeds, pos = torch.cat([embeds, steps[i]]), torch.cat([pos, pos.max().expand(3, 1) + 1], dim=1)


def test_prompt_matches_reference_generate_construction(models):
    from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as M

    ids = torch.tensor([SP["im_start"], SP["system"], 7, SP["im_end"], SP["im_start"], SP["user"], 10,
                        SP["audio_start"], SP["audio"], SP["audio"], SP["audio_end"], 11, SP["im_end"],
                        SP["im_start"], SP["assistant"], 12])
    generated = torch.tensor([20, 21, 22, SP["im_end"]])
    full = torch.cat([ids, generated])
    g = torch.Generator().manual_seed(2)
    th_embed = torch.randn(len(full), 64, generator=g)
    th_hidden = torch.randn(len(full), 64, generator=g)
    top = models.hf_cfg
    fake = types.SimpleNamespace(talker=models.talker, config=top)
    mm = (full == SP["audio"])[None]
    with torch.no_grad():
        # the reference's generate: user rows gathered over user turns, then the assistant part
        user_all = M.Qwen3OmniMoeForConditionalGeneration._get_talker_user_parts(
            fake, 0, len(ids), mm, th_hidden[None], th_embed[None])[0]
        ref_embed = models.thinker.get_input_embeddings()
        special = torch.tensor([[top.tts_bos_token_id, top.tts_eos_token_id, top.tts_pad_token_id]])
        bos, eos, pad = models.talker.text_projection(ref_embed(special)).chunk(3, dim=1)
        start = len(ids) - 3
        a_embeds, a_ids, trailing = M.Qwen3OmniMoeForConditionalGeneration._get_talker_assistant_parts(
            fake, start, len(full), top.talker_config.speaker_id["ethan"], th_embed[None], pad, bos, eos)
        user_mask = torch.zeros(len(ids), dtype=torch.bool)
        user_mask[4:13] = True
        want = torch.cat([user_all[user_mask], a_embeds[0]])

        tts = tts_embeds(models.ours, models.our_thinker.model.embed_tokens, tiny_token_ids())
        got = build_prompt(models.ours, ids, th_embed[: len(ids)], th_hidden[: len(ids)], th_embed[len(ids):],
                           tts, "Ethan", tiny_token_ids())
    torch.testing.assert_close(got.embeds, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.trailing_text, trailing[0], atol=1e-5, rtol=1e-5)
    assert got.rope_ids.tolist() == ids[4:13].tolist() + a_ids[0].tolist()
    codec = models.ours.embed_codec(torch.tensor([5, 6]))
    step = step_embeds(codec, 10, got.trailing_text, tts["tts_pad"])  # past the text: tts_pad
    torch.testing.assert_close(step[0], codec.sum(0) + tts["tts_pad"])


def tiny_token_ids():
    cfg = tiny_hf_config()
    return {n: cfg[f"{n}_token_id"] for n in ("im_start", "im_end", "system", "user", "assistant",
                                              "tts_pad", "tts_bos", "tts_eos")}
