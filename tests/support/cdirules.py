"""The CDI spec rules a container runtime applies when it loads a spec, as a test checker.

Why: containerd and CRI-O load our ``/etc/cdi/bcd-*.json`` with the CDI Go library, which refuses
a spec strictly (shared/reference/kubelet-device-plugin-protocol.md §6; the library's
``pkg/parser/parser.go``, ``pkg/cdi/spec.go``, ``pkg/cdi/container-edits.go`` and
``specs-go/version.go``). A refused spec means a pod that never starts, found on a GPU node
rather than here. ``problems(spec)`` lists every rule ``spec`` breaks; ``check(spec)`` fails the
test with them.

Rules: required keys and no unknown ones (strict loading); a known ``cdiVersion`` no lower than
the features used require; ``kind`` as ``vendor/class`` with the vendor/class syntax; annotation
keys that are Kubernetes qualified names with string values; a non-empty ``devices`` list of
uniquely and validly named devices, each with non-empty ``containerEdits``; container edits whose
env entries are ``K=V``, device nodes with a path, a known type and valid permissions, mounts
with both paths, hooks with a known name and a path.
"""

from __future__ import annotations

import re
from typing import Any

KNOWN_VERSIONS = (
    "0.3.0", "0.4.0", "0.5.0", "0.6.0", "0.7.0", "0.8.0", "1.0.0", "1.1.0",
)  # fmt: skip
SPEC_KEYS = {"cdiVersion", "kind", "annotations", "devices", "containerEdits"}
DEVICE_KEYS = {"name", "annotations", "containerEdits"}
EDIT_KEYS = {
    "env", "deviceNodes", "hooks", "mounts", "intelRdt", "additionalGids", "netDevices",
}  # fmt: skip
DEVICE_NODE_KEYS = {
    "path", "hostPath", "type", "major", "minor", "fileMode", "permissions", "uid", "gid",
}  # fmt: skip
MOUNT_KEYS = {"hostPath", "containerPath", "options", "type"}
HOOK_KEYS = {"hookName", "path", "args", "env", "timeout"}
HOOK_NAMES = {
    "prestart", "createRuntime", "createContainer", "startContainer", "poststart", "poststop",
}  # fmt: skip

_VENDOR_OR_CLASS = re.compile(r"^[A-Za-z]([A-Za-z0-9_.-]*[A-Za-z0-9])?$")
_DEVICE_NAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9_.:-]*[A-Za-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_QUALIFIED_NAME_PART = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
_TOTAL_ANNOTATION_BYTES = 256 * 1024


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("."))


def minimum_version(spec: dict[str, Any]) -> str:
    """The lowest ``cdiVersion`` that allows the features ``spec`` uses (``version.go``)."""
    edits = [spec.get("containerEdits") or {}] + [
        d.get("containerEdits") or {} for d in spec.get("devices") or [] if isinstance(d, dict)
    ]
    devices = [d for d in spec.get("devices") or [] if isinstance(d, dict)]
    if any(e.get("netDevices") for e in edits):
        return "1.1.0"
    if any(e.get("intelRdt") is not None or e.get("additionalGids") for e in edits):
        return "0.7.0"
    _, _, cls = str(spec.get("kind", "")).partition("/")
    if spec.get("annotations") or any(d.get("annotations") for d in devices) or "." in cls:
        return "0.6.0"
    if any(str(d.get("name", "a"))[:1].isdigit() for d in devices) or any(
        node.get("hostPath") for e in edits for node in e.get("deviceNodes") or []
    ):
        return "0.5.0"
    if any(mount.get("type") for e in edits for mount in e.get("mounts") or []):
        return "0.4.0"
    return "0.3.0"


def _annotation_problems(where: str, annotations: Any) -> list[str]:
    if not isinstance(annotations, dict):
        return [f"{where}: must be a mapping of strings"]
    problems = []
    total = 0
    for key, value in annotations.items():
        if not isinstance(value, str):
            problems.append(f"{where}.{key}: value must be a string")
            continue
        total += len(str(key)) + len(value)
        prefix, slash, name = str(key).rpartition("/")
        if slash and (not prefix or len(prefix) > 253 or not _DNS_SUBDOMAIN.fullmatch(prefix)):
            problems.append(f"{where}.{key}: prefix is not a DNS-1123 subdomain")
        if len(name) > 63 or not _QUALIFIED_NAME_PART.fullmatch(name):
            problems.append(f"{where}.{key}: name is not a qualified name")
    if total > _TOTAL_ANNOTATION_BYTES:
        problems.append(f"{where}: larger than 256 KiB")
    return problems


