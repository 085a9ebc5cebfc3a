"""build_engines: every component's weights go on the device before any engine is made, the KV pools of
a worker's autoregressive components are sized together (not by build order), and the deployment's
`engines:` settings reach each engine; build_model checks those settings against the model's graph."""

from types import SimpleNamespace

import pytest
import torch

from mstar.config import ConfigError, KVCacheConfig, config_from_dict
from mstar.engines.base import AutoregressiveSpec, KVLayout, StatelessSpec
from mstar.engines.kv_cache.config import kv_pool_pages, page_bytes
from mstar.graph.spec import ComponentSpec
from mstar.models.base import BuiltComponent, Model
from mstar.runtime import build

SPECS = {"llm": ComponentSpec("autoregressive"), "talker": ComponentSpec("autoregressive"),
         "vocoder": ComponentSpec("stateless")}
BIG, SMALL = KVLayout(4, 4, 16, torch.float32), KVLayout(1, 1, 16, torch.float32)


class FakeModel(Model):
    def __init__(self, events, settings=None):
        super().__init__(None)
        self.events, self.engine_settings = events, settings or {}

    def graph(self):
        return SimpleNamespace(components=SPECS)

    def build_component(self, name, device):
        self.events.append(("build", name))
        if name == "vocoder":
            return BuiltComponent(SimpleNamespace(name=name), StatelessSpec(max_batch_size=8))
        layout = BIG if name == "llm" else SMALL
        return BuiltComponent(SimpleNamespace(name=name, kv_layout=layout), AutoregressiveSpec(max_num_seqs=16))


@pytest.fixture
def made(monkeypatch):
    """(component, spec, pages) per engine made, instead of real engines."""
    out = []

    def engine(built, config, device, pages, tensor_parallel=False):
        out.append((built.module.name, built.engine, pages))
        return built.module.name

    monkeypatch.setattr(build, "_engine", engine)
    return out


def test_all_weights_are_built_before_the_first_engine(made, monkeypatch):
    """Weights first; then the stateless engines (their CUDA graphs hold memory); then the KV pools are sized
    from what is free, and the autoregressive engines made."""
    from mstar.engines.kv_cache import config as kv_config

    events = []
    sizing = kv_config.kv_pool_pages
    monkeypatch.setattr(kv_config, "kv_pool_pages", lambda *a: events.append(("pools", len(made))) or sizing(*a))
    names = ["talker", "llm", "vocoder"]
    engines = build.build_engines(FakeModel(events), config_from_dict({"model": "toy"}), names, torch.device("cpu"))
    assert events == [*(("build", n) for n in names), ("pools", 1)]
    assert [m[0] for m in made] == ["vocoder", "talker", "llm"]
    assert list(engines) == names and engines == {n: n for n in names}


def test_engine_settings_win_over_the_models_defaults(made):
    settings = {"talker": {"max_num_seqs": 4, "max_num_pages": 9}, "vocoder": {"max_batch_size": 2}}
    build.build_engines(FakeModel([], settings), config_from_dict({"model": "toy"}), ["talker", "llm", "vocoder"],
                        torch.device("cpu"))
    specs = {name: (spec, pages) for name, spec, pages in made}
    assert specs["talker"] == (AutoregressiveSpec(max_num_seqs=4, max_num_pages=9), 9)
    assert specs["llm"][0] == AutoregressiveSpec(max_num_seqs=16) and specs["vocoder"] == (StatelessSpec(2), None)


