"""The built-in ``billing.check``: GPU-hours a tenant may spend per rolling window.

For installations without a billing system. The spend of a window is what was used in it, by
the usage ledger (``store/usage.py``: billed from bound to release or end), plus what the
tenant's live reservations still have booked from now on (a pending one its whole duration).
A reservation released early stops counting the hours it gave back. A tenant without a budget
row is not limited. Implements ``core.ports.BudgetCheck``; the ledger is ``bc_budget_state``
(migration ``0011_usage``).

Why the ledger is read twice: ``check`` runs before transaction 2, outside any transaction, as
the guide's sequence says, and refuses early. But two creates checked at once would both fit
and both be admitted, so transaction 2 checks again under the tenant's budget lock
(``bc_budget_lock_check``, see ``store/locking.py``) and refuses the one that no longer fits.
Budgets are per tenant: an offer only says whether they are checked. Never decides policy.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from bettercompute.core import ports
from bettercompute.core.errors import ComputeError, ErrorCode
from bettercompute.store.database import Database


class DatabaseBudget:
    #: The ledger is our own reservations: transaction 2 re-checks it under the budget lock.
    ledger_in_store = True

    def __init__(self, db: Database):
        self._db = db

    async def check(
        self, *, caller: ports.Caller, tenant_id: str, gpu_hours: float
    ) -> ports.BudgetVerdict:
        async with self._db.connection() as conn:
            row = await (
                await conn.execute("SELECT * FROM bc_budget_state(%s)", (tenant_id,))
            ).fetchone()
        if row is None or float(row["spent"]) + gpu_hours <= float(row["budget"]):
            return ports.BudgetVerdict(allowed=True)
        return _spent(
            budget=row["budget"],
            used=row["used"],
            booked=row["booked"],
            asked=gpu_hours,
            resets=row["resets_at_ms"],
        )


def spend_limit_reached(verdict: ports.BudgetVerdict) -> ComputeError:
    """The error a refused budget check answers (402 over HTTP)."""
    details: dict[str, Any] = {}
    if verdict.resets_at_ms is not None:
        details["resetsAt"] = verdict.resets_at_ms
    return ComputeError(
        ErrorCode.SPEND_LIMIT_REACHED, verdict.message or "the budget is spent", details
    )


def short_error(short: Mapping[str, Any]) -> ComputeError:
    """The same error, from the shortfall ``bc_budget_lock_check`` found in transaction 2."""
    return spend_limit_reached(
        _spent(
            budget=short["budget"],
            used=short["used"],
            booked=short["booked"],
            asked=short["asked"],
            resets=short["resetsAt"],
        )
    )


def _spent(
    *, budget: Any, used: Any, booked: Any, asked: Any, resets: int | None
) -> ports.BudgetVerdict:
    return ports.BudgetVerdict(
        allowed=False,
        message=f"the tenant's budget of {float(budget):g} GPU-hours per window is spent "
        f"({float(used):.3f} used, {float(booked):.3f} booked, {float(asked):.3f} asked)",
        resets_at_ms=None if resets is None else int(resets),
    )
