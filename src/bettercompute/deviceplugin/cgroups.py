"""Host limits on the node: the cgroup v2 slice of each ``hold`` allocation that has them.

Why it exists: a reservation books CPUs, memory and 1 GiB huge pages with its GPUs, and the
control plane places such a reservation only on a node that advertises ``devices.limits``. This
module is what makes that advertisement true. For a ``hold`` with limits the node creates the
slice ``bcd-alloc-<id>.slice`` (``core.ids.cgroup_slice``) directly under its cgroup v2 root
and writes its limits:

- ``cpu.max``: ``<cpuMillis × 100> 100000`` (the quota per 100 ms period), ``max`` without one;
- ``memory.max``: ``memoryBytes``, ``max`` without one;
- ``cpuset.cpus`` / ``cpuset.mems``: the cpulists, when the spec gives them;
- ``hugetlb.1GB.max``: ``hugepages1Gi`` × 1 GiB (0 when none were booked), where the host has
  the hugetlb controller.

The workload manager on the node (containerd, Slurm, a wrapper) puts the workload in that slice;
the node names it in the CDI spec, the env file and its bound report. After the release the
slice is removed once no process is left in it (its ``cgroup.events`` says ``populated 0`` and
every ``cgroup.procs`` below it is empty); while one is, removal is tried again every pass.

Which slices are ours: each one is recorded (an empty file named like the slice, in a folder of
the node's own, on tmpfs like the cgroups themselves) before it is created, so a restarted agent
still knows which to clean up, and a slice without a record (another tool's, or one with a name
like ours it did not make) is never touched.

``enforcement_problem`` says why the node cannot enforce limits (no cgroup v2, controllers
missing, a root it may not write), or ``None`` and enables the controllers for the root's
children. A root laid out like cgroup v2 in a plain folder (``lay_out_standin``: tests and the
simulator) behaves the same, except that a plain folder needs its files removed before
``rmdir``, which a real cgroupfs never asks for.

cpulists are read within bounds (CPU and node ids up to 8191, at most 32 KiB and 4096
comma-separated parts), so an oversized spec cannot stall the agent.

What it must never do: write outside its root and its record folder, remove a slice that is not
ours or that still has processes, or put a limit anywhere but the allocation's own slice.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import re
from pathlib import Path
from typing import Any

from bettercompute.core.ids import CGROUP_SLICE_PREFIX, CGROUP_SLICE_SUFFIX

DEFAULT_ROOT = Path("/sys/fs/cgroup")
DEFAULT_RECORDS = Path("/run/bcd/slices")

#: Controllers a slice's limits need; hugetlb only where the host has it.
REQUIRED_CONTROLLERS = ("cpu", "cpuset", "memory")
HUGETLB = "hugetlb"
CPU_PERIOD_US = 100_000
GIB = 1 << 30

MAX_CPU_ID = 8191
MAX_CPULIST_BYTES = 32 * 1024
MAX_CPULIST_PARTS = 4096

_RANGE = re.compile(r"^(\d{1,5})(?:-(\d{1,5}))?$")
_SLICE_NAME = re.compile(
    "^"
    + re.escape(CGROUP_SLICE_PREFIX)
    + r"[A-Za-z0-9_]{1,200}"
    + re.escape(CGROUP_SLICE_SUFFIX)
    + "$"
)


class CgroupError(Exception):
    """A slice that cannot be made or removed; the message names the file and why."""


def parse_cpulist(text: str) -> frozenset[int]:
    """``0-3,8`` → {0, 1, 2, 3, 8}; ``ValueError`` names what is wrong. Empty means none."""
    if len(text.encode()) > MAX_CPULIST_BYTES:
        raise ValueError(f"is longer than {MAX_CPULIST_BYTES} bytes")
    parts = [part.strip() for part in text.split(",")] if text.strip() else []
    if len(parts) > MAX_CPULIST_PARTS:
        raise ValueError(f"has more than {MAX_CPULIST_PARTS} parts")
    ids: set[int] = set()
    for part in parts:
        found = _RANGE.fullmatch(part)
        if found is None:
            raise ValueError(f"{part!r} is not an id or a range such as 0-7")
        low = int(found.group(1))
        high = int(found.group(2)) if found.group(2) is not None else low
        if high > MAX_CPU_ID:
            raise ValueError(f"{part!r} names an id above {MAX_CPU_ID}")
        if high < low:
            raise ValueError(f"{part!r} is a range that runs backwards")
        ids.update(range(low, high + 1))
    return frozenset(ids)


@dataclasses.dataclass(frozen=True)
class HostLimits:
    """An allocation's host limits (``spec.limits``); ``None`` fields are not limited."""

    cpu_millis: int | None = None
    memory_bytes: int | None = None
    hugepages_1gi: int | None = None
    cpus: str | None = None
    mems: str | None = None

    def problems(self) -> list[tuple[str, str]]:
        """(field, reason) for each value no cgroup would take."""
        found = []
        for name in ("cpu_millis", "memory_bytes", "hugepages_1gi"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or value < 0):
                found.append((_FIELDS[name], f"{value!r} is not a count of at least 0"))
        for name in ("cpus", "mems"):
            value = getattr(self, name)
            if value is None:
                continue
            try:
                ids = parse_cpulist(value)
            except ValueError as e:
                found.append((_FIELDS[name], f"not a cpulist: {e}"))
                continue
            if not ids:
                found.append((_FIELDS[name], "names no id; leave it out instead"))
            elif not _SAFE_CPULIST.fullmatch(value):
                found.append((_FIELDS[name], "only digits, '-' and ',' may stand in a cpulist"))
        return found

    def document(self) -> dict[str, Any]:
        """The spec's spelling (``cpuMillis``, …), set fields only: the CDI annotation."""
        values = {_FIELDS[name]: getattr(self, name) for name in _FIELDS}
        return {key: value for key, value in values.items() if value is not None}

    @classmethod
    def from_document(cls, document: Any) -> HostLimits:
        """``document``'s inverse; ``ValueError`` for anything else."""
        if not isinstance(document, dict) or not set(document) <= set(_FIELDS.values()):
            raise ValueError(f"not a limits object: {document!r}")
        by_key = {key: name for name, key in _FIELDS.items()}
        limits = cls(**{by_key[key]: value for key, value in document.items()})
        for name in ("cpu_millis", "memory_bytes", "hugepages_1gi"):
            if not isinstance(getattr(limits, name), int | None):
                raise ValueError(f"{_FIELDS[name]} is not an integer")
        for name in ("cpus", "mems"):
            if not isinstance(getattr(limits, name), str | None):
                raise ValueError(f"{_FIELDS[name]} is not a string")
        if limits.problems():
            raise ValueError(f"limits {document!r}: {limits.problems()}")
        return limits

    def cgroup_files(self) -> dict[str, str]:
        """The interface files of a slice and what each gets, hugetlb's aside."""
        files = {
            "cpu.max": (
                f"{self.cpu_millis * CPU_PERIOD_US // 1000} {CPU_PERIOD_US}"
                if self.cpu_millis
                else f"max {CPU_PERIOD_US}"
            ),
            "memory.max": str(self.memory_bytes) if self.memory_bytes else "max",
        }
        if self.cpus is not None:
            files["cpuset.cpus"] = self.cpus
        if self.mems is not None:
            files["cpuset.mems"] = self.mems
        return files

    @property
    def hugetlb_bytes(self) -> int:
        return (self.hugepages_1gi or 0) * GIB


