"""Following a queued reservation until it is placed or ``--wait`` runs out.

Why here: the guide says ``better-compute reserve`` sends ``wait`` and, "if the answer is still
Queued, keeps polling reservations.get until the same deadline". The server holds a create for
at most 30 seconds, so a longer ``--wait`` (or a server that answered early) is finished here.

What this module must never do: wait past the deadline, treat a timeout as an error (a queued
reservation is a valid answer), or create anything: it only reads with ``reservations.get``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

from rich.console import Console

from bettercompute.cli import client

if TYPE_CHECKING:
    # Annotations only: the CLI starts without loading pydantic.
    from bettercompute.core import answers

#: States a reservation never leaves: waiting for another one would never end.
ENDED = ("released", "expired", "cancelled", "failed", "denied")

#: Polls start quick (a batch may be moments away) and back off so a long wait stays cheap.
FIRST_POLL_S = 0.25
LAST_POLL_S = 2.0


#: What ``--wait-for`` a state is satisfied by: a reservation past ``placed`` was placed.
REACHED = {"placed": ("placed", "binding", "active"), "active": ("active",)}


def reached(view: Any, until: str) -> bool:
    """True when ``view``'s state is ``until`` or past it (``--wait-for``)."""
    state = view.get("state") if isinstance(view, dict) else None
    return state in REACHED.get(until, (until,))


def still_running(view: Any) -> bool:
    """True while the reservation's operation is ``running`` (a draft or ``Queued``)."""
    if not isinstance(view, dict):
        return False
    operation = view.get("operation")
    return isinstance(operation, dict) and operation.get("state") == "running"


def follow(
    api: client.ApiClient,
    *,
    tenant: str,
    view: answers.Reservation,
    deadline: float,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    until: str | None = None,
) -> answers.Reservation:
    """Read the reservation again until its operation stops running (or, with ``until``,
    until it reaches that state or ends) or ``deadline`` passes.

    Answers the last read either way. A spinner shows on stderr when it is a terminal.
    """

    def waiting(current: Any) -> bool:
        if until is None:
            return still_running(current)
        state = current.get("state") if isinstance(current, dict) else None
        return still_running(current) or not (reached(current, until) or state in ENDED)

    if not waiting(view):
        return view
    err = Console(stderr=True)
    # No spinner where nobody watches: stderr piped to a file or a program.
    spinner: contextlib.AbstractContextManager[Any] = (
        err.status(f"Waiting for {view.get('id')} to be {until or 'placed'}…")
        if err.is_terminal
        else contextlib.nullcontext()
    )
    delay = FIRST_POLL_S
    with spinner:
        while waiting(view):
            left = deadline - clock()
            if left <= 0:
                break
            sleep(min(delay, left))
            delay = min(delay * 2, LAST_POLL_S)
            try:
                answer = api.call(
                    "reservations/get", {"tenantId": tenant, "reservationId": view["id"]}
                )
            except client.Failure as e:
                # A draft is still ``running`` and ``get`` answers NOT_FOUND for drafts: keep
                # the last answer and read again, until the deadline.
                if e.code == "NOT_FOUND":
                    continue
                raise
            if isinstance(answer, dict):
                view = cast("answers.Reservation", answer)  # the server's reservations.get
    return view


def waited_line(view: answers.Reservation, *, tenant: str, created: bool = False) -> str:
    """How to follow a reservation: when ``--wait`` ran out with it still queued, or
    (``created``) when reading it again failed after the create succeeded."""
    rid = view.get("id")
    follow_it = f"`better-compute reservations get {rid} --tenant {tenant}`"
    if created:
        return f"{rid} was created before this failed; follow it with {follow_it}"
    return f"{rid} is still queued; the request stands. Follow it with {follow_it}."
