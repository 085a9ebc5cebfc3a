"""Every text decoder's default request ends: Qwen3-Omni's tiny flavour, whose random weights never sample
eos, bounds a default answer by a small context; the real model keeps the checkpoint's."""

from __future__ import annotations

from mstar.models.qwen3_omni.model import Qwen3Omni


def test_qwen3_omni_tiny_context_bounds_a_default_answer():
    assert Qwen3Omni.make_config(tiny=True).context == 2048
    assert Qwen3Omni.make_config().context == 32768
    assert Qwen3Omni.make_config(tiny=True, max_model_len=512).context == 512


def test_every_model_with_a_chat_decoder_names_the_component_bounding_it():
    """The engine's limit reaches the 400s and /v1/models through `context_component`, which must be one of
    the model's autoregressive components."""
    from mstar.models.cosmos3.model import Cosmos3Model
    from mstar.models.orpheus.model import OrpheusModel

    for cls in (Qwen3Omni, Cosmos3Model, OrpheusModel):
        model = cls(cls.make_config(tiny=True), load_format="dummy")
        spec = model.graph().components[cls.context_component]
        assert spec.engine == "autoregressive", cls.__name__
