"""What ``kubectl bcd`` writes and how it reads what comes back, as pure functions.

Why it exists: the commands only move objects between the API server and the terminal. What a
Reservation looks like for a set of options, when a waited-for Reservation is done (ready,
refused, ended, never able to fit), what a GPUPool's status says about N free GPUs, and how a
failed API call reads as one line naming the object: those are decisions worth testing without
a cluster, so they live here.

What it must never do: I/O, read a clock (``now`` is passed in), or judge what the operator
judges: a refusal, a state and a window are read from ``status`` as the operator wrote them.
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lightkube import operators

from bettercompute.core import states
from bettercompute.core.exits import Exit, for_error_code
from bettercompute.kube import names
from bettercompute.kube.client import KubeError
from bettercompute.kubectl import times

#: The states a reservation never leaves (``refused`` too: the word people look for).
TERMINAL = frozenset({*(s.value for s in states.TERMINAL), "refused"})
#: How the operator starts an ``Unschedulable`` message that no wait can cure.
NEVER_FITS = "never fits this pool"
DEVICE_CLASSES = ("gpu", "mig", "slot")
BINDINGS = ("hold", "kubernetes", "node", "instance")
#: The device class a pool hands out, by its sharing mode.
CLASS_OF_SHARING = {"exclusive": "gpu", "mig": "mig", "timeslice": "slot", "mps": "slot"}


class UsageError(ValueError):
    """Options that do not make a request; ``option`` is the one to name."""

    def __init__(self, message: str, *, option: str) -> None:
        super().__init__(message)
        self.option = option


# --- a Reservation from options --------------------------------------------------------------


@dataclass(frozen=True)
class Ask:
    """What ``reserve`` asks for, as its options gave it."""

    pool: str
    count: int
    duration: str
    device_class: str = "gpu"
    start: str | None = None
    nvlink: bool = False
    profile: str | None = None
    gang: int | None = None
    binding: str | None = None
    spot: bool = False


@dataclass(frozen=True)
class Devices:
    """What ``--gpus N``, ``--mig PROFILE [--count N]`` or ``--slots N`` ask for."""

    device_class: str
    count: int
    profile: str | None = None


def devices(
    *,
    gpus: int | None,
    mig: str | None,
    count: int | None,
    slots: int | None,
    old_class: str | None = None,
    old_profile: str | None = None,
) -> Devices:
    """The devices of the options both CLIs share (docs/cli.md): ``--gpus N``, ``--mig PROFILE
    [--count N]`` or ``--slots N``. The old spellings still read the same: ``--class CLASS``
    with ``--gpus``/``--count N`` and ``--profile P``, and ``--count N`` alone for ``--gpus N``."""
    if old_class is not None or old_profile is not None:
        if mig is not None or slots is not None:
            raise UsageError(
                "--class and --profile are the old spellings of --mig and --slots: use one form",
                option="--class",
            )
        if gpus is not None and count is not None:
            raise UsageError("give --gpus or --count, not both", option="--count")
        chosen = old_class or ("mig" if old_profile else "gpu")
        return Devices(chosen, gpus or count or 1, old_profile)
    given = [n for n, v in (("--gpus", gpus), ("--mig", mig), ("--slots", slots)) if v is not None]
    if len(given) > 1:
        raise UsageError(
            f"give one of --gpus N, --mig PROFILE or --slots N (got {' and '.join(given)})",
            option=given[-1],
        )
    if mig is not None:
        return Devices("mig", count or 1, mig)
    if count is not None and gpus is not None:
        raise UsageError(
            "--count is the number of MIG instances: use it with --mig", option="--count"
        )
    if count is not None and slots is not None:
        raise UsageError(
            "--count is the number of MIG instances: use it with --mig", option="--count"
        )
    if slots is not None:
        return Devices("slot", slots)
    # --count alone is the old spelling of --gpus.
    return Devices("gpu", gpus or count or 1)


def reservation(ask: Ask, *, namespace: str, name: str | None) -> dict[str, Any]:
    """The Reservation to create: ``name``, else ``metadata.generateName: rsv-``."""
    if ask.device_class not in DEVICE_CLASSES:
        raise UsageError(f"must be one of {', '.join(DEVICE_CLASSES)}", option="--class")
    if ask.device_class == "mig" and not ask.profile:
        raise UsageError("--class mig needs a MIG profile, such as 1g.10gb", option="--mig")
    if ask.profile and ask.device_class != "mig":
        raise UsageError("a MIG profile is for --class mig only", option="--profile")
    if ask.nvlink and ask.device_class != "gpu":
        raise UsageError("--nvlink is for whole GPUs (--gpus N) only", option="--nvlink")
    if ask.binding is not None and ask.binding not in BINDINGS:
        raise UsageError(f"must be one of {', '.join(BINDINGS)}", option="--binding")
    device: dict[str, Any] = {"class": ask.device_class, "count": ask.count}
    if ask.nvlink:
        device["topology"] = "nvlink-all"
    if ask.profile:
        device["profile"] = ask.profile
    spec: dict[str, Any] = {"poolId": ask.pool, "devices": [device], "duration": ask.duration}
    if ask.gang is not None:
        spec["gang"] = {"size": ask.gang}
    if ask.start is not None:
        spec["start"] = ask.start
    if ask.binding is not None:
        spec["binding"] = ask.binding
    if ask.spot:
        spec["spot"] = True
    metadata: dict[str, Any] = {"namespace": namespace}
    if name:
        metadata["name"] = name
    else:
        metadata["generateName"] = "rsv-"
    return {
        "apiVersion": names.API_VERSION,
        "kind": "Reservation",
        "metadata": metadata,
        "spec": spec,
    }


def extend_patch(*, key: str, by: str | None, until: str | None) -> dict[str, Any]:
    """The merge patch of an extend: one of ``extendBy``/``until`` (the other cleared, as the
    CRD allows only one), with its own ``extendKey``."""
    if (by is None) == (until is None):
        raise UsageError("give exactly one of --by or --until", option="--by")
    return {"spec": {"extendBy": by, "until": until, "extendKey": key}}


def renew_patch(value: str) -> dict[str, Any]:
    return {"metadata": {"annotations": {names.RENEW: value}}}


RELEASE_PATCH: dict[str, Any] = {"spec": {"release": True}}


# --- reading a Reservation's status ----------------------------------------------------------


def status_of(obj: Mapping[str, Any] | None) -> Mapping[str, Any]:
    found = (obj or {}).get("status")
    return found if isinstance(found, Mapping) else {}


def conditions(obj: Mapping[str, Any] | None) -> list[Mapping[str, Any]]:
    return [c for c in status_of(obj).get("conditions") or () if isinstance(c, Mapping)]


def condition(obj: Mapping[str, Any] | None, kind: str) -> Mapping[str, Any] | None:
    for found in conditions(obj):
        if found.get("type") == kind:
            return found
    return None


def holding(obj: Mapping[str, Any] | None, kind: str) -> Mapping[str, Any] | None:
    """The condition ``kind`` while its status is True (a cleared one turns False and stays)."""
    found = condition(obj, kind)
    return found if found is not None and found.get("status") == "True" else None


def is_true(obj: Mapping[str, Any] | None, kind: str) -> bool:
    return holding(obj, kind) is not None


def refused(obj: Mapping[str, Any] | None, operation: str | None = None) -> str | None:
    """``REASON: message`` of the ``Refused`` condition (of ``operation``, when given: the
    operator starts its message with ``create:``, ``extend:`` …), or ``None``."""
    found = holding(obj, "Refused")
    if found is None:
        return None
    message = str(found.get("message") or "")
    if operation is not None and not message.startswith(f"{operation}:"):
        return None
    return f"{found.get('reason') or 'Refused'}: {message}".rstrip(": ")


def never_fits(obj: Mapping[str, Any] | None) -> str | None:
    """The ``Unschedulable`` message of a reservation no wait can place, or ``None``."""
    found = holding(obj, "Unschedulable")
    message = str((found or {}).get("message") or "")
    return message if message.startswith(NEVER_FITS) else None


def state(obj: Mapping[str, Any] | None) -> str:
    return str(status_of(obj).get("state") or "")


def ended(obj: Mapping[str, Any] | None) -> str | None:
    """``'released'`` … when the reservation is in a state it never leaves, else ``None``."""
    current = state(obj)
    return current if current in TERMINAL else None


def why_ended(obj: Mapping[str, Any] | None) -> str:
    """What the status says about why it ended: the operation's error, else a condition."""
    error = (status_of(obj).get("operation") or {}).get("error") or {}
    if isinstance(error, Mapping) and (error.get("code") or error.get("message")):
        return f"{error.get('code') or 'ERROR'}: {error.get('message') or ''}".rstrip(": ")
    for found in conditions(obj):
        shows = found.get("status") == "True" and found.get("message")
        if found.get("type") not in ("Ready", "Placed") and shows:
            return f"{found.get('reason') or found.get('type')}: {found.get('message')}"
    ready = condition(obj, "Ready") or {}
    return str(ready.get("message") or "no reason given")


