"""Config parsing and placement: errors name the key and the file."""

import re

import pytest

from mstar.config import SHIPPED_CONFIGS, ConfigError, config_from_dict, load_config
from mstar.graph.placement import PlacementError, plan_placement
from mstar.models.toy.model import ToyModel

GRAPH = ToyModel(ToyModel.make_config()).graph()


def write(tmp_path, text):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path


def test_original_mstar_keys_load(tmp_path):
    cfg = load_config(write(tmp_path, """
model: toy
max_concurrent_requests: 8
kv_cache: {max_num_pages: 128, page_size: 16, attention_backend: sdpa}
node_groups:
  - {node_names: [encoder, decoder, guide, painter], ranks: [0], graph_walks: [encode, generate, render]}
  - {node_names: [vocoder], ranks: [1], tp_size: 1, sp_size: 1}
model_kwargs: {hidden: 8}
"""))
    assert cfg.kv_cache.max_num_pages == 128 and cfg.num_workers == 2 and cfg.model_kwargs == {"hidden": 8}


@pytest.mark.parametrize("text,message", [
    ("model: toy\nmax_seq_len: 4096\n", "max_seq_len is not taken: each model bounds its own context; set "
                                        "model_kwargs.max_model_len"),
    ("model: toy\nkv_cache: {cpu_offload_pages: 0}\n", "kv_cache.cpu_offload_pages is not taken: mstar does not "
                                                      "offload KV pages to the host"),
])
def test_original_mstar_keys_that_would_do_nothing_are_refused(tmp_path, text, message):
    with pytest.raises(ConfigError, match=message):
        load_config(write(tmp_path, text))


def test_unknown_key_names_key_and_file(tmp_path):
    path = write(tmp_path, "model: toy\nnode_groups:\n  - {node_names: [a], ranks: [0], tp: 2}\n")
    with pytest.raises(ConfigError, match=r"c\.yaml: unknown key 'node_groups\[0\]\.tp'"):
        load_config(path)


def test_bad_values(tmp_path):
    with pytest.raises(ConfigError, match=r"max_concurrent_requests must be int, got 'many'"):
        load_config(write(tmp_path, "model: toy\nmax_concurrent_requests: many\n"))
    with pytest.raises(ConfigError, match=r"not valid YAML"):
        load_config(write(tmp_path, "model: [toy\n"))
    with pytest.raises(ConfigError, match=r"does not exist"):
        load_config(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match=r"kv_cache.page_size=0: use a positive integer"):
        config_from_dict({"model": "toy", "kv_cache": {"page_size": 0}})
    with pytest.raises(ConfigError, match=r"cuda_graphs.prefill_tokens=\[16, 0\]: use a list of positive"):
        config_from_dict({"model": "toy", "cuda_graphs": {"prefill_tokens": [16, 0]}})
    assert config_from_dict({"model": "toy", "cuda_graphs": {"prefill_tokens": [64, 16]}}).cuda_graphs.prefill_tokens \
        == [64, 16]
    assert config_from_dict({"model": "toy"}).cuda_graphs.prefill_tokens == []  # off by default


@pytest.mark.parametrize("data, line", [
    ({"kv_cache": {"page_size": -16}}, "x.yaml: kv_cache.page_size=-16: use a positive integer such as 16"),
    ({"limits": {"max_body_bytes": -1}}, "x.yaml: limits.max_body_bytes=-1: use a positive number"),
    ({"cuda_graphs": {"max_batch_size": 0}}, "x.yaml: cuda_graphs.max_batch_size=0: use a positive integer"),
    # these read 'NodeGroup.__init__() missing 1 required positional argument' and 'unknown key model_kwargs.x'
    ({"node_groups": [{"ranks": [0]}]}, "x.yaml: node_groups[0] needs key 'node_names'"),
    ({"model_kwargs": "x"}, "x.yaml: model_kwargs must be a mapping, got 'x'"),
])
def test_a_bad_section_value_names_its_key_once(data, line):
    """The key is named once, with its section (it read 'kv_cache.: kv_cache.page_size=...' and
    'limits.: max_body_bytes=...')."""
    with pytest.raises(ConfigError) as exc:
        config_from_dict({"model": "toy", **data}, "x.yaml")
    assert str(exc.value) == line


def test_component_placed_nowhere():
    cfg = config_from_dict({"model": "toy", "node_groups": [{"node_names": ["encoder"], "ranks": [0]}]}, "x.yaml")
    with pytest.raises(PlacementError, match=r"x\.yaml: component 'decoder' \(used by walk 'generate'\) is placed in no node group"):
        plan_placement(GRAPH, cfg.node_groups, cfg.source)


