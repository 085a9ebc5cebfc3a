"""The video job store (bounded, evicts the oldest finished job) and the multipart form helpers."""

import pytest
from pydantic import BaseModel

from mstar.server.adapters import RequestError
from mstar.server.forms import form_options, inline_schema
from mstar.server.protocol import GenerateForm, GenerateRequest
from mstar.server.protocol_openai_media import VideoJob
from mstar.server.video_jobs import VideoJobStore, VideoRecord


def record(status: str = "queued") -> VideoRecord:
    return VideoRecord(VideoJob(status=status), fps=8.0, sample_rate=8000)


def test_store_evicts_the_oldest_finished_job_and_refuses_when_all_run():
    store = VideoJobStore(max_jobs=3)
    old_done, running, new_done = record("completed"), record("in_progress"), record("failed")
    for r in (old_done, running, new_done):
        store.add(r)
    store.add(record())
    with pytest.raises(RequestError) as info:
        store.get(old_done.job.id)
    assert info.value.status == 404 and "evicted" in info.value.message
    assert store.get(running.job.id) is running and store.get(new_done.job.id) is new_done
    store.add(record())  # evicts new_done, the only finished one left
    assert len(store) == 3
    with pytest.raises(RequestError) as info:
        store.add(record())
    assert info.value.status == 429


def test_store_runs_at_most_its_share_of_jobs_at_once():
    store = VideoJobStore(max_jobs=8, max_running=2)
    first, second = record("in_progress"), record("queued")
    store.add(first)
    store.add(second)
    with pytest.raises(RequestError, match="2 video jobs are running") as info:
        store.make_room()
    assert info.value.status == 429 and info.value.headers == {"Retry-After": "5"}
    first.job.status = "completed"
    store.add(record())  # one slot of the pool is free again
    assert len(store) == 3


def test_store_pages_in_both_orders():
    store = VideoJobStore()
    jobs = [record() for _ in range(5)]
    for r in jobs:
        store.add(r)
    page, more = store.page(None, 2, "asc")
    assert [r.job.id for r in page] == [jobs[0].job.id, jobs[1].job.id] and more
    page, more = store.page(jobs[3].job.id, 10, "desc")
    assert [r.job.id for r in page] == [r.job.id for r in reversed(jobs[:3])] and not more
    store.delete(jobs[0].job.id)
    assert len(store) == 4


def test_form_options_parse_json_literals_only():
    assert form_options({"max_tokens": "5", "stop_early": "false", "voice": "tara", "ids": "[1, 2]"}) == {
        "max_tokens": 5, "stop_early": False, "voice": "tara", "ids": [1, 2]}


def test_inline_schema_has_no_refs():
    class Inner(BaseModel):
        a: int

    class Outer(BaseModel):
        inner: Inner
        many: list[Inner]

    schema = inline_schema(Outer)
    assert "$defs" not in schema and "$ref" not in str(schema)
    assert schema["properties"]["many"]["items"]["properties"]["a"]["type"] == "integer"
    assert "$ref" not in str(inline_schema(GenerateRequest))


def test_generate_form_allows_no_text_but_checks_outputs():
    assert GenerateForm.model_validate({}).text is None
    with pytest.raises(ValueError, match="distinct"):
        GenerateForm.model_validate({"outputs": ["text", "text"]})
    with pytest.raises(ValueError, match="text"):
        GenerateRequest.model_validate({})
