"""Workers as Ray actors on a two-node Ray cluster (`ray.cluster_utils.Cluster`, both nodes on this
machine): the config's `ray.workers` puts a worker on each node by a custom resource; control messages
go over TCP and tensors between the nodes by TCP pull, as between two hosts. The toy model and a tiny
Llama (prefill on one node, decode on the other, the KV pages crossing) give what one process gives;
killing the remote node's worker actor fails only its requests, and it is restarted in its bundle."""

from __future__ import annotations

import time

import pytest

from mstar.config import config_from_dict
from mstar.runtime.offline import MStar, RequestFailed
from tests.models.llm_runtime_testing import PROMPTS, hf_greedy, make_checkpoint, token_ids

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow  # a cluster of two nodes takes seconds to start, each actor imports torch

HEAD, REMOTE = {"head_node": 1}, {"remote_node": 1}  # what a worker asks; each node has 4


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    nodes = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "resources": {"head_node": 4}, "object_store_memory": 80 * 1024**2})
    nodes.add_node(num_cpus=1, resources={"remote_node": 4}, object_store_memory=80 * 1024**2)
    nodes.wait_for_nodes()
    ray.init(address=nodes.address, logging_level="WARNING")
    yield nodes
    ray.shutdown()
    nodes.shutdown()


def _on_nodes(*places: dict, cpus: float = 0.5) -> list[dict]:
    """`ray.workers` entries putting rank i on the node with resource places[i]."""
    return [{"ranks": [rank], "resources": place, "num_cpus": cpus} for rank, place in enumerate(places)]


TOY = {"model": "toy", "device": "cpu", "model_kwargs": {"samples_per_token": 32768},  # audio chunks beyond inline
       "node_groups": [{"node_names": ["encoder", "decoder", "guide", "painter"], "ranks": [0]},
                       {"node_names": ["vocoder"], "ranks": [1]}]}


def test_toy_with_a_worker_on_each_node_gives_what_one_process_gives(cluster):
    request = {"text": "two nodes"}
    with MStar(config=TOY) as local:
        want = local.generate(request, max_tokens=12, stop_early=False).outputs
    cfg = config_from_dict({**TOY, "ray": {"workers": _on_nodes(HEAD, REMOTE)}})
    with MStar(config=cfg, ray_address=cluster.address) as m:
        sites = m.runtime.cluster.sites
        assert sites[0].node_id != sites[1].node_id  # one worker on each node
        assert sites[1].node_id != m.runtime.cluster.head.node_id
        assert m.runtime.codec.channel.edges["worker-1"].host == "tcp"  # another node: another host
        assert m.runtime.codec.channel.edges["worker-0"].host == "shm"
        got = m.generate(request, max_tokens=12, stop_early=False).outputs
        assert got["text"] == want["text"] and len(got["audio"]) == len(want["audio"])
        for mine, theirs in zip(got["audio"], want["audio"], strict=True):
            assert mine.nbytes > 64 * 1024 and (mine == theirs).all()  # pulled over TCP from the remote node
        assert all((a == b).all() for a, b in zip(got["image"], want["image"], strict=True))


def test_killing_the_remote_worker_fails_only_its_requests(cluster):
    groups = [{"node_names": ["encoder", "guide", "painter", "vocoder"], "ranks": [0]},
              {"node_names": ["decoder"], "ranks": [1, 2]}]
    cfg = config_from_dict({"model": "toy", "device": "cpu", "model_kwargs": {"step_delay_s": 0.02},
                            "node_groups": groups,
                            "ray": {"workers": _on_nodes(HEAD, HEAD, REMOTE, cpus=0.25)}})
    with MStar(config=cfg, ray_address=cluster.address) as m:
        assert m.runtime.cluster.sites[2].node_id != m.runtime.cluster.head.node_id
        handles = [m.submit({"text": f"req {i}"}, max_tokens=40, stop_early=False, modalities=["text"])
                   for i in range(8)]
        time.sleep(0.5)
        ray.kill(m.runtime.cluster.actors[2])
        failed, done = 0, 0
        for h in handles:
            try:
                assert len(h.result().outputs["text"]) == 40
                done += 1
            except RequestFailed as exc:
                assert "worker 2 died: its Ray actor died" in str(exc) and exc.status == 500
                failed += 1
        assert failed == 4 and done == 4  # least-loaded placement split them evenly
        assert len(m.generate({"text": "after"}, max_tokens=4, modalities=["text"]).outputs["text"]) == 4
        _wait(lambda: m.runtime.ready, timeout=90)  # a new actor in the same bundle, built and ready
        assert m.runtime.fatal is None and m.runtime.cluster.sites[2].node_id != m.runtime.cluster.head.node_id
        again = [m.submit({"text": f"again {i}"}, max_tokens=8, stop_early=False, modalities=["text"])
                 for i in range(4)]
        assert all(len(h.result().outputs["text"]) == 8 for h in again)
        assert m.runtime.conductor._load == [0, 0, 0] and not m.runtime.conductor._dead


def test_llama_prefill_and_decode_on_two_nodes(cluster, tmp_path):
    hf, tok = make_checkpoint("llama", tmp_path)
    groups = [{"node_names": ["llm"], "ranks": [0], "graph_walks": ["prefill"]},
              {"node_names": ["llm"], "ranks": [1], "graph_walks": ["decode"]}]
    cfg = config_from_dict({"model": "llama", "device": "cpu", "kv_cache": {"page_size": 16}, "node_groups": groups,
                            "ray": {"workers": _on_nodes(HEAD, REMOTE)}})
    greedy = {"temperature": 0.0, "ignore_eos": True, "max_tokens": 10}
    with MStar("llama", config=cfg, model_path=str(tmp_path), ray_address=cluster.address) as m:
        assert m.runtime.cluster.sites[1].node_id != m.runtime.cluster.head.node_id
        handles = [m.submit({"text": p}, **greedy) for p in PROMPTS[:3]]
        assert [token_ids(h) for h in handles] == [hf_greedy(hf, tok.encode(p), 10) for p in PROMPTS[:3]]
        _wait(lambda: _llm_stat(m, 1, "kv_pages_received") >= 3, timeout=15)  # pages pulled across nodes
        assert _llm_stat(m, 1, "prompt_tokens") == 0


def _llm_stat(m: MStar, rank: int, name: str) -> float:
    stats = m.runtime.conductor.worker_stats().get(rank)
    return next((c.gauges.get(name, 0) for c in stats.components if c.component == "llm"), 0) if stats else 0


def _wait(condition, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def test_a_cluster_without_room_for_the_bundles_fails_the_start_naming_them(cluster, monkeypatch):
    from mstar.runtime import ray_workers

    monkeypatch.setattr(ray_workers, "PLACEMENT_TIMEOUT_S", 1.0)
    cfg = config_from_dict({**TOY, "ray": {"workers": _on_nodes(HEAD, {"gpu_node": 1})}}, source="two.yaml")
    with pytest.raises(ValueError, match=r"two.yaml: the Ray cluster at .* found no room for the workers' bundles "
                                         r"\[.*'gpu_node': 1.*\] within 1 s; it has .*'remote_node': 4.0"):
        MStar(config=cfg, ray_address=cluster.address)
    assert ray.util.placement_group_table() and all(  # the bundles asked for went back
        g["state"] == "REMOVED" for g in ray.util.placement_group_table().values())
