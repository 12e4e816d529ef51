"""Which ResourceClaims this node has prepared, and whether a claim may be prepared at all.

Why it exists: with Dynamic Resource Allocation the kubelet asks the node's DRA plugin to
prepare each ResourceClaim the scheduler allocated from our ResourceSlice (``draserving``). What
this module keeps true:

- **A claim gets only devices booked for it.** ``decide`` is the one rule: every device the
  claim was allocated from our driver must be in this node's pool, bound here under one ``dra``
  allocation (``allocations.is_dra``) that is not being released, and that allocation's
  Reservation must live in the claim's own namespace. Anything else is refused with a reason,
  even though the chart's admission policy should have stopped such a claim earlier: the node
  is the last line, and a claim that selected another namespace's devices by a bug or a race
  must not reach a container.
- **A prepared claim holds its devices.** ``PreparedClaims.holders`` tells the converger which
  claims hold an allocation's devices, so a release stays ``Releasing`` until the kubelet has
  unprepared every one (the report names them as ``namespace/claim-name`` in ``pods``).
- **A container gets its environment.** The device plugin's Allocate answer sets
  ``NVIDIA_VISIBLE_DEVICES`` and the ``BCD_*`` variables for exactly a container's devices; a
  DRA answer carries only CDI device ids. So each prepared claim gets a CDI spec of its own
  (``<cdi dir>/bcdclaim-<uid>.json``, kind ``bcd.dev/gpu``, written before the answer and
  removed at unprepare: ``ClaimFiles``) with one device per request of the claim,
  ``claim-<uid>-<request>``, whose edits set those variables for that request's devices; its
  id is answered with the request's first device. (A container that uses several requests of
  one claim gets several such devices, and the runtime keeps one ``NVIDIA_VISIBLE_DEVICES``;
  the claim template the operator writes per Reservation has one request.)
- **Prepared claims survive a restart.** They are kept in a JSON checkpoint in the agent's
  state folder (beside its node key), written whole to a temporary name and renamed over, and
  read back on start. A second prepare of the same claim answers the devices it got the first
  time.

What it must never do: prepare a device that is not bound here under a ``dra`` allocation of the
claim's namespace, forget a prepared claim before the kubelet unprepares it (a damaged
checkpoint stops the agent rather than free devices), write anything but its checkpoint and the
``bcdclaim-*`` specs (each appears whole or not at all), or talk to Kubernetes or the kubelet
(``draserving`` does, through ports).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from bettercompute.deviceplugin import devicefiles
from bettercompute.deviceplugin.allocations import Allocations, Held, Phase, is_dra
from bettercompute.deviceplugin.devicefiles import write_atomically
from bettercompute.kube import dra
from bettercompute.kube.names import CDI_KIND

#: The checkpoint's name in the agent's state folder.
CHECKPOINT_NAME = "dra-claims.json"
_FORMAT = 1
CLAIM_FILE_PREFIX = "bcdclaim-"
ANNOTATION_CLAIM = "bcd.dev/claim-uid"
# A Kubernetes uid is a UUID; anything else must never become a file name.
_UID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9-]{0,127}$")


class CheckpointError(Exception):
    """The checkpoint cannot be read or written; the message says which file and why."""


@dataclasses.dataclass(frozen=True)
class PreparedDevice:
    """One device of a prepared claim, as the kubelet was told."""

    request_names: tuple[str, ...]
    pool_name: str
    device_name: str
    cdi_device_ids: tuple[str, ...]
    #: What this device adds to ``NVIDIA_VISIBLE_DEVICES`` (a slot: its whole GPU).
    visible: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class PreparedClaim:
    """A claim the kubelet prepared here, the allocation whose devices it got, and those."""

    uid: str
    namespace: str
    name: str
    allocation_id: str
    devices: tuple[PreparedDevice, ...]
    reservation_id: str = ""

    @property
    def holder(self) -> str:
        """How a status report names it among an allocation's holders."""
        return f"{self.namespace}/{self.name}"

    def document(self) -> dict[str, Any]:
        return {
            "namespace": self.namespace,
            "name": self.name,
            "allocationId": self.allocation_id,
            "reservationId": self.reservation_id,
            "devices": [
                {
                    "requestNames": list(d.request_names),
                    "poolName": d.pool_name,
                    "deviceName": d.device_name,
                    "cdiDeviceIds": list(d.cdi_device_ids),
                    "visible": list(d.visible),
                }
                for d in self.devices
            ],
        }

    @classmethod
    def from_document(cls, uid: str, document: Mapping[str, Any]) -> PreparedClaim:
        return cls(
            uid=uid,
            namespace=str(document["namespace"]),
            name=str(document["name"]),
            allocation_id=str(document["allocationId"]),
            reservation_id=str(document.get("reservationId", "")),
            devices=tuple(
                PreparedDevice(
                    request_names=tuple(str(r) for r in d["requestNames"]),
                    pool_name=str(d["poolName"]),
                    device_name=str(d["deviceName"]),
                    cdi_device_ids=tuple(str(c) for c in d["cdiDeviceIds"]),
                    visible=tuple(str(v) for v in d.get("visible", ())),
                )
                for d in document["devices"]
            ),
        )


