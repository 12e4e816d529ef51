"""Ids as people type them: a unique start of an id, with or without its kind (``rsv_``,
``sub_``, ``cnf_``), read as the whole id; and the ids and pools a shell completes.

Why here: tables show ids cut short (as git shows commits), so every command that takes an id
must take what the table showed. A reservation's start is resolved by the server itself
(``reservations.*`` read a unique start of the caller's own ids, at least ``rsv_`` and 4
characters, and answer ``INVALID_INPUT`` listing them when several share it); this module adds
the kind when it was left out and explains a start too short to send. Subscriptions and
confirmations have no such reading on the server: their list (the caller's own, with the
caller's visibility) is small, so the start is matched against it here.

What this module must never do: guess between several ids, read ids the caller may not list,
or let completion print an error or take longer than ``COMPLETE_TIMEOUT_S``: a shell waits on
it at every Tab.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import typer

from bettercompute.cli import calls, client, settings
from bettercompute.core.exits import Exit


@dataclass(frozen=True)
class Kind:
    """One kind of id: its prefix, what people call it, and its length after the prefix."""

    prefix: str
    noun: str
    length: int


RESERVATION = Kind("rsv_", "reservation", 52)
SUBSCRIPTION = Kind("sub_", "subscription", 26)
CONFIRMATION = Kind("cnf_", "confirmation", 26)
KINDS = (RESERVATION, SUBSCRIPTION, CONFIRMATION)

#: The fewest characters after the kind that name an id (the server's ``SHORT_ID_MIN`` less
#: ``rsv_``; git's shortest abbreviation too).
MIN_CHARS = 4
#: How many candidates an error lists before it says how many more.
SHOWN = 10
#: Pages of a list read to find a start (200 ids each): past them, give more of the id.
PAGES = 5
#: A shell waits on completion at every Tab: past this, it completes nothing.
COMPLETE_TIMEOUT_S = 1.0


def normalize(text: str, kind: Kind) -> str:
    """``text`` with its kind: ``x7k2p…`` is ``rsv_x7k2p…`` for a reservation. Another kind's
    prefix is a usage error naming what the command takes."""
    given = text.strip()
    if given.startswith(kind.prefix):
        return given
    for other in KINDS:
        if other is not kind and given.startswith(other.prefix):
            raise client.Failure(
                f"{given} is a {other.noun} id; this command takes a {kind.noun} id"
                f" ({kind.prefix}…)",
                exit_code=Exit.USAGE,
            )
    return kind.prefix + given


def _too_short(given: str, kind: Kind, candidates: list[str]) -> client.Failure:
    return client.Failure(
        f"{given} is too short to name a {kind.noun}: give at least {MIN_CHARS} characters"
        f" after {kind.prefix}{_listed(candidates)}",
        exit_code=Exit.USAGE,
    )


def _listed(candidates: list[str]) -> str:
    if not candidates:
        return ""
    more = len(candidates) - SHOWN
    shown = ", ".join(candidates[:SHOWN]) + (f" and {more} more" if more > 0 else "")
    return f"; it starts {len(candidates)} of yours: {shown}"


def reservation(api: client.ApiClient, tenant: str, text: str) -> str:
    """The reservation id to send for ``text``: with its kind, and long enough that the server
    reads it (a start too short says so, listing the caller's reservations it starts)."""
    given = normalize(text, RESERVATION)
    if len(given) - len(RESERVATION.prefix) >= MIN_CHARS:
        return given
    mine = _ids(api, "reservations/list", {"tenantId": tenant})
    raise _too_short(given, RESERVATION, [i for i in mine if i.startswith(given)])


def listed(api: client.ApiClient, tenant: str, text: str, kind: Kind, operation: str) -> str:
    """The one id of ``operation``'s list (the caller's, with its visibility) that ``text``
    starts: a whole id as given, else a unique start of at least ``MIN_CHARS`` characters."""
    given = normalize(text, kind)
    if len(given) == len(kind.prefix) + kind.length:
        return given
    candidates = [i for i in _ids(api, operation, {"tenantId": tenant}) if i.startswith(given)]
    if len(given) - len(kind.prefix) < MIN_CHARS:
        raise _too_short(given, kind, candidates)
    if len(candidates) == 1:
        return candidates[0]
    if not candidates:
        raise client.Failure(
            f"no {kind.noun} of yours starts with {given}",
            code="NOT_FOUND",
            exit_code=Exit.NOT_FOUND,
        )
    raise client.Failure(
        f"{given} starts several {kind.noun}s{_listed(candidates)}; give more of it",
        exit_code=Exit.USAGE,
    )


def _ids(api: client.ApiClient, operation: str, body: dict[str, Any]) -> list[str]:
    """The ids of a list the caller may read, page by page (at most ``PAGES``)."""
    found: list[str] = []
    cursor = None
    for _ in range(PAGES):
        page = api.call(operation, {**body, **({"cursor": cursor} if cursor else {})})
        found += [str(item.get("id")) for item in page.get("items") or () if item.get("id")]
        cursor = page.get("nextCursor")
        if not cursor:
            break
    return sorted(found)


# --- shell completion ----------------------------------------------------------------------


def _completing(
    ctx: typer.Context, fetch: Callable[[client.ApiClient, str], Iterable[str]], incomplete: str
) -> list[str]:
    """What ``fetch`` answers that starts with ``incomplete`` (typer keeps only those), from
    the server the command line so far, the environment or the config file names, within
    ``COMPLETE_TIMEOUT_S``; nothing on any failure (a completion never prints an error)."""
    params = ctx.params
    try:
        found = settings.resolve(
            url=params.get("url"), token=params.get("token"), tenant=params.get("tenant"),
            output=None,
        )  # fmt: skip
        tenant = calls.tenant(found, timeout_s=COMPLETE_TIMEOUT_S)
        with client.ApiClient(
            url=found.url, token=found.token, timeout_s=COMPLETE_TIMEOUT_S
        ) as api:
            every = list(fetch(api, tenant))
    except Exception:  # a Tab must never print a traceback: it completes nothing instead
        return []
    return [i for i in every if i.startswith(incomplete)]


def _page(operation: str) -> Callable[[client.ApiClient, str], list[str]]:
    def fetch(api: client.ApiClient, tenant: str) -> list[str]:
        page = api.call(operation, {"tenantId": tenant})
        return [str(item.get("id")) for item in page.get("items") or () if item.get("id")]

    return fetch


def complete_reservation(ctx: typer.Context, incomplete: str) -> list[str]:
    """Your reservations' ids (the newest page)."""
    return _completing(ctx, _page("reservations/list"), incomplete)


def complete_subscription(ctx: typer.Context, incomplete: str) -> list[str]:
    """Your tenant's subscriptions' ids."""
    return _completing(ctx, _page("events/subscriptions/list"), incomplete)


def complete_confirmation(ctx: typer.Context, incomplete: str) -> list[str]:
    """The confirmations that name you."""
    return _completing(ctx, _page("confirmations/list"), incomplete)


def complete_pool(ctx: typer.Context, incomplete: str) -> list[str]:
    """Your pools (owned or offered)."""

    def fetch(api: client.ApiClient, tenant: str) -> list[str]:
        page = api.call("pools/list", {"tenantId": tenant})
        return [str(p.get("poolId")) for p in page.get("items") or () if p.get("poolId")]

    return _completing(ctx, fetch, incomplete)
