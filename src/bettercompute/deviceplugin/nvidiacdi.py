"""NVIDIA's CDI devices for this node's GPUs: what Allocate asks the runtime for beside bcd's.

Why it exists: bcd's own CDI spec (``devicefiles``) carries environment variables only, so on
its own a container gets GPUs only where the NVIDIA container runtime turns
``NVIDIA_VISIBLE_DEVICES`` into device nodes, driver libraries and hooks. A runtime that
injects CDI devices itself (containerd or CRI-O with CDI on, as the GPU operator sets them up
from v25.10) ignores that variable. Where NVIDIA's CDI specs exist on the node (written by
``nvidia-ctk cdi generate``, the ``nvidia-cdi-refresh`` service or the GPU operator's toolkit:
usually ``/etc/cdi/nvidia.yaml`` or ``/var/run/cdi/nvidia*.yaml``), the node names NVIDIA's device
for each GPU and MIG instance, and the device plugin's Allocate answer lists it beside bcd's
(``bcd.dev/gpu=GPU-…`` and ``nvidia.com/gpu=GPU-…``): the runtime applies both specs, NVIDIA's
edits giving the device nodes, mounts and hooks. bcd never copies NVIDIA's edits into its
own files, so a driver upgrade that regenerates NVIDIA's spec cannot leave a stale copy behind.

A device is looked up by the names NVIDIA's naming strategies give it, UUID first (``uuid``:
``GPU-…``, ``MIG-…``; ``index``: ``0``, ``0:1``; ``type-index``: ``gpu0``, ``mig0:1``), the
MIG index being NVML's MIG device index on its GPU. Without NVIDIA specs the node is env-only,
as before; the GPUNode says which (``publishing``: the ``cdi.nvidia`` capability and the
``NvidiaCdi`` condition).

``WithNvidiaCdi`` wraps any ``InventorySource`` and fills ``Inventory.nvidia_cdi`` on each read,
so a spec that appears, changes or goes is noticed within one inventory interval. Files are
parsed again only when their size or modification time changes.

What it must never do: write or change a CDI spec of NVIDIA's (it only reads them), read bcd's
own ``bcd-*.json`` specs, fail an inventory read because a spec is broken (the file is named
in ``NvidiaCdi.problems`` and skipped), or read a file larger than ``MAX_SPEC_BYTES``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Iterable, Sequence, Set
from pathlib import Path

import yaml

from bettercompute.deviceplugin.inventory import Gpu, Inventory, InventorySource, NvidiaCdi

log = logging.getLogger(__name__)

#: Where CDI specs live: the CDI library's static and dynamic folders, in its order.
DEFAULT_DIRS = (Path("/etc/cdi"), Path("/var/run/cdi"))
#: The kind of NVIDIA's GPU specs (``management.nvidia.com/gpu`` is for management containers).
KIND = "nvidia.com/gpu"
SPEC_SUFFIXES = (".yaml", ".yml", ".json")
#: bcd's own specs share the folder (``devicefiles``): never NVIDIA's.
OWN_PREFIX = "bcd-"
#: A full spec of a 8-GPU node with MIG is some hundreds of kilobytes.
MAX_SPEC_BYTES = 8 * 1024 * 1024


def gpu_names(gpu: Gpu) -> list[str]:
    """The names NVIDIA's strategies give a whole GPU, UUID first."""
    return [gpu.uuid, str(gpu.index), f"gpu{gpu.index}"]


def mig_names(gpu: Gpu, mig_uuid: str, mig_index: int | None) -> list[str]:
    """The names NVIDIA's strategies give a MIG instance, UUID first."""
    names = [mig_uuid]
    if mig_index is not None:
        names += [f"{gpu.index}:{mig_index}", f"mig{gpu.index}:{mig_index}"]
    return names


@dataclasses.dataclass(frozen=True)
class _Parsed:
    """One file's answer: the device names of an NVIDIA spec, or why it is not one."""

    devices: frozenset[str] | None  # None: not a spec of kind nvidia.com/gpu
    problem: str | None = None


def parse_spec(path: Path, text: str) -> _Parsed:
    """The device names of one spec file's text (JSON for .json, else YAML)."""
    try:
        raw: object = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as e:
        return _Parsed(devices=None, problem=f"{path}: not valid {_format(path)}: {e}")
    if not isinstance(raw, dict):
        return _Parsed(devices=None)  # not a CDI spec at all; nothing to say
    if raw.get("kind") != KIND:
        return _Parsed(devices=None)
    devices = raw.get("devices")
    if not isinstance(devices, list):
        return _Parsed(devices=None, problem=f"{path}: kind {KIND} but no devices list")
    names = frozenset(
        str(device["name"])
        for device in devices
        if isinstance(device, dict) and isinstance(device.get("name"), str | int)
    )
    return _Parsed(devices=names)


def _format(path: Path) -> str:
    return "JSON" if path.suffix == ".json" else "YAML"


