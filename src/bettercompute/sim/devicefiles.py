"""The files a node writes for a bound allocation: a CDI spec and an env file.

Why: the guide's node side (and our device plugin's) hands a hold to the workload manager as
``/etc/cdi/bcd-<allocation>.json`` (device names ``bcd.dev/gpu=<device id>``) and
``/run/bcd/allocations/<allocation>.env``. The simulator writes the same two files under its own
root, ``<root>/cdi/`` and ``<root>/run/allocations/``, so what a real node would expose can be
inspected on a laptop.

What it must never do: write outside its root, or leave a half-written file where a reader
may see it. Allocation ids are checked against a strict pattern before they become file names,
and every file is written to a temporary name in the same directory, then renamed over.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CDI_VERSION = "0.6.0"
CDI_KIND = "bcd.dev/gpu"

# Letters, digits, '_' and '-' only: no '/', no '.', so a name can never leave its directory.
_ALLOCATION_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,127}$")
# What may stand in an env file value or a CDI device name without quoting.
_SAFE_VALUE = re.compile(r"^[A-Za-z0-9_.:,@+=/-]*$")
_CDI_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]*$")


class DeviceFileError(ValueError):
    """An allocation that cannot be written safely (a bad id or device name)."""


@dataclass(frozen=True)
class Allocation:
    """What the node needs of an allocation to write its files."""

    allocation_id: str
    reservation_id: str
    tenant_id: str
    device_class: str
    device_ids: tuple[str, ...]
    parent_gpus: tuple[str, ...]
    until_ms: int

    @classmethod
    def from_desired(cls, item: Mapping[str, Any]) -> Allocation:
        """From one item of ``NodeService.desired``."""
        device_ids = tuple(str(d) for d in item["deviceIds"])
        return cls(
            allocation_id=str(item["allocationId"]),
            reservation_id=str(item["reservationId"]),
            tenant_id=str(item["tenantId"]),
            device_class=str(item["deviceClass"]),
            device_ids=device_ids,
            parent_gpus=tuple(str(p) for p in item.get("parentGpus") or device_ids),
            until_ms=int(item["until"]),
        )

    @property
    def visible_devices(self) -> list[str]:
        """``NVIDIA_VISIBLE_DEVICES``: MIG instances and whole GPUs by their own id; a slot by
        its physical GPU (time-slicing shares the whole device)."""
        if self.device_class == "slot":
            return list(dict.fromkeys(self.parent_gpus))
        return list(self.device_ids)

    @property
    def cdi_devices(self) -> list[str]:
        return [f"{CDI_KIND}={d}" for d in self.device_ids]


class DeviceFiles:
    """The CDI specs and env files of one node, under ``root``."""

    def __init__(self, root: Path):
        self.root = root
        self.cdi_dir = root / "cdi"
        self.env_dir = root / "run" / "allocations"

    def cdi_path(self, allocation_id: str) -> Path:
        return self.cdi_dir / f"bcd-{check_allocation_id(allocation_id)}.json"

    def env_path(self, allocation_id: str) -> Path:
        return self.env_dir / f"{check_allocation_id(allocation_id)}.env"

    def write(self, allocation: Allocation) -> None:
        """Write (or rewrite) both files; each appears whole or not at all."""
        spec = cdi_spec(allocation)
        env = env_text(allocation)
        _write_atomically(self.cdi_path(allocation.allocation_id), json.dumps(spec, indent=2))
        _write_atomically(self.env_path(allocation.allocation_id), env)

    def matches(self, allocation: Allocation) -> bool:
        """Whether both files exist with exactly the content ``write`` would give them."""
        try:
            spec = json.loads(self.cdi_path(allocation.allocation_id).read_text())
            env = self.env_path(allocation.allocation_id).read_text()
        except (OSError, ValueError):
            return False
        return spec == cdi_spec(allocation) and env == env_text(allocation)

    def remove(self, allocation_id: str) -> None:
        for path in (self.cdi_path(allocation_id), self.env_path(allocation_id)):
            path.unlink(missing_ok=True)

    def allocation_ids(self) -> set[str]:
        """Allocations that have a file here (either one), for cleaning up leftovers."""
        found: set[str] = set()
        if self.cdi_dir.is_dir():
            for path in self.cdi_dir.glob("bcd-*.json"):
                found.add(path.name.removeprefix("bcd-").removesuffix(".json"))
        if self.env_dir.is_dir():
            found.update(path.stem for path in self.env_dir.glob("*.env"))
        return {a for a in found if _ALLOCATION_ID.fullmatch(a)}


def check_allocation_id(allocation_id: str) -> str:
    if not _ALLOCATION_ID.fullmatch(allocation_id):
        raise DeviceFileError(
            f"allocation id {allocation_id!r} is not safe as a file name "
            "(letters, digits, '_' and '-' only)"
        )
    return allocation_id


def cdi_spec(allocation: Allocation) -> dict[str, Any]:
    """The CDI spec of one allocation: one device per booked device id; the allocation's env
    goes in the spec-wide edits, which apply whichever of its devices a container asks for."""
    for device_id in allocation.device_ids:
        if not _CDI_NAME.fullmatch(device_id):
            raise DeviceFileError(f"device id {device_id!r} is not a valid CDI device name")
    return {
        "cdiVersion": CDI_VERSION,
        "kind": CDI_KIND,
        "devices": [
            {"name": device_id, "containerEdits": {"env": [f"BCD_DEVICE_{i}={device_id}"]}}
            for i, device_id in enumerate(allocation.device_ids)
        ],
        "containerEdits": {
            "env": [
                "NVIDIA_VISIBLE_DEVICES=" + ",".join(allocation.visible_devices),
                f"BCD_ALLOCATION_ID={allocation.allocation_id}",
            ]
        },
    }


def env_text(allocation: Allocation) -> str:
    """``KEY=value`` lines for the workload manager (systemd ``EnvironmentFile`` syntax)."""
    values = {
        "BCD_ALLOCATION_ID": allocation.allocation_id,
        "BCD_RESERVATION_ID": allocation.reservation_id,
        "BCD_TENANT_ID": allocation.tenant_id,
        "BCD_DEVICE_CLASS": allocation.device_class,
        "BCD_UNTIL_MS": str(allocation.until_ms),
        "NVIDIA_VISIBLE_DEVICES": ",".join(allocation.visible_devices),
    }
    for key, value in values.items():
        if not _SAFE_VALUE.fullmatch(value):
            raise DeviceFileError(f"{key} value {value!r} cannot be written unquoted")
    return "".join(f"{key}={value}\n" for key, value in values.items())


def read_env(path: Path) -> dict[str, str]:
    """Parse an env file written by ``env_text``."""
    pairs = (line.split("=", 1) for line in path.read_text().splitlines() if "=" in line)
    return {key: value for key, value in pairs}


def _write_atomically(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
