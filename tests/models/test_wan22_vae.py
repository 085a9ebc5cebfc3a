"""Wan2.2 VAE parity with Diffusers' AutoencoderKLWan (tiny random config, float32, CPU)."""

from __future__ import annotations

import json

import pytest
import torch

diffusers = pytest.importorskip("diffusers")

from mstar.models.common.loading import CheckpointNotFoundError  # noqa: E402
from mstar.models.common.wan_vae.vae import WanVAE, frames_to_uint8  # noqa: E402
from mstar.models.common.wan_vae.vae_config import (  # noqa: E402
    WAN22_TI2V_5B_VAE,
    WanVAEConfig,
    tiny_vae_config,
)
from mstar.models.common.wan_vae.vae_tiling import TileSpec  # noqa: E402
from mstar.models.common.wan_vae.vae_weights import build_vae, load_vae  # noqa: E402

TOL = 1e-4
CONFIG = tiny_vae_config()


pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


def _reference_kwargs(config: WanVAEConfig) -> dict:
    return {k: v for k, v in config.to_hf().items() if not k.startswith("_")}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A Diffusers pipeline folder whose vae/ holds a random tiny AutoencoderKLWan; returns (folder, ref)."""
    torch.manual_seed(0)
    ref = diffusers.AutoencoderKLWan(**_reference_kwargs(CONFIG)).eval()
    with torch.no_grad():  # norm gains away from one, so a gain that fails to load shows
        for name, param in ref.named_parameters():
            if name.endswith(".gamma"):
                param.copy_(1 + 0.2 * torch.randn_like(param))
    root = tmp_path_factory.mktemp("wan22")
    ref.save_pretrained(root / "vae")
    return root, ref


@pytest.fixture(scope="module")
def vae(checkpoint) -> WanVAE:
    return load_vae(checkpoint[0])


def _stats() -> tuple[torch.Tensor, torch.Tensor]:
    shape = (1, CONFIG.z_dim, 1, 1, 1)
    return torch.tensor(CONFIG.latents_mean).view(shape), torch.tensor(CONFIG.latents_std).view(shape)


def _video(frames: int, height: int = 32, width: int = 48, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(2, 3, frames, height, width, generator=g) * 2 - 1


@pytest.mark.parametrize("frames", [1, 5])
def test_encode_matches_diffusers(checkpoint, vae, frames):
    ref = checkpoint[1]
    video = _video(frames)
    mean, std = _stats()
    with torch.no_grad():
        expected = (ref.encode(video).latent_dist.mode() - mean) / std
    latents = vae.encode(video)
    assert latents.shape == (2, CONFIG.z_dim, 1 + (frames - 1) // 4, 2, 3)
    assert latents.abs().max() > 0.1
    torch.testing.assert_close(latents, expected, atol=TOL, rtol=0)


@pytest.mark.parametrize("latent_frames", [1, 2])
def test_decode_matches_diffusers(checkpoint, vae, latent_frames):
    ref = checkpoint[1]
    latents = torch.randn(2, CONFIG.z_dim, latent_frames, 2, 3, generator=torch.Generator().manual_seed(2))
    mean, std = _stats()
    with torch.no_grad():
        expected = ref.decode(latents * std + mean).sample
    video = vae.decode(latents)
    assert video.shape == (2, 3, 1 + 4 * (latent_frames - 1), 32, 48)
    assert video.std() > 0.01
    torch.testing.assert_close(video, expected, atol=TOL, rtol=0)


def test_decoding_frame_by_frame_equals_decoding_at_once(vae):
    latents = torch.randn(1, CONFIG.z_dim, 4, 2, 3, generator=torch.Generator().manual_seed(3))
    at_once = vae.decode(latents, chunk_frames=None)
    assert at_once.shape[2] == 13
    for chunk in (1, 3):
        torch.testing.assert_close(vae.decode(latents, chunk_frames=chunk), at_once, atol=1e-5, rtol=0)
    pieces = list(vae.decode_chunks(latents))
    assert [p.shape[2] for p in pieces] == [1, 4, 4, 4]
    torch.testing.assert_close(torch.cat(pieces, dim=2), at_once, atol=1e-5, rtol=0)


def test_encoding_in_chunks_equals_encoding_at_once(vae):
    video = _video(9, seed=4)
    at_once = vae.encode(video, chunk_frames=None)
    torch.testing.assert_close(vae.encode(video, chunk_frames=4), at_once, atol=1e-5, rtol=0)
    torch.testing.assert_close(vae.encode(video, chunk_frames=8), at_once, atol=1e-5, rtol=0)


def test_tiled_decode_matches_diffusers(checkpoint, vae):
    ref = checkpoint[1]
    latents = torch.randn(1, CONFIG.z_dim, 2, 4, 5, generator=torch.Generator().manual_seed(5))
    mean, std = _stats()
    spec = TileSpec(tile_height=32, tile_width=32, stride_height=16, stride_width=16)
    ref.enable_tiling(32, 32, 16, 16)
    try:
        with torch.no_grad():
            expected = ref.decode(latents * std + mean).sample
    finally:
        ref.disable_tiling()
    tiled = vae.decode(latents, tiling=spec)
    assert tiled.shape == (1, 3, 5, 64, 80)
    torch.testing.assert_close(tiled, expected, atol=TOL, rtol=0)
    # Tiles see less context than the whole frame, so tiling changes pixels (a real, not a no-op, path).
    assert (tiled - vae.decode(latents)).abs().max() > 1e-3


@pytest.mark.parametrize("batch", [1, 2])
def test_channels_last_decode_equals_the_ncdhw_decode(checkpoint, batch):
    """The channels-last decoder with folded biases (`vae_channels_last.py`, the default on CUDA) against the
    NCDHW one: every chunk size, and tiled; float32 rounding apart (sums in another order)."""
    vae = load_vae(checkpoint[0])  # its own copy: the channels-last decode converts the weights in place
    latents = torch.randn(batch, CONFIG.z_dim, 4, 2, 3, generator=torch.Generator().manual_seed(6))
    for chunk in (1, 2, 3, None):
        want = vae.decode(latents, chunk_frames=chunk, channels_last=False)
        got = vae.decode(latents, chunk_frames=chunk, channels_last=True)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        assert got.is_contiguous()  # the caller's NCDHW video
    pieces = list(vae.decode_chunks(latents, channels_last=True))
    assert [p.shape[2] for p in pieces] == [1, 4, 4, 4]
    tiles = torch.randn(batch, CONFIG.z_dim, 2, 4, 5, generator=torch.Generator().manual_seed(7))
    spec = TileSpec(tile_height=32, tile_width=32, stride_height=16, stride_width=16)
    want = vae.decode(tiles, tiling=spec, channels_last=False)
    torch.testing.assert_close(vae.decode(tiles, tiling=spec, channels_last=True), want, atol=1e-5, rtol=1e-5)


def test_channels_last_decode_feeds_every_conv_channels_last(checkpoint, monkeypatch):
    """Under the channels-last decode every convolution reads a channels-last input with channels-last weights
    (so cuDNN converts nothing), the weights were converted once, in place, under their Diffusers names;
    on CPU the default stays NCDHW."""
    import torch.nn.functional as F

    vae = load_vae(checkpoint[0])
    seen: list[tuple[int, bool, bool]] = []

    def recording(original):
        def conv(x, weight, *args, **kwargs):
            fmt = torch.channels_last_3d if x.dim() == 5 else torch.channels_last
            if weight is not vae.post_quant_conv.weight:  # before the decoder, on the small latents
                seen.append((x.dim(), x.is_contiguous(memory_format=fmt), weight.is_contiguous(memory_format=fmt)))
            return original(x, weight, *args, **kwargs)

        return conv

    monkeypatch.setattr(F, "conv3d", recording(F.conv3d))
    monkeypatch.setattr(F, "conv2d", recording(F.conv2d))
    latents = torch.randn(1, CONFIG.z_dim, 3, 2, 3, generator=torch.Generator().manual_seed(8))
    assert vae._post_quant(latents, 1, None)[1] is vae.decoder  # CPU default: the NCDHW decoder
    vae.channels_last = True
    vae.decode(latents)
    params = {name: (p, p.data_ptr()) for name, p in vae.named_parameters()}
    vae.decode(latents)
    assert {d for d, _, _ in seen} == {4, 5} and all(x_cl and w_cl for _, x_cl, w_cl in seen), [(i, s) for i, s in enumerate(seen) if not all(s)]
    assert all(p.data_ptr() == ptr for p, ptr in params.values())  # converted once, not per call
    assert vae.decoder.conv_in.weight.is_contiguous(memory_format=torch.channels_last_3d)
    assert set(params) == set(checkpoint[1].state_dict())
    vae.load_state_dict(checkpoint[1].state_dict())  # loads into the channels-last weights as they are


def test_full_size_config_mirrors_diffusers():
    with torch.device("meta"):
        ref = diffusers.AutoencoderKLWan(**_reference_kwargs(WAN22_TI2V_5B_VAE))
    ours = build_vae(WAN22_TI2V_5B_VAE, device="meta")
    assert {k: v.shape for k, v in ours.state_dict().items()} == {k: v.shape for k, v in ref.state_dict().items()}
    assert ours.latent_shape(33, 480, 832) == (48, 9, 30, 52)


def test_config_round_trip_and_errors(tmp_path):
    assert WanVAEConfig.from_hf(json.loads(json.dumps(CONFIG.to_hf()))) == CONFIG
    with pytest.raises(ValueError, match="Wan2.1"):
        WanVAEConfig.from_hf({**CONFIG.to_hf(), "is_residual": False})
    with pytest.raises(ValueError, match="latents_mean"):
        WanVAEConfig(z_dim=16)
    with pytest.raises(CheckpointNotFoundError, match="vae"):
        load_vae(tmp_path)


def test_bad_inputs_raise(vae):
    with pytest.raises(ValueError, match="1 \\+ 4k"):
        vae.encode(_video(4))
    with pytest.raises(ValueError, match="multiples of 16"):
        vae.encode(_video(1, height=40))
    with pytest.raises(ValueError, match="chunk_frames"):
        vae.encode(_video(5), chunk_frames=3)
    with pytest.raises(ValueError, match="expected"):
        vae.encode(torch.zeros(1, 3, 32, 32))
    with pytest.raises(ValueError, match="expected"):
        vae.decode(torch.zeros(1, CONFIG.z_dim + 1, 1, 2, 2))


def test_dummy_weights_are_seeded_and_decode():
    a = load_vae(load_format="dummy", config=CONFIG, seed=7)
    b = load_vae(load_format="dummy", config=CONFIG, seed=7)
    latents = torch.randn(1, CONFIG.z_dim, 2, 2, 2)
    video = a.decode(latents)
    assert torch.isfinite(video).all() and video.abs().max() > 0
    torch.testing.assert_close(b.decode(latents), video, atol=0, rtol=0)


def test_frames_to_uint8():
    video = torch.tensor([-1.0, -0.5, 0.0, 1.0, 2.0]).view(1, 1, 5, 1, 1).expand(1, 3, 5, 1, 1)
    frames = frames_to_uint8(video)
    assert frames.shape == (1, 5, 1, 1, 3) and frames.dtype == torch.uint8
    assert frames[0, :, 0, 0, 0].tolist() == [0, 64, 128, 255, 255]
    # non_blocking only changes how a CUDA video's frames reach the host; a CPU video gives the same frames
    assert torch.equal(frames_to_uint8(video, non_blocking=True), frames)


def test_bf16_decode_is_close_to_float32(checkpoint, vae):
    """The `vae_dtype: bfloat16` option's decode against float32 on the same weights. Observed at this tiny
    size (random weights, gains 1 +- 0.2): mean |diff| ~0.002 (1 latent frame) to ~0.004 (3), max ~0.015 to
    ~0.043 on the [-1, 1] scale, i.e. under 1 and at most ~5 of 255 uint8 levels."""
    vae16 = load_vae(checkpoint[0], dtype=torch.bfloat16)
    assert {p.dtype for p in vae16.parameters()} == {torch.bfloat16}
    g = torch.Generator().manual_seed(4)
    latents = torch.randn(2, CONFIG.z_dim, 3, 2, 3, generator=g)
    want, got = vae.decode(latents), vae16.decode(latents)
    assert got.dtype == torch.float32 and got.shape == want.shape
    diff = (got - want).abs()
    assert 0 < diff.mean() < 0.01 and diff.max() < 0.1, (diff.mean(), diff.max())
    levels = (frames_to_uint8(got).int() - frames_to_uint8(want).int()).abs()
    assert levels.float().mean() < 1.5 and levels.max() <= 12, (levels.float().mean(), levels.max())


def test_serve_option_vae_dtype_builds_the_vae_in_it_and_rejects_others():
    from mstar.models.wan22.model import Wan22Model

    assert Wan22Model.make_config(tiny=True).vae_dtype == "float32"  # the parity default
    model = Wan22Model(Wan22Model.make_config(tiny=True, vae_dtype="bfloat16"))
    built = model.build_component("vae", torch.device("cpu")).module.vae
    assert {p.dtype for p in built.parameters()} == {torch.bfloat16}
    with pytest.raises(ValueError, match=r"model_kwargs.vae_dtype='fp8': use one of \['bfloat16', 'float16', 'float32'\]"):
        Wan22Model.make_config(tiny=True, vae_dtype="fp8")


def test_serve_option_vae_conv_dtype_defaults_to_float16_for_a_float32_vae_and_falls_back_on_overflow(caplog):
    """`vae_conv_dtype`: float16 convolutions by default under a float32 VAE (the channels-last decode: CUDA,
    or asked for), the VAE's dtype otherwise; a decode that overflows float16 is redone in float32, which
    then stays, and the request gets the float32 frames."""
    from mstar.models.wan22.model import Wan22Model

    assert Wan22Model.make_config(tiny=True).conv_dtype() == "float16"
    assert Wan22Model.make_config(tiny=True, vae_dtype="bfloat16").conv_dtype() == "bfloat16"
    assert Wan22Model.make_config(tiny=True, vae_conv_dtype="float32").conv_dtype() == "float32"
    with pytest.raises(ValueError, match=r"model_kwargs.vae_conv_dtype='half': use one of"):
        Wan22Model.make_config(tiny=True, vae_conv_dtype="half")
    component = Wan22Model(Wan22Model.make_config(tiny=True)).build_component("vae", torch.device("cpu")).module
    vae = component.vae
    assert vae.conv_dtype == torch.float16 and not vae.runs_channels_last(torch.device("cpu"))
    vae.channels_last = True  # as on CUDA
    latents = torch.randn(vae.config.z_dim, 2, 4, 4)
    with torch.no_grad():
        vae.decoder.conv_in.weight.mul_(1e7)  # activations past float16's range
    finite = torch.ones((), dtype=torch.bool)
    list(vae.decode_chunks(latents[None], 1, finite=finite))
    assert not finite  # the float16 decode overflowed
    vae.conv_dtype = None
    finite = torch.ones((), dtype=torch.bool)
    list(vae.decode_chunks(latents[None], 1, finite=finite))
    assert finite  # float32 holds it
    want = frames_to_uint8(vae.decode(latents[None], chunk_frames=1))[0]
    vae.conv_dtype = torch.float16
    with caplog.at_level("WARNING"):
        out = component.run_batch("t2v", "decode", [{"latents": latents}], [{}])
    assert vae.conv_dtype is None and "overflowed" in caplog.text
    assert torch.equal(out[0]["video"], want)
    # convolutions already in the weights' dtype (a bfloat16 VAE's, or after the fall-back): non-finite
    # frames are reported, not redone, and no overflow is claimed
    caplog.clear()
    calls = []
    decode_chunks = vae.decode_chunks

    def counting(*args, **kwargs):
        calls.append(1)
        yield from decode_chunks(*args, **kwargs)

    vae.decode_chunks = counting
    vae.conv_dtype = torch.float32
    nan_latents = latents.clone()
    nan_latents[0, 0, 0, 0] = float("nan")
    with caplog.at_level("WARNING"):
        component.run_batch("t2v", "decode", [{"latents": nan_latents}], [{}])
    assert len(calls) == 1 and vae.conv_dtype == torch.float32
    assert "not finite" in caplog.text and "latents finite: False" in caplog.text and "overflowed" not in caplog.text


def test_conv_out_wide_weight_pads_with_zero_filters_and_follows_the_weight():
    """conv_out's filters zero-padded to 32 outputs (what the CUDA channels-last decode convolves with): the
    first 12 outputs are conv_out's, the padded weight is made once per weight version and dtype."""
    import torch.nn.functional as F

    from mstar.models.common.wan_vae.vae_channels_last import NARROW_CONV_CHANNELS, _conv_weight

    conv = WanVAE(CONFIG).decoder.conv_out
    torch.nn.init.normal_(conv.weight)
    assert _conv_weight(conv, torch.float32) is conv.weight  # nothing to derive
    wide = _conv_weight(conv, torch.float32, wide=True)
    assert wide.shape == (NARROW_CONV_CHANNELS, *conv.weight.shape[1:])
    assert torch.equal(wide[: conv.out_channels], conv.weight) and not wide[conv.out_channels :].any()
    assert _conv_weight(conv, torch.float32, wide=True) is wide
    x = torch.randn(1, conv.in_channels, 4, 5, 6)
    narrow = F.conv3d(x, conv.weight, None, 1, (0, 1, 1))
    torch.testing.assert_close(F.conv3d(x, wide, None, 1, (0, 1, 1))[:, : conv.out_channels], narrow)
    with torch.no_grad():
        conv.weight.mul_(2.0)  # new weights (a load): the padded copy follows
    assert torch.equal(_conv_weight(conv, torch.float32, wide=True)[: conv.out_channels], conv.weight)
    half = _conv_weight(conv, torch.float16, wide=True)  # another dtype: a cast copy, padded the same way
    assert half.dtype == torch.float16 and half.is_contiguous(memory_format=torch.channels_last_3d)
    assert torch.equal(half[: conv.out_channels], conv.weight.half()) and not half[conv.out_channels :].any()


