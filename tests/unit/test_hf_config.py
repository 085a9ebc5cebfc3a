"""from_hf_fields and rope_theta: HF config sections read into dataclasses."""

from dataclasses import dataclass

import pytest

from mstar.models.common.hf_config import from_hf_fields, rope_theta


@dataclass(frozen=True)
class _Shape:
    hidden_size: int
    num_layers: int = 2
    eps: float = 1e-6
    bias: bool = False
    rates: tuple[int, ...] = (2, 2)


def test_fields_take_renamed_keys_casts_and_defaults():
    cfg = {"hidden_size": 64, "num_hidden_layers": 3, "eps": 1, "bias": 1, "rates": [4, 5], "unknown": "x"}
    shape = from_hf_fields(_Shape, cfg, {"num_layers": "num_hidden_layers"})
    assert shape == _Shape(64, 3, 1.0, True, (4, 5))
    assert isinstance(shape.eps, float) and isinstance(shape.rates, tuple)
    assert from_hf_fields(_Shape, {"hidden_size": 8, "eps": None}) == _Shape(8)


def test_values_win_and_a_missing_required_key_is_named():
    assert from_hf_fields(_Shape, {"hidden_size": 8, "num_layers": 5}, num_layers=7).num_layers == 7
    with pytest.raises(KeyError, match="hidden_size"):
        from_hf_fields(_Shape, {"num_layers": 5})


@pytest.mark.parametrize(("cfg", "theta"), [
    ({}, 10000.0),
    ({"rope_theta": 500}, 500.0),
    ({"rope_scaling": {"rope_type": "default", "rope_theta": 7.0}, "rope_theta": 3}, 7.0),
    ({"rope_parameters": {"rope_theta": 9}, "rope_scaling": {"rope_theta": 7.0}}, 9.0),
])
def test_rope_theta_finds_the_base(cfg, theta):
    assert rope_theta(cfg, "test") == theta


def test_rope_theta_refuses_scaled_rope():
    with pytest.raises(ValueError, match="decoder rope .* only the default RoPE"):
        rope_theta({"rope_scaling": {"type": "linear", "factor": 2.0}}, "decoder")
