"""GPUQuota and GPUPool against the real control plane: the real API server's structural
schema and CEL rules (with their cost limits) decide what may be stored, and the operator,
under the chart's service account, writes what its status subresources say.

The stand-in checked CEL because we taught it to; here the API server's own evaluator does.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from bettercompute.operator.running import Operator
from tests.controlplane.cluster import ApiError
from tests.controlplane.plugin import Cluster
from tests.controlplane.scenarios import (
    PLACED,
    RESERVATIONS,
    call,
    conditions,
    pool_with_nodes,
    reservation,
    state_is,
    tenant_namespace,
    wait_for,
)
from tests.support import kubeworld

QUOTAS = "/apis/bcd.dev/v1alpha1/gpuquotas"
POOLS = "/apis/bcd.dev/v1alpha1/gpupools"
MERGE = "application/merge-patch+json"


def status(obj: Any) -> dict[str, Any]:
    return dict((obj or {}).get("status") or {})


async def test_a_gpuquota_limits_the_tenant_and_shows_what_is_used(
    cluster: Cluster, real_operator: Operator
) -> None:
    plane = cluster.plane
    await tenant_namespace(plane, "ml", tenant="acme", user="alice@acme")
    await pool_with_nodes(plane, nodes=1, gpus=8, quota=3)
    tenant = plane.tokens["alice@acme"]
    shown = await wait_for(plane, f"{QUOTAS}/acme", lambda o: bool(status(o).get("limits")))
    assert status(shown)["limits"] == {"gpu:H100": 3}
    await call(
        plane, "POST", RESERVATIONS.format(ns="ml"), reservation("two", "ml", gpus=2), token=tenant
    )
    await wait_for(plane, f"{RESERVATIONS.format(ns='ml')}/two", state_is(*PLACED))
    used = await wait_for(
        plane, f"{QUOTAS}/acme", lambda o: (status(o).get("used") or {}).get("gpu:H100") == 2
    )
    assert status(used)["summary"] == "gpu:H100 2/3"
    ready = conditions(used)["Ready"]
    assert (ready["status"], ready["reason"]) == ("True", "Applied")
    assert ready["observedGeneration"] == used["metadata"]["generation"]
    # Two more do not fit what is left: refused by the quota, as the object says.
    await call(
        plane, "POST", RESERVATIONS.format(ns="ml"), reservation("more", "ml", gpus=2), token=tenant
    )
    refused = await wait_for(
        plane,
        f"{RESERVATIONS.format(ns='ml')}/more",
        lambda o: conditions(o).get("Refused", {}).get("reason") == "QUOTA_EXCEEDED",
    )
    assert status(refused).get("state") not in PLACED


async def test_the_pool_status_shows_nodes_and_free_and_booked_devices(
    cluster: Cluster, real_operator: Operator
) -> None:
    plane = cluster.plane
    await tenant_namespace(plane, "ml", tenant="acme", user="alice@acme")
    await pool_with_nodes(plane, nodes=2, gpus=4)

    def devices(free: int, booked: int) -> Any:
        def check(o: Any) -> bool:
            gpu = (status(o).get("devices") or {}).get("gpu") or {}
            return (gpu.get("free"), gpu.get("booked"), gpu.get("total")) == (free, booked, 8)

        return check

    await wait_for(plane, f"{POOLS}/h100", devices(8, 0))
    await call(
        plane,
        "POST",
        RESERVATIONS.format(ns="ml"),
        reservation("train", "ml", gpus=3),
        token=plane.tokens["alice@acme"],
    )
    pool = await wait_for(plane, f"{POOLS}/h100", devices(5, 3))
    assert pool is not None
    assert status(pool)["nodesReady"] == 2


@pytest.mark.parametrize(
    ("limits", "says"),
    [
        ({"gpu H100": 4}, "spec.limits"),  # not a resource name
        ({"gpu:H100": -1}, "spec.limits"),  # below zero
    ],
)
async def test_the_api_server_refuses_an_invalid_gpuquota(
    cluster: Cluster, limits: dict[str, int], says: str
) -> None:
    """Refused by the CRD's own schema and CEL rules, evaluated by the real API server,
    before any operator sees it (none runs here)."""
    bad = kubeworld.gpuquota("acme", limits, name="typo")
    with pytest.raises(ApiError) as refused:
        await call(cluster.plane, "POST", QUOTAS, bad)
    assert refused.value.status == 422, refused.value
    assert says in str(refused.value)
    assert await asyncio.to_thread(cluster.plane.get, f"{QUOTAS}/typo") is None


async def test_the_api_server_refuses_a_gpupool_carrying_quotas_naming_gpuquota(
    cluster: Cluster,
) -> None:
    pool = kubeworld.gpupool("old-style")
    pool["spec"]["owner"]["quotas"] = {"gpu:H100": 16}
    with pytest.raises(ApiError) as refused:
        await call(cluster.plane, "POST", POOLS, pool)
    assert refused.value.status == 422, refused.value
    assert "quotas moved to GPUQuota" in str(refused.value)


async def test_a_gpuquota_with_the_most_resources_the_schema_allows_is_stored(
    cluster: Cluster,
) -> None:
    """The CEL rules' cost is bounded by ``maxProperties``: without it the real API server
    refused the whole CRD (the stand-in never estimated cost). At the bound, one object with
    as many resources as allowed is stored; one more is refused by the schema."""
    crd = await asyncio.to_thread(
        cluster.plane.get,
        "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/gpuquotas.bcd.dev",
    )
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    bound = int(schema["properties"]["spec"]["properties"]["limits"]["maxProperties"])
    many = {f"gpu:MODEL{i}": 1 for i in range(bound)}
    await call(cluster.plane, "POST", QUOTAS, kubeworld.gpuquota("acme", many, name="many"))
    many[f"gpu:MODEL{bound}"] = 1
    with pytest.raises(ApiError) as refused:
        await call(cluster.plane, "POST", QUOTAS, kubeworld.gpuquota("globex", many, name="more"))
    assert refused.value.status == 422, refused.value
    assert "spec.limits" in str(refused.value)
