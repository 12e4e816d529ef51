"""Which Kubernetes service accounts are agents acting for a person (delegated confirmation).

Why here: on a cluster an agent is a program running as a service account. Its person is named
by an annotation on that service account, ``bcd.dev/acting-for: <the person's username>``, the
username the API server authenticates the person as (the same string the Reservation webhook
stamps and TokenReview answers). Both doors of the operator, the Reservation handlers and the
HTTP API's TokenReview callers, ask this module, so an agent is an agent whichever way it
comes in. A caller so marked is ``kind="agent"`` with ``on_behalf_of`` set; a refusal the
policy holds for confirmation then opens a confirmation request addressed to that person.

Who may mark a service account: whoever may annotate service accounts in its namespace. That
grants nothing: a delegation only turns a refusal into a question for the person named, who
alone may approve it.

What it must never do: guess. An API server that does not answer is an error (the caller is
asked to try again), never "no delegation", which would turn a held request into a plain
denial that no retry can undo. Only service accounts can be agents; a user is never looked up.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from bettercompute.core import ports
from bettercompute.kube import names, resources
from bettercompute.kube.client import KubeClient

_SERVICE_ACCOUNT_PREFIX = "system:serviceaccount:"


def service_account_of(username: str) -> tuple[str, str] | None:
    """``(namespace, name)`` of a service account's username, else ``None``."""
    if not username.startswith(_SERVICE_ACCOUNT_PREFIX):
        return None
    namespace, _, name = username.removeprefix(_SERVICE_ACCOUNT_PREFIX).partition(":")
    if not namespace or not name or ":" in name:
        return None
    return namespace, name


class Delegations:
    """Reads ``bcd.dev/acting-for`` from service accounts, each at most once per ``ttl_s``."""

    def __init__(
        self,
        kube: KubeClient,
        *,
        ttl_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.kube = kube
        self.ttl_s = ttl_s
        self.clock = clock
        # username -> (person or None, when the entry stops being trusted on ``clock``)
        self._seen: dict[str, tuple[str | None, float]] = {}

    async def acting_for(self, username: str) -> str | None:
        """The person a service account acts for, or ``None``. Raises ``KubeError`` when the
        API server does not answer (never cached)."""
        account = service_account_of(username)
        if account is None:
            return None
        seen = self._seen.get(username)
        if seen is not None and self.clock() < seen[1]:
            return seen[0]
        namespace, name = account
        obj = await self.kube.get(resources.SERVICE_ACCOUNTS, name, namespace=namespace)
        annotations = ((obj or {}).get("metadata") or {}).get("annotations") or {}
        person = str(annotations.get(names.ACTING_FOR) or "").strip() or None
        if len(self._seen) >= 10_000:  # bounded: forget the oldest half
            for key in list(self._seen)[:5_000]:
                del self._seen[key]
        self._seen[username] = (person, self.clock() + self.ttl_s)
        return person

    async def caller(self, caller: ports.Caller) -> ports.Caller:
        """``caller`` as an agent acting for its person when its service account names one."""
        person = await self.acting_for(caller.identity_id)
        if person is None or person == caller.identity_id:
            return caller
        return dataclasses.replace(caller, kind="agent", on_behalf_of=person)
