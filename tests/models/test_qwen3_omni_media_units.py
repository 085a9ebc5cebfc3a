"""The served Qwen3-Omni encoders batch requests without changing any request's rows, place them at the
right multimodal rows, and the YAML configs put them next to the thinker that prefills media."""

import numpy as np
import pytest
import torch

from mstar.config import load_config
from mstar.graph.placement import plan_placement
from mstar.models.qwen3_omni.encoder_components import BatchedAudioEncoder, BatchedVisionEncoder
from mstar.models.qwen3_omni.encoder_config import tiny_audio_config, tiny_vision_config
from mstar.models.qwen3_omni.encoder_weights import (
    build_audio_encoder,
    build_vision_encoder,
    fill_encoder_dummy_weights,
)
from mstar.models.qwen3_omni.features import VisionPreprocessSpec, log_mel_features, preprocess_images
from mstar.models.qwen3_omni.media_inputs import MM_AUDIO, MM_VISION
from mstar.models.qwen3_omni.model import OmniServeConfig, omni_graph

PIXELS = VisionPreprocessSpec(patch_size=16)


@pytest.fixture(scope="module")
def audio():
    encoder = build_audio_encoder(tiny_audio_config(), torch.float32)
    fill_encoder_dummy_weights(encoder, seed=1, std=0.2)
    return BatchedAudioEncoder(encoder, num_deepstack=2)


@pytest.fixture(scope="module")
def vision():
    encoder = build_vision_encoder(tiny_vision_config(), torch.float32)
    fill_encoder_dummy_weights(encoder, seed=2, std=0.2)
    return BatchedVisionEncoder(encoder)


def _audio_item(seconds, kinds_before=0, kinds_after=0):
    rng = np.random.default_rng(int(sum(seconds) * 10))
    feats = log_mel_features([(0.1 * rng.standard_normal(int(s * 16000))).astype(np.float32) for s in seconds])
    rows = sum(audio_rows(feats.lengths.tolist()))
    kinds = torch.tensor([MM_VISION] * kinds_before + [MM_AUDIO] * rows + [MM_VISION] * kinds_after)
    return {"audio_features": feats.features, "audio_lengths": feats.lengths, "mm_kinds": kinds}


def audio_rows(lengths):
    from mstar.models.qwen3_omni.audio_encoder import audio_output_lengths

    return audio_output_lengths(lengths, tiny_audio_config())


def test_audio_batch_equals_each_request_alone(audio):
    # the second request's short audio is padded per request, not to the first request's long chunks
    items = [_audio_item([3.3, 0.4]), _audio_item([0.6], kinds_before=2, kinds_after=3), {"mm_kinds": torch.ones(4)}]
    batched = audio.run_batch("prefill_media", "audio_encoder", items, [{}] * 3)
    alone = [audio.run_batch("prefill_media", "audio_encoder", [x], [{}])[0] for x in items]
    assert batched[2] == {} and alone[2] == {}  # no audio: passes through
    for got, want, item in zip(batched[:2], alone[:2], items):
        torch.testing.assert_close(got["mm_embeds"], want["mm_embeds"], atol=1e-5, rtol=1e-5)
        rows = item["mm_kinds"] == MM_AUDIO
        assert got["mm_embeds"][rows].abs().sum(-1).gt(0).all() and (got["mm_embeds"][~rows] == 0).all()
        assert got["deepstack_embeds"].shape == (len(item["mm_kinds"]), 2, 48) and (got["deepstack_embeds"] == 0).all()


def test_vision_batch_equals_alone_and_fills_only_vision_rows(vision, audio):
    rng = np.random.default_rng(0)
    images = [rng.integers(0, 256, (64, 96, 3), dtype=np.uint8), rng.integers(0, 256, (80, 48, 3), dtype=np.uint8)]
    items = []
    for image in images:
        inputs = preprocess_images([image], PIXELS)
        n = inputs.num_tokens()[0]
        items.append({"pixel_values": inputs.pixel_values, "vision_grid_thw": inputs.grid_thw,
                      "mm_kinds": torch.tensor([MM_VISION] * n)})
    # the second request also has audio rows, placed by the audio encoder before
    first = _audio_item([0.6])
    mixed = {**items[1], "mm_kinds": torch.cat([first["mm_kinds"], items[1]["mm_kinds"]])}
    placed = audio.run_batch("prefill_media", "audio_encoder", [{**first, "mm_kinds": mixed["mm_kinds"]}], [{}])[0]
    items[1] = {**mixed, **placed}
    batched = vision.run_batch("prefill_media", "vision_encoder", items, [{}] * 2)
    alone = [vision.run_batch("prefill_media", "vision_encoder", [x], [{}])[0] for x in items]
    for got, want in zip(batched, alone):
        for key in ("mm_embeds", "deepstack_embeds"):
            torch.testing.assert_close(got[key], want[key], atol=1e-5, rtol=1e-5)
    audio_rows_ = mixed["mm_kinds"] == MM_AUDIO
    assert torch.equal(batched[1]["mm_embeds"][audio_rows_], placed["mm_embeds"][audio_rows_])  # kept
    assert (batched[1]["deepstack_embeds"][audio_rows_] == 0).all()
    assert batched[1]["deepstack_embeds"][~audio_rows_].abs().sum(-1).gt(0).all()


def test_row_count_mismatch_is_an_error(vision):
    inputs = preprocess_images([np.zeros((64, 64, 3), np.uint8)], PIXELS)
    item = {"pixel_values": inputs.pixel_values, "vision_grid_thw": inputs.grid_thw, "mm_kinds": torch.ones(3)}
    with pytest.raises(ValueError, match="3 placeholder rows for the encoder's 4 rows"):
        vision.run_batch("prefill_media", "vision_encoder", [item], [{}])


@pytest.mark.parametrize("file,rank", [("qwen3_omni.yaml", 0), ("qwen3_omni_2gpu.yaml", 0), ("qwen3_omni_pd.yaml", 1)])
def test_configs_place_the_encoders_with_the_media_prefill(file, rank):
    config = load_config(file)
    plan = plan_placement(omni_graph(OmniServeConfig()), config.node_groups, file)
    for component in ("audio_encoder", "vision_encoder", "thinker"):
        assert plan.replicas(component, "prefill_media") == ((rank,),)
    assert plan.replicas("thinker", "decode") == ((rank,),)  # the media prefill's KV is where decode runs
    assert plan.replicas("thinker", "prefill") == ((0,),)


def test_lane_picks_the_media_prefill_only_for_media():
    thinker = {lane.name: lane for lane in omni_graph(OmniServeConfig()).lanes}["thinker"]
    assert thinker.first_walk({}) == "prefill"
    assert thinker.first_walk({"media": ["image"]}) == "prefill_media"
    assert thinker.next_walk("prefill_media", {}) == "decode"