@dataclasses.dataclass(frozen=True)
class Refusal:
    """Why a claim is not prepared: the per-claim ``error`` the kubelet is answered."""

    reason: str


def decide(
    *,
    uid: str,
    namespace: str,
    name: str,
    claim: Mapping[str, Any] | None,
    node_name: str,
    allocations: Allocations,
) -> PreparedClaim | Refusal:
    """Whether the ResourceClaim ``claim`` (as the API returned it; None: not found) may be
    prepared on this node, and with which devices. Pure: it reads ``allocations`` only."""
    where = f"ResourceClaim {namespace}/{name}"
    if claim is None:
        return Refusal(f"{where} does not exist")
    metadata = claim.get("metadata") or {}
    if metadata.get("uid") != uid:
        return Refusal(f"{where} has uid {metadata.get('uid')!r}, not {uid!r}: a different claim")
    allocation = (claim.get("status") or {}).get("allocation")
    if not isinstance(allocation, Mapping):
        return Refusal(f"{where} is not allocated")
    results = [
        r
        for r in ((allocation.get("devices") or {}).get("results") or ())
        if isinstance(r, Mapping) and r.get("driver") == dra.DRIVER
    ]
    if not results:
        return Refusal(f"{where} was allocated no device of driver {dra.DRIVER}")
    bound = _bound_by_name(allocations)
    owners: dict[str, Held] = {}
    devices: list[PreparedDevice] = []
    for result in results:
        pool, device = str(result.get("pool")), str(result.get("device"))
        if pool != node_name:
            return Refusal(f"{where}: device {device} is in pool {pool}, not this node's")
        found = bound.get(device)
        if found is None:
            return Refusal(
                f"{where}: device {device} is not bound on node {node_name} under a DRA reservation"
            )
        held, device_id = found
        if held.phase is not Phase.BOUND:
            state = "being released" if held.phase is Phase.RELEASING else "not bound yet"
            return Refusal(
                f"{where}: device {device} belongs to allocation "
                f"{held.allocation.allocation_id}, which is {state}"
            )
        if held.allocation.namespace != namespace:
            return Refusal(
                f"{where}: device {device} is booked by reservation "
                f"{held.allocation.reservation_id} of namespace "
                f"{held.allocation.namespace or '(none)'}, not {namespace}"
            )
        owners[held.allocation.allocation_id] = held
        names = request_names(result)
        cdi_ids = _cdi_ids(allocations, held, device_id)
        if names not in {d.request_names for d in devices}:  # the request's first device
            cdi_ids.append(claim_cdi_name(uid, names))
        devices.append(
            PreparedDevice(
                request_names=names,
                pool_name=pool,
                device_name=device,
                cdi_device_ids=tuple(cdi_ids),
                visible=tuple(_visible(held, device_id)),
            )
        )
    if len(owners) > 1:
        return Refusal(
            f"{where}: its devices span allocations {', '.join(sorted(owners))}; a claim "
            "takes devices of one reservation only"
        )
    ((allocation_id, owner),) = owners.items()
    return PreparedClaim(
        uid=uid,
        namespace=namespace,
        name=name,
        allocation_id=allocation_id,
        devices=tuple(devices),
        reservation_id=owner.allocation.reservation_id,
    )