def test_pools_split_the_memory_fraction_into_equal_page_counts(monkeypatch):
    """On CUDA the pools that give no size of their own share kv_cache.memory_fraction of the memory free
    once all weights are built, in proportion to their page sizes: each holds as many tokens, whichever
    engine is made first; a component's own memory_fraction or max_num_pages comes off the top."""
    free = 10 * 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 2 * free))
    cuda, kv = torch.device("cuda", 0), KVCacheConfig(memory_fraction=0.8)
    big, small = page_bytes(BIG, 16), page_bytes(SMALL, 16)
    both = {"llm": (BIG, AutoregressiveSpec()), "talker": (SMALL, AutoregressiveSpec())}
    pages = kv_pool_pages(both, kv, cuda)
    assert pages["llm"] == pages["talker"] == int(free * 0.8) // (big + small)
    assert kv_pool_pages(dict(reversed(both.items())), kv, cuda) == pages  # not by order
    own = {"llm": (BIG, AutoregressiveSpec()), "talker": (SMALL, AutoregressiveSpec(memory_fraction=0.1))}
    pages = kv_pool_pages(own, kv, cuda)
    assert pages == {"talker": int(free * 0.1) // small, "llm": int(free * 0.7) // big}
    fixed = {"llm": (BIG, AutoregressiveSpec(max_num_pages=5)), "talker": (SMALL, AutoregressiveSpec())}
    assert kv_pool_pages(fixed, kv, cuda) == {"llm": 5, "talker": int(free * 0.8) // small}
    greedy = {"llm": (BIG, AutoregressiveSpec(memory_fraction=0.9)), "talker": (SMALL, AutoregressiveSpec())}
    with pytest.raises(ValueError, match="leaving nothing of kv_cache.memory_fraction=0.8 for \\['talker'\\]"):
        kv_pool_pages(greedy, kv, cuda)


def test_a_build_returning_the_wrong_spec_kind_is_named(made):
    class Wrong(FakeModel):
        def build_component(self, name, device):
            return BuiltComponent(SimpleNamespace(name=name), StatelessSpec())

    with pytest.raises(TypeError, match=r"build_component\('llm'\) returned a StatelessSpec; its autoregressive "
                                        "engine takes AutoregressiveSpec"):
        build.build_engines(Wrong([]), config_from_dict({"model": "toy"}), ["llm"], torch.device("cpu"))


@pytest.mark.parametrize("engines, message", [
    ({"vocodr": {}}, "unknown key 'engines.vocodr': model 'orpheus' has no such component; valid keys here are "
                     "\\['llm', 'snac'\\]"),
    ({"llm": {"max_num_seq": 4}}, "unknown key 'engines.llm.max_num_seq'; valid keys here are \\['cuda_graph_sizes', "
                                  "'enable_prefix_caching', 'kv_offer_timeout_s', 'max_batch_tokens', 'max_num_pages', "
                                  "'max_num_seqs', 'memory_fraction', 'own_stream'\\]"),
    ({"snac": {"max_num_seqs": 4}}, "unknown key 'engines.snac.max_num_seqs'; valid keys here are "
                                    "\\['cuda_graph_sizes', 'max_batch_size'\\]"),
    ({"llm": {"max_num_seqs": "many"}}, "engines.llm.max_num_seqs must be int, got 'many'"),
    ({"llm": {"max_num_seqs": 0}}, "engines.llm: max_num_seqs=0: use a positive integer"),
    ({"llm": {"kv_offer_timeout_s": 0}}, "engines.llm: kv_offer_timeout_s=0.0: use a positive number of seconds"),
    ({"llm": {"eos_token_ids": [1]}}, "unknown key 'engines.llm.eos_token_ids'"),  # the model's, not tunable
    ({"llm": 4}, "engines.llm must be a mapping, got 4"),
])
def test_engine_settings_are_checked_against_the_graph(tmp_path, engines, message):
    path = tmp_path / "orpheus.yaml"
    path.write_text("model: orpheus\n")
    config = config_from_dict({"model": "orpheus", "engines": engines}, source=str(path))
    with pytest.raises(ConfigError, match=f"{path}: {message}"):
        build.build_model(config, tiny=True)


def test_engine_settings_reach_the_model_typed():
    config = config_from_dict({"model": "orpheus", "engines": {"llm": {"max_num_seqs": 8, "cuda_graph_sizes": [1, 8]},
                                                              "snac": {"max_batch_size": 16}}})
    model = build.build_model(config, tiny=True)
    assert model.engine_settings == {"llm": {"max_num_seqs": 8, "cuda_graph_sizes": [1, 8]},
                                     "snac": {"max_batch_size": 16}}
    assert model.engine_spec("snac", StatelessSpec(max_batch_size=64)) == StatelessSpec(16)
