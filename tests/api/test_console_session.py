"""The console's sign-in cookie (``api.sessions``): what signing in sets, that the cookie is a
credential wherever a bearer token is, and the attacks it must not open: a cross-site POST
carrying the cookie, a forged or revoked cookie."""

from __future__ import annotations

import httpx
from aiohttp.test_utils import make_mocked_request

from bettercompute.api import fairness, sessions
from tests.api.conftest import Api, create_body

CSRF = {"X-Better-Compute": "1"}


def cookie_of(response: httpx.Response) -> list[str]:
    return [v for k, v in response.headers.multi_items() if k.lower() == "set-cookie"]


async def sign_in(api: Api, token: str, **headers: str) -> httpx.Response:
    return await api.client.post(
        "/console/session", json={"token": token}, headers={**CSRF, **headers}
    )


async def test_signing_in_sets_an_httponly_strict_cookie_and_answers_whoami(api: Api):
    response = await sign_in(api, "token-of-alice")
    assert response.status_code == 200, response.text
    assert response.json()["data"] == {
        "identityId": "alice",
        "tenantId": "acme",
        "kind": "user",
        "groups": [],
    }
    (cookie,) = cookie_of(response)
    attributes = [part.strip().lower() for part in cookie.split(";")]
    assert attributes[0] == f"{sessions.COOKIE}=token-of-alice"
    assert "httponly" in attributes
    assert "samesite=strict" in attributes
    assert "path=/" in attributes
    assert f"max-age={sessions.SESSION_SECONDS}" in attributes
    assert "secure" not in attributes  # plain HTTP: a Secure cookie would never come back
    # Behind a proxy that ended TLS, the cookie is Secure.
    proxied = await sign_in(api, "token-of-alice", **{"X-Forwarded-Proto": "https"})
    assert "secure" in [p.strip().lower() for p in cookie_of(proxied)[0].split(";")]


async def test_a_bad_token_is_401_and_sets_no_cookie(api: Api):
    for token in ("not-a-token", "token-of-mallory"):
        response = await sign_in(api, token)
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "ACCESS_DENIED"
        assert cookie_of(response) == []
        assert token not in response.text


async def test_sign_in_input_is_checked_naming_the_field(api: Api):
    for body, field in (
        ({}, "body"),
        ({"token": ""}, "token"),
        ({"token": 7}, "token"),
        ({"token": "a b"}, "token"),
        ({"token": "x" * (sessions.MAX_TOKEN_CHARS + 1)}, "token"),
        ({"token": "token-of-alice", "extra": 1}, "body"),
    ):
        response = await api.client.post("/console/session", json=body, headers=CSRF)
        assert response.status_code == 400, body
        assert response.json()["error"]["details"]["field"] == field
        assert cookie_of(response) == []
    no_header = await api.client.post("/console/session", json={"token": "token-of-alice"})
    assert no_header.status_code == 400
    assert no_header.json()["error"]["details"]["field"] == "X-Better-Compute"
    assert cookie_of(no_header) == []


async def test_the_cookie_is_a_credential_for_operations(api: Api):
    cookie = {"Cookie": f"{sessions.COOKIE}=token-of-alice"}
    response = await api.client.post(
        "/api/compute/reservations/create", json=create_body(), headers={**CSRF, **cookie}
    )
    assert response.status_code == 200, response.text
    assert response.json()["data"]["ownerIdentityId"] == "alice"
    # A header, when given, is the credential, whatever the cookie says.
    header_wins = await api.client.post(
        "/api/compute/whoami",
        json={},
        headers={**CSRF, **cookie, "Authorization": "Bearer token-of-gina"},
    )
    assert header_wins.json()["data"]["identityId"] == "gina"


async def test_a_cross_site_post_with_the_cookie_but_no_csrf_header_is_refused(api: Api):
    # What a page of another site can send: a form post (no custom header), with the cookie
    # if the browser attached it.
    for content_type, content in (
        ("text/plain", b'{"tenantId": "acme"}'),
        ("application/x-www-form-urlencoded", b"tenantId=acme"),
        ("application/json", httpx.Request("POST", "/", json=create_body()).content),
    ):
        response = await api.client.post(
            "/api/compute/reservations/create",
            content=content,
            headers={
                "Content-Type": content_type,
                "Cookie": f"{sessions.COOKIE}=token-of-alice",
                "Origin": "https://evil.example",
            },
        )
        assert response.status_code == 400, response.text
        assert response.json()["error"]["details"]["field"] == "X-Better-Compute"
    assert await api.rows("reservations") == 0
    assert await api.rows("idempotency") == 0


async def test_a_forged_or_revoked_cookie_gets_401_no_data_and_is_cleared(api: Api):
    await api.ok("reservations/create", create_body())
    for value in ("token-of-mallory", "bcdev_nobody", "token-of-alice-revoked"):
        response = await api.client.post(
            "/api/compute/reservations/list",
            json={"tenantId": "acme", "scope": "all"},
            headers={**CSRF, "Cookie": f"{sessions.COOKIE}={value}"},
        )
        assert response.status_code == 401
        body = response.json()
        assert set(body) == {"error"}
        assert body["error"]["code"] == "ACCESS_DENIED"
        assert "rsv_" not in response.text
        (cleared,) = cookie_of(response)
        assert cleared.startswith(f"{sessions.COOKIE}=;")
        assert "Max-Age=0" in cleared
    # And no cookie at all is 401 too, as without a header.
    bare = await api.client.post(
        "/api/compute/reservations/list", json={"tenantId": "acme"}, headers=CSRF
    )
    assert bare.status_code == 401


async def test_the_event_stream_takes_the_cookie(api: Api):
    async with api.client.stream(
        "GET",
        "/api/compute/events/watch?tenantId=acme",
        headers={"Cookie": f"{sessions.COOKIE}=token-of-alice"},
    ) as stream:
        assert stream.status_code == 200
        assert stream.headers["Content-Type"].startswith("text/event-stream")
    refused = await api.client.get(
        "/api/compute/events/watch?tenantId=acme",
        headers={"Cookie": f"{sessions.COOKIE}=token-of-mallory"},
    )
    assert refused.status_code == 401
    # Another tenant's stream is still refused to the cookie's caller.
    other = await api.client.get(
        "/api/compute/events/watch?tenantId=globex",
        headers={"Cookie": f"{sessions.COOKIE}=token-of-alice"},
    )
    assert other.status_code == 403


async def test_signing_out_clears_the_cookie(api: Api):
    refused = await api.client.post("/console/session/delete")
    assert refused.status_code == 400
    response = await api.client.post("/console/session/delete", headers=CSRF)
    assert response.status_code == 200
    (cleared,) = cookie_of(response)
    assert cleared.startswith(f"{sessions.COOKIE}=;")
    assert "Max-Age=0" in cleared
    assert "HttpOnly" in cleared
    assert "SameSite=Strict" in cleared


def test_a_cookie_is_counted_as_its_token_for_the_clients_share():
    # api.fairness counts requests in flight per token: a browser's cookie is its token, so a
    # page cannot escape the per-token share by leaving the header out.
    by_cookie = make_mocked_request(
        "POST", "/api/compute/whoami", headers={"Cookie": f"{sessions.COOKIE}=token-of-alice"}
    )
    by_header = make_mocked_request(
        "POST", "/api/compute/whoami", headers={"Authorization": "Bearer token-of-alice"}
    )
    key = fairness.token_key(sessions.authorization(by_cookie))
    assert key is not None
    assert key == fairness.token_key(sessions.authorization(by_header))
    assert sessions.authorization(make_mocked_request("GET", "/")) == ""
