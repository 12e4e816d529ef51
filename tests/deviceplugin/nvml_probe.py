"""What the node agent's real NVML path finds on this machine, printed as one JSON document.

Run it on a machine with the NVIDIA driver: ``python -m tests.deviceplugin.nvml_probe`` (from the
repository root; ``--wait-seconds`` and ``--cdi-dir`` change what it waits and where it looks).

Why: the tests run the agent on a simulated inventory and a fake event source; this asks the
real driver through the agent's own code and says what it got, item by item:

- ``environment``: the nvidia-ml-py version and the driver's, NVML's and CUDA's versions;
- ``inventory``: ``inventory.NvmlInventory().read()``, as the agent publishes it (UUIDs, models,
  memory, NUMA nodes, NVLink peers and domains, MIG instances with their NVML index, health);
- ``gpus``: what NVML answers for each GPU underneath (MIG mode, NUMA node from NVML and from
  sysfs, every NVLink link's state and remote, the event types it supports);
- ``xidEvents``: ``health.NvmlXidEvents``: open (register every GPU for critical XIDs), one wait
  of ``--wait-seconds``, close; then ``health.XidHealth``'s thread started and stopped;
- ``cdi``: every spec file in the CDI folders (kind, version, device names) and the NVIDIA
  device ``nvidiacdi`` resolves for each GPU and MIG instance;
- ``gpunodeStatus``: the GPUNode status the agent would write (capabilities, conditions).

What it must never do: crash on what a machine does not support. Every item that fails is
printed as ``{"error": "..."}`` in its place, and the document is always printed; the exit
status is 0 when the inventory could be read, else 1.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import platform
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bettercompute.deviceplugin import health, inventory, nvidiacdi

#: A spec lists at most this many of its device names in the document (the rest are counted).
_MAX_DEVICE_NAMES = 64


def attempt(what: Callable[[], Any]) -> Any:
    """``what()``, or ``{"error": ...}`` naming the exception: one item's failure stays its own."""
    try:
        return what()
    except Exception as e:  # a probe reports every failure in place, whatever it is
        return {"error": f"{type(e).__name__}: {e}"}


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def environment(nvml: Any) -> dict[str, Any]:
    return {
        "python": platform.python_version(),
        "host": platform.node(),
        "nvidiaMlPy": attempt(lambda: importlib.metadata.version("nvidia-ml-py")),
        "driver": attempt(lambda: _text(nvml.nvmlSystemGetDriverVersion())),
        "nvml": attempt(lambda: _text(nvml.nvmlSystemGetNVMLVersion())),
        "cudaDriver": attempt(lambda: nvml.nvmlSystemGetCudaDriverVersion_v2()),
        "deviceCount": attempt(nvml.nvmlDeviceGetCount),
    }


def read_inventory(source: inventory.InventorySource) -> dict[str, Any]:
    found = source.read()
    return {
        "nodeName": found.node_name,
        "vcpu": found.vcpu,
        "memoryGiB": found.memory_gib,
        "hugepages1Gi": found.hugepages_1gi,
        "nvlinkDomains": {k: list(v) for k, v in found.nvlink_domains.items()},
        "gpus": [
            {
                "uuid": gpu.uuid,
                "index": gpu.index,
                "model": gpu.model,
                "memoryMiB": gpu.memory_mib,
                "numaNode": gpu.numa_node,
                "nvlinkPeers": list(gpu.nvlink_peers),
                "healthy": gpu.healthy,
                "problem": gpu.problem,
                "mig": [{"uuid": m.uuid, "profile": m.profile, "index": m.index} for m in gpu.mig],
            }
            for gpu in found.gpus
        ],
    }


def _nvlinks(nvml: Any, handle: Any) -> dict[str, Any]:
    active: list[dict[str, Any]] = []
    inactive: list[int] = []
    errors: dict[str, list[int]] = {}
    for link in range(nvml.NVML_NVLINK_MAX_LINKS):
        try:
            state = nvml.nvmlDeviceGetNvLinkState(handle, link)
        except nvml.NVMLError as e:
            errors.setdefault(str(e), []).append(link)
            continue
        if state != nvml.NVML_FEATURE_ENABLED:
            inactive.append(link)
            continue
        remote = attempt(
            lambda link=link: inventory.bus_id(
                nvml.nvmlDeviceGetNvLinkRemotePciInfo(handle, link).busId
            )
        )
        active.append({"link": link, "remote": remote})
    return {"active": active, "inactive": inactive, "errors": errors}


