"""Cosmos3's pieces against diffusers: the MoT generator (vision, sound and action towers, conditioned
frames, padded latents), the prompts' token ids and the native flow schedule."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mstar.models.common.loading import load_named_tensors
from mstar.models.cosmos3.config import Cosmos3TransformerConfig
from mstar.models.cosmos3.positions import GenLayout, gen_positions, rope_tables, text_positions
from mstar.models.cosmos3.tiny import SCHEDULER, TINY_TRANSFORMER
from mstar.models.cosmos3.transformer import GenRow
from mstar.models.cosmos3.weights import build_generator, generator_mapper
from tests.models.cosmos3_testing import NEGATIVE, PROMPTS, reference_transformer

pytest.importorskip("diffusers")
pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py

CONFIG = Cosmos3TransformerConfig.from_hf({**TINY_TRANSFORMER, "dtype": "float32"})


@pytest.fixture(scope="module")
def models():
    ref = reference_transformer()
    ours = build_generator(CONFIG, torch.float32)
    load_named_tensors(ours, ref.state_dict().items(), generator_mapper(CONFIG))
    return ref, ours


def _row(ours, ids, latents, noisy, timestep, sound=None, action=None, fps=24.0):
    p = CONFIG.latent_patch_size
    _, t, h, w = latents.shape
    layout = GenLayout((t, -(-h // p), -(-w // p)), fps, 0 if sound is None else sound.shape[1],
                       0 if action is None else action.shape[0])
    cos, sin = rope_tables(CONFIG, gen_positions(CONFIG, layout, ids.shape[0], 4), torch.float32, "cpu")
    action_noisy = None if action is None else torch.ones(action.shape[0], dtype=torch.bool)
    return GenRow(ours.text_kv(ids), cos, sin, latents, noisy, timestep, sound, action, action_noisy, 8), layout


def _reference(ref, ids, latents, noisy, timestep, layout, sound, action):
    """diffusers' forward over one packed sequence [text | vision | sound | action]."""
    L, nv, ns, na = ids.shape[0], layout.num_vision, layout.sound_len, layout.action_len
    per_frame = nv // layout.vision[0]
    noisy_frames = torch.nonzero(noisy).flatten()
    vision_loss = torch.cat([torch.arange(L + f * per_frame, L + (f + 1) * per_frame) for f in noisy_frames.tolist()])
    positions = torch.cat([text_positions(L, True), gen_positions(CONFIG, layout, L, 4)], dim=1)
    full = lambda n: torch.full((n,), timestep)  # noqa: E731
    start_s, start_a = L + nv, L + nv + ns
    with torch.no_grad():
        return ref(
            input_ids=ids, text_indexes=torch.arange(L), position_ids=positions, und_len=L, sequence_length=L + nv + ns + na,
            vision_tokens=[latents[None]], vision_token_shapes=[layout.vision], vision_sequence_indexes=torch.arange(L, L + nv),
            vision_mse_loss_indexes=vision_loss, vision_timesteps=full(len(vision_loss)),
            vision_noisy_frame_indexes=[noisy_frames], sound_tokens=[sound], sound_token_shapes=[(ns, 1, 1)],
            sound_sequence_indexes=torch.arange(start_s, start_a), sound_mse_loss_indexes=torch.arange(start_s, start_a),
            sound_timesteps=full(ns), sound_noisy_frame_indexes=[torch.arange(ns)], action_tokens=[action],
            action_token_shapes=[(na, 1, 1)], action_sequence_indexes=torch.arange(start_a, start_a + na),
            action_mse_loss_indexes=torch.arange(start_a, start_a + na), action_timesteps=full(na),
            action_noisy_frame_indexes=[torch.arange(na)], action_domain_ids=[torch.tensor([8])], return_dict=False)


def test_generator_matches_diffusers_with_sound_actions_and_a_conditioned_frame(models):
    """Odd latent sides (padded to whole patches), frame 0 conditioning, sound and action towers; two rows
    of different lengths packed in one forward each equal their forward alone."""
    ref, ours = models
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 400, (9,), generator=gen)
    latents = torch.randn(16, 3, 5, 3, generator=gen)
    sound, action = torch.randn(8, 6, generator=gen), torch.randn(7, 16, generator=gen)
    noisy = torch.tensor([False, True, True])
    row, layout = _row(ours, ids, latents, noisy, 700, sound, action, fps=12.0)
    vision, sound_v, action_v = _reference(ref, ids, latents, noisy, 700, layout, sound, action)
    other, _ = _row(ours, ids[:4], torch.randn(16, 1, 4, 4, generator=gen), torch.tensor([True]), 999)
    alone = ours([row])[0]
    both = ours([other, row])[1]
    torch.testing.assert_close(alone.vision, vision[0][0], atol=1e-5, rtol=0)
    torch.testing.assert_close(alone.sound, sound_v[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(alone.action, action_v[0], atol=1e-5, rtol=0)
    assert alone.vision[:, 0].abs().max() == 0 and alone.vision.abs().mean() > 0.1
    for a, b in ((both.vision, alone.vision), (both.sound, alone.sound), (both.action, alone.action)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def pipe(tmp_path_factory):
    from tests.models.cosmos3_testing import reference_pipeline, write_pipeline_dir

    return reference_pipeline(write_pipeline_dir(tmp_path_factory.mktemp("cosmos3_pipeline")))


@pytest.mark.parametrize("mode", ["image", "video", "policy"])
def test_prompt_ids_match_the_pipeline(mode, pipe):
    from mstar.models.common.text import Tokenizer
    from mstar.models.cosmos3 import prompts

    ours = Tokenizer.from_pretrained(pipe.text_tokenizer.name_or_path)
    frames = {"image": 1, "video": 17, "policy": 33}[mode]
    shape = prompts.Shape(frames, 480, 832, 15.0)
    want = pipe.tokenize_prompt(PROMPTS[2], NEGATIVE, num_frames=frames, height=480, width=832, fps=15.0,
                                action_mode="policy" if mode == "policy" else None, action_view_point="wrist_view")
    if mode == "policy":
        texts = (prompts.action_caption(PROMPTS[2], shape, "wrist_view"), NEGATIVE)
    else:
        texts = (prompts.with_metadata(PROMPTS[2], shape), prompts.with_metadata(NEGATIVE, shape, negative=True))
    got = tuple(prompts.prompt_ids(ours, text, shape.is_image, True) for text in texts)
    assert got == tuple(want)
    assert got[0] != got[1]


def test_native_flow_schedule_matches_diffusers():
    from diffusers import UniPCMultistepScheduler

    from mstar.models.common import unipc
    from mstar.models.common.unipc import UniPCConfig

    reference = UniPCMultistepScheduler(**{k: v for k, v in SCHEDULER.items() if not k.startswith("_")})
    steps = 6
    reference.set_timesteps(steps, sigmas=np.linspace(1 - 1 / 1000, 0, steps + 1)[:-1])
    config = UniPCConfig.from_hf(SCHEDULER)
    state = unipc.new_state(UniPCConfig(**{**vars(config), "native_flow": True}), steps)
    assert torch.equal(state.schedule.timesteps, reference.timesteps)
    torch.testing.assert_close(state.schedule.sigmas, reference.sigmas.float(), atol=1e-7, rtol=0)
    assert not torch.equal(unipc.new_state(config, steps).schedule.timesteps, reference.timesteps)
