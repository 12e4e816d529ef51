"""The operator's StatefulSet and the device plugin's DaemonSet: how they run and what they are
told, checked against the programs that read it.

- Every container has startup, liveness and readiness probes on a port it declares, and
  resources; the operator runs as the image's non-root user, the device plugin as root without
  privilege; both drop every capability and keep the root filesystem read-only.
- The device plugin mounts exactly the five host paths, each at the same path, and runs at
  system-node-critical priority on the nodes the values select.
- Each container's environment, resolved as the kubelet would (downward API, the Secret), is
  parsed by the real command (``better-compute-operator``, ``better-compute-deviceplugin``), and
  every path it names lies in a volume the pod mounts: a misspelt variable or a moved mount
  fails here. The policy files the operator is told to read load in the real Cedar engine.
- Each replica's kopf peering priority is its pod index, and its identity its pod name.
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath
from typing import Any

import click
import pytest
import typer

from bettercompute.deviceplugin import agent
from bettercompute.operator import running
from bettercompute.operator.config import OperatorConfig
from tests.chart import rendering
from tests.chart.conftest import DATABASE, POLICY, USER_SECRETS

HOST_PATHS = {
    "/var/lib/kubelet/device-plugins",
    "/var/lib/kubelet/pod-resources",
    "/etc/cdi",
    "/var/run/cdi",
    "/run/bcd",
    "/var/lib/bcd",
    "/sys/fs/cgroup",
}
#: What dra.enabled adds: the DRA plugin's socket, and the plugin watcher's folder.
DRA_HOST_PATHS = {"/var/lib/kubelet/plugins", "/var/lib/kubelet/plugins_registry"}
POD = {"name": "bc-better-compute-operator-1", "index": "1", "node": "gpu-node-1"}


def _workloads(rendered: rendering.Rendered) -> list[dict[str, Any]]:
    return [*rendered.of("StatefulSet"), *rendered.of("DaemonSet"), *rendered.of("Deployment")]


@pytest.mark.parametrize("which", ["defaults", "everything"])
def test_every_container_has_probes_and_resources(which: str, request: pytest.FixtureRequest):
    rendered: rendering.Rendered = request.getfixturevalue(which)
    workloads = _workloads(rendered)
    assert {w["kind"] for w in workloads} == {"StatefulSet", "DaemonSet"}
    for workload in workloads:
        for container in rendering.containers(workload):
            ports = {p["name"]: p["containerPort"] for p in container["ports"]}
            for probe, path in (
                ("startupProbe", "/healthz"),
                ("livenessProbe", "/healthz"),
                ("readinessProbe", "/readyz"),
            ):
                assert container[probe]["httpGet"]["path"] == path, (container["name"], probe)
                assert container[probe]["httpGet"]["port"] in ports, (container["name"], probe)
            resources = container["resources"]
            assert {"cpu", "memory"} <= set(resources["requests"]), container["name"]
            assert "memory" in resources["limits"], container["name"]


def test_the_operator_runs_as_the_images_non_root_user(defaults: rendering.Rendered):
    dockerfile = (rendering.ROOT / "Dockerfile").read_text(encoding="utf-8")
    (user,) = [line.split()[1] for line in dockerfile.splitlines() if line.startswith("USER ")]
    uid = int(user.split(":")[0])
    pod = rendering.pod_spec(defaults.one("StatefulSet"))
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == uid != 0
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    (container,) = pod["containers"]
    _assert_locked_down(container)


def test_the_device_plugin_runs_as_root_without_privilege(everything: rendering.Rendered):
    pod = rendering.pod_spec(everything.one("DaemonSet"))
    assert pod["securityContext"]["runAsUser"] == 0
    assert pod["priorityClassName"] == "system-node-critical"
    assert pod["nodeSelector"] == {"bcd.dev/gpu-node": "true"}
    assert "affinity" not in pod
    assert pod["runtimeClassName"] == "nvidia"
    assert "hostNetwork" not in pod
    assert "hostPID" not in pod
    (container,) = pod["containers"]
    _assert_locked_down(container)
    assert "privileged" not in container["securityContext"]


def test_the_device_plugin_tolerates_gpu_nodes_by_default(defaults: rendering.Rendered):
    pod = rendering.pod_spec(defaults.one("DaemonSet"))
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod[
        "tolerations"
    ]
    # GPU feature discovery's label, as an affinity that a nodeSelector replaces (not merges).
    assert "nodeSelector" not in pod
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert terms["nodeSelectorTerms"] == [
        {
            "matchExpressions": [
                {"key": "nvidia.com/gpu.present", "operator": "In", "values": ["true"]}
            ]
        }
    ]


def _assert_locked_down(container: dict[str, Any]) -> None:
    security = container["securityContext"]
    assert security["allowPrivilegeEscalation"] is False
    assert security["readOnlyRootFilesystem"] is True
    assert security["capabilities"] == {"drop": ["ALL"]}


@pytest.mark.parametrize("which", ["defaults", "everything"])
def test_the_device_plugin_mounts_exactly_the_host_paths(which, request: pytest.FixtureRequest):
    rendered: rendering.Rendered = request.getfixturevalue(which)
    pod = rendering.pod_spec(rendered.one("DaemonSet"))
    host = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    # "everything" turns DRA on, the defaults leave it off.
    assert set(host.values()) == HOST_PATHS | (DRA_HOST_PATHS if which == "everything" else set())
    (container,) = pod["containers"]
    mounted = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    for name, path in host.items():
        assert mounted[name] == path  # the same path inside: the kubelet's sockets name it
    # Nothing else from the host: the other volumes are a ConfigMap and a scratch emptyDir.
    assert all("hostPath" in v or "configMap" in v or "emptyDir" in v for v in pod["volumes"])
    assert rendering.pod_spec(rendered.one("StatefulSet")).get("volumes")
    assert not [
        v for v in rendering.pod_spec(rendered.one("StatefulSet"))["volumes"] if "hostPath" in v
    ]


# --- the environment, as the programs read it ----------------------------------------------


def _resolve(rendered: rendering.Rendered, value: Any) -> str:
    """A valueFrom as the kubelet fills it in, for the pod in ``POD``."""
    if isinstance(value, str):
        return value
    if "fieldRef" in value:
        path = value["fieldRef"]["fieldPath"]
        return {
            "metadata.namespace": rendering.NAMESPACE,
            "metadata.name": POD["name"],
            "spec.nodeName": POD["node"],
            "metadata.labels['apps.kubernetes.io/pod-index']": POD["index"],
        }[path]
    ref = value["secretKeyRef"]
    if (ref["name"], ref["key"]) in USER_SECRETS:  # one the user makes, not the chart
        return USER_SECRETS[ref["name"], ref["key"]]
    secret = rendered.one("Secret", ref["name"])
    return str(secret["stringData"][ref["key"]])


def _params(
    rendered: rendering.Rendered, command: click.Command, container: dict[str, Any], monkeypatch
) -> dict[str, Any]:
    for name in list(agent.os.environ):
        if name.startswith(("BCD_", "DATABASE_URL", "PG", "POD_", "NODE_NAME", "KUBECONFIG")):
            monkeypatch.delenv(name)
    for env in container["env"]:
        monkeypatch.setenv(env["name"], _resolve(rendered, env.get("value", env.get("valueFrom"))))
    context = command.make_context(container["command"][0], list(container.get("args", [])))
    return dict(context.params)


def _inside(path: Path, container: dict[str, Any]) -> dict[str, Any]:
    """The volume mount ``path`` lies in."""
    found = [
        m
        for m in container["volumeMounts"]
        if PurePosixPath(path).is_relative_to(PurePosixPath(m["mountPath"]))
    ]
    assert found, f"{path} is in no volume of {container['name']}"
    return max(found, key=lambda m: len(m["mountPath"]))


def _volume(pod: dict[str, Any], name: str) -> dict[str, Any]:
    (volume,) = [v for v in pod["volumes"] if v["name"] == name]
    return volume


def test_the_operator_command_reads_what_the_chart_gives(
    everything: rendering.Rendered, monkeypatch, tmp_path: Path
):
    statefulset = everything.one("StatefulSet")
    pod = rendering.pod_spec(statefulset)
    (container,) = pod["containers"]
    assert container["command"] == ["better-compute-operator"]
    params = _params(everything, typer.main.get_command(running.cli), container, monkeypatch)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    # The database by host: no URL, libpq's variables (tests/chart/test_database.py connects).
    assert params["database_url"] == "postgresql://"
    env = {
        e["name"]: _resolve(everything, e.get("value", e.get("valueFrom")))
        for e in container["env"]
    }
    assert {k: v for k, v in env.items() if k.startswith("PG")} == {
        "PGHOST": DATABASE["host"],
        "PGPORT": str(DATABASE["port"]),
        "PGDATABASE": DATABASE["name"],
        "PGUSER": DATABASE["user"],
        "PGPASSWORD": USER_SECRETS["bcd-db", "password"],
        "PGSSLMODE": DATABASE["sslmode"],
        # operator.extraEnv, after the chart's own
        "PGSSLROOTCERT": "/etc/bcd/database-ca/ca.crt",
        "PGAPPNAME": POD["name"],
    }
    assert _inside(Path(env["PGSSLROOTCERT"]), container)["name"] == "database-ca"
    assert params["namespace"] == rendering.NAMESPACE
    assert params["root_tenant"] == "platform"
    assert params["priority"] == int(POD["index"])
    assert params["no_default_policies"] is True
    assert params["http_port"] == ports["http"]
    assert params["webhook_port"] == ports["webhook"]
    assert params["metrics_port"] == ports["metrics"] != ports["http"]
    assert _resolve(everything, rendering.env_of(container)["POD_ID"]) == POD["name"]
    # The webhook certificate is the operator's own: where it keeps it, for which Service and
    # which configurations, as the command reads them; no files of Helm's.
    assert (params["webhook_cert"], params["webhook_key"]) == (None, None)
    assert params["webhook_secret"] == "bc-better-compute-webhook-tls"
    assert (
        params["webhook_service"]
        == everything.one("Service", "bc-better-compute")["metadata"]["name"]
    )
    assert params["webhook_configurations"] == [
        everything.one("MutatingWebhookConfiguration")["metadata"]["name"]
    ]
    # The policy files are the ConfigMap's keys, and they load in the real engine.
    (config_map,) = [
        c for c in everything.of("ConfigMap") if c["metadata"]["name"].endswith("policies")
    ]
    files = []
    for path in params["policies_"]:
        mount = _inside(path, container)
        assert _volume(pod, mount["name"])["configMap"]["name"] == config_map["metadata"]["name"]
        local = tmp_path / path.name
        local.write_text(config_map["data"][path.name], encoding="utf-8")
        files.append(local)
    assert [f.name for f in files] == ["one-week-at-most.cedar"]
    assert files[0].read_text(encoding="utf-8") == POLICY
    config = OperatorConfig(database_url="", policy_files=tuple(files), no_default_policies=True)
    running.policy_engine(config)  # raises OperatorError when a file does not load


def test_the_operators_priority_and_identity_come_from_the_pod(defaults: rendering.Rendered):
    statefulset = defaults.one("StatefulSet")
    env = rendering.env_of(rendering.pod_spec(statefulset)["containers"][0])
    assert env["BCD_PEERING_PRIORITY"] == {
        "fieldRef": {"fieldPath": "metadata.labels['apps.kubernetes.io/pod-index']"}
    }
    assert env["POD_ID"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert statefulset["spec"]["podManagementPolicy"] == "Parallel"
    assert "BCD_POLICY_FILES" not in env  # no files: only the built-in policies


def test_the_device_plugin_command_reads_what_the_chart_gives(
    everything: rendering.Rendered, monkeypatch, tmp_path: Path
):
    pod = rendering.pod_spec(everything.one("DaemonSet"))
    (container,) = pod["containers"]
    assert container["command"] == ["better-compute-deviceplugin"]
    params = _params(everything, typer.main.get_command(agent.cli), container, monkeypatch)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert params["node_name"] == POD["node"]
    assert params["namespace"] == rendering.NAMESPACE
    assert params["metrics_port"] == ports["metrics"]
    assert agent._labels(params["node_labels"]) == {
        "bcd.dev/pool": "h100-train",
        "topology.example/rack": "r1",
    }
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert params["plugin_dir"] == Path(mounts["device-plugins"])
    assert _inside(params["pod_resources_socket"], container)["name"] == "pod-resources"
    assert params["cdi_dir"] == Path(mounts["cdi"])
    assert _inside(params["env_dir"], container)["name"] == "run-bcd"
    assert _inside(params["node_key"], container)["name"] == "node-key"
    # The simulated inventory is the mounted ConfigMap's file, one the agent reads.
    inventory = params["inventory_file"]
    volume = _volume(pod, _inside(inventory, container)["name"])
    config_map = everything.one("ConfigMap", volume["configMap"]["name"])
    local = tmp_path / inventory.name
    local.write_text(config_map["data"][inventory.name], encoding="utf-8")
    config = agent.AgentConfig(node_name=POD["node"], inventory_file=local)
    assert len(agent.inventory_source(config).read().gpus) == 8


def test_without_a_simulated_inventory_the_device_plugin_asks_nvml(
    defaults: rendering.Rendered, monkeypatch
):
    (container,) = rendering.pod_spec(defaults.one("DaemonSet"))["containers"]
    params = _params(defaults, typer.main.get_command(agent.cli), container, monkeypatch)
    assert params["inventory_file"] is None
    assert rendering.env_of(container)["NVIDIA_VISIBLE_DEVICES"] == "all"


def test_an_existing_database_secret_is_read_by_name_and_key(render):
    rendered = render({"database": {"existingSecret": {"name": "pg", "key": "dsn"}}})
    (container,) = rendering.pod_spec(rendered.one("StatefulSet"))["containers"]
    assert rendering.env_of(container)["DATABASE_URL"] == {
        "secretKeyRef": {"name": "pg", "key": "dsn"}
    }
    assert [s["metadata"]["name"] for s in rendered.of("Secret")] == []  # none of the chart's


def _image(rendered: rendering.Rendered, kind: str) -> str:
    return str(rendering.pod_spec(rendered.one(kind))["containers"][0]["image"])


def test_each_workload_runs_its_own_image_pinned_by_digest_when_given(defaults, everything, render):
    # The operator's image (Dockerfile target operator) and the slim node agent's (node-agent).
    assert _image(defaults, "StatefulSet") == "better-compute:0.1.0"
    assert _image(defaults, "DaemonSet") == "better-compute-node:0.1.0"
    repository = "registry.example/bcd/better-compute"
    assert _image(everything, "StatefulSet") == f"{repository}@sha256:" + "ab" * 32
    assert _image(everything, "DaemonSet") == f"{repository}-node@sha256:" + "cd" * 32
    named = render({"image": {"nodeRepository": "mirror.example/bcd-node", "tag": "1.2.3"}})
    assert _image(named, "DaemonSet") == "mirror.example/bcd-node:1.2.3"
    assert _image(named, "StatefulSet") == "better-compute:1.2.3"
