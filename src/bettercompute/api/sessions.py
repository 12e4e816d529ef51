"""A request's credential (a bearer token, or the web console's session cookie) and the
console's sign-in and sign-out routes.

Why it exists: a browser page cannot put a bearer token on an ``EventSource`` and must not keep
one where a script can read it. So the console trades the token once for a cookie the page
never sees (``HttpOnly``), that no other site's request carries (``SameSite=Strict``), and that
the API takes wherever it takes ``Authorization: Bearer``:

* ``POST /console/session`` with ``X-Better-Compute: 1`` and ``{"token": "<bearer token>"}``:
  the token is checked by the API's authenticator; valid, the answer is ``200 {"data":
  <whoami>}`` and sets ``bcd_session`` (``HttpOnly; SameSite=Strict; Path=/``, ``Secure`` when
  the request came over TLS, directly or by a proxy's ``X-Forwarded-Proto``, for
  ``SESSION_SECONDS``); not valid, ``401 ACCESS_DENIED`` and no cookie.
* ``POST /console/session/delete`` with the same header: the cookie is cleared.
* Every operation and ``events/watch``: ``Authorization`` when the request has one, else the
  cookie. The cookie is the token itself, checked like a header's on every request (a revoked
  or expired token ends the session at once: 401, and the answer clears the cookie).

The CSRF header stays required for every operation, cookie or not (``api.app``): a cross-site
form can send neither the header nor, with ``SameSite=Strict``, the cookie.

What it must never do: log or echo a token, set the cookie for a token the authenticator did
not accept, or make the cookie readable by a script.
"""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from bettercompute.api import errors
from bettercompute.core import ports
from bettercompute.iam.identities import CachingAuthenticator

#: The console's session cookie: the bearer token, for this site only.
COOKIE = "bcd_session"
#: How long a browser keeps the cookie (a working day); the token's own expiry ends it sooner.
SESSION_SECONDS = 12 * 3600
SIGN_IN = "/console/session"
SIGN_OUT = "/console/session/delete"
#: RFC 6265's cookie-octet: what a cookie value may hold unquoted. A token with anything else
#: (a space, a quote, a comma) could not come back intact.
_COOKIE_VALUE = re.compile(r"[\x21\x23-\x2b\x2d-\x3a\x3c-\x5b\x5d-\x7e]+")
#: A browser keeps cookies of up to 4096 bytes, name and attributes included.
MAX_TOKEN_CHARS = 3800
#: The sign-in body: a token and a little JSON around it.
MAX_SIGN_IN_BYTES = 8192

WhoAmI = Callable[[ports.Caller], Awaitable[dict[str, Any]]]


def authorization(request: web.Request) -> str:
    """The request's credential as an ``Authorization`` value (the cookie's as ``Bearer …``),
    for counting it (``api.fairness``); empty without one."""
    header = request.headers.get("Authorization", "")
    if header.strip():
        return header
    cookie = request.cookies.get(COOKIE, "")
    return f"Bearer {cookie}" if cookie else ""


async def authenticate(request: web.Request, authenticator: CachingAuthenticator) -> ports.Caller:
    """The caller of ``request``: by its ``Authorization`` header, else by the console's
    cookie; 401 ``ACCESS_DENIED`` when neither is there or the token is not valid."""
    header = request.headers.get("Authorization", "").strip()
    if header:
        scheme, _, token = header.partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise errors.unauthenticated(
                "the Authorization header is not a bearer token: send "
                "'Authorization: Bearer <token>'"
            )
        caller = await authenticator.authenticate(token)
        if caller is None:
            raise errors.unauthenticated("the bearer token is not valid")
        return caller
    cookie = request.cookies.get(COOKIE, "")
    if not cookie:
        raise errors.unauthenticated(
            "the bearer token is missing: send 'Authorization: Bearer <token>' "
            "(or sign in to the console)"
        )
    caller = await authenticator.authenticate(cookie)
    if caller is None:
        refusal = errors.unauthenticated(
            "the console session is not valid (its token expired or was revoked): sign in again"
        )
        refusal.details["cookie"] = COOKIE
        refusal.headers["Set-Cookie"] = _cleared(request)
        raise refusal
    return caller


def install(app: web.Application, *, authenticator: CachingAuthenticator, whoami: WhoAmI) -> None:
    """Add the sign-in and sign-out routes to ``app``."""

    async def sign_in(request: web.Request) -> web.StreamResponse:
        _check_header(request)
        token = await _token(request)
        caller = await authenticator.authenticate(token)
        if caller is None:
            raise errors.unauthenticated("the token is not valid: check it was copied whole")
        response = web.json_response({"data": await whoami(caller)}, dumps=json.dumps)
        response.set_cookie(
            COOKIE,
            token,
            max_age=SESSION_SECONDS,
            path="/",
            secure=_over_tls(request),
            httponly=True,
            samesite="Strict",
        )
        return response

    async def sign_out(request: web.Request) -> web.StreamResponse:
        _check_header(request)
        response = web.json_response({"data": {"signedOut": True}})
        response.headers["Set-Cookie"] = _cleared(request)
        return response

    app.router.add_post(SIGN_IN, sign_in, name="console.session")
    app.router.add_post(SIGN_OUT, sign_out, name="console.session.delete")


def _check_header(request: web.Request) -> None:
    # The same rule as every operation (api.app): a page of another site cannot add it.
    if request.headers.get("X-Better-Compute") != "1":
        raise errors.invalid_input(
            "X-Better-Compute", "every call must carry the header 'X-Better-Compute: 1'"
        )


async def _token(request: web.Request) -> str:
    if request.content_length is not None and request.content_length > MAX_SIGN_IN_BYTES:
        raise errors.too_large(MAX_SIGN_IN_BYTES)
    raw = await request.read()  # bounded by the app's client_max_size
    if len(raw) > MAX_SIGN_IN_BYTES:
        raise errors.too_large(MAX_SIGN_IN_BYTES)
    try:
        body = json.loads(raw)
    except ValueError:
        raise errors.invalid_input("body", 'not valid JSON: send {"token": "<token>"}') from None
    if not isinstance(body, dict) or set(body) != {"token"}:
        raise errors.invalid_input("body", 'must be {"token": "<token>"} and nothing else')
    token = body["token"]
    if not isinstance(token, str) or not token.strip():
        raise errors.invalid_input("token", "required: the bearer token to sign in with")
    token = token.strip()
    if len(token) > MAX_TOKEN_CHARS:
        raise errors.invalid_input(
            "token", f"longer than a browser cookie holds (at most {MAX_TOKEN_CHARS} characters)"
        )
    if not _COOKIE_VALUE.fullmatch(token):
        raise errors.invalid_input(
            "token", "has characters a cookie cannot carry (spaces, quotes, commas, ';', '\\')"
        )
    return token


def _over_tls(request: web.Request) -> bool:
    # Behind an Ingress that ends TLS the request arrives as plain HTTP; the proxy says so.
    # Trusting the header can only add Secure, which makes the cookie stricter, never looser.
    forwarded = request.headers.get("X-Forwarded-Proto", "").split(",")[0].strip().lower()
    return request.secure or forwarded == "https"


def _cleared(request: web.Request) -> str:
    secure = "; Secure" if _over_tls(request) else ""
    return f"{COOKIE}=; Max-Age=0; Path=/; HttpOnly; SameSite=Strict{secure}"