@dataclass(frozen=True)
class Outcome:
    """A wait's end: ``ok`` or not, what to say, and the exit code it ends the command with."""

    ok: bool
    message: str
    exit: Exit = Exit.OK


def refusal_exit(obj: Mapping[str, Any] | None) -> Exit:
    """The exit code of the ``Refused`` condition: its reason is the server's error code
    (``NOT_FOUND`` for an unknown pool is 4), and any other refusal is 5."""
    found = holding(obj, "Refused") or {}
    chosen = for_error_code(str(found.get("reason") or ""))
    return Exit.REFUSED if chosen == Exit.FAILED else chosen


def reserved(obj: Mapping[str, Any] | None, *, now: dt.datetime) -> Outcome | None:
    """Whether ``reserve`` is done waiting: Ready (or placed for a later start), refused,
    ended, or never able to fit; ``None`` to keep waiting."""
    if obj is None:
        return Outcome(False, "it was deleted while waiting", Exit.FAILED)
    why = refused(obj)
    if why is not None:
        return Outcome(False, f"refused: {why}", refusal_exit(obj))
    gone = ended(obj)
    if gone is not None:
        return Outcome(False, f"it is {gone}: {why_ended(obj)}", Exit.FAILED)
    if is_true(obj, "Ready"):
        return Outcome(True, "Ready")
    never = never_fits(obj)
    if never is not None:
        return Outcome(False, f"it cannot be placed: {never}", Exit.REFUSED)
    start = times.read(status_of(obj).get("startTime"))
    if is_true(obj, "Placed") and start is not None and start > now:
        # Ready comes only at the start; its window is booked, which is what was asked.
        return Outcome(True, "Placed")
    return None


