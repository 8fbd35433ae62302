"""A bounded, reproducible schemathesis run over every route that takes a body, and the cache
routes without one: no 5xx, every answer's status one the schema lists and its body the
schema's (the cache routes' 200 answers included), and the server healthy after.

Bounds: a fixed number of examples per operation, Hypothesis derandomized (the same cases
every run), a 48-token context so that any accepted request finishes in a few steps, and a
per-request timeout. The whole run stays well under a minute on the 2-core machine.
"""

from __future__ import annotations

import os

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from live_server import running_server
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import response_schema_conformance, status_code_conformance

# per operation and mode; KVSERVE_FUZZ_EXAMPLES=500 runs a deeper (slower) search
MAX_EXAMPLES = int(os.environ.get("KVSERVE_FUZZ_EXAMPLES", "25"))


@pytest.fixture(scope="module")
def fuzzed_server(default_model):
    with running_server(default_model, max_model_len=48, num_kv_blocks=128) as s:
        yield s
        r = httpx.get(f"{s.url}/health")
        assert r.status_code == 200 and r.json() == {"status": "ok"}
        s.wait_idle(30)
        s.ctx.engine.engine.check_integrity()


@pytest.fixture(scope="module")
def api_schema(fuzzed_server):
    return schemathesis.openapi.from_url(f"{fuzzed_server.url}/openapi.json")


# schemathesis' own pytest plugin does not run under pytest 9 (it reads a private node
# attribute), so each operation's strategy is driven with Hypothesis directly
BODY_ROUTES = ["/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/cache/pin", "/v1/cache/unpin"]
# a route without a body or parameters has no invalid request to make: positive cases only
OPERATIONS = [("POST", path, mode) for path in BODY_ROUTES
              for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)] + \
             [("GET", "/v1/cache/pins", GenerationMode.POSITIVE), ("POST", "/v1/cache/reset", GenerationMode.POSITIVE)]


@pytest.mark.parametrize("method,path,mode", OPERATIONS)
def test_no_server_errors(api_schema, method, path, mode):
    operations = [result.ok() for result in api_schema.include(path=path, method=method).get_all_operations()]
    assert len(operations) == 1

    @given(case=operations[0].as_strategy(generation_mode=mode))
    @settings(max_examples=MAX_EXAMPLES, derandomize=True, deadline=None, database=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    def run(case):
        case.call_and_validate(checks=[not_a_server_error, status_code_conformance, response_schema_conformance],
                               timeout=30)

    run()


def test_openapi_schema_is_published(fuzzed_server):
    spec = httpx.get(f"{fuzzed_server.url}/openapi.json").json()
    body = spec["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/ChatCompletionRequest"}
    chat = spec["components"]["schemas"]["ChatCompletionRequest"]
    assert chat["additionalProperties"] is False and "messages" in chat["required"]
    assert {"tools", "response_format", "structured_outputs", "logit_bias"} <= set(chat["properties"])
    reset = spec["paths"]["/v1/cache/reset"]["post"]["responses"]["200"]["content"]["application/json"]["schema"]
    assert "scope" in reset["required"] and reset["properties"]["scope"]["enum"] == ["engine", "tenant"]
    pins = spec["paths"]["/v1/cache/pins"]["get"]["responses"]["200"]["content"]["application/json"]["schema"]
    assert pins["properties"]["data"]["items"]["required"][-1] == "tenant"
