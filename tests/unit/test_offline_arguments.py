"""MStar's constructor arguments are used or refused, never ignored."""

import pytest

from mstar.runtime.offline import MStar


def test_the_model_argument_overrides_the_configs_model_as_serve_does():
    """MStar("toy", config=...) ran the config's model whatever the first argument named (the server's
    `mstar serve MODEL --config FILE` serves MODEL)."""
    groups = [{"node_names": ["encoder", "decoder", "guide", "painter", "vocoder"], "ranks": [0]}]
    with pytest.raises(KeyError, match="unknown model 'nosuch'"):
        MStar("nosuch", config={"model": "toy", "node_groups": groups})
    with MStar(config={"model": "toy", "node_groups": groups}) as m:  # no model: the config's
        assert m.runtime.config.model == "toy"


def test_an_unknown_load_format_is_refused():
    with pytest.raises(ValueError, match=r"load_format 'wrong': use 'auto' or 'dummy'"):
        MStar("toy", load_format="wrong")


@pytest.mark.parametrize("request_, message", [
    ("hello", r"a request is a dict such as \{'text': 'hi'\}, got str"),
    ({"text": 5}, r"request\['text'\] must be a string, got int"),
])
def test_a_malformed_request_is_a_type_error_naming_it(request_, message):
    """They were AttributeErrors from inside the processor ('str' object has no attribute 'get')."""
    with MStar("toy") as m:
        with pytest.raises(TypeError, match=message):
            m.submit(request_, max_tokens=2)
