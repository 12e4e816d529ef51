"""values.schema.json: a wrong value fails ``helm install`` naming the value and the reason.

Table-driven: each bad value is refused by Helm's own schema check (the one install and upgrade
run) with a message that names its path. The pool spec part of the schema is the GPUPool CRD's,
converted (``tests/chart/converting.py``), and must not drift from it; the default simulated
inventory must be one the device plugin reads.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import helm_python
import pytest
import yaml

from tests.chart import converting, rendering
from tests.chart.conftest import POOL, full


def _pool(**changes: Any) -> dict[str, Any]:
    pool = copy.deepcopy(POOL)
    pool.update(changes)
    return pool


# (values, the path the message must name, a word of the reason)
REFUSED = [
    ({"operator": {"replicas": "two"}}, "/operator/replicas", "want integer"),
    ({"operator": {"replicas": 0}}, "/operator/replicas", "minimum"),
    ({"operator": {"replica": 2}}, "/operator", "'replica' not allowed"),
    ({"operator": {"logLevel": "LOUD"}}, "/operator/logLevel", "one of"),
    ({"metrics": {"port": 8080}}, "/metrics/port", "not"),  # the HTTP API's
    ({"metrics": {"port": 0}}, "/metrics/port", "minimum"),
    ({"operator": {"resources": {"requests": {"cpu": "lots"}}}}, "/operator/resources", "pattern"),
    ({"image": {"pullPolicy": "Sometimes"}}, "/image/pullPolicy", "one of"),
    ({"image": {"digest": "sha256:short"}}, "/image/digest", "pattern"),
    ({"database": {"url": "mysql://db/bcd"}}, "/database/url", "pattern"),
    ({"database": {"password": "x"}}, "/database", "'password' not allowed"),
    ({"webhook": {"failurePolicy": "Maybe"}}, "/webhook/failurePolicy", "one of"),
    ({"webhook": {"selfSigned": {"validityDays": 0}}}, "/webhook/selfSigned/validityDays", "min"),
    ({"webhook": {"pods": {"enabled": "yes"}}}, "/webhook/pods/enabled", "want boolean"),
    ({"webhook": {"pods": {"timeoutSeconds": 60}}}, "/webhook/pods/timeoutSeconds", "max"),
    ({"webhook": {"pods": {"excludeNamespaces": "kube-system"}}}, "/webhook/pods", "want array"),
    (
        {"webhook": {"certManager": {"enabled": True, "issuerRef": {"kind": "ClusterIssuer"}}}},
        "/webhook/certManager/issuerRef",
        "name",
    ),
    (
        {"policies": {"files": {"../escape": "permit(principal,action,resource);"}}},
        "",
        "invalid propertyName '../escape'",
    ),
    ({"pools": {"h100": _pool(modle="H100")}}, "/pools/h100", "'modle' not allowed"),
    ({"pools": {"h100": _pool(sharing={"mode": "shared"})}}, "/pools/h100/sharing/mode", "one of"),
    ({"pools": {"h100": _pool(region="EU West")}}, "/pools/h100/region", "pattern"),
    ({"pools": {"h100": _pool(owner={"quotas": {}})}}, "/pools/h100/owner", "tenant"),
    (
        {"pools": {"h100": _pool(policy={"maxPending": True})}},
        "/pools/h100/policy/maxPending",
        "want integer or string",
    ),
    # Helm reports a bad map key at '' (not at /pools), but names the key and the pattern.
    ({"pools": {"H100_Train": POOL}}, "", "invalid propertyName 'H100_Train'"),
    (
        {"devicePlugin": {"simulatedInventory": {"inventory": {"gpus": [{"index": 0}]}}}},
        "/devicePlugin/simulatedInventory/inventory/gpus/0",
        "uuid",
    ),
    (
        {"devicePlugin": {"nodeLabels": {"bcd.dev/pool": "not a value"}}},
        "/devicePlugin/nodeLabels/bcd.dev~1pool",
        "pattern",
    ),
    (
        {"metrics": {"serviceMonitor": {"interval": "often"}}},
        "/metrics/serviceMonitor/interval",
        "pattern",
    ),
    ({"networkPolicy": {"httpFrom": [{"pods": {}}]}}, "/networkPolicy/httpFrom/0", "'pods'"),
    ({"surprise": True}, "", "'surprise' not allowed"),
    # --- the pods' settings (tests/chart/test_pod_settings.py renders them)
    (
        {"operator": {"podSecurityContext": {"runAsUser": "root"}}},
        "/operator/podSecurityContext/runAsUser",
        "want integer",
    ),
    (
        {"operator": {"podSecurityContext": {"privileged": True}}},
        "/operator/podSecurityContext",
        "'privileged' not allowed",
    ),
    # A default is dropped field by field: the whole map may not go (a reused older release's
    # values, which lack it, fail here instead of running without it).
    ({"operator": {"podSecurityContext": None}}, "/operator", "podSecurityContext"),
    ({"devicePlugin": {"securityContext": None}}, "/devicePlugin", "securityContext"),
    (
        {"devicePlugin": {"securityContext": {"capabilities": {"drop": "ALL"}}}},
        "/devicePlugin/securityContext/capabilities/drop",
        "want array",
    ),
    (
        {"operator": {"securityContext": {"seccompProfile": {"type": "Strict"}}}},
        "/operator/securityContext/seccompProfile/type",
        "one of",
    ),
    (
        {"operator": {"serviceAccount": {"annotations": {"eks.amazonaws.com/role-arn": 1}}}},
        "/operator/serviceAccount/annotations/eks.amazonaws.com~1role-arn",
        "want string",
    ),
    (
        {"devicePlugin": {"serviceAccount": {"name": "other"}}},
        "/devicePlugin/serviceAccount",
        "'name' not allowed",
    ),
    ({"operator": {"extraEnv": [{"value": "x"}]}}, "/operator/extraEnv/0", "name"),
    (
        {"operator": {"extraEnv": [{"name": "A", "value": 5}]}},
        "/operator/extraEnv/0/value",
        "string",
    ),
    (
        {
            "operator": {
                "extraEnv": [
                    {
                        "name": "A",
                        "value": "1",
                        "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}},
                    }
                ]
            }
        },
        "/operator/extraEnv/0",
        "'not' failed",
    ),
    ({"devicePlugin": {"extraEnv": {"TZ": "UTC"}}}, "/devicePlugin/extraEnv", "want array"),
    ({"devicePlugin": {"extraVolumes": [{"name": "x"}]}}, "/devicePlugin/extraVolumes/0", "min"),
    (
        {"devicePlugin": {"extraVolumes": [{"name": "x", "hostpath": {"path": "/"}}]}},
        "/devicePlugin/extraVolumes/0",
        "'hostpath' not allowed",
    ),
    (
        {"operator": {"extraVolumeMounts": [{"name": "x", "mountPath": "relative"}]}},
        "/operator/extraVolumeMounts/0/mountPath",
        "pattern",
    ),
    (
        {"operator": {"topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "zone"}]}},
        "/operator/topologySpreadConstraints/0",
        "whenUnsatisfiable",
    ),
    (
        {"devicePlugin": {"topologySpreadConstraints": []}},
        "/devicePlugin",
        "'topologySpreadConstraints' not allowed",
    ),
    ({"devicePlugin": {"priorityClassName": 5}}, "/devicePlugin/priorityClassName", "string"),
    ({"crds": {"upgrade": {"enabled": "yes"}}}, "/crds/upgrade/enabled", "want boolean"),
    ({"crds": {"upgrade": {"image": "kubectl"}}}, "/crds/upgrade", "'image' not allowed"),
]


@pytest.mark.parametrize(("values", "path", "reason"), REFUSED, ids=[str(r[0]) for r in REFUSED])
def test_a_wrong_value_fails_with_its_path_and_reason(
    chart: helm_python.Chart, values: dict[str, Any], path: str, reason: str
):
    with pytest.raises(helm_python.HelmValuesError) as refused:
        rendering.render(chart, values)
    message = str(refused.value)
    assert f"at '{path}" in message, message
    assert reason in message, message


def test_the_defaults_and_every_option_pass(chart: helm_python.Chart):
    chart.validate_schema({})
    chart.validate_schema(full())
    chart.validate_schema({"webhook": {"certManager": {"enabled": True}}})
    chart.validate_schema(
        {"webhook": {"certManager": {"enabled": True, "issuerRef": {"name": "corp-ca"}}}}
    )
    chart.validate_schema({"database": {"existingSecret": {"name": "pg", "key": "dsn"}}})


def test_every_example_pool_passes_as_a_value(chart: helm_python.Chart):
    pools = {
        obj["metadata"]["name"]: obj["spec"]
        for _, obj in rendering.load_examples()
        if obj["kind"] == "GPUPool"
    }
    assert pools
    chart.validate_schema({"pools": pools})


def test_the_pool_schema_is_the_gpupool_crds():
    schema = json.loads(converting.VALUES_SCHEMA.read_text(encoding="utf-8"))
    assert schema["definitions"]["poolSpec"] == converting.pool_spec_schema(), (
        "values.schema.json's poolSpec drifted from crds/gpupools.yaml: "
        "run `python -m tests.chart.converting`"
    )
    assert schema["properties"]["pools"]["additionalProperties"] == {
        "$ref": "#/definitions/poolSpec"
    }


@pytest.mark.parametrize(
    ("node", "expected"),
    [
        ({"type": "string", "nullable": True}, {"type": ["string", "null"]}),
        ({"x-kubernetes-int-or-string": True}, {"type": ["integer", "string"]}),
        (
            {"type": "object", "properties": {"a": {"type": "integer", "format": "int64"}}},
            {
                "type": "object",
                "properties": {"a": {"type": "integer"}},
                "additionalProperties": False,
            },
        ),
        (
            {"type": "object", "additionalProperties": {"type": "string"}},
            {"type": "object", "additionalProperties": {"type": "string"}},
        ),
    ],
)
def test_the_conversion_rules(node, expected):
    assert converting.json_schema(node) == expected


def test_the_conversion_refuses_a_keyword_it_does_not_know():
    with pytest.raises(ValueError, match="oneOf"):
        converting.json_schema({"oneOf": [{"type": "string"}]})


def test_the_default_simulated_inventory_is_one_the_device_plugin_reads(
    chart: helm_python.Chart, tmp_path: Path
):
    from bettercompute.deviceplugin.inventory import FileInventory

    rendered = rendering.render(chart, {"devicePlugin": {"simulatedInventory": {"enabled": True}}})
    config_map = rendered.one("ConfigMap", "bc-better-compute-device-plugin-inventory")
    path = tmp_path / "inventory.yaml"
    path.write_text(config_map["data"]["inventory.yaml"], encoding="utf-8")
    inventory = FileInventory(path=path, node_name="kind-worker").read()
    assert len(inventory.gpus) == 8
    assert len(inventory.nvlink_domains) == 2
    assert (
        yaml.safe_load(config_map["data"]["inventory.yaml"])
        == (chart.values["devicePlugin"]["simulatedInventory"]["inventory"])
    )