def test_a_component_placed_twice_on_the_same_ranks_is_refused():
    """The same component, walk and ranks in two groups is a mistake (it made two identical replicas on
    one worker); the error names both groups."""
    cfg = config_from_dict({"model": "toy", "node_groups": [
        {"node_names": ["encoder", "decoder", "guide", "painter", "vocoder"], "ranks": [0]},
        {"node_names": ["encoder"], "ranks": [0]}]}, "x.yaml")
    with pytest.raises(PlacementError, match=r"x\.yaml: node_groups\[1\]: 'encoder' is already on ranks \[0\] "
                                             r"for walk '\w+' \(node_groups\[0\]\)"):
        plan_placement(GRAPH, cfg.node_groups, cfg.source)


@pytest.mark.parametrize("groups,idle,used", [
    ([{"node_names": ["encoder", "decoder", "guide", "painter"], "ranks": [0]},
      {"node_names": ["vocoder"], "ranks": [2]}], [1], [0, 2]),
    ([{"node_names": ["encoder", "decoder", "guide", "painter", "vocoder"], "ranks": [0, 3]}], [1, 2], [0, 3]),
    ([{"node_names": ["encoder", "decoder", "guide", "painter", "vocoder"], "ranks": [0]},
      {"node_names": ["vocoder"], "ranks": [1], "graph_walks": ["encode"]}], [1], [0]),  # placed where unused
])
def test_a_rank_that_would_run_no_component_is_refused_naming_it(groups, idle, used):
    """Each rank is a worker process: a gap (or a group whose components its walks never use) started an idle
    one that loaded nothing."""
    cfg = config_from_dict({"model": "toy", "node_groups": groups}, "gap.yaml")
    with pytest.raises(PlacementError, match=rf"gap\.yaml: ranks {re.escape(str(idle))} would run no component "
                                             rf"\(components are on ranks {re.escape(str(used))}\): number the "
                                             r"ranks from 0 with no gaps.*--gpus"):
        plan_placement(GRAPH, cfg.node_groups, cfg.source)


def test_rank_out_of_range_and_unknown_names():
    groups = config_from_dict({"model": "toy", "node_groups": [
        {"node_names": ["encoder", "decoder", "guide", "painter", "vocoder"], "ranks": [0, 3]}]}).node_groups
    with pytest.raises(PlacementError, match=r"node_groups\[0\]: rank 3 is out of range: 2 device"):
        plan_placement(GRAPH, groups, max_ranks=2)
    bad = config_from_dict({"model": "toy", "node_groups": [{"node_names": ["nope"], "ranks": [0]}]}).node_groups
    with pytest.raises(PlacementError, match=r"unknown component 'nope'"):
        plan_placement(GRAPH, bad)


def test_prefill_and_decode_walks_on_different_ranks():
    groups = config_from_dict({"model": "toy", "node_groups": [
        {"node_names": ["encoder", "decoder", "guide", "painter", "vocoder"], "ranks": [0],
         "graph_walks": ["encode", "render", "vocode"]},
        {"node_names": ["decoder", "guide"], "ranks": [1], "graph_walks": ["generate"]},
    ]}).node_groups
    plan = plan_placement(GRAPH, groups)
    assert plan.replicas("decoder", "generate") == ((1,),)
    assert plan.replicas("encoder", "encode") == ((0,),)
    assert plan.components_on(1) == ["decoder", "guide"]


def test_unknown_model_lists_valid_names():
    from mstar.models.registry import get_model_class

    with pytest.raises(KeyError, match=r"unknown model 'toyy'; registered models are: .*toy"):
        get_model_class("toyy")


def test_every_shipped_config_loads():
    import dataclasses

    from mstar.models.registry import get_model_class

    configs = sorted(SHIPPED_CONFIGS.glob("*.yaml"))
    assert len(configs) >= 5
    for path in configs:
        cfg = load_config(path)
        fields = {f.name for f in dataclasses.fields(get_model_class(cfg.model).make_config())}
        assert set(cfg.model_kwargs) <= fields, path  # build_model refuses any other key


def test_shipped_configs_load_by_name_from_any_directory(tmp_path, monkeypatch):
    from mstar.cli.main import resolve_config

    monkeypatch.chdir(tmp_path)  # no configs/ folder here
    assert load_config("toy_3workers").source == str(SHIPPED_CONFIGS / "toy_3workers.yaml")
    assert load_config("toy_2workers.yaml").num_workers == 2
    assert resolve_config("toy", None).source == str(SHIPPED_CONFIGS / "toy.yaml")  # `mstar serve toy`
    assert resolve_config("qwen3", None).source == "<defaults for qwen3>"  # no shipped file: defaults
    with pytest.raises(ConfigError, match=r"config file toy_9workers does not exist \(shipped configs, usable "
                                          r"by name: .*toy_3workers"):
        load_config("toy_9workers")
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("elsewhere/toy.yaml")  # a path is never read as a shipped name
    local = tmp_path / "toy.yaml"  # a file in the working directory wins over the shipped one
    local.write_text("model: toy\nnode_groups: [{node_names: [encoder, decoder, guide, painter, vocoder], ranks: [0]}]\n")
    assert load_config("toy.yaml").source == "toy.yaml"


