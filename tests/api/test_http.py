"""The HTTP layer's own answers: the CSRF header, bearer tokens (and their 30-second cache),
bodies that are not JSON objects, unknown fields, bodies too large, unknown routes and methods,
request ids, an unexpected server error and an unreachable database."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import pytest

from bettercompute.core import ports
from bettercompute.iam import identities
from bettercompute.store.database import Database
from tests.api.conftest import TOKENS, Api, Serve, build_world, create_body


def error_of(response) -> dict:
    assert response.headers["Content-Type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"code", "message", "details"}
    return body["error"]


# --- the CSRF header ---------------------------------------------------------------------------


@pytest.mark.parametrize("value", [None, "0", "true", ""])
async def test_calls_without_the_csrf_header_are_refused_naming_it(api: Api, value: str | None):
    api.headers = {} if value is None else {"X-Better-Compute": value}
    response = await api.call("reservations/create", create_body())
    assert response.status_code == 400
    error = error_of(response)
    assert error["code"] == "INVALID_INPUT"
    assert error["details"]["field"] == "X-Better-Compute"
    assert "X-Better-Compute: 1" in error["message"]
    assert await api.rows("reservations") == 0


# --- bearer tokens -----------------------------------------------------------------------------


async def test_a_missing_bearer_token_is_401(api: Api):
    response = await api.call("reservations/create", create_body(), who=None)
    assert response.status_code == 401
    assert response.headers["WWW-Authenticate"].startswith("Bearer")
    error = error_of(response)
    assert error["code"] == "ACCESS_DENIED"
    assert "bearer token is missing" in error["message"]


@pytest.mark.parametrize(
    "header",
    [
        "Bearer not-a-token",
        "Basic YWxpY2U6c2VjcmV0",
        "Bearer",
        "token-of-alice",
        "Bearer token-of-alice extra",
    ],
)
async def test_an_invalid_bearer_token_is_401(api: Api, header: str):
    response = await api.call(
        "reservations/get",
        {"tenantId": "acme", "reservationId": "rsv_x"},
        who=None,
        headers={"Authorization": header},
    )
    assert response.status_code == 401
    error = error_of(response)
    assert error["code"] == "ACCESS_DENIED"
    assert "bearer token" in error["message"]


async def test_the_bearer_scheme_is_case_insensitive(api: Api):
    response = await api.call(
        "reservations/create",
        create_body(),
        who=None,
        headers={"Authorization": "bearer token-of-alice"},
    )
    assert response.status_code == 200, response.text


class CountingAuthenticator:
    """Our own boundary: static tokens, counting how often they are asked."""

    def __init__(self) -> None:
        self.inner = identities.StaticTokenAuthenticator(TOKENS)
        self.asked = 0

    async def authenticate(self, token: str) -> ports.Caller | None:
        self.asked += 1
        return await self.inner.authenticate(token)


async def test_credentials_are_cached_but_refusals_are_not(db: Database, serve: Serve):
    await build_world(db)
    counting = CountingAuthenticator()
    api = await serve(authenticator=counting)
    for _ in range(3):
        await api.ok("reservations/list", {"tenantId": "acme"})
    assert counting.asked == 1
    for _ in range(2):
        response = await api.call(
            "reservations/list", {"tenantId": "acme"}, headers={"Authorization": "Bearer nope"}
        )
        assert response.status_code == 401
    assert counting.asked == 3


# --- bodies ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (b"{not json", "not valid JSON"),
        (b"", "the body is empty"),
        (b"   ", "the body is empty"),
        (b'{"tenantId": NaN}', "not valid JSON"),
        (b'{"limit": Infinity}', "not valid JSON"),
        (b"\xff\xfe\x00garbage", "not valid JSON"),
        (b"[" * 100_000 + b"]" * 100_000, "not valid JSON"),
        (b'{"limit": ' + b"9" * 5000 + b"}", "not valid JSON"),
        (b"[]", "must be a JSON object"),
        (b'"a string"', "must be a JSON object"),
        (b"null", "must be a JSON object"),
    ],
)
async def test_a_body_that_is_not_a_json_object_is_invalid_input(
    api: Api, content: bytes, reason: str
):
    response = await api.call("reservations/list", content=content)
    assert response.status_code == 400
    error = error_of(response)
    assert error["code"] == "INVALID_INPUT"
    assert error["details"]["field"] == "body"
    assert reason in error["message"]


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (create_body(colour="blue"), "colour"),
        (
            create_body(devices=[{"class": "gpu", "count": 1, "colour": "blue"}]),
            "devices[0].colour",
        ),
        ({"tenantId": "acme", "reservationId": "rsv_x", "force": True}, "force"),
    ],
)
async def test_an_unknown_field_is_invalid_input_naming_it(api: Api, body: dict, field: str):
    operation = "reservations/create" if "devices" in body else "reservations/get"
    response = await api.call(operation, body)
    assert response.status_code == 400
    error = error_of(response)
    assert error == {
        "code": "INVALID_INPUT",
        "message": f"{field}: unknown field",
        "details": {"field": field, "reason": "unknown field"},
    }


async def test_a_bad_value_names_the_field_and_the_reason(api: Api):
    response = await api.call("reservations/create", create_body(duration="forever"))
    error = error_of(response)
    assert response.status_code == 400
    assert error["details"]["field"] == "duration"
    assert "cannot read 'forever'" in error["message"]


async def test_a_body_over_the_limit_is_413(db: Database, serve: Serve):
    await build_world(db)
    api = await serve(max_body_bytes=1024)
    big = create_body(idempotencyKey="k" * 200, projectId="p" * 120, padding="x" * 2000)
    response = await api.call("reservations/create", big)
    assert response.status_code == 413
    error = error_of(response)
    assert error["code"] == "INVALID_INPUT"
    assert error["details"]["field"] == "body"
    assert "1024 bytes" in error["message"]

    async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: the reader must stop it
        for _ in range(10):
            yield b" " * 512

    response = await api.client.post(
        "/api/compute/reservations/create",
        content=chunks(),
        headers={**api.headers, "Authorization": "Bearer token-of-alice"},
    )
    assert response.status_code == 413
    assert error_of(response)["details"]["field"] == "body"
    # Under the limit, the same app answers normally.
    assert (await api.call("reservations/create", create_body())).status_code == 200


# --- routes, methods, request ids --------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", "/api/compute/reservations/delete"),
        ("POST", "/api/compute/reservations"),
        ("GET", "/nothing-here"),
        ("POST", "/api/compute/capacity/preview/x"),
        ("GET", "/metrics"),  # on the metrics port only (tests/api/test_plain_routes.py)
    ],
)
async def test_an_unknown_route_is_a_json_404(api: Api, method: str, path: str):
    response = await api.client.request(method, path, headers=api.headers)
    assert response.status_code == 404
    assert error_of(response)["code"] == "NOT_FOUND"
    assert response.headers["X-Request-Id"].startswith("req_")


@pytest.mark.parametrize(
    ("method", "path", "allowed"),
    [
        ("GET", "/api/compute/reservations/create", "POST"),
        ("PUT", "/api/compute/capacity/preview", "POST"),
        ("POST", "/healthz", "GET"),
        ("DELETE", "/readyz", "GET"),
    ],
)
async def test_a_wrong_method_is_a_json_405(api: Api, method: str, path: str, allowed: str):
    response = await api.client.request(method, path, headers=api.headers)
    assert response.status_code == 405
    error = error_of(response)
    assert error["code"] == "INVALID_INPUT"
    assert error["details"]["field"] == "method"
    assert allowed in error["details"]["allowed"]
    assert allowed in response.headers["Allow"]


async def test_request_ids_are_echoed_or_made_up(api: Api):
    given = await api.call(
        "reservations/list", {"tenantId": "acme"}, headers={"X-Request-Id": "abc.1"}
    )
    assert given.headers["X-Request-Id"] == "abc.1"
    made = await api.call("reservations/list", {"tenantId": "acme"})
    assert made.headers["X-Request-Id"].startswith("req_")
    for unsafe in ("has space", "x" * 129, "ünïcode".encode()):
        response = await api.call(
            "reservations/list", {"tenantId": "acme"}, headers={"X-Request-Id": unsafe}
        )
        assert response.headers["X-Request-Id"].startswith("req_")
    refused = await api.call("reservations/list", {}, headers={"X-Request-Id": "r-2"})
    assert refused.status_code == 400
    assert refused.headers["X-Request-Id"] == "r-2"


# --- server-side failures ----------------------------------------------------------------------


class BrokenAuthenticator:
    """Our own boundary: an authenticator whose back end fails unexpectedly."""

    async def authenticate(self, token: str) -> ports.Caller | None:
        raise RuntimeError("the identity provider exploded")


async def test_an_unexpected_error_is_a_logged_500_with_the_request_id(
    db: Database, serve: Serve, caplog: pytest.LogCaptureFixture
):
    api = await serve(authenticator=BrokenAuthenticator())
    with caplog.at_level(logging.ERROR, logger="bettercompute.api.app"):
        response = await api.call(
            "reservations/list", {"tenantId": "acme"}, headers={"X-Request-Id": "trace-me"}
        )
    assert response.status_code == 500
    error = error_of(response)
    assert error["code"] == "INTERNAL"
    assert error["details"] == {"requestId": "trace-me"}
    assert "exploded" not in response.text  # no internals in the answer …
    logged = [r for r in caplog.records if "trace-me" in r.getMessage()]
    assert logged  # … but in the log, with the id the caller was given
    assert logged[0].exc_info is not None


async def test_an_unreachable_database_is_503_unavailable(db: Database, serve: Serve, pg_dsn: str):
    closed = await Database.open(pg_dsn, min_size=1, max_size=1, migrate=False)
    await closed.close()
    api = await serve(database=closed)
    response = await api.call("reservations/create", create_body())
    assert response.status_code == 503
    assert response.headers["Retry-After"] == "5"
    error = error_of(response)
    assert error["code"] == "UNAVAILABLE"
    assert error["details"]["requestId"] == response.headers["X-Request-Id"]