def _edit_problems(where: str, edits: Any) -> list[str]:
    if not isinstance(edits, dict):
        return [f"{where}: must be an object"]
    problems = [f"{where}.{key}: unknown field" for key in sorted(set(edits) - EDIT_KEYS)]
    for i, entry in enumerate(edits.get("env") or []):
        if not isinstance(entry, str) or entry.find("=") <= 0:
            problems.append(f"{where}.env[{i}]: {entry!r} is not KEY=VALUE")
    for i, node in enumerate(edits.get("deviceNodes") or []):
        at = f"{where}.deviceNodes[{i}]"
        problems += [f"{at}.{key}: unknown field" for key in sorted(set(node) - DEVICE_NODE_KEYS)]
        if not node.get("path"):
            problems.append(f"{at}.path: required")
        if node.get("type", "") not in ("", "b", "c", "u", "p"):
            problems.append(f"{at}.type: {node['type']!r} is not b, c, u or p")
        if node.get("major", 0) < 0 or node.get("minor", 0) < 0:
            problems.append(f"{at}: negative device number")
        permissions = node.get("permissions", "")
        if permissions not in ("", "none") and permissions.strip("rwm"):
            problems.append(f"{at}.permissions: {permissions!r} is not of r, w, m")
    for i, mount in enumerate(edits.get("mounts") or []):
        at = f"{where}.mounts[{i}]"
        problems += [f"{at}.{key}: unknown field" for key in sorted(set(mount) - MOUNT_KEYS)]
        if not mount.get("hostPath") or not mount.get("containerPath"):
            problems.append(f"{at}: hostPath and containerPath are required")
    for i, hook in enumerate(edits.get("hooks") or []):
        at = f"{where}.hooks[{i}]"
        problems += [f"{at}.{key}: unknown field" for key in sorted(set(hook) - HOOK_KEYS)]
        if hook.get("hookName") not in HOOK_NAMES:
            problems.append(f"{at}.hookName: {hook.get('hookName')!r} is unknown")
        if not hook.get("path"):
            problems.append(f"{at}.path: required")
    return problems


def _is_empty(edits: dict[str, Any]) -> bool:
    return not any(edits.get(key) for key in EDIT_KEYS if key != "intelRdt") and (
        edits.get("intelRdt") is None
    )


def problems(spec: Any) -> list[str]:
    """Every CDI rule ``spec`` (a parsed JSON document) breaks; empty when it loads."""
    if not isinstance(spec, dict):
        return ["spec: must be an object"]
    found = [f"{key}: unknown field" for key in sorted(set(spec) - SPEC_KEYS)]
    found += [f"{key}: required" for key in ("cdiVersion", "kind", "devices") if key not in spec]
    version = spec.get("cdiVersion")
    if version is not None:
        if version not in KNOWN_VERSIONS:
            found.append(f"cdiVersion: {version!r} is not a known version")
        elif _version(minimum_version(spec)) > _version(version):
            found.append(f"cdiVersion: the features used need at least {minimum_version(spec)}")
    kind = spec.get("kind")
    if kind is not None:
        vendor, slash, cls = str(kind).partition("/")
        if not slash or not _VENDOR_OR_CLASS.fullmatch(vendor):
            found.append(f"kind: {kind!r} has no valid vendor")
        if not slash or not _VENDOR_OR_CLASS.fullmatch(cls):
            found.append(f"kind: {kind!r} has no valid class")
    if "annotations" in spec:
        found += _annotation_problems("annotations", spec["annotations"])
    if "containerEdits" in spec:
        found += _edit_problems("containerEdits", spec["containerEdits"])
    devices = spec.get("devices")
    if "devices" in spec and (not isinstance(devices, list) or not devices):
        found.append("devices: must be a non-empty list")
        devices = []
    seen: set[str] = set()
    for i, device in enumerate(devices or []):
        at = f"devices[{i}]"
        if not isinstance(device, dict):
            found.append(f"{at}: must be an object")
            continue
        found += [f"{at}.{key}: unknown field" for key in sorted(set(device) - DEVICE_KEYS)]
        name = device.get("name")
        if not isinstance(name, str) or not _DEVICE_NAME.fullmatch(name):
            found.append(f"{at}.name: {name!r} is not a valid device name")
        elif name in seen:
            found.append(f"{at}.name: {name!r} is not unique")
        else:
            seen.add(name)
        if "annotations" in device:
            found += _annotation_problems(f"{at}.annotations", device["annotations"])
        edits = device.get("containerEdits")
        if not isinstance(edits, dict) or _is_empty(edits):
            found.append(f"{at}.containerEdits: required and must not be empty")
        else:
            found += _edit_problems(f"{at}.containerEdits", edits)
    return found


def check(spec: Any) -> None:
    broken = problems(spec)
    assert not broken, "the CDI spec would be refused: " + "; ".join(broken)
