"""Authentication: a bearer credential in, a ``Caller`` (or ``None``) out.

Why here: every door (HTTP, CLI, operator) authenticates the same way, through the
``Authenticator`` port, so a deployment chooses static tokens for development or a remote IAM
in production without the service noticing. ``CachingAuthenticator`` puts the guide's rule in
one place: "The credential is authenticated (cached for 30 seconds)".

What this module must never do: keep or log a raw token (tokens are held only as SHA-256
digests), compare tokens in time that depends on their content, or cache a refusal (a token
issued a moment ago must work at once). It never imports ``store`` or ``service``.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Callable, Mapping

from bettercompute.core.errors import ComputeError, ErrorCode
from bettercompute.core.ports import Authenticator, Caller


def token_digest(token: str) -> bytes:
    """SHA-256 of the token: the only form in which a token is kept or compared."""
    # surrogatepass: a header value with a lone surrogate must be refused, not crash hashing.
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()


class StaticTokenAuthenticator:
    """Fixed tokens, each naming one caller: for development, tests and service accounts."""

    def __init__(self, callers: Mapping[str, Caller]) -> None:
        if "" in callers:
            raise ComputeError(ErrorCode.INVALID_INPUT, "static tokens: a token must not be empty")
        self._entries = tuple((token_digest(token), caller) for token, caller in callers.items())

    async def authenticate(self, token: str) -> Caller | None:
        digest = token_digest(token)
        found: Caller | None = None
        # Compare with every entry, without stopping at a match, so neither the comparison nor
        # the position of the match shows in the time taken.
        for stored, caller in self._entries:
            if hmac.compare_digest(stored, digest):
                found = caller
        return found


class CachingAuthenticator:
    """Remembers successful authentications of another ``Authenticator`` for ``ttl_seconds``."""

    def __init__(
        self,
        inner: Authenticator,
        *,
        ttl_seconds: float = 30.0,
        max_entries: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if ttl_seconds <= 0:
            raise ValueError("ttl_seconds must be positive")
        if max_entries < 1:
            raise ValueError("max_entries must be at least 1")
        self._inner = inner
        self._ttl = ttl_seconds
        self._max_entries = max_entries
        self._clock = clock
        # digest -> (caller, expiry on ``clock``); insertion order is age, oldest first.
        self._entries: dict[bytes, tuple[Caller, float]] = {}

    async def authenticate(self, token: str) -> Caller | None:
        key = token_digest(token)
        cached = self._entries.get(key)
        if cached is not None:
            caller, expires_at = cached
            if self._clock() < expires_at:
                return caller
            del self._entries[key]
        fresh = await self._inner.authenticate(token)
        if fresh is None:
            return None
        # Another task may have cached this token while we awaited; pop so that re-inserting
        # moves it to the young end of the order.
        self._entries.pop(key, None)
        self._entries[key] = (fresh, self._clock() + self._ttl)
        # Oldest first out: a flood of distinct tokens cannot grow memory without bound.
        while len(self._entries) > self._max_entries:
            del self._entries[next(iter(self._entries))]
        return fresh
