"""A stored reservation as a Reservation's ``status``, and a refusal as a condition.

Why a module of its own: ``status`` is written from several places (the create handler, the
extend and renew handlers, the change listener), and must look the same whichever wrote it.
Conditions keep their ``lastTransitionTime`` while their status and reason stand still, as
Kubernetes conventions ask, so a re-projection does not look like a change to ``kubectl``.

Pure: the clock is passed in; nothing here does I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from bettercompute.core import moments
from bettercompute.core.errors import ComputeError

REFUSED = "Refused"

#: Keys of ``status`` a projection owns; a merge patch sets the absent ones to null.
PROJECTED = (
    "id",
    "state",
    "tenantId",
    "poolId",
    "during",
    "startTime",
    "endTime",
    "window",
    "leaseUntil",
    "gpus",
    "nodes",
    "conditions",
    "conditionDetails",
    "binding",
    "operation",
    "version",
    "leaseExpiresAt",
    "resourceName",
    "claimTemplate",
    "resources",
    "hostShare",
    "observedGeneration",
)


def rfc3339(ms: int | None) -> str | None:
    return None if ms is None else moments.rfc3339(ms)


def conditions(
    guide: Sequence[Mapping[str, Any]],
    *,
    previous: Sequence[Mapping[str, Any]] | None,
    now: str,
) -> list[dict[str, Any]]:
    """The guide's conditions as ``metav1.Condition``s (``status: "True"``, a CamelCase reason,
    ``lastTransitionTime``); ``observedGeneration`` is added by ``settle``."""
    before = {c.get("type"): c for c in previous or ()}
    out: list[dict[str, Any]] = []
    for condition in guide:
        kind = str(condition.get("type"))
        reason = str(condition.get("reason") or kind)
        old = before.get(kind)
        since = rfc3339(condition.get("since")) if condition.get("since") else None
        unchanged = old is not None and old.get("reason") == reason and old.get("status") == "True"
        out.append(
            {
                "type": kind,
                "status": "True",
                "reason": reason,
                "message": str(condition.get("message") or ""),
                "lastTransitionTime": (
                    since or (old or {}).get("lastTransitionTime") if unchanged else since or now
                ),
            }
        )
    return out


#: What a guide condition says beyond a ``metav1.Condition`` (when it began, on which nodes, by
#: which pods), shown in ``status.conditionDetails`` under the condition's type.
DETAILS = ("since", "nodes", "pods")


def condition_details(guide: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    # ``since`` is epoch ms in the guide's condition; people read it here, so RFC 3339.
    found = {
        str(c.get("type")): {
            k: rfc3339(c[k]) if k == "since" else c[k] for k in DETAILS if c.get(k) is not None
        }
        for c in guide
        if any(c.get(k) is not None for k in DETAILS)
    }
    return found or None


CLEARED = "Cleared"


def settle(
    current: Sequence[Mapping[str, Any]],
    *,
    previous: Sequence[Mapping[str, Any]] | None,
    now: str,
    generation: int | None,
    observed: int | None = None,
) -> list[dict[str, Any]]:
    """``current`` as Kubernetes conventions ask: a condition shown before and no longer
    reported turns ``status: "False"`` (reason ``Cleared``, its last transition now) instead of
    disappearing, and every condition carries ``observedGeneration`` (``generation``, or the one
    it had when a re-projection handles no spec, else the status's ``observed``)."""
    present = {c.get("type") for c in current}
    out = [dict(c) for c in current]
    for old in previous or ():
        if old.get("type") in present:
            continue
        if old.get("status") == "True":
            out.append(
                {
                    "type": old.get("type"),
                    "status": "False",
                    "reason": CLEARED,
                    "message": f"no longer so; it was {old.get('reason')}",
                    "lastTransitionTime": now,
                    "observedGeneration": old.get("observedGeneration"),
                }
            )
        else:
            out.append(dict(old))
    before = {c.get("type"): c for c in previous or ()}
    for item in out:
        seen = generation
        if seen is None:
            seen = (
                item.get("observedGeneration")
                or (before.get(item["type"]) or {}).get("observedGeneration")
                or observed
            )
        item["observedGeneration"] = int(seen or 0)
    return out


def transition_time(
    previous: Sequence[Mapping[str, Any]] | None, kind: str, status: str, *, now: str
) -> str:
    """A condition's ``lastTransitionTime``: kept while its status stands still, else ``now``."""
    for condition in previous or ():
        if condition.get("type") == kind and condition.get("status") == status:
            return str(condition.get("lastTransitionTime") or now)
    return now


#: Summary conditions, always present, for ``kubectl wait`` and GitOps health checks.
READY = "Ready"
PLACED = "Placed"
#: States whose window is booked (``Placed`` is True in them).
_BOOKED = ("placed", "binding", "active")


def summary(
    view: Mapping[str, Any],
    *,
    previous: Sequence[Mapping[str, Any]] | None,
    now: str,
    generation: int | None,
    refused: bool,
    observed: int | None = None,
) -> list[dict[str, Any]]:
    """``Ready`` (True while the reservation is ``active``: its devices are bound) and
    ``Placed`` (True while its window is booked), each with the state as its reason when
    False; ``kubectl wait --for=condition=Ready rsv/NAME`` waits on the first."""
    state = str(view.get("state") or "")
    reason = "".join(part.capitalize() for part in state.split("-")) or "Unknown"
    nodes = ", ".join((view.get("binding") or {}).get("nodeIds") or ())
    ready = state == "active"
    ready_message = (
        f"its devices are bound on {nodes}" if ready else f"the reservation is {state or 'new'}"
    )
    if refused and not ready:
        reason, ready_message = REFUSED, "the last operation was refused (see Refused)"
    placed = state in _BOOKED
    before = {c.get("type"): c for c in previous or ()}
    out = []
    for kind, status, why, message in (
        (READY, ready, "Active" if ready else reason, ready_message),
        (PLACED, placed, "Booked" if placed else reason, _placed_message(view, placed)),
    ):
        value = "True" if status else "False"
        old = before.get(kind)
        item: dict[str, Any] = {
            "type": kind,
            "status": value,
            "reason": why,
            "message": message,
            "lastTransitionTime": transition_time(previous, kind, value, now=now),
        }
        # A re-projection (no spec handled) keeps the generation the status last observed.
        seen = generation
        if seen is None:
            seen = (old or {}).get("observedGeneration", observed)
        if seen is not None:
            item["observedGeneration"] = seen
        out.append(item)
    return out


def _placed_message(view: Mapping[str, Any], placed: bool) -> str:
    during = view.get("during") or {}
    if placed and during:
        return f"booked from {rfc3339(during.get('start'))} to {rfc3339(during.get('end'))}"
    return "no window is booked"


def gpus(request: Mapping[str, Any]) -> int:
    """Devices booked: whole GPUs, MIG instances and slots, times the gang size."""
    gang = int((request.get("gang") or {}).get("size") or 1)
    return gang * sum(int(d.get("count") or 0) for d in request.get("devices") or ())


def reservation_status(
    view: Mapping[str, Any],
    *,
    nodes: Sequence[str],
    generation: int | None,
    previous: Mapping[str, Any] | None,
    now: str,
    refused: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The full projected ``status`` of a stored reservation (a merge patch body).

    ``refused`` is the ``Refused`` condition of an earlier operation, shown until an operation
    succeeds: a re-projection must not hide a refused extend.
    """
    previous = previous or {}
    during = view.get("during") or None
    status: dict[str, Any] = {key: None for key in PROJECTED}
    status.update(
        {
            "id": view["id"],
            "state": view["state"],
            "tenantId": view["tenantId"],
            "poolId": view["poolId"],
            "during": during,
            "startTime": rfc3339(during["start"]) if during else None,
            "endTime": rfc3339(during["end"]) if during else None,
            # What kubectl's columns show: a string reads the same for a past and a future
            # time (a date column shows a future one as <invalid>).
            "window": (
                {"start": moments.shown(during["start"]), "end": moments.shown(during["end"])}
                if during
                else None
            ),
            "leaseUntil": (
                moments.shown(view["leaseExpiresAt"]) if view.get("leaseExpiresAt") else None
            ),
            "gpus": gpus(view.get("request") or {}),
            "nodes": ",".join(nodes) if nodes else None,
            "conditions": conditions(
                view.get("conditions") or (),
                previous=previous.get("conditions"),
                now=now,
            ),
            "conditionDetails": condition_details(view.get("conditions") or ()),
            "binding": view.get("binding") or None,
            "operation": view.get("operation"),
            "version": view.get("version"),
            "leaseExpiresAt": rfc3339(view.get("leaseExpiresAt")),
            "resourceName": view.get("resourceName"),
            # What each node books of its host, and the part that is the pool's share.
            "resources": (view.get("request") or {}).get("resources") or None,
            "hostShare": view.get("hostShare"),
        }
    )
    if refused is not None:
        status["conditions"].append(dict(refused))
    status["conditions"] += summary(
        view,
        previous=previous.get("conditions"),
        now=now,
        generation=generation,
        refused=refused is not None,
        observed=previous.get("observedGeneration"),
    )
    status["conditions"] = settle(
        status["conditions"],
        previous=previous.get("conditions"),
        now=now,
        generation=generation,
        observed=previous.get("observedGeneration"),
    )
    if generation is not None:
        status["observedGeneration"] = generation
    else:
        status.pop("observedGeneration")
    return status


def disowned() -> dict[str, Any]:
    """A merge patch emptying what a projection showed, conditions and generation aside: the
    status of an object refused a reservation that another object owns."""
    kept = ("conditions", "observedGeneration")
    return {key: None for key in PROJECTED if key not in kept}


def refusal(error: ComputeError, *, operation: str, now: str) -> dict[str, Any]:
    """The ``Refused`` condition for an operation the core refused."""
    return {
        "type": REFUSED,
        "status": "True",
        "reason": error.code.value,
        "message": f"{operation}: {error.message}",
        "lastTransitionTime": now,
    }


def refused_in(status: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    """The ``Refused`` condition a status shows, if any."""
    for condition in (status or {}).get("conditions") or ():
        if condition.get("type") == REFUSED and condition.get("status") == "True":
            found: Mapping[str, Any] = condition
            return found
    return None


def with_refusal(
    previous: Mapping[str, Any] | None,
    refused: Mapping[str, Any],
    *,
    now: str,
    generation: int | None,
) -> list[dict[str, Any]]:
    """``previous``'s conditions with ``refused`` in place of an older refusal, and ``Ready``
    and ``Placed`` saying so (an object refused before it was ever admitted shows them too, so
    ``kubectl wait --for=condition=Ready`` has something to read)."""
    previous = previous or {}
    old = previous.get("conditions") or ()
    kept = [dict(c) for c in old if c.get("type") not in (REFUSED, READY, PLACED)]
    shown = {k: previous.get(k) for k in ("state", "binding", "during")}
    current = [
        *kept,
        dict(refused),
        *summary(
            shown,
            previous=old,
            now=now,
            generation=generation,
            refused=True,
            observed=previous.get("observedGeneration"),
        ),
    ]
    return settle(
        current,
        previous=old,
        now=now,
        generation=generation,
        observed=previous.get("observedGeneration"),
    )
