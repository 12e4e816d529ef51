"""The chart's DRA parts (``dra.enabled``): off by default; on, the DeviceClass of our driver,
the three claim policies (bound with Deny), the node agent's own-slices policy, and the names
they spell as ``kube.dra`` spells them. Their CEL is evaluated here with cel-python on the
operator's own template, which all three must admit; the attacks themselves are refused by the
real API server in tests/controlplane/test_real_dra_admission.py.
"""

from __future__ import annotations

from typing import Any

import celpy
from celpy import adapter

from bettercompute.kube import dra
from bettercompute.operator import claiming
from tests.chart import rendering

POLICIES = ("bcd-dra-namespace-pinned", "bcd-dra-admin-access", "bcd-dra-managed")
OPERATOR = f"system:serviceaccount:{rendering.NAMESPACE}:bc-better-compute-operator"


def _cel(expression: str, activation: dict[str, Any]) -> Any:
    env = celpy.Environment()
    return env.program(env.compile(expression)).evaluate(
        {k: adapter.json_to_cel(v) for k, v in activation.items()}
    )


def _admit(policy: dict[str, Any], base: dict[str, Any]) -> list[str]:
    """The policy's refusals (messages) of the admission request ``base``; [] when admitted."""
    spec = policy["spec"]
    for condition in spec.get("matchConditions", ()):
        if not _cel(condition["expression"], base):
            return []
    variables: dict[str, Any] = {}
    for variable in spec.get("variables", ()):
        variables[variable["name"]] = _cel(variable["expression"], {**base, "variables": variables})
    activation = {**base, "variables": variables}
    return [
        str(_cel(v["messageExpression"], activation))
        for v in spec["validations"]
        if not _cel(v["expression"], activation)
    ]


def _create(obj: dict[str, Any], *, user: str) -> dict[str, Any]:
    return {
        "request": {
            "operation": "CREATE",
            "namespace": obj["metadata"]["namespace"],
            "name": obj["metadata"]["name"],
            "resource": {"group": "resource.k8s.io", "resource": "resourceclaimtemplates"},
            "userInfo": {"username": user},
        },
        "object": obj,
        "oldObject": None,
        "namespaceObject": {"metadata": {"name": obj["metadata"]["namespace"], "labels": {}}},
    }


def test_dra_is_off_by_default(defaults: rendering.Rendered):
    assert defaults.of("DeviceClass") == []
    named = {o["metadata"]["name"] for o in defaults.of("ValidatingAdmissionPolicy")}
    assert not named & set(POLICIES)
    assert not any(n.endswith("-own-slices") for n in named)


def test_the_device_class_selects_our_driver(everything: rendering.Rendered):
    device_class = everything.one("DeviceClass", dra.DEVICE_CLASS)
    assert device_class["apiVersion"] == "resource.k8s.io/v1"
    assert device_class["spec"]["selectors"] == [
        {"cel": {"expression": f'device.driver == "{dra.DRIVER}"'}}
    ]


def test_every_policy_is_bound_to_deny_and_fails_closed(everything: rendering.Rendered):
    slices = "bc-better-compute-device-plugin-own-slices"
    for name in (*POLICIES, slices):
        policy = everything.one("ValidatingAdmissionPolicy", name)
        assert policy["spec"]["failurePolicy"] == "Fail"
        binding = everything.one("ValidatingAdmissionPolicyBinding", name)
        assert binding["spec"] == {"policyName": name, "validationActions": ["Deny"]}


def test_the_pin_is_kube_dras_namespace_selector(everything: rendering.Rendered):
    policy = everything.one("ValidatingAdmissionPolicy", "bcd-dra-namespace-pinned")
    (pin,) = [v for v in policy["spec"]["variables"] if v["name"] == "pin"]
    assert _cel(pin["expression"], {"request": {"namespace": "ml"}}) == dra.namespace_selector("ml")


def test_the_operators_own_template_passes_every_policy(
    everything: rendering.Rendered,
):
    made = claiming.template(namespace="ml", name="train", uid="u-1", reservation_id="rsv_1")
    for name in POLICIES:
        policy = everything.one("ValidatingAdmissionPolicy", name)
        assert _admit(policy, _create(made, user=OPERATOR)) == [], name
    # bcd-dra-managed does not even match the operator's own writes (its matchConditions);
    # anyone else's is refused by the real API server (cel-python has no null comparison of
    # a map, which that policy's `object != null` needs).
    managed = everything.one("ValidatingAdmissionPolicy", "bcd-dra-managed")
    (condition,) = managed["spec"]["matchConditions"]
    assert condition["expression"] == f"request.userInfo.username != {OPERATOR!r}".replace("'", '"')
