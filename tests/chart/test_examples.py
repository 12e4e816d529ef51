"""The manifests in examples/: each is an object the API server accepts (the Kubernetes schema,
or our CRDs), each Reservation passes the validating webhook's checks (the core's own request
validation), each GPUPool is one the operator accepts, and the labelled Pod names the
``binding: kubernetes`` example's Reservation and passes the pod webhooks' rules for it.
"""

from __future__ import annotations

import copy
import json

import pytest

from bettercompute.kube import names
from bettercompute.operator import definitions, podaccess, webhooks
from tests.chart import rendering

EXAMPLES = rendering.load_examples()


def _ids() -> list[str]:
    return [f"{name}:{obj['kind']}/{obj['metadata']['name']}" for name, obj in EXAMPLES]


def test_the_examples_are_the_ones_the_readme_promises():
    kinds = {(name, obj["kind"]) for name, obj in EXAMPLES}
    assert ("gpupool.yaml", "GPUPool") in kinds
    assert ("reservation-nvlink.yaml", "Reservation") in kinds
    assert ("reservation-mig.yaml", "Reservation") in kinds
    assert {
        ("reservation-kubernetes.yaml", "Reservation"),
        ("pod-reservation.yaml", "Pod"),
    } <= kinds


@pytest.mark.parametrize(("name", "obj"), EXAMPLES, ids=_ids())
def test_every_example_is_a_valid_object(name: str, obj: dict, schemas):
    # The DRA examples are for Kubernetes 1.34 and later (a pod's resourceClaims as 1.34 has
    # them); the rest for the oldest version we support.
    version = rendering.DRA_KUBERNETES if "dra" in name else None
    assert rendering.problems(obj, schemas=schemas, kubernetes=version) == []


@pytest.mark.parametrize(
    ("name", "obj"), [e for e in EXAMPLES if e[1]["kind"] == "Reservation"], ids=lambda e: str(e)
)
def test_every_example_reservation_passes_the_webhook(name: str, obj: dict):
    assert webhooks.spec_problem(obj["spec"]) is None


def test_every_example_pool_is_accepted_and_every_reservation_has_its_pool():
    pools = {
        obj["metadata"]["name"]: definitions.pool_definition(obj["metadata"]["name"], obj["spec"])
        for _, obj in EXAMPLES
        if obj["kind"] == "GPUPool"
    }
    namespaces = {
        obj["metadata"]["name"]: obj["metadata"].get("labels", {})
        for _, obj in EXAMPLES
        if obj["kind"] == "Namespace"
    }
    for _, obj in EXAMPLES:
        if obj["kind"] != "Reservation":
            continue
        pool = pools[obj["spec"]["poolId"]]
        tenant = definitions.tenant_of(
            obj["metadata"]["namespace"], namespaces[obj["metadata"]["namespace"]]
        )
        assert pool.pool.owner == tenant or tenant in {o.tenant for o in pool.offers}


def test_the_mig_reservation_is_for_the_mig_pool():
    (mig,) = [o for n, o in EXAMPLES if n == "reservation-mig.yaml"]
    (pool,) = [o for n, o in EXAMPLES if n == "gpupool-mig.yaml"]
    assert mig["spec"]["poolId"] == pool["metadata"]["name"]
    assert pool["spec"]["sharing"]["mode"] == "mig"
    assert all(d["class"] == "mig" and d["profile"] for d in mig["spec"]["devices"])


def test_the_labelled_pod_asks_for_what_its_reservation_books():
    (reservation,) = [o for n, o in EXAMPLES if n == "reservation-kubernetes.yaml"]
    (pod,) = [o for n, o in EXAMPLES if n == "pod-reservation.yaml"]
    assert reservation["spec"]["binding"] == "kubernetes"
    meta = pod["metadata"]
    assert meta["namespace"] == reservation["metadata"]["namespace"]
    assert meta["labels"][names.POD_RESERVATION_LABEL] == reservation["metadata"]["name"]
    (device,) = reservation["spec"]["devices"]
    (container,) = pod["spec"]["containers"]
    assert container["resources"]["limits"] == {"bcd.dev/gpu": device["count"]}
    # Its pool lets reservations hand devices to pods, each under its own resource.
    (pool,) = [o for n, o in EXAMPLES if n == "gpupool.yaml"]
    assert pool["metadata"]["name"] == reservation["spec"]["poolId"]
    assert pool["spec"]["policy"]["kubernetes"] is True
    assert pool["spec"]["policy"].get("podAccess", "reservation") == "reservation"

    # The pod webhooks' rules, with the Reservation as it looks once admitted.
    admitted = copy.deepcopy(reservation)
    resource = names.reservation_resource_name("rsv_examplereservationid0000")
    admitted["status"] = {"state": "active", "resourceName": resource}
    booked = podaccess.booked(admitted)
    changes = podaccess.rewritten(pod, booked)
    assert changes is not None
    (rewritten,) = changes["spec"]["containers"]
    assert rewritten["resources"]["limits"] == {resource: str(device["count"])}
    original = json.loads(changes["annotations"][names.ORIGINAL_RESOURCES])
    assert original == {"containers": {"main": {"limits": {"bcd.dev/gpu": device["count"]}}}}
    stored = copy.deepcopy(pod)
    stored["spec"].update(changes["spec"])
    stored["metadata"]["annotations"] = changes["annotations"]

    def check(candidate: dict) -> str | None:
        return podaccess.refusal(
            operation="CREATE",
            pod=candidate,
            old=None,
            reservation_named=lambda ns, name: booked if (ns, name) == ("ml", "infer-1") else None,
            owner_of={resource: booked}.get,
        )

    assert check(stored) is None
    elsewhere = copy.deepcopy(stored)
    elsewhere["metadata"]["namespace"] = "team-b"
    assert "another namespace" in (check(elsewhere) or "")


def test_the_tenant_namespace_is_labelled():
    (namespace,) = [o for _, o in EXAMPLES if o["kind"] == "Namespace"]
    assert namespace["metadata"]["labels"][names.TENANT_LABEL] == "acme"


def test_the_dra_job_uses_the_claim_template_its_reservation_gets():
    """The operator names a dra Reservation's claim template after the Reservation; the Job's
    pod asks for it by that name, and its container names the pod's claim."""
    (reservation,) = [o for n, o in EXAMPLES if n == "reservation-dra.yaml"]
    (pool,) = [o for n, o in EXAMPLES if n == "gpupool-dra.yaml"]
    (job,) = [o for n, o in EXAMPLES if n == "job-dra.yaml"]
    assert reservation["spec"]["poolId"] == pool["metadata"]["name"]
    assert pool["spec"]["policy"]["kubernetes"] == {"api": "dra"}
    assert reservation["spec"]["binding"] == "kubernetes"
    pod = job["spec"]["template"]["spec"]
    (claim,) = pod["resourceClaims"]
    assert claim["resourceClaimTemplateName"] == reservation["metadata"]["name"]
    assert job["metadata"]["namespace"] == reservation["metadata"]["namespace"]
    (container,) = pod["containers"]
    assert container["resources"]["claims"] == [{"name": claim["name"]}]
