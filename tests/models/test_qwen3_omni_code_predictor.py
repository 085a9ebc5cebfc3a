"""Code predictor parity with transformers (tiny, float32) and its per-request sampling."""

from __future__ import annotations

import pytest
import torch

from mstar.engines.base import StepGraphs
from mstar.models.qwen3_omni.code_predictor_config import CodePredictorConfig
from mstar.models.qwen3_omni.code_predictor_sampling import CodePredictorSampling
from mstar.models.qwen3_omni.codec_weights import build_code_predictor
from tests.models.qwen3_omni_codec_testing import hf_talker_config, make_hf_code_predictor, save_checkpoint

CFG = CodePredictorConfig.tiny()
GREEDY = {"code_predictor.temperature": 0.0}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(transformers code predictor, talker codec embedding, ours loaded from their HF-layout checkpoint)."""
    ref, talker_embedding = make_hf_code_predictor(CFG)
    tensors = {f"talker.code_predictor.{k}": v for k, v in ref.state_dict().items()}
    tensors["talker.model.codec_embedding.weight"] = talker_embedding.weight
    path = save_checkpoint(tensors, tmp_path_factory.mktemp("code_predictor"))
    return ref, talker_embedding, build_code_predictor(CFG, path, progress=False)


def _frames(num: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(talker hidden states [2, H], first codes [2]) for `num` frames of a batch of two requests."""
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(2, CFG.hidden_size, generator=gen),
             torch.randint(0, CFG.talker_vocab_size, (2,), generator=gen)) for _ in range(num)]


@torch.no_grad()
def _reference(ref, talker_embedding, hidden, first):
    """What the reference talker does per frame in generate: codes and the summed codec embeddings."""
    first_embed = talker_embedding(first)[:, None]
    result = ref.generate(inputs_embeds=torch.cat([hidden[:, None], first_embed], dim=1),
                          max_new_tokens=CFG.num_residual, do_sample=False, output_hidden_states=True,
                          return_dict_in_generate=True)
    codes = torch.cat([first[:, None], result.sequences], dim=1)
    mid = [h[0] for h in result.hidden_states[1:]]  # input embeddings of codes 1..G-2
    last = ref.get_input_embeddings()[-1](result.sequences[:, -1:])
    return codes, torch.cat([first_embed, *mid, last], dim=1).sum(1)


def test_config_from_hf_dict():
    assert CodePredictorConfig.from_hf(hf_talker_config(CFG)) == CFG
    bad = hf_talker_config(CFG) | {"num_code_groups": 8}
    with pytest.raises(ValueError, match="num_code_groups"):
        CodePredictorConfig.from_hf(bad)


@torch.no_grad()
def test_greedy_codes_match_reference(pair):
    ref, talker_embedding, ours = pair
    distinct = set()
    for hidden, first in _frames(3):
        codes, embed_sum = _reference(ref, talker_embedding, hidden, first)
        inputs = [{"talker_hidden": hidden[i], "first_code": first[i:i + 1]} for i in range(2)]
        out = ours.run_batch("talker", "code_predictor", inputs, [GREEDY, GREEDY])
        for i, item in enumerate(out):
            assert item["codes"].shape == (1, CFG.num_code_groups) and item["codes"].dtype == torch.long
            assert item["codes"][0].tolist() == codes[i].tolist()
            torch.testing.assert_close(item["codec_embed_sum"], embed_sum[i], atol=1e-5, rtol=1e-5)
            distinct.update(codes[i, 1:].tolist())
    assert len(distinct) > 10  # the frames really exercise different heads and codes


def _run(ours, rows):
    """rows: (hidden, first code, options, frame index) -> codes [G] per row, one batch."""
    inputs = [{"talker_hidden": h, "first_code": c.view(1), "frame_index": torch.tensor(f)} for h, c, _, f in rows]
    return [o["codes"][0] for o in ours.run_batch("talker", "code_predictor", inputs, [r[2] for r in rows])]