def request_names(result: Mapping[str, Any]) -> tuple[str, ...]:
    """The request names a result's device is answered under. A container names the claim's
    top-level request, while a result of a firstAvailable subrequest says
    ``<request>/<subrequest>``: the kubelet matches the former exactly."""
    request = str(result.get("request") or "").split("/", 1)[0]
    return (request,) if request else ()


def _bound_by_name(allocations: Allocations) -> dict[str, tuple[Held, str]]:
    """Slice device name -> (the ``dra`` allocation that owns it, the device id)."""
    found: dict[str, tuple[Held, str]] = {}
    for held in allocations.all():
        if held.phase is Phase.RELEASED or not is_dra(held.allocation):
            continue
        for device_id in held.allocation.device_ids:
            if allocations.owner_of(device_id) is held:
                found[dra.device_name(device_id)] = (held, device_id)
    return found


def _visible(held: Held, device_id: str) -> list[str]:
    allocation = held.allocation
    parent = allocation.parent_gpus[allocation.device_ids.index(device_id)]
    return devicefiles.visible_devices(
        device_class=allocation.device_class, device_ids=[device_id], parent_gpus=[parent]
    )


def _cdi_ids(allocations: Allocations, held: Held, device_id: str) -> list[str]:
    """bcd's CDI device, then NVIDIA's for the GPU behind it when the node's specs name one."""
    inventory = allocations.inventory
    visible = _visible(held, device_id)
    nvidia = [] if inventory is None else inventory.nvidia_cdi.devices_for(visible)
    return [devicefiles.cdi_name(device_id), *nvidia]


def claim_device(uid: str, request: str) -> str:
    """The CDI device of one request of a prepared claim, in its own spec."""
    return f"claim-{uid}-{request}" if request else f"claim-{uid}"


def claim_cdi_name(uid: str, request_names: tuple[str, ...]) -> str:
    return devicefiles.cdi_name(claim_device(uid, request_names[0] if request_names else ""))


def claim_spec(claim: PreparedClaim) -> dict[str, Any]:
    """The CDI spec of a prepared claim: per request, the environment its container needs."""
    requests: dict[tuple[str, ...], list[str]] = {}
    for device in claim.devices:
        requests.setdefault(device.request_names, []).extend(device.visible)
    return {
        "cdiVersion": devicefiles.CDI_VERSION,
        "kind": CDI_KIND,
        "annotations": {
            ANNOTATION_CLAIM: claim.uid,
            devicefiles.ANNOTATION_ALLOCATION: claim.allocation_id,
        },
        "devices": [
            {
                "name": claim_device(claim.uid, names[0] if names else ""),
                "containerEdits": {
                    "env": [
                        "NVIDIA_VISIBLE_DEVICES=" + ",".join(dict.fromkeys(visible)),
                        f"BCD_ALLOCATION_ID={claim.allocation_id}",
                        f"BCD_RESERVATION_ID={claim.reservation_id}",
                        f"BCD_CLAIM={claim.holder}",
                    ]
                },
            }
            for names, visible in requests.items()
        ],
    }