def waiting_for(obj: Mapping[str, Any] | None, goal: str) -> str:
    """What a wait that ran out was waiting for, and where the object stands."""
    if obj is None:
        return f"{goal}; the object is gone"
    current = state(obj) or "not yet seen by the operator (no status)"
    said = f"{goal}; it is {current}"
    ready = condition(obj, "Ready")
    if ready is not None and ready.get("status") != "True" and ready.get("message"):
        said += f" (Ready {ready.get('status')}: {ready.get('reason')}: {ready.get('message')})"
    for kind in ("Unschedulable", "Queued", "BindTimeout"):
        found = holding(obj, kind)
        if found is not None and found.get("message"):
            said += f"; {kind}: {found.get('message')}"
    return said


# --- GPUPools --------------------------------------------------------------------------------


def pool_class(pool: Mapping[str, Any], wanted: str | None = None) -> str:
    """The device class to count in a pool: ``wanted``, else the one its sharing mode hands
    out, else the only one its status shows."""
    if wanted:
        return wanted
    mode = ((pool.get("spec") or {}).get("sharing") or {}).get("mode") or "exclusive"
    devices = (pool.get("status") or {}).get("devices") or {}
    preferred = CLASS_OF_SHARING.get(str(mode), "gpu")
    if preferred in devices or len(devices) != 1:
        return preferred
    return str(next(iter(devices)))


def pool_counts(pool: Mapping[str, Any], device_class: str) -> Mapping[str, Any]:
    found = ((pool.get("status") or {}).get("devices") or {}).get(device_class)
    return found if isinstance(found, Mapping) else {}