def _sysfs_numa(bus: str) -> Any:
    path = inventory.SYSFS_PCI_DEVICES / bus / "numa_node"
    return attempt(lambda: int(path.read_text().strip()))


def gpu_details(nvml: Any, index: int) -> dict[str, Any]:
    handle = nvml.nvmlDeviceGetHandleByIndex(index)
    bus = attempt(lambda: inventory.bus_id(nvml.nvmlDeviceGetPciInfo(handle).busId))
    supported = attempt(lambda: int(nvml.nvmlDeviceGetSupportedEventTypes(handle)))
    return {
        "index": index,
        "uuid": attempt(lambda: _text(nvml.nvmlDeviceGetUUID(handle))),
        "name": attempt(lambda: _text(nvml.nvmlDeviceGetName(handle))),
        "busId": bus,
        "memoryMiB": attempt(lambda: int(nvml.nvmlDeviceGetMemoryInfo(handle).total) // 2**20),
        "migMode": attempt(
            lambda: dict(
                zip(("current", "pending"), nvml.nvmlDeviceGetMigMode(handle), strict=True)
            )
        ),
        "maxMigDevices": attempt(lambda: nvml.nvmlDeviceGetMaxMigDeviceCount(handle)),
        "numaNodeNvml": attempt(lambda: nvml.nvmlDeviceGetNumaNodeId(handle)),
        "numaNodeSysfs": _sysfs_numa(bus) if isinstance(bus, str) else None,
        "nvlink": attempt(lambda: _nvlinks(nvml, handle)),
        "supportedEventTypes": hex(supported) if isinstance(supported, int) else supported,
        "xidCriticalSupported": bool(supported & health.XID_CRITICAL_ERROR)
        if isinstance(supported, int)
        else None,
    }


def xid_events(wait_s: float) -> dict[str, Any]:
    found: dict[str, Any] = {}
    source = health.NvmlXidEvents()
    started = time.monotonic()
    try:
        registration = source.open()
    except health.EventSourceError as e:
        found["open"] = {"error": str(e)}
        return found
    found["open"] = {
        "seconds": round(time.monotonic() - started, 3),
        "watched": list(registration.watched),
        "unsupported": [{"uuid": u, "why": why} for u, why in registration.unsupported],
    }
    started = time.monotonic()
    try:
        event = source.wait(wait_s)
        found["wait"] = {
            "seconds": round(time.monotonic() - started, 3),
            "event": None if event is None else {"xid": event.xid, "uuid": event.uuid},
        }
    except health.EventSourceError as e:
        found["wait"] = {"error": str(e)}
    found["close"] = attempt(lambda: source.close() or "closed")
    found["thread"] = attempt(_xid_thread)
    return found


def _xid_thread() -> dict[str, Any]:
    """XidHealth's own thread over NVML: it opens the events, waits, and stops within a wait."""
    xid = health.XidHealth(health.NvmlXidEvents(), wait_s=0.2, retry_s=1.0)
    xid.start()
    deadline = time.monotonic() + 5.0
    while xid.registration is None and time.monotonic() < deadline:
        time.sleep(0.01)
    seen = xid.registration
    time.sleep(0.5)
    stopping = time.monotonic()
    xid.stop()
    return {
        "opened": seen is not None,
        "watched": None if seen is None else len(seen.watched),
        "stopSeconds": round(time.monotonic() - stopping, 3),
        "unhealthy": xid.unhealthy(),
    }


def spec_file(path: Path) -> dict[str, Any]:
    found: dict[str, Any] = {"file": str(path)}
    try:
        found["bytes"] = path.stat().st_size
        import yaml

        text = path.read_text(encoding="utf-8")
        raw = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except Exception as e:  # an unreadable spec is an answer too
        found["error"] = f"{type(e).__name__}: {e}"
        return found
    if not isinstance(raw, dict):
        found["error"] = "not a mapping"
        return found
    devices = raw.get("devices") if isinstance(raw.get("devices"), list) else []
    names = [d.get("name") for d in devices if isinstance(d, dict)]
    found.update(
        cdiVersion=raw.get("cdiVersion"),
        kind=raw.get("kind"),
        devices=len(names),
        deviceNames=names[:_MAX_DEVICE_NAMES],
        specEdits=sorted((raw.get("containerEdits") or {}).keys()),
    )
    return found


def cdi(dirs: list[Path], node_name: str) -> dict[str, Any]:
    files: list[dict[str, Any]] = []
    for folder in dirs:
        if not folder.is_dir():
            files.append({"folder": str(folder), "error": "no such folder"})
            continue
        for path in sorted(folder.iterdir()):
            if path.suffix in nvidiacdi.SPEC_SUFFIXES and path.is_file():
                files.append(spec_file(path))
    source = nvidiacdi.WithNvidiaCdi(inventory.NvmlInventory(node_name=node_name), dirs=dirs)
    resolved = attempt(lambda: source.read().nvidia_cdi)
    if isinstance(resolved, dict):  # the error
        return {"files": files, "resolved": resolved}
    return {
        "files": files,
        "resolved": {
            "nvidiaFiles": list(resolved.files),
            "names": dict(resolved.names),
            "missing": list(resolved.missing),
            "problems": list(resolved.problems),
            "complete": resolved.complete,
            "says": nvidiacdi.describe(resolved),
        },
    }


def gpunode_status(dirs: list[Path], node_name: str) -> dict[str, Any]:
    # The publisher needs the node extra (lightkube, prometheus-client): imported here, so a
    # machine without it still gets the rest of the document.
    from bettercompute.deviceplugin.publishing import CAPABILITIES, gpunode_status, rfc3339

    source = nvidiacdi.WithNvidiaCdi(inventory.NvmlInventory(node_name=node_name), dirs=dirs)
    now = rfc3339(time.time())
    status = gpunode_status(
        inventory=source.read(), capabilities=CAPABILITIES, heartbeat=now, ready_since=now
    )
    return {"capabilities": status["capabilities"], "conditions": status["conditions"]}


def probe(*, wait_s: float, dirs: list[Path], node_name: str) -> tuple[dict[str, Any], bool]:
    document: dict[str, Any] = {}
    try:
        import pynvml
    except ImportError as e:
        return {"error": f"the pynvml module is missing: {e}"}, False
    document["environment"] = {"nvmlInit": attempt(lambda: pynvml.nvmlInit() or "ok")}
    initialised = document["environment"]["nvmlInit"] == "ok"
    if initialised:
        try:
            document["environment"].update(environment(pynvml))
            count = attempt(pynvml.nvmlDeviceGetCount)
            document["gpus"] = (
                [attempt(lambda i=i: gpu_details(pynvml, i)) for i in range(count)]
                if isinstance(count, int)
                else count
            )
        finally:
            attempt(pynvml.nvmlShutdown)
    document["inventory"] = attempt(
        lambda: read_inventory(inventory.NvmlInventory(node_name=node_name))
    )
    ok = "error" not in document["inventory"]
    document["xidEvents"] = attempt(lambda: xid_events(wait_s))
    document["cdi"] = attempt(lambda: cdi(dirs, node_name))
    document["gpunodeStatus"] = attempt(lambda: gpunode_status(dirs, node_name))
    document["summary"] = {
        "inventoryRead": ok,
        "gpus": len(document["inventory"].get("gpus", [])) if ok else 0,
        "xidEventsOpened": "watched" in (document["xidEvents"].get("open") or {})
        if isinstance(document["xidEvents"], dict)
        else False,
    }
    return document, ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.deviceplugin.nvml_probe")
    parser.add_argument("--wait-seconds", type=float, default=1.0, help="one XID wait (1 s)")
    parser.add_argument(
        "--cdi-dir",
        type=Path,
        action="append",
        help="a folder of CDI specs (repeatable; default /etc/cdi and /var/run/cdi)",
    )
    parser.add_argument("--node-name", default=platform.node() or "probe")
    args = parser.parse_args(argv)
    dirs = args.cdi_dir or list(nvidiacdi.DEFAULT_DIRS)
    try:
        document, ok = probe(wait_s=args.wait_seconds, dirs=dirs, node_name=args.node_name)
    except Exception:  # a bug in the probe itself: still one JSON document
        document, ok = {"error": traceback.format_exc()}, False
    json.dump(document, sys.stdout, indent=2, default=str)
    sys.stdout.write("\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
