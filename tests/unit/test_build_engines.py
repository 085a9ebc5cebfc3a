"""build_engines puts every component's weights on the device before it makes any engine (an
autoregressive engine sizes its KV pool from the memory free when it is made)."""

from types import SimpleNamespace

import torch

from mstar.graph.spec import ComponentSpec
from mstar.runtime import build


def test_all_weights_are_built_before_the_first_engine(monkeypatch):
    events: list[tuple[str, str]] = []
    specs = {"llm": ComponentSpec("autoregressive"), "talker": ComponentSpec("autoregressive"),
             "vocoder": ComponentSpec("stateless")}

    class FakeModel:
        def graph(self):
            return SimpleNamespace(components=specs)

        def build_component(self, name, device):
            events.append(("build", name))
            return SimpleNamespace(name=name)

    def engine(kind, built, config, device):
        events.append(("engine", built.name))
        return (kind, built.name)

    monkeypatch.setattr(build, "_engine", engine)
    names = ["talker", "llm", "vocoder"]
    engines = build.build_engines(FakeModel(), SimpleNamespace(), names, torch.device("cpu"))
    assert events == [("build", n) for n in names] + [("engine", n) for n in names]
    assert engines == {n: (specs[n].engine, n) for n in names}