@dataclass(frozen=True)
class Found:
    """``find``'s answer for one pool, from its status."""

    pool: str
    model: str
    device_class: str
    free: int | None
    total: int | None
    fits_now: bool
    #: When the pool's status says the first booked device frees (only when none is free).
    next_free_at: str | None
    #: The window the answer points at: now, or ``next_free_at``, for the duration.
    start: dt.datetime | None
    end: dt.datetime | None
    note: str

    def plain(self) -> dict[str, Any]:
        """For ``-o json|yaml``."""
        return {
            "pool": self.pool,
            "model": self.model,
            "class": self.device_class,
            "free": self.free,
            "total": self.total,
            "fitsNow": self.fits_now,
            "nextFreeAt": self.next_free_at,
            "start": times.rfc3339(self.start) if self.start else None,
            "end": times.rfc3339(self.end) if self.end else None,
            "note": self.note,
        }


def find(
    pool: Mapping[str, Any],
    *,
    count: int,
    duration_ms: int,
    device_class: str | None,
    now: dt.datetime,
) -> Found:
    """Whether ``count`` devices are free in ``pool`` now, else the next time its status names."""
    name = str((pool.get("metadata") or {}).get("name") or "")
    chosen = pool_class(pool, device_class)
    counts = pool_counts(pool, chosen)
    free, total = _int(counts.get("free")), _int(counts.get("total"))
    status = pool.get("status") or {}
    next_free = status.get("nextFreeAt") if isinstance(status.get("nextFreeAt"), str) else None
    length = dt.timedelta(milliseconds=duration_ms)
    model = str((pool.get("spec") or {}).get("model") or "-")

    def answer(fits: bool, start: dt.datetime | None, note: str) -> Found:
        end = start + length if start is not None else None
        return Found(name, model, chosen, free, total, fits, next_free, start, end, note)

    if not status:
        return answer(False, None, "the operator has not written this pool's status yet")
    if total is None or total == 0:
        return answer(False, None, f"no {chosen} devices in this pool")
    if total < count:
        return answer(False, None, f"only {total} {chosen} devices in this pool in all")
    if free is not None and free >= count:
        return answer(True, now, f"{free} free now across the pool")
    start = times.read(next_free)
    if start is not None:
        return answer(False, start, "none free now; the first booked device frees then")
    return answer(False, None, f"{free or 0} free now; the pool's status names no later time")


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


# --- GPUQuotas -------------------------------------------------------------------------------


@dataclass(frozen=True)
class QuotaRow:
    tenant: str
    resource: str
    used: int | None
    limit: int | None

    @property
    def free(self) -> int | None:
        if self.limit is None:
            return None
        return max(0, self.limit - (self.used or 0))


def quota_rows(quotas: Sequence[Mapping[str, Any]]) -> list[QuotaRow]:
    """One row per tenant and resource: the limit from ``status.limits`` (what the operator
    enforces), else ``spec.limits``; what is used from ``status.used``."""
    rows = []
    for quota in quotas:
        spec, status = quota.get("spec") or {}, quota.get("status") or {}
        tenant = str(spec.get("tenant") or (quota.get("metadata") or {}).get("name") or "")
        limits = status.get("limits") or spec.get("limits") or {}
        used = status.get("used") or {}
        for resource in sorted({*limits, *used}):
            rows.append(
                QuotaRow(tenant, resource, _int(used.get(resource)), _int(limits.get(resource)))
            )
    return sorted(rows, key=lambda r: (r.tenant, r.resource))


# --- a failed API call as one line -----------------------------------------------------------


@dataclass(frozen=True)
class Target:
    """What a call was about, for its error line: ``get`` ``Reservation`` ``ml``/``train``."""

    verb: str
    kind: str
    plural: str
    namespace: str | None = None
    name: str | None = None

    @property
    def ref(self) -> str:
        if self.name is None:
            where = f" in namespace {self.namespace}" if self.namespace else ""
            return f"{self.plural}{where}"
        return (
            f"{self.kind} {self.namespace}/{self.name}"
            if self.namespace
            else (f"{self.kind} {self.name}")
        )


