"""Least privilege: the rendered RBAC is exactly the table below, and it is enough.

- Exactly: every rule of both service accounts' Roles and ClusterRoles, table-driven, with the
  caller that needs it; nothing else (no wildcard, no Secrets, no Pods).
- Enough, by construction: kopf's needs derived from the operator's real handler registry
  (watched kinds need list and watch, kinds with change handlers need patch).
- Enough, by observation: the real operator and the real device plugin run one
  ``binding: kubernetes`` reservation's whole life (placed, bound, active, a labelled pod
  admitted through the chart's pod webhooks, released while a pod holds a device, freed,
  deleted) against the API stand-in, each with its own token; every
  request each one made must be allowed by its rendered RBAC (``tests/chart/authorizing.py``).
- The device plugin's own-node ValidatingAdmissionPolicy: its CEL, evaluated with cel-python,
  lets a node write its own objects and refuses another node's, naming the node.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator
from typing import Any

import celpy
import pytest
import yaml
from celpy import adapter

from bettercompute.deviceplugin.agent import started as agent_started
from bettercompute.operator import handlers
from bettercompute.operator.config import OperatorConfig
from bettercompute.operator.running import started as operator_started
from bettercompute.store.database import Database
from tests.chart import authorizing, rendering
from tests.deviceplugin import agents
from tests.deviceplugin.conftest import GPU, Node
from tests.support import kubeworld
from tests.support.kubeobjects import DEVICEALLOCATIONS, EVENTS, GPUPOOLS, RESERVATIONS, Ref
from tests.support.kubeserver import KubeApi

OPERATOR = "bc-better-compute-operator"
DEVICE_PLUGIN = "bc-better-compute-device-plugin"
CRD_UPGRADE = "bc-better-compute-crd-upgrade"
SUBSCRIPTION_SECRETS = f"{OPERATOR}-subscription-secrets"
NODE_CA = "bc-node-ca"
WEBHOOK_SECRET = "bc-better-compute-webhook-tls"
CONFIGURATIONS = ("bc-better-compute",)
#: Our CRDs by name, the only ones the CRD upgrade hook may touch.
BCD_CRDS = tuple(
    sorted(
        yaml.safe_load(p.read_text(encoding="utf-8"))["metadata"]["name"]
        for p in (rendering.ROOT / "crds").glob("*.yaml")
    )
)
PODS = Ref(group="", version="v1", plural="pods", namespaced=True)
MUTATING = Ref(
    group="admissionregistration.k8s.io",
    version="v1",
    plural="mutatingwebhookconfigurations",
    namespaced=False,
)
VALIDATING = Ref(
    group="admissionregistration.k8s.io",
    version="v1",
    plural="validatingwebhookconfigurations",
    namespaced=False,
)

# (kind, apiGroup, resource, resourceNames, verbs, who needs it)
EXPECTED = [
    # --- the operator, everywhere
    ("ClusterRole", OPERATOR, "bcd.dev", "reservations", None, "list watch patch", "kopf"),
    ("ClusterRole", OPERATOR, "bcd.dev", "gpupools", None, "list watch patch", "kopf"),
    ("ClusterRole", OPERATOR, "bcd.dev", "reservations", None, "get", "the pod webhook"),
    ("ClusterRole", OPERATOR, "bcd.dev", "reservations/status", None, "patch", "projecting.py"),
    ("ClusterRole", OPERATOR, "bcd.dev", "gpupools/status", None, "patch", "handlers.py"),
    ("ClusterRole", OPERATOR, "bcd.dev", "gpuquotas", None, "list watch patch", "kopf"),
    ("ClusterRole", OPERATOR, "bcd.dev", "gpuquotas/status", None, "patch", "handlers.py"),
    ("ClusterRole", OPERATOR, "bcd.dev", "eventsubscriptions", None, "list watch patch", "kopf"),
    (
        "ClusterRole",
        OPERATOR,
        "bcd.dev",
        "eventsubscriptions/status",
        None,
        "patch",
        "subscribing.py",
    ),
    # Bound only by RoleBindings in eventSubscriptions.namespaces, never cluster-wide.
    ("ClusterRole", SUBSCRIPTION_SECRETS, "", "secrets", None, "create update", "subscribing.py"),
    ("ClusterRole", OPERATOR, "bcd.dev", "gpunodes", None, "list watch patch", "kopf timer"),
    ("ClusterRole", OPERATOR, "bcd.dev", "deviceallocations", None, "list watch", "kopf event"),
    ("ClusterRole", OPERATOR, "", "namespaces", None, "list watch", "kopf index"),
    ("ClusterRole", OPERATOR, "", "events", None, "create", "kube client, kopf posting"),
    ("ClusterRole", OPERATOR, "authentication.k8s.io", "tokenreviews", None, "create", "HTTP API"),
    ("ClusterRole", OPERATOR, "", "serviceaccounts", None, "get", "delegating.py"),
    (
        "ClusterRole",
        OPERATOR,
        "apiextensions.k8s.io",
        "customresourcedefinitions",
        None,
        "list watch",
        "kopf resource observer",
    ),
    ("ClusterRole", OPERATOR, "kopf.dev", "clusterkopfpeerings", None, "list watch", "peering"),
    (
        "ClusterRole",
        OPERATOR,
        "kopf.dev",
        "clusterkopfpeerings",
        ("better-compute",),
        "patch",
        "peering keep-alive",
    ),
    ("ClusterRole", OPERATOR, "bcd.dev", "gpunodes", None, "get", "nodecerts: the CSR's node"),
    (
        "ClusterRole",
        OPERATOR,
        "certificates.k8s.io",
        "certificatesigningrequests",
        None,
        "get list watch",
        "kopf event, nodecerts",
    ),
    (
        "ClusterRole",
        OPERATOR,
        "certificates.k8s.io",
        "certificatesigningrequests/approval",
        None,
        "update",
        "nodecerts: approve or deny",
    ),
    (
        "ClusterRole",
        OPERATOR,
        "certificates.k8s.io",
        "certificatesigningrequests/status",
        None,
        "update",
        "nodecerts: the certificate",
    ),
    (
        "ClusterRole",
        OPERATOR,
        "certificates.k8s.io",
        "signers",
        ("bcd.dev/node-report",),
        "approve sign",
        "the API server's check on /approval and /status",
    ),
    # --- the operator, in its namespace
    ("Role", OPERATOR, "bcd.dev", "deviceallocations", None, "create patch delete", "allocating"),
    ("Role", OPERATOR, "", "secrets", (NODE_CA,), "get", "nodeca: the node-report CA"),
    ("Role", OPERATOR, "", "secrets", None, "create", "nodeca, webhookcerts: first start"),
    ("Role", OPERATOR, "", "secrets", (WEBHOOK_SECRET,), "get update", "webhookcerts"),
    (
        "ClusterRole",
        OPERATOR,
        "admissionregistration.k8s.io",
        "mutatingwebhookconfigurations",
        CONFIGURATIONS,
        "get update",
        "webhookcerts: caBundle",
    ),
    (
        "ClusterRole",
        OPERATOR,
        "admissionregistration.k8s.io",
        "validatingwebhookconfigurations",
        CONFIGURATIONS,
        "get update",
        "webhookcerts: caBundle",
    ),
    # --- the device plugin, everywhere (one GPUNode and one Node: its own)
    ("ClusterRole", DEVICE_PLUGIN, "bcd.dev", "gpunodes", None, "get create patch", "publishing"),
    ("ClusterRole", DEVICE_PLUGIN, "bcd.dev", "gpunodes/status", None, "patch", "publishing"),
    ("ClusterRole", DEVICE_PLUGIN, "", "nodes", None, "get", "publishing: Node labels"),
    ("ClusterRole", DEVICE_PLUGIN, "", "events", None, "create", "converging: intruder pods"),
    (
        "ClusterRole",
        DEVICE_PLUGIN,
        "resource.k8s.io",
        "resourceslices",
        None,
        "list",
        "foreign: DRA GPU drivers",
    ),
    (
        "ClusterRole",
        DEVICE_PLUGIN,
        "certificates.k8s.io",
        "certificatesigningrequests",
        None,
        "create get watch",
        "enrolling",
    ),
    # --- the device plugin, in the operator's namespace
    ("Role", DEVICE_PLUGIN, "bcd.dev", "deviceallocations", None, "list watch", "watching"),
    ("Role", DEVICE_PLUGIN, "bcd.dev", "deviceallocations/status", None, "patch", "watching"),
    # --- the CRD upgrade hook (files/apply-crds.py), our CRDs by name: server-side apply (a
    # patch, and a create of that name when the CRD is new), get while waiting for Established
    (
        "ClusterRole",
        CRD_UPGRADE,
        "apiextensions.k8s.io",
        "customresourcedefinitions",
        BCD_CRDS,
        "get create patch",
        "test_crd_upgrade.py",
    ),
]


#: Granted, and needed, on paths the observed life does not take.
NOT_EXERCISED = {
    OPERATOR: {
        # kopf's resource observer: the stand-in serves no CRD API (a cluster does).
        ("customresourcedefinitions", "list"),
        ("customresourcedefinitions", "watch"),
        # The HTTP API authenticates its callers; the life is driven through objects.
        ("tokenreviews", "create"),
        # An agent's service account (tests/operator/test_delegations.py); the life's
        # Reservation is a person's.
        ("serviceaccounts", "get"),
        # Checked by the API server itself when the operator writes /approval and /status.
        ("signers", "approve"),
        ("signers", "sign"),
        # Renewing the webhook certificate, months after it was made (a moved clock renews it
        # in tests/operator/test_webhook_certificates.py); an EventSubscription's Secret.
        ("secrets", "update"),
        # EventSubscriptions (tests/operator/test_event_subscriptions.py); the life has none.
        ("eventsubscriptions", "patch"),
        ("eventsubscriptions/status", "patch"),
        # DRA (dra.enabled): this life's pool hands devices out through the device plugin; a
        # dra pool's template is made and deleted in tests/controlplane/test_real_dra_admission.py.
        ("resourceclaimtemplates", "get"),
        ("resourceclaimtemplates", "create"),
        ("resourceclaimtemplates", "delete"),
    },
    DEVICE_PLUGIN: {
        # With labels that differ from an existing GPUNode's, the agent merges them in. (It
        # reads its Node on every status write, for foreign GPU resources.)
        ("gpunodes", "patch"),
        # DRA (dra.enabled): slices and claims, on a dra pool's node (tests/controlplane).
        ("resourceslices", "get"),
        ("resourceslices", "watch"),
        ("resourceslices", "create"),
        ("resourceslices", "update"),
        ("resourceslices", "delete"),
        ("resourceclaims", "get"),
    },
}


def _granted(rendered: rendering.Rendered) -> set[tuple]:
    found = set()
    for kind in ("Role", "ClusterRole"):
        for role in rendered.of(kind):
            for rule in role["rules"]:
                names = tuple(rule["resourceNames"]) if rule.get("resourceNames") else None
                for group in rule["apiGroups"]:
                    for resource in rule["resources"]:
                        for verb in rule["verbs"]:
                            found.add(
                                (kind, role["metadata"]["name"], group, resource, names, verb)
                            )
    return found


#: What ``dra.enabled`` adds (off by default: it needs Kubernetes 1.34's resource.k8s.io/v1).
#: The node agent's slice writes are limited to its own node and driver by the chart's
#: device-plugin-policy.yaml (tests/controlplane/test_real_dra_admission.py).
EXPECTED_DRA = [
    (
        "ClusterRole",
        OPERATOR,
        "resource.k8s.io",
        "resourceclaimtemplates",
        None,
        "get create delete",
        "claiming: a Reservation's claim template",
    ),
    (
        "ClusterRole",
        DEVICE_PLUGIN,
        "resource.k8s.io",
        "resourceslices",
        None,
        "get watch create update delete",
        "draslices: its node's ResourceSlice",
    ),
    (
        "ClusterRole",
        DEVICE_PLUGIN,
        "resource.k8s.io",
        "resourceclaims",
        None,
        "get",
        "DRA prepare: the claim's allocation",
    ),
]


def _expected(*, dra: bool = True) -> set[tuple]:
    return {
        (kind, name, group, resource, names, verb)
        for kind, name, group, resource, names, verbs, _ in EXPECTED + (EXPECTED_DRA if dra else [])
        for verb in verbs.split()
    }


def test_the_rules_are_exactly_the_table(everything: rendering.Rendered):
    granted = _granted(everything)
    assert granted - _expected() == set(), "granted beyond the table"
    assert _expected() - granted == set(), "in the table but not granted"


def test_the_defaults_grant_the_same_but_dra(defaults: rendering.Rendered, everything):
    assert _granted(defaults) == _expected(dra=False)
    assert _granted(everything) - _granted(defaults) == _expected() - _expected(dra=False)


def test_no_wildcards_secrets_or_pods(everything: rendering.Rendered):
    for kind, name, group, resource, names, verb in _granted(everything):
        assert "*" not in (group, resource, verb), kind
        assert resource not in ("pods", "configmaps"), resource
        if resource == "secrets" and kind == "ClusterRole":
            # An EventSubscription's signing secret, beside it in a tenant namespace: create,
            # and update (of one it made); never read. Only RoleBindings grant it (below).
            allowed = (
                (SUBSCRIPTION_SECRETS, None, "create"),
                (SUBSCRIPTION_SECRETS, None, "update"),
            )
            assert (name, names, verb) in allowed
        elif resource == "secrets":
            # Only the operator's node-report CA, in its own namespace: read that one Secret,
            # create it (a create cannot name its object in RBAC).
            assert (kind, name) == ("Role", OPERATOR)
            allowed = (
                ((NODE_CA,), "get"),
                (None, "create"),
                ((WEBHOOK_SECRET,), "get"),
                ((WEBHOOK_SECRET,), "update"),
            )
            assert (names, verb) in allowed


def test_a_provided_node_ca_grants_only_reading_it(render: Any) -> None:
    rendered = render(
        {
            "operator": {"nodeCA": {"existingSecret": "platform-node-ca"}},
            "webhook": {"operatorManaged": False},  # the webhook certificate is Helm's here
        }
    )
    secrets = {
        (kind, name, names, verb)
        for kind, name, _, resource, names, verb in _granted(rendered)
        if resource == "secrets" and kind == "Role"  # the ClusterRole's: EventSubscriptions
    }
    assert secrets == {("Role", OPERATOR, ("platform-node-ca",), "get")}
    env = {
        e["name"]: e.get("value")
        for e in rendering.pod_spec(rendered.one("StatefulSet"))["containers"][0]["env"]
    }
    assert env["BCD_NODE_CA_SECRET"] == "platform-node-ca"
    assert env["BCD_NODE_CA_CREATE"] == "false"


def test_node_certificates_off_grants_nothing_for_them(render):
    off = render({"nodeCertificates": {"enabled": False}})
    operator = rendering.env_of(next(rendering.containers(off.one("StatefulSet"))))
    assert operator["BCD_NODE_CERTIFICATES"] == "false"
    # ... and that operator's kopf needs nothing of them: its registry has no CSR handler.
    registry = handlers.make_registry(node_certificates=False)
    watched = {
        h.selector.any_name
        for h in registry._watching.get_all_handlers()
        if h.selector.group == "certificates.k8s.io"
    }
    assert watched == set()
    for _, _, group, _, _, _ in _granted(off):
        assert group != "certificates.k8s.io"
    plugin = rendering.env_of(next(rendering.containers(off.one("DaemonSet"))))
    assert plugin["BCD_ENROL"] == "false"


def test_with_cert_manager_the_operator_never_creates_the_ca(render):
    values = {
        "nodeCertificates": {"certManager": {"enabled": True, "issuerRef": {"name": "root"}}},
        "webhook": {"operatorManaged": False},
    }
    rendered = render(values)
    secrets = {
        (verb, names)
        for kind, _, _, r, names, verb in _granted(rendered)
        if r == "secrets" and kind == "Role"  # the ClusterRole's: EventSubscriptions
    }
    assert secrets == {("get", (NODE_CA,))}


def _secret_write(verb: str, namespace: str, name: str = "") -> authorizing.Attributes:
    path = f"/api/v1/namespaces/{namespace}/secrets" + (f"/{name}" if name else "")
    return authorizing.attributes({"create": "POST", "update": "PUT"}[verb], path, {})


def test_attack_the_operator_cannot_write_a_secret_in_another_namespace(render: Any) -> None:
    """A stolen operator token (or a bug in the operator) must not be able to plant or replace
    a Secret anywhere in the cluster: a service account's token in kube-system, another
    tenant's registry credentials. The chart grants Secret writes only in the operator's own
    namespace and in the namespaces opened for EventSubscriptions, and the operator can still
    do everything it does with Secrets there."""
    rendered = render({"eventSubscriptions": {"namespaces": ["ml"]}})
    operator = authorizing.authorizer_for(
        rendered.objects, namespace=rendering.NAMESPACE, name=OPERATOR
    )
    assert rendered.of("ClusterRoleBinding")  # the operator still holds cluster-wide rules
    for namespace in ("kube-system", "default", "team-b"):
        for verb, name in (("create", ""), ("update", "registry"), ("update", NODE_CA)):
            attempt = _secret_write(verb, namespace, name)
            assert not operator.allows(attempt), f"the operator may {attempt}"
    # What it needs: the node CA and webhook certificate in its own namespace (first start,
    # renewal), and an EventSubscription's Secret in a namespace opened to it.
    needed = [
        _secret_write("create", rendering.NAMESPACE),
        _secret_write("update", rendering.NAMESPACE, WEBHOOK_SECRET),
        _secret_write("create", "ml"),
        _secret_write("update", "ml", "hooks-signing"),
    ]
    for request in needed:
        assert operator.allows(request), f"the operator may not {request}"
    # Its own namespace's other Secrets stay out of reach but for creating new ones.
    assert not operator.allows(_secret_write("update", rendering.NAMESPACE, "someone-elses"))
    # Without any namespace opened, EventSubscriptions' Secrets are written nowhere.
    closed = authorizing.authorizer_for(
        render({}).objects, namespace=rendering.NAMESPACE, name=OPERATOR
    )
    assert not closed.allows(_secret_write("create", "ml"))


def test_each_service_account_is_bound_to_its_own_roles_and_used(everything: rendering.Rendered):
    for workload_kind, account in (("StatefulSet", OPERATOR), ("DaemonSet", DEVICE_PLUGIN)):
        workload = everything.one(workload_kind)
        assert rendering.pod_spec(workload)["serviceAccountName"] == account
        everything.one("ServiceAccount", account)
        for binding_kind, role_kind in (
            ("RoleBinding", "Role"),
            ("ClusterRoleBinding", "ClusterRole"),
        ):
            binding = everything.one(binding_kind, account)
            assert binding["roleRef"] == {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": role_kind,
                "name": account,
            }
            assert binding["subjects"] == [
                {"kind": "ServiceAccount", "name": account, "namespace": rendering.NAMESPACE}
            ]


def test_kopfs_needs_from_the_operators_registry_are_granted(everything: rendering.Rendered):
    registry = handlers.make_registry()
    needs: set[tuple[str, str, str]] = set()
    watched = (registry._indexing, registry._watching, registry._spawning, registry._changing)
    for registered in watched:
        for handler in registered.get_all_handlers():
            for verb in ("list", "watch"):
                needs.add((handler.selector.group, handler.selector.any_name, verb))
    # Change handlers keep progress in annotations; delete handlers, timers and daemons hold a
    # finalizer: all of it by patching the object.
    for registered in (registry._spawning, registry._changing):
        for handler in registered.get_all_handlers():
            needs.add((handler.selector.group, handler.selector.any_name, "patch"))
    cluster_wide = {
        (group, resource, verb)
        for kind, name, group, resource, names, verb in _granted(everything)
        if kind == "ClusterRole" and name == OPERATOR and names is None
    }
    assert needs <= cluster_wide, needs - cluster_wide
    # The webhooks need no RBAC (the API server sends the object): the Reservation webhooks are
    # for a kind the rules cover anyway, and the pod webhooks must not make the operator a
    # reader of every pod.
    for handler in registry._webhooks.get_all_handlers():
        if handler.selector.group == "":
            assert handler.selector.any_name == "pods"
            continue
        assert (handler.selector.group, handler.selector.any_name, "list") in cluster_wide
    assert not any(resource == "pods" for _, resource, _ in cluster_wide)


# --- observed: a whole reservation's life -------------------------------------------------


@pytest.fixture
async def node() -> AsyncIterator[Node]:
    async with agents.standing_node() as standing:
        yield standing


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _requests_by(kube: KubeApi, token: str) -> list[authorizing.Attributes]:
    seen = []
    for request in kube.emulator:
        if request.headers.get("Authorization") == f"Bearer {token}":
            seen.append(
                authorizing.attributes(request.method.value, request.url.path, request.params)
            )
    return seen


def _state(state: str):
    return lambda o: bool(o) and (o.get("status") or {}).get("state") == state


def _held_by(pods: list[str]):
    def check(o: Any) -> bool:
        status = (o or {}).get("status") or {}
        held = (status.get("conditionDetails") or {}).get("DevicesHeld") or {}
        return held.get("pods") == pods

    return check


async def _allocation_of(kube: KubeApi, rid: str) -> dict[str, Any]:
    async with asyncio.timeout(5):
        while True:
            seen = kube.emulator.revision
            for obj in await kube.list(DEVICEALLOCATIONS, kubeworld.OPERATOR_NAMESPACE):
                if obj["spec"]["reservationId"] == rid and obj.get("status"):
                    return obj
            await kube.emulator.written(since=seen)


async def test_every_call_of_a_reservations_life_is_allowed(
    kube_api: KubeApi, db: Database, node: Node, everything: rendering.Rendered
):
    await kube_api.create({**kubeworld.namespace("ml", tenant="acme")})
    await kube_api.create(kubeworld.namespace(kubeworld.OPERATOR_NAMESPACE, tenant=None))
    await kube_api.create(everything.one("ClusterKopfPeering"))
    await kube_api.create(kubeworld.gpuquota("acme", {"gpu:H100": 64}))
    await kube_api.create(kubeworld.gpupool("h100"))
    config = OperatorConfig(
        database_url=db.dsn,
        namespace=kubeworld.OPERATOR_NAMESPACE,
        http_host="127.0.0.1",
        http_port=0,
        metrics_host="127.0.0.1",
        metrics_port=0,
        webhook_host="127.0.0.1",
        webhook_port=_free_port(),
        api_server=kube_api.url,
        api_token="operator-token",
        allocation_resync_s=3600.0,
        # As the chart sets them (BCD_NODE_AGENT_SERVICE_ACCOUNT, BCD_NODE_CA_SECRET,
        # BCD_WEBHOOK_SECRET, BCD_WEBHOOK_CONFIGURATIONS).
        node_agent_service_account=DEVICE_PLUGIN,
        node_ca_secret=NODE_CA,
        webhook_secret=WEBHOOK_SECRET,
        webhook_configurations=CONFIGURATIONS,
        webhook_extra_names=("127.0.0.1",),  # the stand-in calls the webhooks there
        webhook_check_s=0.2,
    )
    # The device plugin's pod token, bound to its node: it enrols for a node certificate.
    kube_api.tokens["plugin-token"] = {
        "username": f"system:serviceaccount:{kubeworld.OPERATOR_NAMESPACE}:{DEVICE_PLUGIN}",
        "uid": "plugin",
        "groups": ["system:serviceaccounts"],
        "extra": {"authentication.kubernetes.io/node-name": [agents.NODE]},
    }
    node_config = agents.agent_config(kube=kube_api, node=node, api_token="plugin-token")
    kube_api.emulator.declare(PODS, kind="Pod", status_subresource=True)
    async with operator_started(config, db=db) as operator:
        await operator.ready.wait()
        async with agent_started(node_config) as agent:
            # The agent enrols itself: a CSR the operator signs from the CA it made.
            await node.kubelet.wait_registered([GPU])
            # The pool handler and the GPUNode handler both wrote (they race the agent's start):
            # a reservation made before the pool is known is refused, pool not found.
            await kube_api.wait_for(
                GPUPOOLS,
                None,
                "h100",
                lambda o: (
                    bool(o)
                    and (o.get("status") or {}).get("observedGeneration") is not None
                    and (o.get("status") or {}).get("nodes") == 1
                ),
            )
            await kube_api.create(kubeworld.reservation("train").gpus(2).kubernetes().obj())
            active = await kube_api.wait_for(
                RESERVATIONS, "ml", "train", _state("active"), timeout=15
            )
            allocation = await _allocation_of(kube_api, active["status"]["id"])
            await _pod_admitted(
                kube_api,
                everything,
                port=config.webhook_port or 0,
                resource=active["status"]["resourceName"],
            )
            # The pod holds them under the reservation's own resource (pod access 'reservation').
            own = active["status"]["resourceName"]
            node.pod_resources.holding({"ml/trainer-0": {own: allocation["spec"]["deviceIds"]}})
            await _an_intruder_is_caught(kube_api, node, own, allocation["spec"]["deviceIds"])
            await kube_api.patch(RESERVATIONS, "ml", "train", {"spec": {"release": True}})
            await kube_api.wait_for(RESERVATIONS, "ml", "train", _held_by(["ml/trainer-0"]))
            node.pod_resources.holding({})
            name = allocation["metadata"]["name"]
            ns = kubeworld.OPERATOR_NAMESPACE
            await kube_api.wait_for(DEVICEALLOCATIONS, ns, name, lambda o: o is None)
            await kube_api.delete(RESERVATIONS, "ml", "train")
            await kube_api.wait_for(RESERVATIONS, "ml", "train", lambda o: o is None)
            async with asyncio.timeout(5):
                while True:  # enrolled: every CSR call was made
                    if agent.certificate_pem is not None:
                        break
                    await asyncio.sleep(0.02)

    for account, token in ((OPERATOR, "operator-token"), (DEVICE_PLUGIN, "plugin-token")):
        made = _requests_by(kube_api, token)
        rbac = authorizing.authorizer_for(
            everything.objects, namespace=rendering.NAMESPACE, name=account
        )
        denied = sorted({str(r) for r in made if not rbac.allows(r)})
        assert denied == [], f"{account} made calls its RBAC does not allow"
        # And every permission was used, but for the paths this life does not take.
        used = {(r.full_resource, r.verb) for r in made if r.resource}
        granted = {
            (resource, verb)
            for _, name, _, resource, _, verb in _granted(everything)
            if name == account
        }
        assert granted - used == NOT_EXERCISED[account]
    # And the authorizer itself refuses: the device plugin may not create allocations.
    plugin = authorizing.authorizer_for(
        everything.objects, namespace=rendering.NAMESPACE, name=DEVICE_PLUGIN
    )
    create = authorizing.attributes(
        "POST", f"/apis/bcd.dev/v1alpha1/namespaces/{rendering.NAMESPACE}/deviceallocations", {}
    )
    assert not plugin.allows(create)
    elsewhere = authorizing.attributes(
        "GET", "/apis/bcd.dev/v1alpha1/namespaces/ml/deviceallocations", {"watch": "true"}
    )
    assert not plugin.allows(elsewhere)


async def _an_intruder_is_caught(
    kube: KubeApi, node: Node, resource: str, device_ids: list[str]
) -> None:
    """A pod of another namespace found holding the devices (as if the webhooks had been
    bypassed): a Warning Event on it from the device plugin, and the Reservation Degraded
    until it lets go."""
    await kube.create(kubeworld.namespace("other", tenant=None))
    node.pod_resources.holding(
        {"ml/trainer-0": {resource: device_ids[:1]}, "other/thief": {resource: device_ids[1:]}}
    )
    degraded = await kube.wait_for(
        RESERVATIONS, "ml", "train", _degraded("PodOutsideNamespace"), timeout=15
    )
    assert degraded is not None
    assert degraded["status"]["binding"]["pods"] == ["ml/trainer-0", "other/thief"]
    (event,) = await kube.list(EVENTS, "other")
    assert (event["type"], event["involvedObject"]) == (
        "Warning",
        {"apiVersion": "v1", "kind": "Pod", "name": "thief", "namespace": "other"},
    )
    assert event["reason"] == "ReservationDevicesOfAnotherNamespace"
    assert event["reportingComponent"] == "bcd.dev/device-plugin"
    node.pod_resources.holding({"ml/trainer-0": {resource: device_ids}})
    await kube.wait_for(RESERVATIONS, "ml", "train", _degraded(None), timeout=15)


def _degraded(reason: str | None):
    def check(o: Any) -> bool:
        found = [
            c.get("reason")
            for c in ((o or {}).get("status") or {}).get("conditions") or ()
            if c["type"] == "Degraded" and c["status"] == "True"
        ]
        return found == ([reason] if reason else [])

    return check


async def _pod_admitted(
    kube: KubeApi, rendered: rendering.Rendered, *, port: int, resource: str
) -> None:
    """A labelled pod through the chart's pod webhooks, routed to the operator."""
    async with asyncio.timeout(15):  # kopf starts its webhook server after discovery
        while True:
            try:
                _, writer = await asyncio.open_connection("127.0.0.1", port)
            except OSError:
                await asyncio.sleep(0.05)
                continue
            writer.close()
            await writer.wait_closed()
            break
    for kind in ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"):
        configuration = rendered.one(kind)
        hooks = [w for w in configuration["webhooks"] if w["name"].endswith(".pods.bcd.dev")]
        service = hooks[0]["clientConfig"]["service"]
        kube.emulator.webhook_services[(service["namespace"], service["name"])] = (
            f"https://127.0.0.1:{port}"
        )
        await kube.create({**configuration, "webhooks": hooks})
    # The operator keeps its own certificate: it writes its CA into the configurations.
    for ref in (MUTATING, VALIDATING):
        await kube.wait_for(
            ref,
            None,
            CONFIGURATIONS[0],
            lambda o: all(w["clientConfig"].get("caBundle") for w in (o or {}).get("webhooks", [])),
        )
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "trainer-0",
            "namespace": "ml",
            "labels": {"bcd.dev/reservation": "train"},
        },
        "spec": {
            "containers": [
                {"name": "main", "image": "x", "resources": {"limits": {"bcd.dev/gpu": "1"}}}
            ]
        },
    }
    created = await kube.create(pod)
    (container,) = created["spec"]["containers"]
    assert container["resources"]["limits"] == {resource: "1"}


