"""The served code predictor reads device values on the host only where it must (each read is a host sync)."""

from __future__ import annotations

import torch

from mstar.models.qwen3_omni.code_predictor_config import CodePredictorConfig
from mstar.models.qwen3_omni.code_predictor_sampling import CodePredictorSampling, build_sampling_tensors
from mstar.models.qwen3_omni.components import FrameCodePredictor

CFG = CodePredictorConfig.tiny()


class _NoHostRead:
    """A frame index that fails the test when something reads it on the host."""

    def __int__(self) -> int:
        raise AssertionError("frame_index was read on the host")


def _predictor() -> FrameCodePredictor:
    torch.manual_seed(0)
    module = FrameCodePredictor(CFG).eval()
    module.codec_eos = CFG.talker_vocab_size - 1
    return module


def _items(frame_index) -> list[dict]:
    return [{"talker_hidden": torch.randn(CFG.hidden_size), "first_code": torch.tensor([i + 1]),
             "frame_index": frame_index} for i in range(2)]


def test_unseeded_and_greedy_rows_never_read_the_frame_index() -> None:
    module = _predictor()
    sampled = {"code_predictor.temperature": 1.0}
    greedy_seeded = {"code_predictor.temperature": 0.0, "code_predictor.seed": 3}
    out = module.run_batch("talk", "code_predictor", _items(_NoHostRead()), [sampled, greedy_seeded])
    assert [o["codes"].shape for o in out] == [(1, CFG.num_code_groups)] * 2


def test_seeded_rows_still_use_the_frame_index() -> None:
    module = _predictor()
    seeded = [{"code_predictor.seed": 5}] * 2
    a = module.run_batch("talk", "code_predictor", _items(torch.tensor(4)), seeded)
    b = module.run_batch("talk", "code_predictor", _items(torch.tensor(4)), seeded)
    c = module.run_batch("talk", "code_predictor", _items(torch.tensor(9)), seeded)
    assert all(torch.equal(x["codes"], y["codes"]) for x, y in zip(a, b))
    assert not all(torch.equal(x["codes"], y["codes"]) for x, y in zip(a, c))


def test_sampling_tensors_keep_each_rows_values() -> None:
    params = [CodePredictorSampling(temperature=0.7, top_k=0, top_p=0.8),
              CodePredictorSampling(temperature=0.0, top_k=5, top_p=1.0)]
    st = build_sampling_tensors(params, [None, None], CFG.num_residual, CFG.vocab_size, torch.device("cpu"))
    assert st.temperature.dtype == torch.float32 and st.top_k.dtype == torch.long
    assert st.temperature.tolist() == [torch.tensor(0.7).item(), 0.0]
    assert st.top_k.tolist() == [CFG.vocab_size, 5] and st.top_p.tolist() == [torch.tensor(0.8).item(), 2.0]
    assert st.noise is not None and st.noise.shape == (2, CFG.num_residual, CFG.vocab_size)


def test_eos_frame_gives_no_codes_and_the_eos_embedding_to_feed_on() -> None:
    """An EOS step makes no frame; its sum (fed on when the talk goes past EOS) is the EOS code's embedding."""
    module = _predictor()
    items = _items(torch.tensor(0))
    items[1]["first_code"] = torch.tensor([module.codec_eos])
    out = module.run_batch("talk", "code_predictor", items, [{"code_predictor.temperature": 0.0}] * 2)
    assert set(out[0]) == {"codes", "codec_embed_sum"} and set(out[1]) == {"codec_embed_sum"}
    assert torch.equal(out[1]["codec_embed_sum"], module.talker_codec_embedding.weight[module.codec_eos])
