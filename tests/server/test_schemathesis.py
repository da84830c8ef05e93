"""The HTTP API against its own OpenAPI schema: schemathesis generates requests (valid and
not) for every operation; no answer may be a 5xx, and every answer must match the schema."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    response_schema_conformance,
    status_code_conformance,
)

from pagedserve.serving.openai.server import build_app


@pytest.fixture(scope="module")
def app(llama_dir, srv) -> Iterator[Any]:
    client = srv.start_client(llama_dir, max_model_len=128)
    try:
        yield build_app(client)
    finally:
        client.shutdown()


def _shrink(case: Any) -> None:
    """Keep generation cheap on 2 cores: a few tokens exercise the same path."""
    if isinstance(case.body, dict):
        for name in ("max_tokens", "max_output_tokens"):
            if isinstance(case.body.get(name), int) and case.body[name] > 8:
                case.body[name] = 8
        if isinstance(case.body.get("n"), int) and case.body["n"] > 4:
            case.body["n"] = 4


def test_api_conforms_to_its_schema(app) -> None:
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    cases: dict[str, int] = {}
    for result in schema.get_all_operations():
        operation = result.ok()

        @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck),
                  database=None)
        @given(operation.as_strategy())
        def check(case: Any) -> None:
            _shrink(case)
            cases[case.operation.label] = cases.get(case.operation.label, 0) + 1
            response = case.call()
            case.validate_response(response, checks=[
                not_a_server_error, response_schema_conformance, status_code_conformance])

        check()
    print("schemathesis cases per operation:", cases)
    # Operations without parameters have one case; the two completion endpoints get many.
    assert cases["POST /v1/completions"] >= 20 and cases["POST /v1/chat/completions"] >= 20
    assert cases["POST /v1/responses"] >= 20
    assert {"GET /health", "GET /metrics", "GET /v1/models"} <= set(cases)