# --- the device plugin's own-node admission policy ------------------------------------------


def _cel(expression: str, activation: dict[str, Any]) -> Any:
    env = celpy.Environment()
    return env.program(env.compile(expression)).evaluate(
        {k: adapter.json_to_cel(v) for k, v in activation.items()}
    )


def _admit(policy: dict[str, Any], request: dict[str, Any], obj: dict[str, Any]) -> list[str]:
    """The policy's refusals of ``request`` writing ``obj`` (messages), [] when admitted."""
    spec = policy["spec"]
    base = {"request": request, "object": obj}
    for condition in spec["matchConditions"]:
        if not _cel(condition["expression"], base):
            return []
    variables: dict[str, Any] = {}
    for variable in spec["variables"]:
        variables[variable["name"]] = _cel(variable["expression"], {**base, "variables": variables})
    activation = {**base, "variables": variables}
    refusals = []
    for validation in spec["validations"]:
        if not _cel(validation["expression"], activation):
            if "messageExpression" in validation:
                refusals.append(str(_cel(validation["messageExpression"], activation)))
            else:
                refusals.append(" ".join(validation["message"].split()))
    return refusals


def _request(resource: str, *, node: str | None, user: str | None = None) -> dict[str, Any]:
    extra = {} if node is None else {"authentication.kubernetes.io/node-name": [node]}
    username = user or f"system:serviceaccount:{rendering.NAMESPACE}:{DEVICE_PLUGIN}"
    return {
        "operation": "UPDATE",
        "resource": {"group": "bcd.dev", "version": "v1alpha1", "resource": resource},
        "userInfo": {"username": username, "extra": extra},
    }


