"""Models from outside the package: 'package.module:Class' as the model name, or an installed package's
entry point in the `mstar.models` group."""

from __future__ import annotations

import pytest

from mstar.models.registry import get_model_class, model_names
from mstar.runtime.offline import MStar

MODULE = '''
from mstar.models.toy.model import ToyModel


class ShoutingToy(ToyModel):
    name = "shouting_toy"
'''


@pytest.fixture
def package(tmp_path, monkeypatch):
    """A module `my_models` and a distribution that registers its class as the model `shout`."""
    (tmp_path / "my_models.py").write_text(MODULE)
    info = tmp_path / "my_models-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: my-models\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[mstar.models]\nshout = my_models:ShoutingToy\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_an_out_of_tree_model_serves_by_module_path_or_entry_point(package):
    assert get_model_class("my_models:ShoutingToy").name == "shouting_toy"
    assert "shout" in model_names() and get_model_class("shout") is get_model_class("my_models:ShoutingToy")
    with MStar(config={"model": "shout"}) as m:
        assert len(m.generate({"text": "hi"}, max_tokens=3, stop_early=False).outputs["text"]) == 3


@pytest.mark.parametrize("name,message", [
    ("my_models:Missing", "cannot load 'my_models:Missing'"),
    ("pytest:mark", "is not a subclass of mstar.models.base.Model"),
])
def test_a_bad_out_of_tree_name_says_why(package, name, message):
    with pytest.raises(KeyError, match=message):
        get_model_class(name)
