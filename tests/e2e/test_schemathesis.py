"""Property tests of live servers (toy, tiny Llama) against their own OpenAPI schema (schemathesis).

Every operation gets generated valid and invalid requests; no answer may be a 5xx, and status
codes, content types and bodies must be the ones the schema documents.
"""

from __future__ import annotations

import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, settings  # noqa: E402  (schemathesis brings hypothesis)
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from mstar import envs  # noqa: E402
from tests.e2e.server_thread import running_server  # noqa: E402

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
# Generation length is not what this test probes (tests/e2e/test_native_and_errors.py sends huge
# max_tokens): valid lengths are capped so a million-token toy request does not eat the time budget.
TOKEN_FIELDS = ("max_tokens", "max_completion_tokens", "min_tokens")
TOKEN_CAP = 16
EXAMPLES = envs.schemathesis_examples()
QUICK_EXAMPLES = min(EXAMPLES, 8)  # the default run's count; the slow group runs EXAMPLES


# name -> (config, Runtime kwargs, run schemathesis' coverage phase). The coverage phase (about a
# thousand boundary cases) runs on the toy; the tiny Llama gets the fuzzing phase only, for time.
SERVERS = {
    "toy": ({"model": "toy"}, {}, True),
    "tiny-llama": ({"model": "llama", "device": "cpu", "kv_cache": {"max_num_pages": 128}}, {"tiny": True}, False),
}


# the toy app in the default run; the tiny Llama's (the same routes and schema) in the slow group
@pytest.fixture(scope="module", params=[pytest.param(name, marks=pytest.mark.slow) if name == "tiny-llama" else name
                                        for name in sorted(SERVERS)])
def api_schema(request):
    from schemathesis.config import SchemathesisConfig

    config, runtime_kwargs, coverage = SERVERS[request.param]
    with running_server(config, runtime_kwargs=runtime_kwargs) as url:
        phases = SchemathesisConfig.from_dict({"phases": {"coverage": {"enabled": coverage}}})
        yield schemathesis.openapi.from_url(f"{url}/openapi.json", config=phases)


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=QUICK_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_api_conforms_to_its_schema(case):
    _conforms(case)


@pytest.mark.slow
@schema.parametrize()
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_api_conforms_to_its_schema_with_every_example(case):
    _conforms(case)


def _conforms(case) -> None:
    _cap_lengths(case.body)
    case.call_and_validate(checks=CHECKS, timeout=30)


def _cap_lengths(body) -> None:
    if isinstance(body, dict):
        for field in TOKEN_FIELDS:
            value = body.get(field)
            if isinstance(value, int) and not isinstance(value, bool) and value > TOKEN_CAP:
                body[field] = TOKEN_CAP
