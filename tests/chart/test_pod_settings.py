"""The pods' settings, per component (``operator``, ``devicePlugin``): each renders where it
should, and nothing when unset.

- ``serviceAccount.annotations`` on the component's own ServiceAccount;
- ``podSecurityContext`` and ``securityContext``: the defaults are exactly what the chart set
  before they were values (kept), a value merges into them, and a field can be dropped;
- ``extraEnv``, ``extraVolumes``, ``extraVolumeMounts`` after the chart's own; one that would
  collide with the chart's (a variable, a volume name, a mount path) or name no volume fails
  the render, naming the value;
- ``nodeSelector``, ``tolerations``, ``affinity``, ``priorityClassName`` for both;
  ``topologySpreadConstraints`` for the operator (a DaemonSet has none: one pod per node),
  given the operator's pod labels when they name none.

``full()`` turns them all on, so ``test_chart.py`` checks the objects against Kubernetes'
schemas; the schema's refusals are in ``test_values.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import helm_python
import pytest

from tests.chart import rendering
from tests.chart.conftest import GSA, ROLE_ARN

OPERATOR = "bc-better-compute-operator"
DEVICE_PLUGIN = "bc-better-compute-device-plugin"
WORKLOADS = {"operator": "StatefulSet", "devicePlugin": "DaemonSet"}

# What the templates set before these were values (chart 0.1.0): the defaults keep them.
BEFORE = {
    "operator": (
        {
            "runAsNonRoot": True,
            "runAsUser": 10001,
            "runAsGroup": 10001,
            "fsGroup": 10001,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        {
            "runAsNonRoot": True,
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        },
    ),
    "devicePlugin": (
        {"runAsUser": 0, "runAsGroup": 0, "seccompProfile": {"type": "RuntimeDefault"}},
        {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        },
    ),
}


def _pod(rendered: rendering.Rendered, component: str) -> dict[str, Any]:
    return rendering.pod_spec(rendered.one(WORKLOADS[component]))


def _container(rendered: rendering.Rendered, component: str) -> dict[str, Any]:
    (container,) = _pod(rendered, component)["containers"]
    return container


def _refused(render: Callable, values: dict[str, Any]) -> str:
    with pytest.raises(helm_python.HelmError) as refused:
        render(values)
    return str(refused.value)


# --- service accounts -------------------------------------------------------------------------


def test_service_account_annotations(defaults: rendering.Rendered, everything):
    assert everything.one("ServiceAccount", OPERATOR)["metadata"]["annotations"] == {
        "eks.amazonaws.com/role-arn": ROLE_ARN
    }
    assert everything.one("ServiceAccount", DEVICE_PLUGIN)["metadata"]["annotations"] == {
        "iam.gke.io/gcp-service-account": GSA
    }
    for name in (OPERATOR, DEVICE_PLUGIN):
        assert "annotations" not in defaults.one("ServiceAccount", name)["metadata"]


# --- security contexts ------------------------------------------------------------------------


@pytest.mark.parametrize("component", sorted(WORKLOADS))
def test_the_default_security_contexts_are_the_charts_before(defaults, component: str):
    pod, container = BEFORE[component]
    assert _pod(defaults, component)["securityContext"] == pod
    assert _container(defaults, component)["securityContext"] == container


def test_security_contexts_merge_into_the_defaults(everything: rendering.Rendered):
    operator = _pod(everything, "operator")["securityContext"]
    expected = {k: v for k, v in BEFORE["operator"][0].items() if k != "fsGroup"}
    assert operator == {**expected, "fsGroupChangePolicy": "OnRootMismatch"}
    plugin = _pod(everything, "devicePlugin")["securityContext"]
    assert plugin == {**BEFORE["devicePlugin"][0], "supplementalGroups": [44]}
    assert _container(everything, "operator")["securityContext"] == {
        **BEFORE["operator"][1],
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def test_a_default_field_can_be_dropped(render: Callable):
    # OpenShift: the namespace's uid range applies, so the fixed ids go.
    drop = {"runAsUser": None, "runAsGroup": None, "fsGroup": None}
    rendered = render({"operator": {"podSecurityContext": drop}})
    assert _pod(rendered, "operator")["securityContext"] == {
        "runAsNonRoot": True,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


# --- extra environment, volumes and mounts ----------------------------------------------------


def test_extras_come_after_the_charts_own(defaults: rendering.Rendered, everything):
    operator, plugin = _container(everything, "operator"), _container(everything, "devicePlugin")
    assert [e["name"] for e in operator["env"][-2:]] == ["PGSSLROOTCERT", "PGAPPNAME"]
    assert operator["env"][-1]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert plugin["env"][-1] == {"name": "TZ", "value": "UTC"}
    assert _pod(everything, "operator")["volumes"][-1] == {
        "name": "database-ca",
        "secret": {"secretName": "db-ca", "items": [{"key": "ca.crt", "path": "ca.crt"}]},
    }
    assert operator["volumeMounts"][-1] == {
        "name": "database-ca",
        "mountPath": "/etc/bcd/database-ca",
        "readOnly": True,
    }
    assert _pod(everything, "devicePlugin")["volumes"][-1] == {
        "name": "site-config",
        "configMap": {"name": "site-config"},
    }
    assert plugin["volumeMounts"][-1]["mountPath"] == "/etc/site"
    # Unset: only the chart's own.
    for component in WORKLOADS:
        names = {e["name"] for e in _container(defaults, component)["env"]}
        assert not {"PGSSLROOTCERT", "PGAPPNAME", "TZ"} & names
        volumes = {v["name"] for v in _pod(defaults, component)["volumes"]}
        assert not {"database-ca", "site-config"} & volumes


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (
            {"devicePlugin": {"extraEnv": [{"name": "NODE_NAME", "value": "x"}]}},
            'devicePlugin.extraEnv[0]: name "NODE_NAME" is the chart\'s own',
        ),
        (
            {"operator": {"extraEnv": [{"name": "TZ", "value": "UTC"}, {"name": "TZ"}]}},
            'operator.extraEnv[1]: name "TZ" is given twice',
        ),
        (
            {"operator": {"extraVolumes": [{"name": "tmp", "emptyDir": {}}]}},
            'operator.extraVolumes[0]: name "tmp" is the chart\'s own',
        ),
        (
            {
                "devicePlugin": {
                    "extraVolumes": [{"name": "scratch", "emptyDir": {}}],
                    "extraVolumeMounts": [{"name": "scratch", "mountPath": "/run/bcd"}],
                }
            },
            'devicePlugin.extraVolumeMounts[0]: mountPath "/run/bcd" is the chart\'s own',
        ),
        (
            {"operator": {"extraVolumeMounts": [{"name": "nowhere", "mountPath": "/x"}]}},
            'operator.extraVolumeMounts[0]: no volume named "nowhere" in the pod',
        ),
    ],
)
def test_an_extra_that_collides_fails_naming_the_value(render: Callable, values, message: str):
    assert message in _refused(render, values)


def test_an_extra_mount_may_use_a_chart_volume(render: Callable):
    mount = {"name": "tmp", "mountPath": "/var/tmp"}
    rendered = render({"operator": {"extraVolumeMounts": [mount]}})
    assert _container(rendered, "operator")["volumeMounts"][-1] == mount


# --- scheduling -------------------------------------------------------------------------------


def test_the_operator_is_scheduled_as_told(defaults: rendering.Rendered, everything):
    pod = _pod(everything, "operator")
    assert pod["nodeSelector"] == {"node-role/control": "true"}
    assert pod["tolerations"] == [{"key": "control", "operator": "Exists", "effect": "NoSchedule"}]
    assert pod["priorityClassName"] == "system-cluster-critical"
    # A constraint without a labelSelector counts the operator's pods.
    assert pod["topologySpreadConstraints"] == [
        {
            "maxSkew": 1,
            "topologyKey": "topology.kubernetes.io/zone",
            "whenUnsatisfiable": "ScheduleAnyway",
            "labelSelector": {
                "matchLabels": everything.one("StatefulSet")["spec"]["selector"]["matchLabels"]
            },
        }
    ]
    unset = _pod(defaults, "operator")
    for field in ("nodeSelector", "tolerations", "priorityClassName", "topologySpreadConstraints"):
        assert field not in unset, field


def test_a_spread_constraints_own_selector_is_kept(render: Callable):
    constraint = {
        "maxSkew": 2,
        "topologyKey": "kubernetes.io/hostname",
        "whenUnsatisfiable": "DoNotSchedule",
        "labelSelector": {"matchLabels": {"team": "platform"}},
        "matchLabelKeys": ["apps.kubernetes.io/pod-index"],
    }
    rendered = render({"operator": {"topologySpreadConstraints": [constraint]}})
    assert _pod(rendered, "operator")["topologySpreadConstraints"] == [constraint]


def test_an_affinity_replaces_the_operators_default(render: Callable):
    affinity = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["ctl"]}]}
                ]
            }
        }
    }
    rendered = render({"operator": {"affinity": affinity}})
    assert _pod(rendered, "operator")["affinity"] == affinity


def test_the_device_plugin_is_scheduled_as_told(render: Callable):
    toleration = {"key": "dedicated", "operator": "Equal", "value": "gpu", "effect": "NoExecute"}
    rendered = render(
        {
            "devicePlugin": {
                "tolerations": [toleration],
                "affinity": {"podAffinity": {}},
                "priorityClassName": "gpu-agents",
            }
        }
    )
    pod = _pod(rendered, "devicePlugin")
    assert pod["tolerations"] == [toleration]  # replaces the nvidia.com/gpu default
    assert pod["affinity"] == {"podAffinity": {}}
    assert pod["priorityClassName"] == "gpu-agents"
    assert "topologySpreadConstraints" not in pod


@pytest.mark.parametrize(
    ("given", "expected"),
    [("absent", "system-node-critical"), (None, "system-node-critical"), ("", None)],
    ids=["default", "null", "empty"],
)
def test_the_device_plugins_priority_class(render: Callable, given, expected):
    values = {} if given == "absent" else {"devicePlugin": {"priorityClassName": given}}
    assert _pod(render(values), "devicePlugin").get("priorityClassName") == expected