def _gpunode(name: str) -> dict[str, Any]:
    return {"metadata": {"name": name}, "status": {"gpus": 8}}


def _allocation(node: str, reporter: str | None = None) -> dict[str, Any]:
    obj: dict[str, Any] = {"metadata": {"name": "alloc-1", "labels": {"bcd.dev/node": node}}}
    if reporter:
        obj["status"] = {"nodeName": reporter, "phase": "Bound"}
    return obj


CASES = [
    ("own GPUNode", _request("gpunodes", node="n1"), _gpunode("n1"), None),
    (
        "another GPUNode",
        _request("gpunodes", node="n1"),
        _gpunode("n2"),
        "may write only GPUNode n1",
    ),
    ("own allocation", _request("deviceallocations", node="n1"), _allocation("n1", "n1"), None),
    (
        "another node's allocation",
        _request("deviceallocations", node="n1"),
        _allocation("n2"),
        "labelled bcd.dev/node=n1",
    ),
    (
        "a report as another node",
        _request("deviceallocations", node="n1"),
        _allocation("n1", "n2"),
        "may report only as n1",
    ),
    ("a token bound to no node", _request("gpunodes", node=None), _gpunode("n1"), "bound to a pod"),
    (
        "someone else entirely",
        _request("gpunodes", node=None, user="system:serviceaccount:x:y"),
        _gpunode("n2"),
        None,
    ),
]


