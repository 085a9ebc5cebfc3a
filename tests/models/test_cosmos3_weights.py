"""Full-size structure on the meta device (no memory): every tensor of diffusers' Cosmos3OmniTransformer at
the Nano and Super shapes lands on one of our generator's parameters with its shape, each parameter is
filled exactly once, and only the reasoner's head and final norm are left to the reasoner."""

from __future__ import annotations

import pytest
import torch

from mstar.models.cosmos3.config import NANO, SUPER, Cosmos3TransformerConfig
from mstar.models.cosmos3.transformer import Cosmos3Generator
from mstar.models.cosmos3.weights import READ_BY_REASONER, checkpoint_shapes, generator_mapper

pytest.importorskip("diffusers")


def _reference_shapes(config: Cosmos3TransformerConfig) -> dict[str, tuple[int, ...]]:
    from diffusers import Cosmos3OmniTransformer

    kwargs = {k: v for k, v in config.to_hf().items() if k not in ("_class_name", "dtype")}
    return checkpoint_shapes(lambda: Cosmos3OmniTransformer(**kwargs))


@pytest.mark.parametrize(("config", "billions"), [(NANO, 15.17), (SUPER, 64.02)], ids=["nano", "super"])
def test_every_checkpoint_tensor_maps_onto_a_parameter(config, billions):
    shapes = _reference_shapes(config)
    with torch.device("meta"):
        ours = dict(Cosmos3Generator(config).named_parameters())
    filled = dict.fromkeys(ours, 0)
    mapper = generator_mapper(config)
    skipped = []
    for name, shape in shapes.items():
        target = mapper(name)
        if target is None:
            skipped.append(name)
            continue
        param, offset = target
        assert param in ours, f"{name} -> {param}: no such parameter"
        rows = ours[param].shape[0] if ours[param].ndim else 1
        assert offset + shape[0] <= rows and tuple(ours[param].shape[1:]) == shape[1:], (name, param, shape)
        filled[param] += torch.Size(shape).numel()
    assert sorted(skipped) == sorted(READ_BY_REASONER)
    assert {n: c for n, c in filled.items() if c != ours[n].numel()} == {}
    total = sum(torch.Size(s).numel() for s in shapes.values()) / 1e9
    assert total == pytest.approx(billions, rel=0.001)  # two 8B / 32B towers (Nano / Super), no ViT


def test_config_round_trips_and_rejects_what_we_do_not_run():
    assert Cosmos3TransformerConfig.from_hf(NANO.to_hf()) == NANO
    with pytest.raises(ValueError, match="hidden_act='relu2' is not supported"):
        Cosmos3TransformerConfig.from_hf({**NANO.to_hf(), "hidden_act": "relu2"})
    with pytest.raises(ValueError, match="rope_axes_dim"):
        Cosmos3TransformerConfig.from_hf({**NANO.to_hf(), "rope_axes_dim": [24, 20, 24]})


def test_dummy_weights_build_the_full_size_generator_on_the_meta_device():
    """`--load-format dummy` at full size: Nano's shapes, the Wan2.2-TI2V-5B VAE, every parameter built."""
    from mstar.models.common.wan_vae.vae_config import WAN22_TI2V_5B_VAE
    from mstar.models.cosmos3.model import Cosmos3DroidModel, Cosmos3Model

    for cls in (Cosmos3Model, Cosmos3DroidModel):
        model = cls(cls.make_config(), load_format="dummy")
        assert model.components.transformer == NANO and model.vae_config == WAN22_TI2V_5B_VAE
        dit = model.build_component("dit", torch.device("meta")).module
        count = sum(p.numel() for p in dit.parameters())
        head_and_norm = NANO.vocab_size * NANO.hidden_size + NANO.hidden_size  # the reasoner's, not built here
        assert count == sum(torch.Size(s).numel() for s in _reference_shapes(NANO).values()) - head_and_norm


def test_sound_decoder_takes_the_full_size_avae_checkpoint():
    """Every decoder tensor of diffusers' Cosmos3AVAEAudioTokenizer (shipped config), weight norm folded, lands
    on our SoundDecoder with its shape; the encoder's are not read."""
    from diffusers import Cosmos3AVAEAudioTokenizer

    from mstar.models.common.loading import load_named_tensors
    from mstar.models.cosmos3.sound import SoundConfig, SoundDecoder, _snake_and_folded

    with torch.device("meta"):
        reference = Cosmos3AVAEAudioTokenizer()
        ours = SoundDecoder(SoundConfig.from_hf(dict(reference.config)))
    assert any(name.startswith("encoder.") for name in reference.state_dict())
    load_named_tensors(ours, _snake_and_folded(reference.state_dict().items()).items(), lambda name: (name, 0))
    assert SoundConfig().hop == reference._hop_size == 1920 and ours.config.latent_dim == NANO.sound_dim