def test_channels_last_decode_with_float16_convolutions_is_close_to_float32(checkpoint, vae):
    """`WanVAE.conv_dtype = float16`: only the convolutions run in float16 (inputs rounded once, weights cast
    copies), the residual stream stays float32. Observed at this tiny size: mean |diff| ~1.5e-4 (1 latent
    frame) to ~3.4e-4 (3), max ~1.2e-3 to ~2.4e-3 on the [-1, 1] scale, a tenth to a fifteenth of the bf16
    VAE's (test above); at most one uint8 level."""
    g = torch.Generator().manual_seed(4)
    latents = torch.randn(2, CONFIG.z_dim, 3, 2, 3, generator=g)
    want = vae.decode(latents, channels_last=True)
    vae.conv_dtype = torch.float16
    try:
        got = vae.decode(latents, channels_last=True)
        streamed = torch.cat(list(vae.decode_chunks(latents, 1, channels_last=True)), dim=2)
    finally:
        vae.conv_dtype = None
    assert {p.dtype for p in vae.parameters()} == {torch.float32}  # the module's own weights are untouched
    assert got.dtype == torch.float32 and got.shape == want.shape
    diff = (got - want).abs()
    assert 0 < diff.mean() < 1e-3 and diff.max() < 1e-2, (diff.mean(), diff.max())
    levels = (frames_to_uint8(got).int() - frames_to_uint8(want).int()).abs()
    assert levels.max() <= 2, levels.max()
    torch.testing.assert_close(streamed, got, atol=0, rtol=0)  # decode() streams one latent frame at a time too