@pytest.mark.parametrize(("case", "request_", "obj", "refusal"), CASES, ids=[c[0] for c in CASES])
def test_the_device_plugin_writes_only_its_own_node(
    defaults: rendering.Rendered, case: str, request_: dict, obj: dict, refusal: str | None
):
    policy = defaults.one("ValidatingAdmissionPolicy")
    refusals = _admit(policy, request_, obj)
    if refusal is None:
        assert refusals == []
    else:
        assert any(refusal in r for r in refusals), refusals


def test_the_policy_is_bound_and_matches_the_plugins_writes(defaults: rendering.Rendered):
    policy = defaults.one("ValidatingAdmissionPolicy")
    binding = defaults.one("ValidatingAdmissionPolicyBinding")
    assert binding["spec"] == {
        "policyName": policy["metadata"]["name"],
        "validationActions": ["Deny"],
    }
    (rule,) = policy["spec"]["matchConstraints"]["resourceRules"]
    writes = {
        resource
        for kind, name, _, resource, _, verb in _granted(defaults)
        if name == DEVICE_PLUGIN and verb in ("create", "patch", "update")
    }
    # A CSR is the one write the policy leaves alone: CEL cannot read its PEM request, and the
    # operator signs it only for the token's own node (tests/operator/test_node_certificates.py).
    writes.discard("certificatesigningrequests")
    # An Event is only the device plugin's word about a pod (reportingComponent
    # bcd.dev/device-plugin); it changes nothing, and CEL cannot tell which node a pod is on.
    writes.discard("events")
    assert writes <= set(rule["resources"]), writes
    assert json.dumps(policy).count(f"serviceaccount:{rendering.NAMESPACE}:{DEVICE_PLUGIN}") == 1


def test_the_policy_can_be_turned_off(render):
    rendered = render({"devicePlugin": {"nodeRestriction": {"enabled": False}}})
    assert rendered.of("ValidatingAdmissionPolicy") == []
    assert rendered.of("ValidatingAdmissionPolicyBinding") == []
