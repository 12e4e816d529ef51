"""The chart's pod webhooks: which pods the API server sends to the operator, and how.

The ``matchConditions`` are CEL the API server evaluates before calling a webhook; here they
are compiled and evaluated with cel-python, as the API stand-in does
(``tests/support/crdchecking.py``), against pods written as users write them: only a pod that
asks a ``bcd.dev/`` resource (in a container or an init container, in requests or limits) or
carries the ``bcd.dev/reservation`` label is sent, so an operator outage blocks no other pod.
``tests/operator/test_pod_webhooks.py`` runs these same configurations against the real
operator through the stand-in's admission chain.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.chart import rendering
from tests.support import crdchecking

KINDS = ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration")


def _pod_webhooks(rendered: rendering.Rendered) -> list[dict[str, Any]]:
    return [
        w
        for kind in KINDS
        for w in rendered.one(kind)["webhooks"]
        if w["name"].endswith(".pods.bcd.dev")
    ]


def _pod(
    *, labels: dict[str, str] | None = None, init: bool = False, **resources: Any
) -> dict[str, Any]:
    container: dict[str, Any] = {"name": "main", "image": "x"}
    if resources:
        container["resources"] = resources
    spec: dict[str, Any] = {"containers": [{"name": "app", "image": "x"}]}
    if init:
        spec["initContainers"] = [container]
    else:
        spec["containers"].append(container)
    meta: dict[str, Any] = {"name": "p", "namespace": "ml"}
    if labels is not None:
        meta["labels"] = labels
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}


SENT = [
    _pod(labels={"bcd.dev/reservation": "train"}),
    _pod(limits={"bcd.dev/gpu": "1"}),
    _pod(requests={"bcd.dev/gpu.mig": "1"}),
    _pod(init=True, limits={"bcd.dev/gpu.slot": "1"}),
    _pod(limits={"bcd.dev/rsv-abcdefghjkmnpqrstvwxyz01": "1", "cpu": "1"}),
    _pod(labels={"app": "x"}, init=True, requests={"bcd.dev/anything": "1"}),
]
NOT_SENT = [
    _pod(),
    _pod(labels={}),
    _pod(labels={"app": "bcd.dev/reservation"}),
    _pod(limits={"nvidia.com/gpu": "1", "cpu": "2"}),
    _pod(requests={"memory": "1Gi"}, limits={}),
    _pod(init=True, limits={"example.com/bcd.dev/gpu": "1"}),
]


@pytest.mark.parametrize("pod", SENT, ids=[f"sent-{i}" for i in range(len(SENT))])
def test_pods_that_ask_bcd_devices_or_name_a_reservation_are_sent(defaults, pod):
    for webhook in _pod_webhooks(defaults):
        (condition,) = webhook["matchConditions"]
        activation = {"object": pod, "oldObject": None, "request": {}}
        assert crdchecking.evaluate(condition["expression"], activation) is True


@pytest.mark.parametrize("pod", NOT_SENT, ids=[f"not-sent-{i}" for i in range(len(NOT_SENT))])
def test_other_pods_never_reach_the_operator(defaults, pod):
    for webhook in _pod_webhooks(defaults):
        (condition,) = webhook["matchConditions"]
        activation = {"object": pod, "oldObject": None, "request": {}}
        assert crdchecking.evaluate(condition["expression"], activation) is False


def test_pod_webhooks_fail_closed_quickly_and_skip_kube_system(defaults):
    mutating, validating = _pod_webhooks(defaults)
    assert mutating["name"] == "rewrite.pods.bcd.dev"
    assert mutating["rules"][0]["operations"] == ["CREATE"]
    assert mutating["reinvocationPolicy"] == "Never"
    assert validating["name"] == "check.pods.bcd.dev"
    assert validating["rules"][0]["operations"] == ["CREATE", "UPDATE"]
    for webhook in (mutating, validating):
        assert webhook["rules"][0]["resources"] == ["pods"]  # not pods/status: the kubelet's
        assert webhook["failurePolicy"] == "Fail"
        assert webhook["sideEffects"] == "None"
        assert webhook["timeoutSeconds"] == 5
        assert webhook["namespaceSelector"] == {
            "matchExpressions": [
                {
                    "key": "kubernetes.io/metadata.name",
                    "operator": "NotIn",
                    "values": ["kube-system"],
                }
            ]
        }
        assert "objectSelector" not in webhook


def test_the_reservation_webhooks_failure_policy_does_not_loosen_the_pod_webhooks(render):
    rendered = render({"webhook": {"failurePolicy": "Ignore"}})
    for webhook in _pod_webhooks(rendered):
        assert webhook["failurePolicy"] == "Fail"


def test_pod_webhooks_can_be_turned_off_or_scoped(render, schemas):
    off = render({"webhook": {"pods": {"enabled": False}}})
    assert _pod_webhooks(off) == []
    for kind in KINDS:
        (left,) = off.one(kind)["webhooks"]
        assert left["name"].endswith(".reservations.bcd.dev")
    scoped = render({"webhook": {"pods": {"excludeNamespaces": ["kube-system", "infra"]}}})
    for webhook in _pod_webhooks(scoped):
        (expression,) = webhook["namespaceSelector"]["matchExpressions"]
        assert expression["values"] == ["kube-system", "infra"]
    everywhere = render({"webhook": {"pods": {"excludeNamespaces": [], "timeoutSeconds": 3}}})
    for webhook in _pod_webhooks(everywhere):
        assert "namespaceSelector" not in webhook
        assert webhook["timeoutSeconds"] == 3
    for rendered in (off, scoped, everywhere):
        for kind in KINDS:
            assert rendering.problems(rendered.one(kind), schemas=schemas) == []
