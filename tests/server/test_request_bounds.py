"""Every numeric field of the completion and chat request models, at its bounds and just past
them: inside, the model accepts it and the server never answers 5xx; outside, a 400 naming the
field. The fields and bounds are read from the models' own JSON schema, and every numeric
field must have both bounds, so a field added without them fails here."""

from __future__ import annotations

import math
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import httpx2 as httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ValidationError

from pagedserve.serving.openai.protocol import ChatCompletionRequest, CompletionRequest
from pagedserve.serving.openai.server import build_app

# A prompt's ids have no lower bound in the schema: below 0 is the engine's InvalidTokenError.
PROMPT_ID_MIN = 0

ENDPOINTS: dict[str, tuple[type[BaseModel], dict[str, Any]]] = {
    "/v1/completions": (CompletionRequest, {"prompt": "hi", "max_tokens": 1}),
    "/v1/chat/completions": (
        ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
    ),
}


class Field_(SimpleNamespace):
    """One numeric field: ``name``, ``integer``, ``lo``/``hi``, ``lo_open``, and ``wrap`` (how
    one value goes into the body: as is, or as the item of a list)."""


def _numeric(schema: dict[str, Any]) -> Iterator[tuple[dict[str, Any], int]]:
    """Numeric subschemas of one property, with their list depth (0: the value itself)."""
    for option in schema.get("anyOf", [schema]):
        depth, node = 0, option
        while node.get("type") == "array":
            depth, node = depth + 1, node["items"]
        if node.get("type") == "object" and isinstance(node.get("additionalProperties"), dict):
            node = node["additionalProperties"]
            depth = -1  # a dict's values
        if node.get("type") in ("integer", "number"):
            yield node, depth


def _fields(model: type[BaseModel]) -> list[Field_]:
    out = []
    for name, prop in model.model_json_schema()["properties"].items():
        for node, depth in _numeric(prop):
            lo_open = "exclusiveMinimum" in node
            lo = node.get("exclusiveMinimum", node.get("minimum"))
            if name == "prompt" and lo is None:
                lo = PROMPT_ID_MIN
            assert lo is not None and "maximum" in node, f"{model.__name__}.{name} is unbounded"
            out.append(Field_(name=name, integer=node["type"] == "integer", lo=lo,
                              hi=node["maximum"], lo_open=lo_open, depth=depth))
    return out


FIELDS = {path: _fields(model) for path, (model, _) in ENDPOINTS.items()}


def _edges(f: Field_) -> list[tuple[Any, bool]]:
    """(value, inside the bounds) at each bound and just past it."""
    if f.integer:
        return [(f.lo, True), (f.lo - 1, False), (f.hi, True), (f.hi + 1, False)]
    up, down = math.inf, -math.inf
    low = [(math.nextafter(f.lo, up), True), (f.lo, False)] if f.lo_open else [
        (f.lo, True), (math.nextafter(f.lo, down), False)]
    return [*low, (f.hi, True), (math.nextafter(f.hi, up), False)]


def _body(path: str, f: Field_, value: Any) -> dict[str, Any]:
    body = dict(ENDPOINTS[path][1])
    wrapped: Any = value
    if f.depth == -1:
        wrapped = {"5": value}
    for _ in range(max(f.depth, 0)):
        wrapped = [wrapped]
    body[f.name] = wrapped
    if f.name == "top_logprobs":
        body["logprobs"] = True
    return body


def _check(http: httpx.Client, path: str, f: Field_, value: Any, inside: bool) -> None:
    body = _body(path, f, value)
    model = ENDPOINTS[path][0]
    # Below 0, a prompt id passes the model and the engine refuses it (InvalidTokenError).
    if inside or (f.name == "prompt" and value < PROMPT_ID_MIN):
        model.model_validate(body)
    else:
        with pytest.raises(ValidationError):
            model.model_validate(body)
    resp = http.post(path, json=body)
    assert resp.status_code < 500, (f.name, value, resp.text)
    if not inside:
        assert resp.status_code == 400, (f.name, value, resp.text)
        assert resp.json()["error"]["param"] == f.name, (f.name, value, resp.text)


@pytest.fixture(scope="module")
def http(llama_dir, srv) -> Iterator[httpx.Client]:
    client = srv.start_client(llama_dir, max_model_len=128)
    try:
        with srv.running(build_app(client)) as url, httpx.Client(base_url=url, timeout=60) as h:
            yield h
    finally:
        client.shutdown()


def test_every_numeric_field_is_found() -> None:
    names = {path: {f.name for f in fields} for path, fields in FIELDS.items()}
    shared = {"n", "temperature", "top_p", "seed", "presence_penalty", "frequency_penalty",
              "top_k", "min_p", "min_tokens", "repetition_penalty", "stop_token_ids",
              "logit_bias", "max_tokens", "prompt_logprobs", "truncate_prompt_tokens",
              "allowed_token_ids", "priority", "best_of"}
    assert names["/v1/completions"] == shared | {"prompt", "logprobs"}
    assert names["/v1/chat/completions"] == shared | {"max_completion_tokens", "top_logprobs"}


@pytest.mark.parametrize("path", list(ENDPOINTS))
def test_every_bound_and_just_past_it(http: httpx.Client, path: str) -> None:
    for f in FIELDS[path]:
        for value, inside in _edges(f):
            _check(http, path, f, value, inside)


def _values(f: Field_) -> st.SearchStrategy[tuple[Any, bool]]:
    edges = st.sampled_from(_edges(f))
    if f.integer:
        inside = st.integers(f.lo + f.lo_open, f.hi)
        outside = st.one_of(st.integers(max_value=f.lo - 1 + f.lo_open),
                            st.integers(min_value=f.hi + 1))
    else:
        inside = st.floats(f.lo, f.hi, exclude_min=f.lo_open)
        outside = st.one_of(st.floats(max_value=f.lo, exclude_max=not f.lo_open,
                                      allow_infinity=False, allow_nan=False),
                            st.floats(min_value=f.hi, exclude_min=True, allow_infinity=False))
    return st.one_of(edges, inside.map(lambda v: (v, True)), outside.map(lambda v: (v, False)))


@st.composite
def _cases(draw: st.DrawFn) -> tuple[str, Field_, Any, bool]:
    path = draw(st.sampled_from(list(ENDPOINTS)))
    f = draw(st.sampled_from(FIELDS[path]))
    value, inside = draw(_values(f))
    return path, f, value, inside


@settings(max_examples=60, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(_cases())
def test_numeric_fields_property(http: httpx.Client, case: tuple[str, Field_, Any, bool]) -> None:
    path, f, value, inside = case
    if f.name in ("max_tokens", "max_completion_tokens", "n") and inside:
        value = min(value, 4)  # cheap on 2 cores: a few tokens exercise the same path
    _check(http, path, f, value, inside)