def test_mstar_configs_lists_the_shipped_configs(capsys):
    from mstar.cli.main import main

    assert main(["configs"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == sorted(p.stem for p in SHIPPED_CONFIGS.glob("*.yaml"))
    assert any(line.startswith("toy_2workers") and "second worker" in line for line in lines)


def test_limits_section_is_validated():
    cfg = config_from_dict({"model": "toy", "limits": {"max_image_pixels": 4096, "body_timeout_s": 2.5}})
    assert cfg.limits.max_image_pixels == 4096 and cfg.limits.body_timeout_s == 2.5
    assert cfg.limits.max_body_bytes == 64 * 1024 * 1024  # the rest keep their defaults
    with pytest.raises(ConfigError, match=r"unknown key 'limits.max_pixels'; valid keys here are .*max_image_pixels"):
        config_from_dict({"model": "toy", "limits": {"max_pixels": 4096}})
    with pytest.raises(ConfigError, match=r"limits.*max_audio_seconds=0.0: use a positive number"):
        config_from_dict({"model": "toy", "limits": {"max_audio_seconds": 0}})


def test_limits_may_differ_per_route():
    cfg = config_from_dict({"model": "toy", "limits": {"max_audio_seconds": 60, "routes": {
        "/v1/audio/transcriptions": {"max_audio_seconds": 7200}}}})
    assert cfg.limits.for_route("/v1/audio/transcriptions").max_audio_seconds == 7200
    assert cfg.limits.for_route("/generate").max_audio_seconds == 60
    with pytest.raises(ConfigError, match=r"routes\['/generate'\]: give a route path and a mapping of max_media_bytes"):
        config_from_dict({"model": "toy", "limits": {"routes": {"/generate": {"max_body_bytes": 5}}}})
    with pytest.raises(ConfigError, match="max_image_pixels=-1: use a positive number"):
        config_from_dict({"model": "toy", "limits": {"routes": {"/generate": {"max_image_pixels": -1}}}})


def test_a_misspelt_model_kwargs_key_names_the_file_and_the_valid_keys(tmp_path):
    from mstar.runtime.build import build_model

    path = tmp_path / "toy.yaml"
    path.write_text("model: toy\nmodel_kwargs: {step_delay: 0.5}\n")
    with pytest.raises(ConfigError, match=rf"{path}: unknown key 'model_kwargs.step_delay' for model 'toy'; "
                                          r"valid keys here are \[.*'step_delay_s'"):
        build_model(load_config(path))
    assert build_model(config_from_dict({"model": "toy", "model_kwargs": {"step_delay_s": 0.5}})).config.step_delay_s == 0.5


def test_ray_section_places_ranks_and_is_validated(tmp_path):
    groups = "node_groups:\n  - {node_names: [encoder, decoder, guide, painter], ranks: [0]}\n" \
             "  - {node_names: [vocoder], ranks: [1]}\n"
    cfg = load_config(write(tmp_path, "model: toy\n" + groups + "ray:\n  strategy: SPREAD\n  workers:\n"
                            "    - {ranks: [1], node_ip: 10.0.0.2, resources: {big_disk: 1}, num_gpus: 0}\n"))
    assert cfg.ray.strategy == "SPREAD"
    assert cfg.ray.bundle_of(1).node_ip == "10.0.0.2" and cfg.ray.bundle_of(1).resources == {"big_disk": 1}
    assert cfg.ray.bundle_of(0).ranks == [0] and cfg.ray.bundle_of(0).num_gpus is None  # the default bundle
    for ray, message in [
        ("  workers: [{ranks: [2]}]", r"ray.workers\[0\]: ranks must name worker ranks 0..1, got \[2\]"),
        ("  workers: [{ranks: [1], host: a}]", r"unknown key 'ray.workers\[0\].host'; valid keys here are \['node_ip'"),
        ("  workers: [{ranks: [1]}, {ranks: [0, 1]}]", r"ray.workers\[1\] places rank 1 again"),
        ("  workers: [{ranks: [1], resources: {gpu_a: -1}}]", r"ray.workers\[0\]: resource amounts must be numbers >= 0, got \{'gpu_a': -1\}"),
        ("  strategy: pack", r"ray.strategy 'pack' must be one of \('PACK'"),
    ]:
        path = write(tmp_path, "model: toy\n" + groups + "ray:\n" + ray + "\n")
        with pytest.raises(ConfigError, match=rf"^{path}: {message}"):
            load_config(path)