_FIELDS = {
    "cpu_millis": "cpuMillis",
    "memory_bytes": "memoryBytes",
    "hugepages_1gi": "hugepages1Gi",
    "cpus": "cpus",
    "mems": "mems",
}
_SAFE_CPULIST = re.compile(r"^[0-9,-]+$")


def lay_out_standin(
    root: Path, *, controllers: tuple[str, ...] = (*REQUIRED_CONTROLLERS, HUGETLB)
) -> Path:
    """A plain folder laid out like a cgroup v2 root (``cgroup.controllers``,
    ``cgroup.subtree_control``, ``cgroup.procs``), for tests and the simulator."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "cgroup.controllers").write_text(" ".join(controllers) + "\n")
    for name in ("cgroup.subtree_control", "cgroup.procs"):
        if not (root / name).exists():
            (root / name).write_text("")
    return root


class Cgroups:
    """The slices of one node, under its cgroup v2 ``root``, recorded in ``records``."""

    def __init__(self, root: Path = DEFAULT_ROOT, *, records: Path = DEFAULT_RECORDS) -> None:
        self.root = root
        self.records = records
        self.controllers: frozenset[str] = frozenset()

    # --- whether limits can be enforced -------------------------------------------------

    def enforcement_problem(self) -> str | None:
        """Why this node cannot enforce host limits, or ``None`` once the controllers the
        slices need are enabled for the root's children."""
        controllers_file = self.root / "cgroup.controllers"
        try:
            available = set(controllers_file.read_text().split())
        except FileNotFoundError:
            return (
                f"no cgroup v2 at {self.root} ({controllers_file.name} is missing): the host "
                "runs cgroup v1 or a hybrid layout; boot it with the unified hierarchy "
                "(systemd.unified_cgroup_hierarchy=1)"
            )
        except OSError as e:
            return f"cannot read {controllers_file}: {e.strerror or e}"
        missing = [c for c in REQUIRED_CONTROLLERS if c not in available]
        if missing:
            return f"cgroup v2 at {self.root} lacks the controllers {', '.join(missing)}"
        wanted = [c for c in (*REQUIRED_CONTROLLERS, HUGETLB) if c in available]
        subtree = self.root / "cgroup.subtree_control"
        if not os.access(self.root, os.W_OK) or not os.access(subtree, os.W_OK):
            return (
                f"cgroup v2 at {self.root} is not writable: mount the host's cgroupfs "
                "read-write into the agent"
            )
        try:
            enabled = {c.lstrip("+") for c in subtree.read_text().split()}
            if not set(wanted) <= enabled:
                # One controller per write: the kernel refuses the whole line if one fails.
                for controller in wanted:
                    if controller not in enabled:
                        subtree.write_text(f"+{controller}\n")
        except OSError as e:
            return f"cannot enable {', '.join(wanted)} in {subtree}: {e.strerror or e}"
        try:
            self.records.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            return f"cannot keep the record of slices in {self.records}: {e.strerror or e}"
        self.controllers = frozenset(wanted)
        return None

    # --- slices -------------------------------------------------------------------------

    def path(self, name: str) -> Path:
        return self.root / _checked(name)

    def ours(self) -> set[str]:
        """The slices this node made and has not removed yet."""
        try:
            return {p.name for p in self.records.iterdir() if _SLICE_NAME.fullmatch(p.name)}
        except FileNotFoundError:
            return set()

    def create(self, name: str, limits: HostLimits) -> None:
        """Make slice ``name`` (or keep it) with ``limits``; ``CgroupError`` says why not."""
        path = self.path(name)
        try:
            self.records.mkdir(parents=True, exist_ok=True)
            (self.records / name).touch()  # recorded first: a crash after mkdir leaves it ours
            path.mkdir(exist_ok=True)
        except OSError as e:
            raise CgroupError(f"cannot create {path}: {e.strerror or e}") from e
        files = limits.cgroup_files()
        for file_name, value in files.items():
            _write(path / file_name, value)
        if HUGETLB in self.controllers:
            try:
                (path / "hugetlb.1GB.max").write_text(f"{limits.hugetlb_bytes}\n")
            except OSError as e:
                # A kernel without 1 GiB pages has no such file: nothing to limit, unless
                # pages were booked.
                if limits.hugetlb_bytes:
                    raise CgroupError(
                        f"cannot write {path / 'hugetlb.1GB.max'}: {e.strerror or e}"
                    ) from e
        elif limits.hugetlb_bytes:
            raise CgroupError(f"cgroup v2 at {self.root} has no hugetlb controller")

    def exists(self, name: str) -> bool:
        return self.path(name).is_dir()

    def populated(self, name: str) -> bool:
        """Whether a process is left in the slice or below it."""
        path = self.path(name)
        with contextlib.suppress(OSError):
            for line in (path / "cgroup.events").read_text().splitlines():
                if line.split() == ["populated", "1"]:
                    return True
        for folder, _dirs, _files in os.walk(path):
            try:
                if (Path(folder) / "cgroup.procs").read_text().strip():
                    return True
            except FileNotFoundError:
                continue
            except OSError:
                return True  # cannot tell: keep it
        return False

    def remove(self, name: str) -> bool:
        """Remove slice ``name`` if it is ours and empty; whether it is gone now."""
        if name not in self.ours():
            raise CgroupError(f"slice {name} is not one this node made; it stays")
        path = self.path(name)
        if path.is_dir():
            if self.populated(name):
                return False
            # Children first (a workload manager's own cgroups below the slice), deepest first.
            for folder, _dirs, _files in sorted(os.walk(path), key=lambda w: -len(w[0])):
                if not _rmdir(Path(folder)):
                    return False
        (self.records / name).unlink(missing_ok=True)
        return True


def _checked(name: str) -> str:
    if not _SLICE_NAME.fullmatch(name):
        raise CgroupError(f"{name!r} is not a slice name of this node")
    return name


def _write(path: Path, value: str) -> None:
    try:
        path.write_text(value + "\n")
    except OSError as e:
        raise CgroupError(f"cannot write {value!r} to {path}: {e.strerror or e}") from e


def _rmdir(folder: Path) -> bool:
    """Remove one cgroup folder; False while the kernel says it is busy."""
    try:
        os.rmdir(folder)
        return True
    except FileNotFoundError:
        return True
    except OSError as e:
        if e.errno != errno.ENOTEMPTY:
            return False
    # A plain folder standing in for cgroupfs keeps its "interface files" as real files; a
    # real cgroupfs answers EBUSY instead, so this is never reached there.
    for child in folder.iterdir():
        if child.is_file() and not child.is_symlink():
            child.unlink()
    try:
        os.rmdir(folder)
    except OSError:
        return False
    return True