@torch.no_grad()
def test_seeded_sampling_is_reproducible_and_batch_independent(pair):
    _, _, ours = pair
    (hidden, first), = _frames(1, seed=5)
    seeded = {"code_predictor.temperature": 1.3, "code_predictor.top_k": 0, "code_predictor.top_p": 1.0,
              "code_predictor.seed": 11}
    alone = _run(ours, [(hidden[0], first[0], seeded, 4)])[0]
    with_other = _run(ours, [(hidden[1], first[1], {"code_predictor.temperature": 1.0}, 9),
                             (hidden[0], first[0], seeded, 4)])[1]
    assert alone.tolist() == with_other.tolist()
    others = [_run(ours, [(hidden[0], first[0], seeded, frame)])[0] for frame in (5, 6, 7)]
    greedy = _run(ours, [(hidden[0], first[0], GREEDY, 4)])[0]
    assert any(o.tolist() != alone.tolist() for o in [*others, greedy])  # it really samples


@torch.no_grad()
def test_top_k_one_is_greedy_and_greedy_rows_ignore_noise(pair):
    _, _, ours = pair
    (hidden, first), = _frames(1, seed=6)
    greedy = _run(ours, [(hidden[i], first[i], GREEDY, 0) for i in range(2)])
    top1 = {"code_predictor.temperature": 2.0, "code_predictor.top_k": 1}
    mixed = _run(ours, [(hidden[0], first[0], top1, 0), (hidden[1], first[1], GREEDY, 0)])
    assert [m.tolist() for m in mixed] == [g.tolist() for g in greedy]


def test_options_are_validated():
    assert CodePredictorSampling.from_options({"temperature": 0.3, "code_predictor.top_k": -1}).top_k == 0
    with pytest.raises(ValueError, match="code_predictor.min_p"):
        CodePredictorSampling.from_options({"code_predictor.min_p": 0.1})
    with pytest.raises(ValueError, match="code_predictor.temperature"):
        CodePredictorSampling.from_options({"code_predictor.temperature": -1})
    with pytest.raises(ValueError, match="code_predictor.top_p"):
        CodePredictorSampling.from_options({"code_predictor.top_p": 0})


@torch.no_grad()
def test_seed_needs_frame_index(pair):
    _, _, ours = pair
    (hidden, first), = _frames(1)
    with pytest.raises(ValueError, match="frame_index"):
        ours.run_batch("talker", "code_predictor", [{"talker_hidden": hidden[0], "first_code": first[:1]}],
                       [{"code_predictor.seed": 1}])


class _EagerGraphs:
    """BatchGraphs' interface on CPU: static output buffers reused across calls, so a caller that keeps
    views instead of copies sees them overwritten, as with a real graph."""

    def __init__(self, fn, sizes, example, device, before_capture=None, warmup=2):
        self.fn, self.sizes, self.calls, self.out = fn, sorted(sizes), 0, None

    @property
    def max_batch(self):
        return self.sizes[-1]

    def __call__(self, *inputs, bucket=None):
        self.calls += 1
        with torch.inference_mode():
            result = self.fn(*inputs)
        if self.out is None:
            self.out = tuple(torch.empty_like(r) for r in result)
        for o, r in zip(self.out, result):
            o.copy_(r)
        return self.out


def test_captured_predict_serves_the_same_frames(pair):
    """run_batch through the graphs (greedy and sampled batches) equals the eager predict."""
    _, _, ours = pair
    frames = _frames(3, seed=4)
    sampled = {"code_predictor.temperature": 0.9, "code_predictor.seed": 3}
    rows = [[GREEDY, GREEDY], [sampled, GREEDY]]

    def serve():
        return [[(o["codes"], o["codec_embed_sum"]) for o in ours.run_batch("talker", "code_predictor",
                                                             [{"talker_hidden": h[i], "first_code": f[i:i + 1],
                                                               "frame_index": torch.tensor(k)} for i in range(2)],
                                                             opts)]
                for opts in rows for k, (h, f) in enumerate(frames)]

    want = serve()
    graphs = {plan.key: _EagerGraphs(plan.fn, [1, 2, 4], plan.example, None) for plan in ours.capture_plans()}
    ours.graphs = StepGraphs(graphs)
    try:
        got = serve()
        assert graphs[False].calls == 3 and graphs[True].calls == 3
    finally:
        del ours.graphs  # back to the class's empty StepGraphs
    # compared after all calls: outputs must not be views a later replay overwrites
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for g, w in zip(got, want) for a, b in zip(g, w))
