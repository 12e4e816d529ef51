"""What each MCP tool does, as plain calls over the reservations API: the rules, not the wire.

Why it exists apart from ``server``: the promises an agent relies on are rules about requests,
not about MCP, and deserve to be read in one place:

* one idempotency key per request, derived from the tool's arguments and this process's
  nonce, so calling ``reserve_gpus`` again with the same arguments (after a timeout, or after
  a person approved it) reaches the same draft instead of booking twice; a start of
  ``earliest`` is looked up once and kept with the key, so the retry's body is the same too;
* ``CONFIRMATION_REQUIRED`` is an answer (the confirmation id, its deadline and what to do),
  not a failure: the agent asks the person, then retries;
* every other refusal is ``Refused`` carrying the server's code and message, for the tool to
  report as an error;
* times go in as RFC 3339 and come back as epoch milliseconds with an RFC 3339 sibling
  (``start`` → ``startTime``), because a model reads the one and the API speaks the other.

What this module must never do: speak HTTP (the ``Api`` handed in does), import the CLI or the
MCP SDK, print anything (stdout belongs to the stdio transport), or send a request with a key
it did not derive from the arguments.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol, cast

from bettercompute.core import durations, moments
from bettercompute.core.errors import ErrorCode

#: How long past the server's own wait a create may take to answer (as the CLI allows).
ANSWER_GRACE_S = 15
#: The longest the server holds a create (its cap on ``wait.timeoutMs``).
WAIT_CAP_S = 30
#: ``start`` that asks for the first window ``capacity/search`` finds.
EARLIEST = "earliest"
#: Codes of refusals that never reached the server's judgement.
UNREACHABLE = "UNREACHABLE"
USAGE = "USAGE"

#: Epoch-millisecond fields of the API's answers that get an RFC 3339 ``…Time`` sibling.
_MS_FIELDS = frozenset(
    {
        "start",
        "end",
        "createdAt",
        "updatedAt",
        "requestedStart",
        "leaseExpiresAt",
        "from",
        "horizonEnd",
        "availableUntil",
        "expiresAt",
    }
)

DeviceClass = Literal["gpu", "mig", "slot"]
Scope = Literal["mine", "all"]


class Api(Protocol):
    """What the door needs of a client: the CLI's ``ApiClient`` is one."""

    def call(
        self, operation: str, body: dict[str, Any], *, timeout_s: float | None = None
    ) -> Any: ...


class _Failure(Protocol):
    """The shape of the client's failure (the CLI's ``client.Failure``)."""

    message: str
    code: str | None
    details: dict[str, Any]
    exit_code: int
    hint: str | None


class Refused(Exception):
    """The server (or the door, before sending) refused: a code, a message, maybe more."""

    def __init__(
        self,
        code: str,
        message: str,
        *,
        details: Mapping[str, Any] | None = None,
        hint: str | None = None,
    ) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.details: dict[str, Any] = dict(details or {})
        self.hint = hint

    def text(self) -> str:
        """``CODE: message``, then the details as JSON (times in them as RFC 3339: this text is
        read, not parsed) and a hint, one line each."""
        lines = [f"{self.code}: {self.message}"]
        if self.details:
            details = json.dumps(as_read(self.details), sort_keys=True, default=str)
            lines.append(f"Details: {details}")
        if self.hint:
            lines.append(f"Hint: {self.hint}")
        return "\n".join(lines)


def invalid(field: str, reason: str) -> Refused:
    """A request the door refuses before sending, named as the server would name it."""
    return Refused(
        ErrorCode.INVALID_INPUT.value,
        f"{field}: {reason}",
        details={"field": field, "reason": reason},
    )


@dataclass(frozen=True)
class Devices:
    """One kind of device and how many: whole GPUs, MIG instances of a profile, or slots."""

    count: int
    device_class: DeviceClass = "gpu"
    profile: str | None = None
    nvlink: bool = False

    def body(self) -> list[dict[str, Any]]:
        """The request's ``devices``: one entry, its combinations checked."""
        if self.device_class == "mig" and not self.profile:
            raise invalid("profile", "MIG instances need a profile such as '1g.10gb'")
        if self.device_class != "mig" and self.profile is not None:
            raise invalid("profile", "a profile is only for device_class 'mig'")
        if self.nvlink and self.device_class != "gpu":
            raise invalid("nvlink", "NVLink is only for whole GPUs (device_class 'gpu')")
        device: dict[str, Any] = {"class": self.device_class, "count": self.count}
        if self.profile is not None:
            device["profile"] = self.profile
        if self.nvlink:
            device["topology"] = "nvlink-all"
        return [device]


def epoch_ms(value: str, *, field: str) -> int:
    """An RFC 3339 time (with its zone) as epoch milliseconds, or ``INVALID_INPUT``."""
    try:
        return moments.parse_ms(value.strip())
    except moments.MomentError as e:
        raise invalid(field, str(e)) from None


