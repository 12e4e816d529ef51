"""The built-in ``billing.check``: GPU-hours a tenant may book per rolling window.

A simple ledger over our own reservations, for installations without a billing system: the
spend of a window is the GPU-hours of the tenant's admitted reservations created in it. A
tenant without a budget row is not limited. Implements ``core.ports.BudgetCheck``.
"""

from __future__ import annotations

from bettercompute.core import ports
from bettercompute.store.admission import to_ms
from bettercompute.store.database import Database


class DatabaseBudget:
    def __init__(self, db: Database):
        self._db = db

    async def check(
        self, *, caller: ports.Caller, tenant_id: str, gpu_hours: float
    ) -> ports.BudgetVerdict:
        async with self._db.connection() as conn:
            row = await (
                await conn.execute(
                    """
                    SELECT b.gpu_hours AS budget, w.spent, w.oldest,
                           b.window_seconds * interval '1 second' AS window_
                      FROM budgets b, LATERAL (
                        SELECT coalesce(sum(((a.attributes ->> 'gpuCount')::numeric
                                  + (a.attributes ->> 'gpuSlices')::numeric / 7)
                                  * (a.attributes ->> 'durationHours')::numeric), 0) AS spent,
                               min(r.created_at) AS oldest
                          FROM reservations r JOIN authz_resources a ON a.id = r.id
                         WHERE r.tenant_id = b.tenant_id
                           AND r.state NOT IN ('draft', 'denied', 'awaiting-confirmation')
                           AND r.created_at > compute_now()
                                              - b.window_seconds * interval '1 second'
                      ) w
                     WHERE b.tenant_id = %s
                    """,
                    (tenant_id,),
                )
            ).fetchone()
        if row is None:
            return ports.BudgetVerdict(allowed=True)
        spent, budget = float(row["spent"]), float(row["budget"])
        if spent + gpu_hours <= budget:
            return ports.BudgetVerdict(allowed=True)
        resets = to_ms(row["oldest"] + row["window_"]) if row["oldest"] is not None else None
        return ports.BudgetVerdict(
            allowed=False,
            message=f"the tenant's budget of {budget:g} GPU-hours per window is spent "
            f"({spent:.3f} used, {gpu_hours:.3f} asked)",
            resets_at_ms=resets,
        )
