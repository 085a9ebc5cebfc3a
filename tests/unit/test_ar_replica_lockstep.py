"""A tensor-parallel replica's lockstep at the engine seam (worker/replica.py): a follower engine fed the
lead's ReplicaEngineStep messages ends every step in the lead's state (same tokens, same stops, same
releases, same KV pages). Its tokens come from the lead's items; its stops from its own draws, sampled
hot with no seed and an eighth of the vocabulary ending a request: they agree because each request draws
from a generator seeded by its id (`seed_per_request`). Without that seed the two draw from the shared
generator, stop at different steps and part."""

import pytest
import torch

from mstar.engines.autoregressive import AutoregressiveEngine
from mstar.engines.base import StepItem
from mstar.engines.kv_cache.config import KVCacheConfig
from mstar.engines.sampling import SamplingParams
from mstar.models.common.loading import fill_dummy_weights
from mstar.models.llama.model import build_model
from mstar.models.llama.tiny import tiny_config
from mstar.transport import wire
from mstar.worker.replica import FollowerEngine, LeadEngine

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py
OPTIONS = {"temperature": 4.0, "max_tokens": 12}  # hot: draws really differ
CANCEL = 2  # the step before which request b is cancelled
EOS = tuple(range(0, 256, 8))  # an eighth of the tiny vocabulary ends a request: stops follow the draws


@pytest.fixture(scope="module")
def model():
    m = build_model(tiny_config("qwen3"), dtype=torch.float32)
    fill_dummy_weights(m, seed=1, std=0.3)
    return m


def _engine(model, seeded: bool) -> AutoregressiveEngine:
    engine = AutoregressiveEngine(model, KVCacheConfig(max_num_pages=48, page_size=4), "cpu", eos_token_ids=EOS,
                                  default_sampling=SamplingParams(temperature=4.0))
    engine.seed_per_request = seeded
    return engine


def _state(engine: AutoregressiveEngine) -> dict:
    return {key: (list(seq.token_ids), seq.num_computed, list(seq.pages)) for key, seq in engine._seqs.items()}


def _run(model, seeded: bool) -> tuple[list[dict], list[dict], list[list[int]]]:
    """Drive the lead as a worker would (feed each token back, release a finished request, one request
    cancelled mid-way, one arriving late); deliver its messages to the follower after each step."""
    sent: list[tuple[int, object]] = []
    lead = LeadEngine(_engine(model, seeded), "llm", [1], lambda rank, msg: sent.append((rank, msg)), lambda t, rank: t)
    follower = FollowerEngine(_engine(model, seeded))
    prompts = {"a": [5, 9, 2, 7], "b": [3, 3, 8], "c": [11, 4, 6, 1, 2]}
    for rid in ("a", "b"):
        lead.submit(StepItem(rid, "w", "decode", {"input_ids": torch.tensor(prompts[rid])}, OPTIONS))
    leads, follows, tokens = [], [], []
    for step in range(40):
        if step == 3:
            lead.submit(StepItem("c", "w", "decode", {"input_ids": torch.tensor(prompts["c"])}, OPTIONS))
        if step == CANCEL:
            lead.release("b")  # cancelled while running
        if not lead.has_work():
            break
        results = lead.step()
        for rank, msg in sent:
            assert rank == 1 and isinstance(msg, wire.ReplicaEngineStep)
            items = [StepItem(i.rid, i.walk, i.node, dict(i.inputs), i.options, i.iteration) for i in msg.items]
            follower.follow(msg, items)
        sent.clear()
        assert not follower.has_work() and follower.step() == []  # stepped by the lead only
        leads.append(_state(lead.engine))
        follows.append(_state(follower.engine))
        tokens.append([int(r.outputs["token"]) for r in results if r.error is None])
        for r in results:
            if r.stop:
                lead.release(r.request_id)
            elif r.request_id != "b" or step < CANCEL:
                lead.submit(StepItem(r.request_id, "w", "decode", {"input_ids": r.outputs["token"].view(1)}, OPTIONS))
    return leads, follows, tokens


def test_the_follower_keeps_the_leads_state_step_by_step(model):
    leads, follows, tokens = _run(model, seeded=True)
    assert len(leads) > 3 and sum(len(t) for t in tokens) > 5  # the requests really ran
    assert not leads[-1]  # all finished and released
    assert any(key[0] == "b" for key in leads[CANCEL - 1]) and not any(key[0] == "b" for key in leads[CANCEL])
    assert any(key[0] == "c" for state in leads for key in state)  # the late request ran too
    for step, (want, got) in enumerate(zip(leads, follows, strict=True)):
        assert got == want, f"step {step}"


def test_without_per_request_seeds_the_ranks_part(model):
    leads, follows, _ = _run(model, seeded=False)
    assert any(want != got for want, got in zip(leads, follows, strict=True))


def test_a_follower_engine_takes_nothing_but_the_leads_steps(model):
    follower = FollowerEngine(_engine(model, True))
    with pytest.raises(RuntimeError, match="from its lead only"):
        follower.submit(StepItem("x", "w", "decode", {"input_ids": torch.tensor([1])}, OPTIONS))
    follower.release("x")  # a worker-level release: ignored, the lead's message carries it
    assert follower.stats()["seqs_running"] == 0
