"""Each client's share of the HTTP server: what one client may hold at once.

Why it exists: one global limit of connections, and none per client, let a single client take
the whole server. An unauthenticated client reconnecting in a loop left 3 of 159 other requests
served; one tenant's token holding 512 event streams left none. So what a client holds is
counted by its remote address and by its bearer token, and a client over its share is refused
with 429 and ``Retry-After``, while everyone else goes on being served.

* Connections, by remote address: counted by ``api.serving`` as each connection is made (no
  request has been read yet, so no token is known).
* Requests in flight, by remote address and by token (the raw ``Authorization`` value, before
  it is checked: a client cycling through made-up tokens is still bounded by its address).
* Event streams (``events/watch``), by address and by token, counted apart from requests so
  that a client's streams never use up its requests, nor the other way round.

``Shares`` is the counting; ``ClientShares.hold`` is what ``api.app``'s pipeline wraps each
request in. The caps come from ``api.serving.HttpLimits``.

What it must never do: keep a count after its request ended (every ``hold`` gives back what it
took, whatever happens), keep a key whose count is zero (the tables would grow with every client
ever seen), or put a token in a log line or an answer.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass
class OverShare(Exception):
    """A client holds its whole share of ``what`` (``connections``, ``requests``,
    ``streams``) by ``by`` (``address``, ``token``)."""

    what: str
    by: str
    limit: int

    def __str__(self) -> str:
        return f"this client already has {self.limit} {self.what} open (by {self.by})"


class Shares:
    """How many of something each key holds now, at most ``cap`` each (0: no cap)."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.held: dict[str, int] = {}

    def has_room(self, key: str) -> bool:
        return self.cap <= 0 or self.held.get(key, 0) < self.cap

    def take(self, key: str) -> None:
        self.held[key] = self.held.get(key, 0) + 1

    def give_back(self, key: str) -> None:
        left = self.held.get(key, 0) - 1
        if left > 0:
            self.held[key] = left
        else:
            self.held.pop(key, None)


def token_key(authorization: str) -> str | None:
    """The key a request's bearer token is counted under: a digest, so the table holds no
    credential; ``None`` without a token."""
    scheme, _, token = authorization.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return None
    return hashlib.sha256(token.encode("utf-8", "surrogateescape")).hexdigest()[:32]


class ClientShares:
    """Requests and event streams in flight, by address and by token."""

    def __init__(
        self,
        *,
        requests_per_address: int,
        requests_per_token: int,
        streams_per_address: int,
        streams_per_token: int,
    ) -> None:
        self.requests = (Shares(requests_per_address), Shares(requests_per_token))
        self.streams = (Shares(streams_per_address), Shares(streams_per_token))

    @contextlib.contextmanager
    def hold(self, *, address: str, token: str | None, stream: bool) -> Iterator[None]:
        """One request (or stream) of this client, for the block's duration; ``OverShare``
        at once when the client already holds its share."""
        by_address, by_token = self.streams if stream else self.requests
        what = "event streams" if stream else "requests"
        if not by_address.has_room(address):
            raise OverShare(what, "address", by_address.cap)
        if token is not None and not by_token.has_room(token):
            raise OverShare(what, "token", by_token.cap)
        by_address.take(address)
        if token is not None:
            by_token.take(token)
        try:
            yield
        finally:
            by_address.give_back(address)
            if token is not None:
                by_token.give_back(token)
