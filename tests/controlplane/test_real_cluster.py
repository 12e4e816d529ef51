"""The chart, the operator and its webhooks against the real Kubernetes control plane.

Everything here meets the real kube-apiserver (its structural-schema checks, CEL, RBAC and
Node authorizers, admission chain, TokenRequest and CSR APIs), controller-manager and
scheduler, built from Kubernetes' Go modules (``tests/controlplane/``). The chart is installed
as ``helm install`` would install it, and the operator runs under the chart's own service
account: a missing RBAC rule fails here. Tenants act with their own credentials, never as
the admin, so every answer is what ``kubectl`` would get in a real cluster.
"""

from __future__ import annotations

import pytest

from bettercompute.kube import names
from bettercompute.operator.running import Operator
from tests.controlplane import install
from tests.controlplane.cluster import ApiError
from tests.controlplane.plugin import Cluster
from tests.controlplane.scenarios import (
    PLACED,
    RESERVATIONS,
    call,
    kubectl,
    pool_with_nodes,
    reservation,
    state_is,
    tenant_namespace,
    wait_for,
)


async def test_the_chart_installs_on_a_real_api_server(cluster: Cluster):
    """Helm's render of the chart is accepted as it is: CRDs (structural schemas, CEL within
    its cost limits), RBAC, webhook configurations and the admission policy."""
    plane = cluster.plane
    resources = (await kubectl(plane, "api-resources", "--api-group=bcd.dev", "-o", "name")).stdout
    for plural in ("reservations", "gpupools", "gpunodes", "gpuquotas", "deviceallocations"):
        assert f"{plural}.bcd.dev" in resources.split()
    short = (await kubectl(plane, "api-resources", "--api-group=bcd.dev")).stdout
    assert "rsv" in short
    policies = await call(
        plane, "GET", "/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicies"
    )
    assert policies["items"], "the chart's ValidatingAdmissionPolicy was applied"


async def test_a_tenants_reservation_is_stamped_by_the_webhook_and_placed(
    cluster: Cluster, real_operator: Operator
):
    """alice applies a Reservation with her own token: the real API server calls the
    operator's mutating webhook over TLS (the caBundle the operator wrote), which stamps her
    identity; the operator, under its chart service account, places it."""
    plane = cluster.plane
    await tenant_namespace(plane, "ml", tenant="acme", user="alice@acme")
    nodes = await pool_with_nodes(plane)
    alice = plane.tokens["alice@acme"]
    created = await call(
        plane,
        "POST",
        RESERVATIONS.format(ns="ml"),
        reservation("train", "ml", gpus=4, devices=[{"class": "gpu", "count": 4}]),
        token=alice,
    )
    annotations = created["metadata"].get("annotations") or {}
    assert annotations.get(names.REQUESTED_BY) == "alice@acme"
    placed = await wait_for(plane, f"{RESERVATIONS.format(ns='ml')}/train", state_is(*PLACED))
    assert placed is not None
    status = placed["status"]
    assert status["tenantId"] == "acme"
    assert (status["gpus"], status["nodes"]) == (4, nodes[0])
    stored = await real_operator.runtime.service.snapshot(status["id"])
    assert stored is not None
    assert stored["ownerIdentityId"] == "alice@acme"


async def test_a_forged_identity_stamp_is_refused_by_the_real_admission_chain(
    cluster: Cluster, real_operator: Operator
):
    """mallory writes alice's name into the stamp: the mutating webhook overwrites it with who
    really asked, and the validating webhook refuses a later change of it."""
    plane = cluster.plane
    await tenant_namespace(plane, "team", tenant="globex", user="mallory@globex")
    await pool_with_nodes(plane, tenants=("globex",))
    forged = reservation("sneaky", "team")
    forged["metadata"]["annotations"] = {names.REQUESTED_BY: "alice@acme"}
    created = await call(
        plane, "POST", RESERVATIONS.format(ns="team"), forged, token=plane.tokens["mallory@globex"]
    )
    assert created["metadata"]["annotations"][names.REQUESTED_BY] == "mallory@globex"
    with pytest.raises(ApiError) as refused:
        await call(
            plane,
            "PATCH",
            f"{RESERVATIONS.format(ns='team')}/sneaky",
            {"metadata": {"annotations": {names.REQUESTED_BY: "alice@acme"}}},
            token=plane.tokens["mallory@globex"],
            content_type="application/merge-patch+json",
        )
    assert refused.value.status in (400, 403, 422), refused.value.body


