"""The exit codes of both command lines, ``better-compute`` and ``kubectl bcd``, in one table.

Why one table: a script that runs either CLI must tell "the server is down" from "no such
reservation" from "the quota said no" from "the wait ran out" by the exit code alone, and the
two CLIs used to disagree (3 against 1 for an unreachable server, 0 against 2 for a wait that
ran out). ``docs/cli.md`` prints this same table, and ``tests/cli/test_vocabulary.py`` runs both
CLIs against each row. Here, in ``core``, because both CLIs may import ``core`` while neither may
import the other.

What this module must never do: import anything of ours but ``core.errors``, or give two
meanings one number (a code, once published, keeps its meaning).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from bettercompute.core.errors import ErrorCode


class Exit(enum.IntEnum):
    """How a command ended, as its process exit status."""

    OK = 0
    FAILED = 1
    USAGE = 2
    UNREACHABLE = 3
    NOT_FOUND = 4
    REFUSED = 5
    CONFLICT = 6
    WAIT_RAN_OUT = 7
    INTERRUPTED = 130


@dataclass(frozen=True)
class Row:
    """One line of the table in ``docs/cli.md``."""

    exit: Exit
    meaning: str
    examples: str


TABLE: tuple[Row, ...] = (
    Row(Exit.OK, "success", "the reservation was made, read, extended, released"),
    Row(
        Exit.FAILED,
        "failed for another reason",
        "a server error, an operator that failed the reservation, a bug",
    ),
    Row(
        Exit.USAGE,
        "usage error: the request as given is wrong, nothing changed",
        "an unknown flag, `--for 8`, two of `--gpus`/`--mig`/`--slots`; the server's"
        " `INVALID_INPUT`; Kubernetes' 422 Invalid",
    ),
    Row(
        Exit.UNREACHABLE,
        "the server could not be reached or does not speak the API",
        "connection refused, a timeout, `--url` pointing at another service;"
        " the Kubernetes API server down",
    ),
    Row(
        Exit.NOT_FOUND,
        "not found",
        "`NOT_FOUND`; Kubernetes' 404; an id prefix that matches nothing",
    ),
    Row(
        Exit.REFUSED,
        "refused: access, policy or quota said no",
        "`ACCESS_DENIED`, `QUOTA_EXCEEDED`, `SPEND_LIMIT_REACHED`, `CAPACITY_UNAVAILABLE`,"
        " `UNSUPPORTED`, `CONFIRMATION_REQUIRED`; Kubernetes' 401/403 or an admission refusal;"
        " the operator's Refused condition; a request that can never fit its pool",
    ),
    Row(
        Exit.CONFLICT,
        "conflict with the current state",
        "`CONFLICT` (a key reused for another request), `INVALID_STATE` (cancel an active"
        " reservation); Kubernetes' 409; an extend that another booking blocks",
    ),
    Row(
        Exit.WAIT_RAN_OUT,
        "a wait ran out; the request stands",
        "`reserve --timeout 20s` still queued, `kubectl bcd reserve --timeout 5m` not Ready",
    ),
    Row(Exit.INTERRUPTED, "interrupted (Ctrl-C)", "a watch or a wait stopped by the user"),
)

_BY_ERROR_CODE: dict[str, Exit] = {
    ErrorCode.INVALID_INPUT: Exit.USAGE,
    ErrorCode.NOT_FOUND: Exit.NOT_FOUND,
    ErrorCode.ACCESS_DENIED: Exit.REFUSED,
    ErrorCode.QUOTA_EXCEEDED: Exit.REFUSED,
    ErrorCode.SPEND_LIMIT_REACHED: Exit.REFUSED,
    ErrorCode.CAPACITY_UNAVAILABLE: Exit.REFUSED,
    ErrorCode.UNSUPPORTED: Exit.REFUSED,
    ErrorCode.CONFIRMATION_REQUIRED: Exit.REFUSED,
    ErrorCode.CONFLICT: Exit.CONFLICT,
    ErrorCode.INVALID_STATE: Exit.CONFLICT,
}


def for_error_code(code: str | None) -> Exit:
    """The exit code of a refusal the server answered with ``code`` (the guide's codes)."""
    return _BY_ERROR_CODE.get(code or "", Exit.FAILED)


def for_http_status(status: int) -> Exit:
    """The exit code of a Kubernetes API server's refusal with HTTP ``status`` (0: no answer)."""
    if status == 0:
        return Exit.UNREACHABLE
    if status == 404:
        return Exit.NOT_FOUND
    if status in (401, 403):
        return Exit.REFUSED
    if status == 409:
        return Exit.CONFLICT
    if status in (400, 422):
        return Exit.USAGE
    return Exit.FAILED
