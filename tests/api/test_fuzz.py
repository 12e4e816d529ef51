"""Property-based fuzzing of every operation: whatever JSON arrives, the answer is a 200 with
``{"data": …}`` or a documented error envelope, never a 5xx.

Two kinds of bodies, POSTed over a real socket to the real app on the real database:

* random JSON: objects of the document's field names and random keys with random values, and
  a few bodies that are not objects at all;
* bodies built from the OpenAPI document's own request schemas (so most are nearly valid and
  reach the service, the database and the placer), then mutated: a field dropped, added,
  replaced by random JSON or wrapped in a list or an object.

Bounded: 150 examples per operation, ``deadline=None`` (a create takes milliseconds,
but the first ones warm the pool).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from bettercompute.api import errors, openapi, operations
from bettercompute.core import ids
from bettercompute.core.errors import ErrorCode
from tests.api.conftest import POOL, Api, create_body

DOCUMENT = openapi.document()
SCHEMAS = DOCUMENT["components"]["schemas"]
OPERATIONS = {op.name: op for op in operations.OPERATIONS}

#: A reservation the fuzz may hit by id: alice's, created before each test.
SEED_KEY = "fuzz-seed"
SEED_ID = ids.draft_id("acme", "alice", SEED_KEY)

# Epoch ms of 3000-01-01: most ``start`` and ``until`` values are drawn below it, so most
# bodies get past validation; the end of the calendar has its own tests at the end of the file.
SAFE_MS = 32_503_680_000_000

EXAMPLES = 150

SETTINGS = {
    "deadline": None,
    "suppress_health_check": [
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.filter_too_much,
    ],
}

# --- strategies ------------------------------------------------------------------------------

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=24)
)
json_values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
FIELD_NAMES = sorted({name for schema in SCHEMAS.values() for name in schema.get("properties", {})})

VALID_UNTIL = st.integers(min_value=0, max_value=SAFE_MS)
VALID_BY = st.sampled_from(["1h", "30m", 60_000, "366d"])

#: Fields drawn from these values instead of their schema, so that most bodies reach the
#: service, the database and the placer instead of failing validation at once (the random
#: bodies and the mutations bring the invalid values).
FAVOURITES: dict[str, st.SearchStrategy[Any]] = {
    "tenantId": st.sampled_from(["acme", "acme", "acme", "acme", "globex", "root"]),
    "poolId": st.sampled_from([POOL, POOL, "pool_globex"]),
    "reservationId": st.sampled_from([SEED_ID, SEED_ID, "rsv_missing"]),
    "duration": st.sampled_from(["1h", "8h", "90m", "2h30m", 3_600_000, "366d"]),
    "by": VALID_BY,
    "state": st.sampled_from([None, "placed", "pending", "released", "draft"]),
    "cursor": st.sampled_from([None, SEED_ID]),
    "binding": st.just("hold"),
    "node": st.none(),
    "gang": st.none() | st.just({"size": 2}),
    "wait": st.none() | st.just({"timeoutMs": 0}),
    "devices": st.lists(
        st.fixed_dictionaries(
            {"class": st.just("gpu"), "count": st.integers(min_value=1, max_value=20)},
            optional={"topology": st.sampled_from(["any", "nvlink-all"])},
        )
        | st.just({"class": "mig", "count": 1, "profile": "1g.10gb"}),
        min_size=1,
        max_size=2,
    ),
    "limit": st.integers(min_value=1, max_value=3),
    "start": st.integers(min_value=0, max_value=SAFE_MS),
    "until": st.none() | VALID_UNTIL,
}


def from_schema(schema: dict[str, Any], name: str | None = None) -> st.SearchStrategy[Any]:
    """Values that (mostly) satisfy a JSON schema of the document: types, enums, bounds,
    patterns, required and optional properties, ``$ref`` and ``anyOf``."""
    if "$ref" in schema:
        return from_schema(openapi_ref(schema["$ref"]), name)
    if name in FAVOURITES:
        return FAVOURITES[name]
    if "anyOf" in schema:
        return st.one_of([from_schema(s, name) for s in schema["anyOf"]])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    if "const" in schema:
        return st.just(schema["const"])
    kind = schema.get("type")
    if kind == "string":
        low, high = schema.get("minLength", 0), min(schema.get("maxLength", 40), 40)
        if "pattern" in schema:
            return st.from_regex(schema["pattern"], fullmatch=True).filter(
                lambda s: low <= len(s) <= schema.get("maxLength", 10**6)
            )
        return st.text(min_size=low, max_size=max(low, high))
    if kind == "integer":
        return st.integers(
            min_value=schema.get("minimum", -(2**40)), max_value=schema.get("maximum", 2**40)
        )
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    if kind == "array":
        low = schema.get("minItems", 0)
        return st.lists(
            from_schema(schema["items"]), min_size=low, max_size=min(schema.get("maxItems", 3), 3)
        )
    if kind == "object":
        properties = schema.get("properties", {})
        required = set(schema.get("required", []))
        return st.fixed_dictionaries(
            {k: from_schema(v, k) for k, v in properties.items() if k in required},
            optional={k: from_schema(v, k) for k, v in properties.items() if k not in required},
        )
    return json_values


def openapi_ref(ref: str) -> dict[str, Any]:
    name = ref.rsplit("/", 1)[-1]
    schema: dict[str, Any] = SCHEMAS[name]
    return schema


@st.composite
def mutated(draw: st.DrawFn, base: st.SearchStrategy[dict[str, Any]], *, extend: bool) -> Any:
    body = dict(draw(base))
    if extend:
        # Extend wants exactly one of until and by, a rule the schema cannot say; mostly obey.
        keep = draw(st.sampled_from(["until", "by", "until", "by", "both", "neither"]))
        if keep in ("until", "by"):
            drop = "by" if keep == "until" else "until"
            body.pop(drop, None)
            if body.get(keep) is None:
                body[keep] = draw(VALID_UNTIL if keep == "until" else VALID_BY)
    for _ in range(draw(st.sampled_from([0, 0, 0, 1, 2]))):
        how = draw(st.sampled_from(["drop", "add", "replace", "wrap"]))
        if how == "add" or not body:
            body[draw(st.sampled_from(FIELD_NAMES) | st.text(max_size=10))] = draw(json_values)
            continue
        key = draw(st.sampled_from(sorted(body)))
        if how == "drop":
            del body[key]
        elif how == "replace":
            body[key] = draw(json_values)
        else:
            body[key] = draw(st.sampled_from([[body[key]], {"value": body[key]}]))
    return body


def random_bodies() -> st.SearchStrategy[Any]:
    keys = st.sampled_from(FIELD_NAMES) | st.text(max_size=12)
    return st.dictionaries(keys, json_values, max_size=8) | json_values


def schema_bodies(operation: operations.Operation) -> st.SearchStrategy[Any]:
    return mutated(from_schema(SCHEMAS[operation.schema_name]), extend=operation.method == "extend")


# --- the property ----------------------------------------------------------------------------


async def post(api: Api, operation: operations.Operation, body: Any) -> None:
    # Encoded here with escapes, so even lone surrogates travel as valid JSON text.
    content = json.dumps(body).encode()
    response = await api.call(operation.path.removeprefix("/api/compute/"), content=content)
    assert response.status_code < 500, (body, response.status_code, response.text)
    answer = response.json()
    # Shown by --hypothesis-show-statistics: how deep the bodies got.
    event(f"{response.status_code} {answer.get('error', {}).get('code', 'data')}")
    if response.status_code == 200:
        assert set(answer) == {"data"}, answer
        assert isinstance(answer["data"], dict)
        return
    assert set(answer) == {"error"}, answer
    error = answer["error"]
    assert set(error) == {"code", "message", "details"}, error
    assert error["code"] in errors.CODES, error
    assert isinstance(error["message"], str)
    assert error["message"]
    assert isinstance(error["details"], dict)
    expected = 401 if response.status_code == 401 else errors.STATUS[ErrorCode(error["code"])]
    assert response.status_code == expected, (response.status_code, error)
    if error["code"] == "INVALID_INPUT":
        assert "field" in error["details"], error  # always names the field


@pytest.fixture
async def seeded(api: Api) -> Api:
    await api.ok("reservations/create", create_body(idempotencyKey=SEED_KEY))
    return api


NAMES = sorted(OPERATIONS)


#: Per operation: a third random JSON, two thirds mutated schema bodies. Built once, so
#: hypothesis reuses them (rebuilding ``from_regex`` per example costs more than the request).
BODIES = {
    name: st.one_of(random_bodies(), schema_bodies(op), schema_bodies(op))
    for name, op in OPERATIONS.items()
}


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=EXAMPLES, **SETTINGS)
@given(data=st.data())
async def test_no_body_breaks_the_server(seeded: Api, name: str, data: st.DataObject):
    await post(seeded, OPERATIONS[name], data.draw(BODIES[name], label="body"))


# --- windows at the end of the calendar, and invisible names -----------------------------------


async def test_a_create_ending_after_the_year_9999_is_invalid_input(api: Api):
    response = await api.call("reservations/create", create_body(start=253_402_300_799_999))
    assert response.status_code == 400, response.text


async def test_an_extend_past_the_year_9999_is_invalid_input(api: Api):
    far = 253_402_300_799_999 - 10 * 86_400_000
    rid = (await api.ok("reservations/create", create_body(start=far)))["id"]
    response = await api.call(
        "reservations/extend",
        {"tenantId": "acme", "reservationId": rid, "by": "366d", "idempotencyKey": "far"},
    )
    assert response.status_code == 400, response.text


async def test_an_unknown_field_with_an_empty_name_is_named_visibly(api: Api):
    error = await api.error(
        "reservations/get",
        {"tenantId": "acme", "reservationId": SEED_ID, "": 1},
        status=400,
        code="INVALID_INPUT",
    )
    assert not error["message"].startswith(":"), error


async def test_a_preview_ending_after_the_year_9999_is_invalid_input(api: Api):
    error = await api.error(
        "capacity/preview",
        create_body(start=253_402_300_799_999),
        status=400,
        code="INVALID_INPUT",
    )
    assert error["details"]["field"] == "start"