async def test_a_tenant_cannot_write_a_reservations_status(
    cluster: Cluster, real_operator: Operator
):
    """The status is the operator's: a tenant with every verb on Reservations still gets 403
    on ``reservations/status`` from the real authorizer."""
    plane = cluster.plane
    await tenant_namespace(plane, "ml", tenant="acme", user="alice@acme")
    await pool_with_nodes(plane)
    alice = plane.tokens["alice@acme"]
    await call(plane, "POST", RESERVATIONS.format(ns="ml"), reservation("r1", "ml"), token=alice)
    with pytest.raises(ApiError) as refused:
        await call(
            plane,
            "PATCH",
            f"{RESERVATIONS.format(ns='ml')}/r1/status",
            {"status": {"resourceName": "bcd.dev/rsv-victim"}},
            token=alice,
            content_type="application/merge-patch+json",
        )
    assert refused.value.status == 403


async def test_the_operator_service_account_is_denied_what_the_chart_does_not_grant(
    cluster: Cluster,
):
    """The chart's RBAC is minimal: the operator's own token may not read Secrets outside its
    namespace, nor write Nodes; the real authorizer says no."""
    plane, chart = cluster.plane, cluster.chart
    await call(plane, "POST", "/api/v1/namespaces", {"metadata": {"name": "elsewhere"}})
    await call(
        plane,
        "POST",
        "/api/v1/namespaces/elsewhere/secrets",
        {"metadata": {"name": "db-password"}, "stringData": {"password": "hunter2"}},
    )
    token = plane.service_account_token(install.NAMESPACE, chart.operator_account)
    for method, path, body in (
        ("GET", "/api/v1/namespaces/elsewhere/secrets/db-password", None),
        (
            "POST",
            "/api/v1/namespaces/elsewhere/secrets",
            {"metadata": {"name": "planted"}, "stringData": {"x": "y"}},
        ),
        ("DELETE", "/api/v1/namespaces/elsewhere/secrets/db-password", None),
    ):
        with pytest.raises(ApiError) as refused:
            await call(plane, method, path, body, token=token)
        assert refused.value.status == 403, (method, path, refused.value.body)


async def test_kubectl_get_rsv_shows_the_printer_columns(cluster: Cluster, real_operator: Operator):
    """The real kubectl of the same release prints the CRD's printer columns."""
    plane = cluster.plane
    await tenant_namespace(plane, "ml", tenant="acme", user="alice@acme")
    await pool_with_nodes(plane)
    alice = plane.kubeconfig("alice", token=plane.tokens["alice@acme"])
    await call(
        plane,
        "POST",
        RESERVATIONS.format(ns="ml"),
        reservation("train", "ml", gpus=2, devices=[{"class": "gpu", "count": 2}]),
        token=plane.tokens["alice@acme"],
    )
    await wait_for(plane, f"{RESERVATIONS.format(ns='ml')}/train", state_is(*PLACED))
    shown = (await kubectl(plane, "get", "rsv", "-n", "ml", kubeconfig=alice)).stdout
    header, row = shown.splitlines()[:2]
    crd = next(c for c in install.crds() if c["spec"]["names"]["kind"] == "Reservation")
    version = next(v for v in crd["spec"]["versions"] if v.get("served"))
    # Columns of priority 0 show by default (the others with -o wide); NAME comes first.
    columns = [
        c["name"].upper()
        for c in version.get("additionalPrinterColumns") or ()
        if not c.get("priority")
    ]
    assert header.split() == ["NAME", *" ".join(columns).split()], header
    assert row.split()[0] == "train"
    assert set(row.split()) & set(PLACED), row
