"""The operator's and the CRD hook's pods meet the ``restricted`` Pod Security Standard, with
default values and with every value set; the node agent's does not, for the reasons the
install page gives.

The rules are the standard's, checked field by field on the rendered pod templates so that
this runs anywhere; ``tests/controlplane/test_real_pod_security.py`` sends the same pods to a
real API server's Pod Security admission.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.chart import rendering

#: Volume types ``restricted`` allows.
VOLUMES = {
    "configMap",
    "csi",
    "downwardAPI",
    "emptyDir",
    "ephemeral",
    "persistentVolumeClaim",
    "projected",
    "secret",
}


def restricted_violations(pod: dict[str, Any]) -> list[str]:
    """What in ``pod`` (a PodSpec) the ``restricted`` level (latest) refuses."""
    found = []
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(field):
            found.append(field)
    for volume in pod.get("volumes") or ():
        kinds = set(volume) - {"name"}
        if not kinds <= VOLUMES:
            found.append(f"volume {volume['name']}: {sorted(kinds - VOLUMES)}")
    context = pod.get("securityContext") or {}
    if context.get("sysctls"):
        found.append("sysctls")
    for container in [*pod.get("initContainers", []), *pod["containers"]]:
        name = container["name"]
        own = container.get("securityContext") or {}
        if own.get("privileged"):
            found.append(f"{name}: privileged")
        if own.get("allowPrivilegeEscalation") is not False:
            found.append(f"{name}: allowPrivilegeEscalation must be false")
        capabilities = own.get("capabilities") or {}
        if "ALL" not in (capabilities.get("drop") or ()):
            found.append(f"{name}: capabilities must drop ALL")
        if set(capabilities.get("add") or ()) - {"NET_BIND_SERVICE"}:
            found.append(f"{name}: adds capabilities")
        if not own.get("runAsNonRoot", context.get("runAsNonRoot")):
            found.append(f"{name}: runAsNonRoot")
        if own.get("runAsUser", context.get("runAsUser")) == 0:
            found.append(f"{name}: runAsUser 0")
        seccomp = (own.get("seccompProfile") or context.get("seccompProfile") or {}).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            found.append(f"{name}: seccompProfile")
        if any(p.get("hostPort") for p in container.get("ports") or ()):
            found.append(f"{name}: hostPort")
    return found


def _pods(rendered: rendering.Rendered) -> dict[str, dict[str, Any]]:
    return {
        "operator": rendering.pod_spec(rendered.one("StatefulSet")),
        "crd-upgrade": rendering.pod_spec(rendered.one("Job")),
        "device-plugin": rendering.pod_spec(rendered.one("DaemonSet")),
    }


@pytest.mark.parametrize("which", ["defaults", "everything"])
def test_the_operator_and_the_hook_meet_restricted(which: str, request: Any) -> None:
    pods = _pods(request.getfixturevalue(which))
    assert restricted_violations(pods["operator"]) == []
    assert restricted_violations(pods["crd-upgrade"]) == []


def test_the_node_agent_needs_privileged_for_root_and_host_paths(
    defaults: rendering.Rendered,
) -> None:
    found = restricted_violations(_pods(defaults)["device-plugin"])
    assert "device-plugin: runAsNonRoot" in found
    assert "device-plugin: runAsUser 0" in found
    assert any("hostPath" in f for f in found)
    # Nothing beyond root and host paths: not a privileged container.
    assert all("privileged" not in f and "capabilities" not in f for f in found), found


def test_the_check_refuses_what_restricted_refuses(defaults: rendering.Rendered) -> None:
    pod = _pods(defaults)["operator"]
    broken = {
        **pod,
        "hostNetwork": True,
        "containers": [
            {**c, "securityContext": {**c["securityContext"], "allowPrivilegeEscalation": True}}
            for c in pod["containers"]
        ],
    }
    found = restricted_violations(broken)
    assert "hostNetwork" in found
    assert any("allowPrivilegeEscalation" in f for f in found)