class ClaimFiles:
    """The prepared claims' CDI specs in the node's CDI folder (``bcdclaim-<uid>.json``, a
    prefix no allocation file has, so ``devicefiles`` never takes one for a leftover)."""

    def __init__(self, cdi_dir: Path) -> None:
        self.cdi_dir = cdi_dir

    def path(self, uid: str) -> Path:
        if not _UID.fullmatch(uid):
            raise CheckpointError(f"claim uid {uid!r} cannot name a file")
        return self.cdi_dir / f"{CLAIM_FILE_PREFIX}{uid}.json"

    def write(self, claim: PreparedClaim) -> None:
        try:
            write_atomically(self.path(claim.uid), json.dumps(claim_spec(claim), indent=2))
        except OSError as e:
            raise CheckpointError(f"cannot write the CDI spec of claim {claim.holder}: {e}") from e

    def remove(self, uid: str) -> None:
        with contextlib.suppress(CheckpointError):
            self.path(uid).unlink(missing_ok=True)

    def uids(self) -> set[str]:
        if not self.cdi_dir.is_dir():
            return set()
        found = (p.name for p in self.cdi_dir.glob(f"{CLAIM_FILE_PREFIX}*.json"))
        return {n.removeprefix(CLAIM_FILE_PREFIX).removesuffix(".json") for n in found}

    def match(self, claims: Iterable[PreparedClaim]) -> None:
        """Write every prepared claim's spec, remove those of claims no longer prepared
        (a start after a crash between the two steps of a prepare or an unprepare)."""
        keep = set()
        for claim in claims:
            self.write(claim)
            keep.add(claim.uid)
        for uid in self.uids() - keep:
            self.remove(uid)


class PreparedClaims:
    """The prepared claims, by uid, kept in ``path`` (None: in memory only, for tests)."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._claims: dict[str, PreparedClaim] = {}

    @classmethod
    def load(cls, path: Path | None) -> PreparedClaims:
        """The claims the checkpoint holds (none when it does not exist yet)."""
        claims = cls(path)
        if path is None:
            return claims
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return claims
        except OSError as e:
            raise CheckpointError(f"cannot read {path}: {e}") from e
        try:
            document = json.loads(text)
            if document.get("format") != _FORMAT:
                raise ValueError(f"format {document.get('format')!r}, not {_FORMAT}")
            for uid, entry in document["claims"].items():
                claims._claims[str(uid)] = PreparedClaim.from_document(str(uid), entry)
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(
                f"{path} is damaged ({e}); it lists the claims the kubelet prepared here, so "
                "the agent will not guess: restore it, or remove it once no pod uses a claim"
            ) from e
        return claims

    def get(self, uid: str) -> PreparedClaim | None:
        return self._claims.get(uid)

    def all(self) -> list[PreparedClaim]:
        return list(self._claims.values())

    def holders(self, allocation_id: str) -> list[str]:
        """The prepared claims holding ``allocation_id``'s devices, ``namespace/name``."""
        return sorted(c.holder for c in self._claims.values() if c.allocation_id == allocation_id)

    def add(self, claim: PreparedClaim) -> None:
        """Remember ``claim``, on disk before this returns (``CheckpointError`` if it cannot
        be, and then it is not remembered at all)."""
        before = dict(self._claims)
        self._claims[claim.uid] = claim
        try:
            self._save()
        except CheckpointError:
            self._claims = before
            raise

    def remove(self, uids: Iterable[str]) -> list[PreparedClaim]:
        """Forget these claims (unknown uids are ignored); the ones forgotten."""
        gone = [self._claims[uid] for uid in uids if uid in self._claims]
        if not gone:
            return []
        before = dict(self._claims)
        for claim in gone:
            del self._claims[claim.uid]
        try:
            self._save()
        except CheckpointError:
            self._claims = before
            raise
        return gone

    def _save(self) -> None:
        if self.path is None:
            return
        document = {
            "format": _FORMAT,
            "claims": {uid: c.document() for uid, c in sorted(self._claims.items())},
        }
        try:
            write_atomically(self.path, json.dumps(document, indent=2, sort_keys=True))
        except OSError as e:
            raise CheckpointError(f"cannot write {self.path}: {e}") from e
