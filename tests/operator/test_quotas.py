"""GPUQuota objects: one tenant's quota each, applied by the real operator against the API
stand-in and PostgreSQL, whatever order objects arrive in; and GPUPools that still carry
quotas, refused with a pointer to GPUQuota."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from bettercompute.operator import handlers, quotas
from bettercompute.operator.running import Operator
from bettercompute.store.database import Database
from tests.operator.conftest import World, apply_world
from tests.support import kubeworld
from tests.support.kubeobjects import GPUPOOLS, GPUQUOTAS, RESERVATIONS
from tests.support.kubeserver import ApiStatusError, KubeApi


def _ready(obj: Any) -> dict[str, Any]:
    for condition in ((obj or {}).get("status") or {}).get("conditions") or ():
        if condition.get("type") == "Ready":
            return dict(condition)
    return {}


def _status(obj: Any) -> dict[str, Any]:
    return dict((obj or {}).get("status") or {})


def _refused(code: str):
    def check(o: Any) -> bool:
        return any(
            c.get("type") == "Refused" and c.get("status") == "True" and c.get("reason") == code
            for c in _status(o).get("conditions") or ()
        )

    return check


def _placed(o: Any) -> bool:
    return _status(o).get("state") == "placed"


async def _limits_in_db(db: Database, tenant: str) -> dict[str, tuple[int, int]]:
    async with db.connection() as conn:
        rows = await (
            await conn.execute(
                "SELECT resource, limit_, used FROM quotas WHERE tenant_id = %s", (tenant,)
            )
        ).fetchall()
    return {r["resource"]: (int(r["limit_"]), int(r["used"])) for r in rows}


async def test_a_gpuquota_limits_the_tenant_and_shows_what_is_used(world: World):
    kube = world.kube
    await kube.patch(GPUQUOTAS, None, "acme", {"spec": {"limits": {"gpu:H100": 3, "vcpu": 8}}})
    await kube.wait_for(
        GPUQUOTAS, None, "acme", lambda o: _status(o).get("limits") == {"gpu:H100": 3, "vcpu": 8}
    )
    await kube.create(kubeworld.reservation("two").gpus(2).obj())
    await kube.wait_for(RESERVATIONS, "ml", "two", _placed)
    shown = await kube.wait_for(
        GPUQUOTAS, None, "acme", lambda o: (_status(o).get("used") or {}).get("gpu:H100") == 2
    )
    assert _status(shown)["summary"] == "gpu:H100 2/3"
    ready = _ready(shown)
    assert (ready["status"], ready["reason"]) == ("True", "Applied")
    assert ready["observedGeneration"] == shown["metadata"]["generation"]

    # Two more do not fit in what is left: refused by the quota, as the object says.
    await kube.create(kubeworld.reservation("two-more").gpus(2).obj())
    await kube.wait_for(RESERVATIONS, "ml", "two-more", _refused("QUOTA_EXCEEDED"))


async def test_a_resource_taken_out_of_the_limits_grants_nothing(world: World, db: Database):
    kube = world.kube
    # A merge patch takes a key out with null.
    await kube.patch(GPUQUOTAS, None, "acme", {"spec": {"limits": {"gpu:H100": None, "vcpu": 8}}})
    await kube.wait_for(
        GPUQUOTAS,
        None,
        "acme",
        lambda o: (
            _status(o).get("limits")
            == {
                "gpu:H100": 0,
                "vcpu": 8,
            }
        ),
    )
    assert (await _limits_in_db(db, "acme"))["gpu:H100"][0] == 0
    await kube.create(kubeworld.reservation("one").gpus(1).obj())
    await kube.wait_for(RESERVATIONS, "ml", "one", _refused("QUOTA_EXCEEDED"))


async def test_two_gpuquotas_for_one_tenant_the_older_applies_whatever_the_order(
    world: World, db: Database
):
    kube = world.kube  # "acme" (64 GPUs) exists already: it is the older one
    await kube.create(kubeworld.gpuquota("acme", {"gpu:H100": 1}, name="acme-late"))
    late = await kube.wait_for(
        GPUQUOTAS, None, "acme-late", lambda o: _ready(o).get("status") == "False"
    )
    assert _ready(late)["reason"] == "Conflict"
    assert "GPUQuota acme already sets tenant acme's quota" in _ready(late)["message"]
    assert "limits" not in _status(late)
    # Re-applying the newer one (an update) changes nothing either.
    await kube.patch(GPUQUOTAS, None, "acme-late", {"spec": {"limits": {"gpu:H100": 2}}})
    await kube.wait_for(
        GPUQUOTAS, None, "acme-late", lambda o: _ready(o).get("observedGeneration") == 2
    )
    assert (await _limits_in_db(db, "acme"))["gpu:H100"][0] == 64

    # The older one goes: the newer one speaks for the tenant now.
    await kube.delete(GPUQUOTAS, None, "acme")
    now = await kube.wait_for(
        GPUQUOTAS, None, "acme-late", lambda o: _ready(o).get("status") == "True"
    )
    assert _status(now)["limits"] == {"gpu:H100": 2}
    assert (await _limits_in_db(db, "acme"))["gpu:H100"][0] == 2


async def test_deleting_the_tenants_gpuquota_leaves_it_nothing_but_keeps_charges(
    world: World, db: Database
):
    kube = world.kube
    await kube.create(kubeworld.reservation("kept").gpus(2).obj())
    await kube.wait_for(RESERVATIONS, "ml", "kept", _placed)
    await kube.delete(GPUQUOTAS, None, "acme")
    await kube.wait_for(GPUQUOTAS, None, "acme", lambda o: o is None)

    # Charged work keeps its charge; nothing new is granted.
    async def zero() -> bool:
        return (await _limits_in_db(db, "acme")).get("gpu:H100") == (0, 2)

    for _ in range(50):
        if await zero():
            break
        await asyncio.sleep(0.1)
    assert await zero()
    assert _status(kube.stored(RESERVATIONS, "ml", "kept"))["state"] in ("placed", "binding")
    await kube.create(kubeworld.reservation("new").gpus(1).obj())
    await kube.wait_for(RESERVATIONS, "ml", "new", _refused("QUOTA_EXCEEDED"))


async def test_an_invalid_gpuquota_is_not_applied_and_says_why(world: World, db: Database):
    bad = kubeworld.gpuquota("acme", {"gpu H100": 4}, name="typo")
    world.kube.emulator.put_raw(GPUQUOTAS, bad)  # past the CRD's CEL rule, as an old object
    shown = await world.kube.wait_for(
        GPUQUOTAS, None, "typo", lambda o: _ready(o).get("status") == "False"
    )
    assert _ready(shown)["reason"] == "INVALID_INPUT"
    assert "spec.limits" in _ready(shown)["message"]
    assert "gpu H100" not in await _limits_in_db(db, "acme")


async def test_the_api_server_refuses_a_gpupool_carrying_quotas_naming_gpuquota(
    kube_api: KubeApi, db: Database, operator: Operator
):
    pool = kubeworld.gpupool("old-style")
    pool["spec"]["owner"]["quotas"] = {"gpu:H100": 16}
    with pytest.raises(ApiStatusError) as refused:
        await kube_api.create(pool)
    assert refused.value.status == 422
    assert "quotas moved to GPUQuota" in json.dumps(refused.value.body), refused.value.body


async def test_a_stored_gpupool_carrying_quotas_is_refused_by_the_operator(
    kube_api: KubeApi, db: Database, operator: Operator
):
    await apply_world(kube_api, db)
    pool = kubeworld.gpupool("old-style")
    pool["spec"]["offers"] = [{"tenant": "globex", "quotas": {"gpu:H100": 8}}]
    kube_api.emulator.put_raw(GPUPOOLS, pool)  # written under the previous CRD
    shown = await kube_api.wait_for(
        GPUPOOLS, None, "old-style", lambda o: _ready(o).get("status") == "False"
    )
    ready = _ready(shown)
    assert ready["reason"] == "INVALID_INPUT"
    assert ready["message"].startswith("spec.offers[0].quotas: quotas moved to GPUQuota")
    assert await _limits_in_db(db, "globex") == {}


async def test_a_stopped_operators_leftover_timer_writes_no_quota(
    kube_api: KubeApi, db: Database, start_operator: Any
):
    """A kopf whose shutdown is cut short (on a loaded machine it passes its grace) can leave
    a per-object timer behind: the GPUQuota timer then wrote the tenant's limits into the
    database long after its operator stopped, where the next user of the database found a
    quota it never set (a CI run's "quota exceeded … 2 left of 2" with 64 configured). Called
    once its operator stopped, the timer ends its task and writes nothing."""
    async with start_operator() as op:
        await apply_world(kube_api, db)
        quota = await kube_api.wait_for(
            GPUQUOTAS, None, "acme", lambda o: _ready(o).get("status") == "True"
        )
    assert op.runtime.stopped
    async with db.connection() as conn:
        await conn.execute("DELETE FROM quotas")
    registry = handlers.make_registry(node_certificates=False, pool_status_s=0.5)
    (timer,) = [h for h in registry._spawning.get_all_handlers() if h.id.endswith(".quota_shown")]
    index = {"acme": [quotas.claim(quota)]}
    with pytest.raises(asyncio.CancelledError):
        await timer.fn(body=quota, memo={"runtime": op.runtime}, quota_claims=index)
    assert await _limits_in_db(db, "acme") == {}
