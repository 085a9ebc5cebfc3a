"""Wan2.2 components at tiny size against transformers/diffusers with the same random weights (float32).

Reference modules get random weights, are saved in the Diffusers pipeline layout and loaded through our
loaders, so every test also proves the checkpoint name mapping.
"""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch

from mstar.models.common import unipc
from mstar.models.common.guidance import combine_guidance, initial_noise
from mstar.models.wan22 import denoise
from mstar.models.wan22.text_encoder import tokenize_prompts
from mstar.models.wan22.tiny import SCHEDULER, TINY_TEXT_ENCODER, TINY_TEXT_LENGTH, TINY_TRANSFORMER
from mstar.models.wan22.weights import load_scheduler_config, load_text_encoder, load_transformer

TOL = 1e-4


def _randomize(module: torch.nn.Module, seed: int) -> None:
    """Non-trivial values everywhere (norm scales around 1), so a mis-mapped tensor cannot hide."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            param.copy_(1 + 0.2 * noise if "norm" in name and param.ndim == 1 else 0.3 * noise)


@pytest.fixture(scope="module")
def pipeline_dir(tmp_path_factory) -> Path:
    """A tiny Diffusers-layout Wan2.2 folder written by the reference classes."""
    import json

    from diffusers import WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    from mstar.models.wan22.tiny import write_tiny_tokenizer

    root = tmp_path_factory.mktemp("wan22_tiny")
    torch.manual_seed(0)
    text_encoder = UMT5EncoderModel(UMT5Config(**TINY_TEXT_ENCODER))
    _randomize(text_encoder, 1)
    text_encoder.save_pretrained(root / "text_encoder")
    cfg = {k: v for k, v in TINY_TRANSFORMER.items() if not k.startswith("_")}
    transformer = WanTransformer3DModel(**cfg)
    _randomize(transformer, 2)
    transformer.save_pretrained(root / "transformer")
    (root / "scheduler").mkdir()
    (root / "scheduler" / "scheduler_config.json").write_text(json.dumps(SCHEDULER))
    write_tiny_tokenizer(root / "tokenizer")
    return root


def _reference_transformer(root: Path):
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel.from_pretrained(root / "transformer").eval()


def test_text_encoder_matches_umt5_and_zeroes_padding(pipeline_dir: Path) -> None:
    from transformers import UMT5EncoderModel

    reference = UMT5EncoderModel.from_pretrained(pipeline_dir / "text_encoder").eval()
    ours = load_text_encoder(pipeline_dir, dtype=torch.float32, progress=False)
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 470, (3, TINY_TEXT_LENGTH), generator=gen)
    lengths = [TINY_TEXT_LENGTH, 5, 1]
    mask = (torch.arange(TINY_TEXT_LENGTH)[None] < torch.tensor(lengths)[:, None]).long()
    with torch.no_grad():
        expected = reference(ids, mask).last_hidden_state
        got = ours(ids, mask)
    for row, n in enumerate(lengths):
        torch.testing.assert_close(got[row, :n], expected[row, :n], atol=TOL, rtol=0)
        assert torch.count_nonzero(got[row, n:]) == 0
    assert expected.abs().mean() > 0.1  # the comparison is not between near-zero tensors


def _latents(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def test_transformer_text_to_video_matches_diffusers(pipeline_dir: Path) -> None:
    reference = _reference_transformer(pipeline_dir)
    ours = load_transformer(pipeline_dir, dtype=torch.float32, progress=False)
    latents = _latents((2, 16, 3, 4, 6), 4)
    text = _latents((2, TINY_TEXT_LENGTH, 32), 5)
    timestep = torch.tensor([999, 412])  # rows at different steps share the batch
    with torch.no_grad():
        expected = reference(latents, timestep, text, return_dict=False)[0]
        got = ours(latents, timestep, text)
        alone = ours(latents[1:], timestep[1:], text[1:])
    assert got.shape == latents.shape
    torch.testing.assert_close(got, expected, atol=TOL, rtol=0)
    torch.testing.assert_close(alone, got[1:], atol=TOL, rtol=0)


def test_transformer_first_frame_condition_matches_diffusers(pipeline_dir: Path) -> None:
    reference = _reference_transformer(pipeline_dir)
    ours = load_transformer(pipeline_dir, dtype=torch.float32, progress=False)
    latents = denoise.blend_first_frame(_latents((2, 16, 3, 4, 4), 6), _latents((2, 16, 1, 4, 4), 7))
    text = _latents((2, TINY_TEXT_LENGTH, 32), 8)
    frame_ts = torch.stack([denoise.frame_timesteps(t, 3, first_frame_conditioned=True) for t in (950, 300)])
    token_ts = denoise.token_timesteps(frame_ts, tokens_per_frame=4)  # (4/2) * (4/2) tokens per frame
    assert token_ts[0, :4].eq(0).all() and token_ts[0, 4:].eq(950).all()
    with torch.no_grad():
        expected = reference(latents, token_ts, text, return_dict=False)[0]
        per_token = ours(latents, token_ts, text)
        per_frame = ours(latents, frame_ts, text)
        unconditioned = ours(latents, torch.tensor([950.0, 300.0]), text)
    torch.testing.assert_close(per_token, expected, atol=TOL, rtol=0)
    torch.testing.assert_close(per_frame, expected, atol=TOL, rtol=0)
    assert (unconditioned - expected).abs().max() > 1e-2  # the frame-0 timestep really matters


def test_scheduler_matches_diffusers_unipc_for_20_steps(pipeline_dir: Path) -> None:
    from diffusers import UniPCMultistepScheduler

    config = load_scheduler_config(pipeline_dir)
    reference = UniPCMultistepScheduler.from_pretrained(pipeline_dir / "scheduler")
    reference.set_timesteps(20)
    state = unipc.new_state(config, 20)
    assert torch.equal(state.schedule.timesteps, reference.timesteps)
    gen = torch.Generator().manual_seed(9)
    expected = got = torch.randn(1, 16, 3, 4, 4, generator=gen)
    for t in reference.timesteps:
        assert int(state.timestep) == int(t)
        velocity = torch.randn(got.shape, generator=gen)
        expected = reference.step(velocity, t, expected, return_dict=False)[0]
        got = unipc.step(state, velocity, got)
        torch.testing.assert_close(got, expected, atol=TOL, rtol=0)
    assert state.done
    with pytest.raises(ValueError, match="already took all 20 steps"):
        unipc.step(state, velocity, got)


def test_scheduler_states_are_independent(pipeline_dir: Path) -> None:
    """Two requests with different step counts, stepped interleaved, equal each run alone."""
    config = load_scheduler_config(pipeline_dir)
    gen = torch.Generator().manual_seed(10)
    start = [torch.randn(1, 4, 2, 2, 2, generator=gen) for _ in range(2)]
    outputs = [[torch.randn(1, 4, 2, 2, 2, generator=gen) for _ in range(n)] for n in (6, 4)]

    def run_alone(i: int) -> torch.Tensor:
        state, x = unipc.new_state(config, len(outputs[i])), start[i]
        for v in outputs[i]:
            x = unipc.step(state, v, x)
        return x

    states = [unipc.new_state(config, len(o)) for o in outputs]
    xs = list(start)
    for k in range(6):
        for i in (1, 0) if k % 2 else (0, 1):
            if k < len(outputs[i]):
                xs[i] = unipc.step(states[i], outputs[i][k], xs[i])
    for i in range(2):
        torch.testing.assert_close(xs[i], run_alone(i), atol=0, rtol=0)


def test_combine_guidance() -> None:
    cond, uncond = torch.tensor([3.0, 1.0]), torch.tensor([1.0, 1.0])
    assert torch.equal(combine_guidance(cond, uncond, 5.0), torch.tensor([11.0, 1.0]))


def _tiny_vae():
    from diffusers import AutoencoderKLWan

    # Laid out like the Wan2.2 VAE (patch 2, residual, 16x spatial, 4x temporal), tiny widths.
    torch.manual_seed(12)
    return AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, is_residual=True,
                            patch_size=2, in_channels=12, out_channels=12, scale_factor_spatial=16,
                            scale_factor_temporal=4).eval()


def _reference_pipeline(root: Path, monkeypatch, image_to_video: bool):
    from diffusers import UniPCMultistepScheduler, WanImageToVideoPipeline, WanPipeline
    from diffusers.pipelines.wan import pipeline_wan, pipeline_wan_i2v
    from transformers import AutoTokenizer, UMT5EncoderModel

    for module in (pipeline_wan, pipeline_wan_i2v):  # ftfy is optional for us; make the reference skip it too
        monkeypatch.setattr(module, "ftfy", types.SimpleNamespace(fix_text=lambda s: s), raising=False)
    parts = dict(
        tokenizer=AutoTokenizer.from_pretrained(root / "tokenizer"),
        text_encoder=UMT5EncoderModel.from_pretrained(root / "text_encoder").eval(),
        vae=_tiny_vae(), scheduler=UniPCMultistepScheduler.from_pretrained(root / "scheduler"),
        transformer=_reference_transformer(root), expand_timesteps=True,
    )
    if image_to_video:
        return WanImageToVideoPipeline(image_encoder=None, image_processor=None, **parts)
    return WanPipeline(**parts)


def _our_denoise(root: Path, prompts: list[str], steps: int, guidance: float, seed: int,
                 condition: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Our components in the order the denoise walk will run them; latents after every step."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(root / "tokenizer" / "tokenizer.json"))
    ids, mask = tokenize_prompts(tokenizer, prompts, pad_id=tokenizer.token_to_id("<pad>"),
                                 max_length=TINY_TEXT_LENGTH)
    encoder = load_text_encoder(root, dtype=torch.float32, progress=False)
    transformer = load_transformer(root, dtype=torch.float32, progress=False)
    state = unipc.new_state(load_scheduler_config(root), steps)
    latents = initial_noise((1, 16, 3, 4, 4), [torch.Generator().manual_seed(seed)])
    history = []
    with torch.no_grad():
        text = encoder(ids, mask)  # rows: [cond, uncond]
        for _ in range(steps):
            x = denoise.blend_first_frame(latents, condition)
            ts = denoise.frame_timesteps(state.timestep, 3, condition is not None)[None].expand(2, -1)
            cond, uncond = transformer(torch.cat([x, x]), ts, text).chunk(2)
            latents = unipc.step(state, combine_guidance(cond, uncond, guidance), latents)
            history.append(latents)
    return history


PROMPT, NEGATIVE = "A cat  and a dog bake a cake &amp; the camera pans left", "blurred details, worst quality"


def _capture(store: list[torch.Tensor]):
    def callback(_pipe, _i, _t, kwargs):
        store.append(kwargs["latents"].clone())
        return {}

    return callback


def test_denoise_loop_matches_wan_pipeline(pipeline_dir: Path, monkeypatch) -> None:
    pipe = _reference_pipeline(pipeline_dir, monkeypatch, image_to_video=False)
    captured: list[torch.Tensor] = []
    pipe(prompt=PROMPT, negative_prompt=NEGATIVE, height=64, width=64, num_frames=9, num_inference_steps=3,
         guidance_scale=5.0, generator=torch.Generator().manual_seed(11), output_type="latent",
         max_sequence_length=TINY_TEXT_LENGTH, callback_on_step_end=_capture(captured))
    ours = _our_denoise(pipeline_dir, [PROMPT, NEGATIVE], steps=3, guidance=5.0, seed=11)
    assert len(captured) == len(ours) == 3
    for step_index, (got, expected) in enumerate(zip(ours, captured, strict=True)):
        torch.testing.assert_close(got, expected, atol=TOL, rtol=0, msg=f"step {step_index}")


def test_image_to_video_loop_matches_wan_i2v_pipeline(pipeline_dir: Path, monkeypatch) -> None:
    """TI2V: the encoded image rides as latent frame 0 at timestep 0; latents match after every step."""
    from PIL import Image

    pipe = _reference_pipeline(pipeline_dir, monkeypatch, image_to_video=True)
    pixels = (torch.rand(64, 64, 3, generator=torch.Generator().manual_seed(13)) * 255).to(torch.uint8)
    image = Image.fromarray(pixels.numpy())
    captured: list[torch.Tensor] = []
    pipe(image=image, prompt=PROMPT, negative_prompt=NEGATIVE, height=64, width=64, num_frames=9,
         num_inference_steps=3, guidance_scale=5.0, generator=torch.Generator().manual_seed(14),
         output_type="latent", max_sequence_length=TINY_TEXT_LENGTH, callback_on_step_end=_capture(captured))
    # The condition as the VAE helper will produce it: mode of the posterior, normalised per channel.
    with torch.no_grad():
        video = pipe.video_processor.preprocess(image, height=64, width=64).unsqueeze(2)
        mean = torch.tensor(pipe.vae.config.latents_mean).view(1, -1, 1, 1, 1)
        std = torch.tensor(pipe.vae.config.latents_std).view(1, -1, 1, 1, 1)
        condition = (pipe.vae.encode(video).latent_dist.mode() - mean) / std
    ours = _our_denoise(pipeline_dir, [PROMPT, NEGATIVE], steps=3, guidance=5.0, seed=14, condition=condition)
    for step_index, (got, expected) in enumerate(zip(ours, captured, strict=True)):
        torch.testing.assert_close(got, expected, atol=TOL, rtol=0, msg=f"step {step_index}")
    t2v = _our_denoise(pipeline_dir, [PROMPT, NEGATIVE], steps=3, guidance=5.0, seed=14)
    assert (t2v[-1] - captured[-1]).abs().max() > 1e-2  # the condition changes the result


def test_config_errors_name_the_offending_value(tmp_path: Path) -> None:
    from mstar.models.common.loading import CheckpointNotFoundError
    from mstar.models.common.unipc import UniPCConfig
    from mstar.models.wan22.config import WanTransformerConfig

    with pytest.raises(ValueError, match="prediction_type='epsilon'"):
        UniPCConfig.from_hf({**SCHEDULER, "prediction_type": "epsilon"})
    with pytest.raises(ValueError, match="image_dim=1280"):
        WanTransformerConfig.from_hf({**TINY_TRANSFORMER, "image_dim": 1280})
    with pytest.raises(CheckpointNotFoundError, match="no transformer/ folder"):
        load_transformer(tmp_path)
    with pytest.raises(ValueError, match="fits none of"):
        from mstar.models.wan22.tiny import tiny_config
        from mstar.models.wan22.transformer import WanTransformer

        WanTransformer(tiny_config().transformer)(torch.zeros(1, 16, 3, 4, 4), torch.zeros(1, 5),
                                                  torch.zeros(1, 4, 32))