def as_read(value: Any) -> Any:
    """``value`` with each epoch-millisecond time it holds as RFC 3339, for text."""
    if isinstance(value, list):
        return [as_read(item) for item in value]
    if not isinstance(value, dict):
        return value
    return {
        key: moments.rfc3339(item, exact=True)
        if key in _MS_FIELDS and isinstance(item, int) and not isinstance(item, bool)
        else as_read(item)
        for key, item in value.items()
    }


def with_times(value: Any) -> Any:
    """``value`` with an RFC 3339 ``…Time`` beside each epoch-millisecond time it holds, and a
    ``…Text`` beside each duration in the API's milliseconds (``'28800000ms'``: ``'8h'``)."""
    if isinstance(value, list):
        return [with_times(item) for item in value]
    if not isinstance(value, dict):
        return value
    shown: dict[str, Any] = {}
    for key, item in value.items():
        shown[key] = with_times(item)
        if key in _MS_FIELDS and isinstance(item, int) and not isinstance(item, bool):
            shown[f"{key}Time"] = moments.rfc3339(item, exact=True)
        elif isinstance(item, str) and item.endswith("ms") and item[:-2].isdigit():
            shown[f"{key}Text"] = durations.human_text(item) or item
    return shown


def _digest(identity: Mapping[str, Any]) -> str:
    canonical = json.dumps(identity, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(canonical.encode("ascii")).hexdigest()


class Door:
    """The tools' behaviour over one API client, for one MCP session (this process).

    Safe to call from several threads at once: the SDK runs each call of a synchronous tool
    on a worker thread, and the tenant and the remembered starts are shared under a lock.
    """

    def __init__(
        self,
        api: Api,
        *,
        refusal: type[Exception] | tuple[type[Exception], ...],
        tenant: str | None = None,
        nonce: str | None = None,
    ) -> None:
        self._api = api
        self._refusal = refusal
        self._tenant = tenant
        #: Makes this session's keys its own: a new session's identical call is a new request.
        self.nonce = nonce or secrets.token_hex(8)
        self._lock = threading.Lock()
        #: The start ``earliest`` was resolved to, per request (digest of its arguments).
        self._starts: dict[str, int] = {}

    # --- the tools -------------------------------------------------------------------------

    def reserve_gpus(
        self,
        *,
        pool: str,
        devices: Devices,
        duration: str,
        start: str | None = None,
        wait_seconds: int = 0,
    ) -> dict[str, Any]:
        """``reservations.create`` under a key kept for these arguments; a confirmation the
        server asks for is answered, not raised."""
        tenant = self.tenant()
        request: dict[str, Any] = {
            "tenantId": tenant,
            "poolId": pool,
            "devices": devices.body(),
            "duration": duration.strip(),
        }
        # The wait is left out: it is not part of the request (nor of the server's hash).
        digest = _digest({"tool": "reserve_gpus", **request, "start": start})
        key = self._key(digest)
        if start is not None and start.strip() == EARLIEST:
            request["start"] = self._earliest(digest, request)
        elif start is not None:
            request["start"] = epoch_ms(start, field="start")
        wait = max(0, min(wait_seconds, WAIT_CAP_S))
        body: dict[str, Any] = {**request, "idempotencyKey": key}
        if wait > 0:
            body["wait"] = {"timeoutMs": wait * 1000}
        try:
            view = self._call("reservations/create", body, timeout_s=wait + ANSWER_GRACE_S)
        except Refused as e:
            if e.code == ErrorCode.CONFIRMATION_REQUIRED.value:
                return self._confirmation(e, tool="reserve_gpus", key=key)
            if e.code == UNREACHABLE:
                e.hint = (
                    "call reserve_gpus again with the same arguments: it reaches the same"
                    " request (same idempotency key), so nothing is booked twice"
                )
            raise
        return {"outcome": "created", "reservation": with_times(view)}

    def get_reservation(self, reservation_id: str) -> dict[str, Any]:
        """``reservations.get``: one reservation, by id or a start of one (8+ characters)."""
        body = {"tenantId": self.tenant(), "reservationId": reservation_id.strip()}
        return cast(dict[str, Any], with_times(self._call("reservations/get", body)))

    def list_reservations(
        self,
        *,
        state: str | None = None,
        scope: Scope = "mine",
        pool: str | None = None,
        limit: int = 50,
        cursor: str | None = None,
    ) -> dict[str, Any]:
        """``reservations.list``, newest first."""
        body: dict[str, Any] = {"tenantId": self.tenant(), "scope": scope, "limit": limit}
        if state is not None:
            body["state"] = state.strip()
        if pool is not None:
            body["poolId"] = pool
        if cursor is not None:
            body["cursor"] = cursor
        return cast(dict[str, Any], with_times(self._call("reservations/list", body)))

    def extend_reservation(
        self, reservation_id: str, *, until: str | None = None, by: str | None = None
    ) -> dict[str, Any]:
        """``reservations.extend`` with exactly one of ``until`` or ``by``, under a key kept
        for these arguments (the same call again is a retry, never a second extension)."""
        if (until is None) == (by is None):
            raise invalid(
                "until",
                "give exactly one of 'until' (an RFC 3339 time) or 'by' (a duration: '4h')",
            )
        tenant = self.tenant()
        body: dict[str, Any] = {"tenantId": tenant, "reservationId": reservation_id.strip()}
        if until is not None:
            body["until"] = epoch_ms(until, field="until")
        else:
            assert by is not None
            body["by"] = by.strip()
        digest = _digest({"tool": "extend_reservation", **body, "until": until})
        key = self._key(digest)
        try:
            answer = self._call("reservations/extend", {**body, "idempotencyKey": key})
        except Refused as e:
            if e.code == ErrorCode.CONFIRMATION_REQUIRED.value:
                return self._confirmation(e, tool="extend_reservation", key=key)
            raise
        shown = cast(dict[str, Any], with_times(answer))
        return {"outcome": "extended" if shown.get("extended") else "not-extended", **shown}

    def release_reservation(self, reservation_id: str) -> dict[str, Any]:
        """``reservations.release``: end it now (a pending one is cancelled)."""
        body = {"tenantId": self.tenant(), "reservationId": reservation_id.strip()}
        return cast(dict[str, Any], with_times(self._call("reservations/release", body)))

    def find_capacity(
        self,
        *,
        pool: str,
        devices: Devices,
        duration: str,
        not_before: str | None = None,
        horizon: str | None = None,
        limit: int = 5,
    ) -> dict[str, Any]:
        """``capacity.search``: the earliest windows such a reservation would fit in."""
        body: dict[str, Any] = {
            "tenantId": self.tenant(),
            "poolId": pool,
            "devices": devices.body(),
            "duration": duration.strip(),
            "limit": limit,
        }
        if not_before is not None:
            body["from"] = epoch_ms(not_before, field="not_before")
        if horizon is not None:
            body["horizon"] = horizon.strip()
        return cast(dict[str, Any], with_times(self._call("capacity/search", body)))

    # --- shared ----------------------------------------------------------------------------

    def tenant(self) -> str:
        """The tenant given, else the one the token belongs to (``whoami``, asked once)."""
        with self._lock:
            if self._tenant:
                return self._tenant
        who = self._call("whoami", {})
        tenant = who.get("tenantId") if isinstance(who, dict) else None
        if not isinstance(tenant, str) or not tenant:
            raise Refused(
                USAGE,
                "no tenant: the token names none",
                hint="set $BETTER_COMPUTE_TENANT, pass --tenant to `better-compute mcp`,"
                " or put 'tenant:' in the config file",
            )
        with self._lock:
            self._tenant = self._tenant or tenant
            return self._tenant

    def _key(self, digest: str) -> str:
        return f"mcp-{self.nonce}-{digest[:40]}"

    def _earliest(self, digest: str, request: dict[str, Any]) -> int:
        """The first window's start, looked up once per request and kept with its key."""
        with self._lock:
            known = self._starts.get(digest)
        if known is not None:
            return known
        answer = self._call("capacity/search", {**request, "limit": 1})
        windows = answer.get("windows") if isinstance(answer, dict) else None
        if not windows:
            message = answer.get("message") if isinstance(answer, dict) else None
            raise Refused(
                "NO_WINDOW",
                f"start 'earliest': no window found ({message or 'nothing fits'})",
                hint="try find_capacity with a longer horizon, fewer devices or another pool",
            )
        with self._lock:
            return self._starts.setdefault(digest, int(windows[0]["start"]))

    def _confirmation(self, refused: Refused, *, tool: str, key: str) -> dict[str, Any]:
        details = refused.details
        confirmation = details.get("confirmationId")
        expires = details.get("expiresAt")
        deadline = (
            moments.rfc3339(expires)
            if isinstance(expires, int) and not isinstance(expires, bool)
            else expires
        )
        before = f" before {deadline}" if deadline else ""
        answer: dict[str, Any] = {
            "outcome": "confirmation-required",
            "confirmationId": confirmation,
            "expiresAt": expires,
            "message": refused.message,
            "idempotencyKey": key,
            "instruction": (
                f"Nothing is booked yet: a person must approve this request first. Ask the"
                f" person to approve confirmation {confirmation}{before}. Once they have,"
                f" call {tool} again with exactly the same arguments: the retry carries the"
                " same idempotency key and reaches this same request, so nothing is booked"
                " twice. Changed arguments would be a new request needing a new approval."
            ),
        }
        if isinstance(deadline, str) and deadline != expires:
            answer["expiresAtTime"] = deadline
        return answer

    def _call(self, operation: str, body: dict[str, Any], *, timeout_s: float | None = None) -> Any:
        try:
            return self._api.call(operation, body, timeout_s=timeout_s)
        except self._refusal as e:
            failure = cast(_Failure, e)
            code = failure.code or (USAGE if failure.exit_code == 2 else UNREACHABLE)
            raise Refused(
                code, failure.message, details=failure.details, hint=failure.hint
            ) from None
