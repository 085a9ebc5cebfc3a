"""Models from outside the package: 'package.module:Class' as the model name (on `mstar serve`, found from
its working directory, or as a YAML's `model:`), or an installed package's entry point in the
`mstar.models` group; a bad one ends `mstar serve` in one line naming it."""

from __future__ import annotations

import importlib.metadata
import socket
import sys

import pytest

from mstar.cli import main as cli
from mstar.models.registry import ENTRY_POINT_GROUP, get_model_class, model_names
from mstar.runtime.offline import MStar

MODULE = '''
from mstar.models.toy.model import ToyModel


MODULE_NOTE = "not a model"


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


def test_a_yaml_model_spec_serves_through_the_cli_config_path(package):
    (package / "shout.yaml").write_text("model: my_models:ShoutingToy\n")
    config = cli.resolve_config(None, str(package / "shout.yaml"))
    with MStar(config=config) as m:
        assert m.runtime.model.name == "shouting_toy"
        assert len(m.generate({"text": "hi"}, max_tokens=2, stop_early=False).outputs["text"]) == 2


def test_entry_points_are_read_from_importlib_metadata(package, monkeypatch):
    fake = importlib.metadata.EntryPoint("loud", "my_models:ShoutingToy", ENTRY_POINT_GROUP)
    monkeypatch.setattr(importlib.metadata, "entry_points",
                        lambda group: [fake] if group == ENTRY_POINT_GROUP else [])
    assert "loud" in model_names() and get_model_class("loud").name == "shouting_toy"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.parametrize("spec,message", [
    ("no_such_pkg.models:Thing", "mstar: model 'no_such_pkg.models:Thing': cannot load 'no_such_pkg.models:Thing': "
                                 "No module named 'no_such_pkg'"),
    ("my_models:Missing", "mstar: model 'my_models:Missing': cannot load 'my_models:Missing': "
                          "module 'my_models' has no attribute 'Missing'"),
    ("my_models:MODULE_NOTE", "mstar: model 'my_models:MODULE_NOTE': 'my_models:MODULE_NOTE' is not a subclass "
                              "of mstar.models.base.Model"),
])
def test_a_bad_spec_on_the_command_line_is_one_line_naming_it(package, monkeypatch, spec, message):
    # the module is found from the working directory alone, as `mstar serve` run next to it would
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p != str(package)])
    monkeypatch.delitem(sys.modules, "my_models", raising=False)
    monkeypatch.chdir(package)
    with pytest.raises(SystemExit) as exc:
        cli.main(["serve", spec, "--port", str(_free_port())])
    first, hint = str(exc.value).split("\n")
    assert first == message and hint == "(--log-level DEBUG shows the traceback)"