def one_line(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


def failed_call(error: KubeError, target: Target, *, server: str) -> str:
    """A failed call as one line naming the object and the HTTP status, in words a person can
    act on: ``forbidden: your identity may not create reservations in namespace ml (…)``."""
    said = one_line(error.message) or error.reason
    where = f" in namespace {target.namespace}" if target.namespace else " (cluster-wide)"
    if error.status == 0:
        return f"cannot reach the Kubernetes API server {server}: {said}"
    if error.status == 401:
        return (
            f"unauthorized (401): the API server {server} did not accept your credentials"
            f" ({said}); log in again, or check --kubeconfig and --context"
        )
    if error.status == 403:
        if said.startswith("admission webhook"):
            return f"{target.verb} {target.ref}: refused (403): {said}"
        return (
            f"forbidden (403): your identity may not {target.verb} {target.plural}{where} ({said})"
        )
    if error.status == 404:
        if target.name is not None and target.verb != "create":
            return f"no {target.ref} (404)"
        return (
            f"{target.verb} {target.ref}: not found (404: {said}); is better-compute installed"
            f" in this cluster (its {target.plural}.{names.GROUP} CRD)?"
        )
    if error.status == 422:
        return f"{target.verb} {target.ref}: invalid (422): {said}"
    return f"{target.verb} {target.ref}: {error.status} {error.reason}: {said}"


# --- label selectors -------------------------------------------------------------------------

_KEY = r"(?:[A-Za-z0-9](?:[-A-Za-z0-9_.]*[A-Za-z0-9])?/)?[A-Za-z0-9](?:[-A-Za-z0-9_.]*[A-Za-z0-9])?"
_VALUE = r"(?:[A-Za-z0-9](?:[-A-Za-z0-9_.]*[A-Za-z0-9])?)?"
_EXISTS = re.compile(rf"^(?P<not>!?)\s*(?P<key>{_KEY})$")
_COMPARE = re.compile(rf"^(?P<key>{_KEY})\s*(?P<op>==|=|!=)\s*(?P<value>{_VALUE})$")
_SET = re.compile(rf"^(?P<key>{_KEY})\s+(?P<op>in|notin)\s*\((?P<values>[^()]*)\)$")

Selector = dict[str, str | operators.Operator[Any]]


def _terms(text: str) -> list[str]:
    """``text`` split at the commas outside parentheses."""
    terms, depth, current = [], 0, ""
    for char in text:
        if char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
        if char == "," and depth == 0:
            terms.append(current.strip())
            current = ""
        else:
            current += char
    terms.append(current.strip())
    return terms


def label_selector(text: str) -> Selector:
    """kubectl's ``-l`` syntax (``a=b``, ``a==b``, ``a!=b``, ``a in (x,y)``, ``a notin (x)``,
    ``a``, ``!a``, joined by commas) as lightkube's selector; ``UsageError`` naming
    ``--selector`` for anything else."""
    parsed: Selector = {}

    def bad(why: str) -> UsageError:
        return UsageError(f"{text!r}: {why}", option="--selector")

    for term in _terms(text):
        if not term:
            raise bad("an empty requirement (a stray comma?)")
        value: str | operators.Operator[Any]
        if found := _SET.match(term):
            values = [v.strip() for v in found["values"].split(",")]
            if not all(re.fullmatch(_VALUE, v) for v in values) or values == [""]:
                raise bad(f"{term!r} needs label values in its parentheses: a in (x,y)")
            maker = operators.in_ if found["op"] == "in" else operators.not_in
            value = maker(values)
        elif found := _COMPARE.match(term):
            value = (
                operators.not_equal(found["value"])
                if found["op"] == "!="
                else operators.equal(found["value"])
            )
        elif found := _EXISTS.match(term):
            value = operators.not_exists() if found["not"] else operators.exists()
        else:
            raise bad(
                f"{term!r} is not a requirement: use key=value, key!=value, key in (a,b),"
                " key notin (a,b), key or !key"
            )
        key = found["key"]
        parsed[key] = value if key not in parsed else _Both(parsed[key], value)
    return parsed


class _Both(operators.Operator[None]):
    """Two requirements on one key (``team,team!=a``), which a dict keyed by label cannot
    hold otherwise: encoded as both, comma-joined, as the API server reads them."""

    def __init__(
        self, first: str | operators.Operator[Any], second: operators.Operator[Any]
    ) -> None:
        super().__init__("all", ",", None)
        self.parts = [operators.equal(first) if isinstance(first, str) else first, second]

    def encode(self, key: str) -> str:
        return ",".join(part.encode(key) for part in self.parts)