class SpecReader:
    """Reads NVIDIA's specs from ``dirs``, parsing a file again only once it changed."""

    def __init__(self, dirs: Sequence[Path] = DEFAULT_DIRS) -> None:
        self.dirs = tuple(dirs)
        self._cache: dict[Path, tuple[tuple[int, int], _Parsed]] = {}

    def specs(self) -> tuple[list[str], set[str], list[str]]:
        """(files of kind nvidia.com/gpu, the device names they define, problems)."""
        files: list[str] = []
        names: set[str] = set()
        problems: list[str] = []
        seen: set[Path] = set()
        for path in self._candidates():
            seen.add(path)
            parsed = self._parse(path)
            if parsed.problem is not None:
                problems.append(parsed.problem)
            if parsed.devices is not None:
                files.append(str(path))
                names.update(parsed.devices)
        for gone in set(self._cache) - seen:
            del self._cache[gone]
        return files, names, problems

    def _candidates(self) -> list[Path]:
        found: list[Path] = []
        for folder in self.dirs:
            try:
                entries = sorted(folder.iterdir())
            except OSError:
                continue  # no such folder (a node without the toolkit): nothing there
            found.extend(
                entry
                for entry in entries
                if entry.suffix in SPEC_SUFFIXES
                and not entry.name.startswith((OWN_PREFIX, "."))
                and entry.is_file()
            )
        return found

    def _parse(self, path: Path) -> _Parsed:
        try:
            status = path.stat()
        except OSError as e:
            return _Parsed(devices=None, problem=f"{path}: cannot read: {e.strerror or e}")
        key = (status.st_size, status.st_mtime_ns)
        cached = self._cache.get(path)
        if cached is not None and cached[0] == key:
            return cached[1]
        if status.st_size > MAX_SPEC_BYTES:
            parsed = _Parsed(
                devices=None, problem=f"{path}: larger than {MAX_SPEC_BYTES} bytes; not read"
            )
        else:
            try:
                parsed = parse_spec(path, path.read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError) as e:
                reason = e.strerror if isinstance(e, OSError) and e.strerror else e
                parsed = _Parsed(devices=None, problem=f"{path}: cannot read: {reason}")
        self._cache[path] = (key, parsed)
        return parsed


def resolve(
    *,
    gpus: Iterable[Gpu],
    files: Sequence[str],
    names: Set[str],
    searched: Sequence[Path],
    problems: Sequence[str] = (),
) -> NvidiaCdi:
    """Each GPU's and MIG instance's NVIDIA device, from the names the specs define."""
    found: list[tuple[str, str]] = []
    missing: list[str] = []

    def pick(uuid: str, candidates: list[str], *, required: bool = True) -> None:
        for candidate in candidates:
            if candidate in names:
                found.append((uuid, f"{KIND}={candidate}"))
                return
        if required:
            missing.append(uuid)

    if files:
        for gpu in gpus:
            # NVIDIA names a MIG-enabled GPU only by its instances: they are what is handed out.
            pick(gpu.uuid, gpu_names(gpu), required=not gpu.mig)
            for mig in gpu.mig:
                pick(mig.uuid, mig_names(gpu, mig.uuid, mig.index))
    return NvidiaCdi(
        searched=tuple(str(d) for d in searched),
        files=tuple(files),
        names=tuple(found),
        missing=tuple(missing),
        problems=tuple(problems),
    )


class WithNvidiaCdi:
    """An ``InventorySource`` whose inventories say which NVIDIA CDI device each GPU has."""

    def __init__(self, inner: InventorySource, *, dirs: Sequence[Path] = DEFAULT_DIRS) -> None:
        self.inner = inner
        self.reader = SpecReader(dirs)
        self._said: NvidiaCdi | None = None

    def read(self) -> Inventory:
        inventory = self.inner.read()
        files, names, problems = self.reader.specs()
        cdi = resolve(
            gpus=inventory.gpus,
            files=files,
            names=names,
            searched=self.reader.dirs,
            problems=problems,
        )
        self._log(cdi)
        return dataclasses.replace(inventory, nvidia_cdi=cdi)

    def _log(self, cdi: NvidiaCdi) -> None:
        if cdi == self._said:
            return
        self._said = cdi
        for problem in cdi.problems:
            log.warning("NVIDIA CDI spec skipped: %s", problem)
        log.info("%s", describe(cdi))


def describe(cdi: NvidiaCdi) -> str:
    """One sentence on what the node does with NVIDIA's CDI specs (the GPUNode condition)."""
    if not cdi.searched:
        return "NVIDIA CDI specs are not looked for: containers get NVIDIA_VISIBLE_DEVICES only"
    if not cdi.found:
        return (
            f"no NVIDIA CDI spec (kind {KIND}) in {', '.join(cdi.searched)}: containers get "
            "NVIDIA_VISIBLE_DEVICES only, which needs the NVIDIA container runtime"
        )
    files = ", ".join(cdi.files)
    if cdi.missing:
        return (
            f"NVIDIA CDI specs ({files}) name no device for {', '.join(cdi.missing)}: those get "
            "NVIDIA_VISIBLE_DEVICES only; generate the spec again (nvidia-ctk cdi generate)"
        )
    return (
        f"NVIDIA CDI specs ({files}) name every GPU: Allocate asks for {KIND} devices beside "
        "bcd.dev/gpu"
    )
