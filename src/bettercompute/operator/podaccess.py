"""Which pod may take which reservation's devices: the rules of the pod admission webhooks.

Why it exists: in a pool with pod access ``reservation`` each ``kubernetes`` allocation is
advertised on its nodes under the reservation's own extended resource (``bcd.dev/rsv-…``).
That isolates reservations only if no pod can ask another namespace's resource, so:

- the mutating webhook (``rewritten``) turns a labelled pod's ``bcd.dev/gpu`` (``gpu.mig``,
  ``gpu.slot``) requests and limits, in containers and init containers, into its
  Reservation's resource name and records the original in an annotation;
- the validating webhook (``refusal``) refuses, naming the reason: a label naming a
  Reservation that is missing from the pod's namespace, not admitted yet, terminal or not
  ``kubernetes``-bound; more devices than the reservation holds on one node; a class the
  reservation does not hold; any ``bcd.dev/rsv-…`` resource of another namespace's (or of
  no) Reservation, or one asked without the label; and, on update, a changed label on a pod
  that asks bcd devices;
- ``warning`` tells a pod that asks plain ``bcd.dev/gpu`` without a label that no pool
  shares its devices, when none does.

How many devices a pod asks is what Kubernetes reserves for it: per resource, the larger of
the sum over its app containers (plus restartable "sidecar" init containers) and the largest
single init container (plus the sidecars started before it). It must fit what the
reservation holds on one node (a pod runs on one node; a gang member holds the same on each).

Pure: nothing here does I/O; ``handlers`` gives it what the operator recorded of the
Reservations (``Booked``, ``podowners``: from the store, never from a Reservation's status, which
a tenant may be able to write) and turns its answers into kopf's admission answers.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from bettercompute.core import states
from bettercompute.kube import names

#: Every resource a bcd node advertises starts with this domain.
BCD_DOMAIN = "bcd.dev/"
#: A shared resource name → its device class (``bcd.dev/gpu`` → ``gpu``).
CLASS_OF = {resource: device_class for device_class, resource in names.RESOURCE_NAMES.items()}
_LABEL = f"metadata.labels[{names.POD_RESERVATION_LABEL}]"
_CONTAINER_LISTS = ("initContainers", "containers")
#: A DNS-1123 subdomain: what a Reservation's (or a namespace's) name must be.
_OBJECT_NAME = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")


def is_object_name(value: Any) -> bool:
    """Whether ``value`` can name a Kubernetes object (so it is safe in an API path)."""
    return isinstance(value, str) and _OBJECT_NAME.fullmatch(value) is not None


@dataclass(frozen=True)
class Booked:
    """What the pod webhooks need of one Reservation, read from its object."""

    namespace: str
    name: str
    #: ``status.state``; ``None`` until the store has admitted the request.
    state: str | None
    #: ``spec.binding`` (``hold`` when absent, as the core defaults it).
    binding: str
    #: ``status.resourceName``: set in pod-access mode ``reservation``, absent for ``shared``.
    resource_name: str | None
    #: Devices held on each node of the reservation, by class (a gang member holds the same).
    per_node: Mapping[str, int]
    #: ``status.claimTemplate``: a reservation of a ``dra`` pool reaches pods through it.
    claim_template: str | None = None

    @property
    def held(self) -> int:
        return sum(self.per_node.values())


class Owned(Protocol):
    """Whose a reservation is: its Reservation's namespace and name."""

    @property
    def namespace(self) -> str: ...
    @property
    def name(self) -> str: ...


@dataclass(frozen=True)
class Owner:
    """The Reservation that owns a reservation's resource, as the store recorded it."""

    namespace: str
    name: str


def booked(body: Mapping[str, Any]) -> Booked:
    """A Reservation object as the pod webhooks see it (tolerant: a watch delivers any shape)."""
    meta = body.get("metadata") or {}
    spec = body.get("spec") or {}
    status = body.get("status") or {}
    per_node: dict[str, int] = {}
    devices = spec.get("devices")
    for device in devices if isinstance(devices, list) else ():
        if not isinstance(device, Mapping):
            continue
        count = device.get("count")
        if isinstance(count, int) and not isinstance(count, bool) and count > 0:
            device_class = str(device.get("class"))
            per_node[device_class] = per_node.get(device_class, 0) + count
    state, resource_name = status.get("state"), status.get("resourceName")
    return Booked(
        namespace=str(meta.get("namespace") or ""),
        name=str(meta.get("name") or ""),
        state=str(state) if state else None,
        binding=str(spec.get("binding") or "hold"),
        resource_name=str(resource_name) if resource_name else None,
        per_node=per_node,
        claim_template=str(status["claimTemplate"]) if status.get("claimTemplate") else None,
    )


# --- what a pod asks ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Ask:
    """One container's bcd resources: the larger of its request and limit, by name."""

    where: str  # spec.containers[0] (for messages)
    init: bool
    sidecar: bool  # an init container with restartPolicy Always: runs beside the app
    counts: Mapping[str, int]
    #: Quantities that are not whole numbers, as ``(field, value)``: refused by name.
    malformed: tuple[tuple[str, str], ...] = ()


def _quantity(value: Any) -> int | None:
    """An extended resource's quantity: a whole number (``2``, ``"2"``), else ``None``."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if value >= 0 else None
    if isinstance(value, str) and value.isascii() and value.isdigit():
        return int(value)
    return None


def _containers(pod: Mapping[str, Any], key: str) -> list[Mapping[str, Any]]:
    found = (pod.get("spec") or {}).get(key)
    if not isinstance(found, list):
        return []
    return [c for c in found if isinstance(c, Mapping)]


def _bcd_entries(container: Mapping[str, Any], kind: str) -> dict[str, Any]:
    resources = container.get("resources")
    entries = resources.get(kind) if isinstance(resources, Mapping) else None
    if not isinstance(entries, Mapping):
        return {}
    return {str(k): v for k, v in entries.items() if str(k).startswith(BCD_DOMAIN)}


def asks(pod: Mapping[str, Any]) -> list[Ask]:
    """Every container's and init container's bcd resources (those that ask none left out)."""
    found: list[Ask] = []
    for key in _CONTAINER_LISTS:
        for index, container in enumerate(_containers(pod, key)):
            where = f"spec.{key}[{index}]"
            counts: dict[str, int] = {}
            malformed: list[tuple[str, str]] = []
            for kind in ("requests", "limits"):
                for resource, value in _bcd_entries(container, kind).items():
                    quantity = _quantity(value)
                    if quantity is None:
                        malformed.append((f"{where}.resources.{kind}[{resource}]", str(value)))
                        continue
                    counts[resource] = max(counts.get(resource, 0), quantity)
            if counts or malformed:
                found.append(
                    Ask(
                        where=where,
                        init=key == "initContainers",
                        sidecar=key == "initContainers"
                        and container.get("restartPolicy") == "Always",
                        counts=counts,
                        malformed=tuple(malformed),
                    )
                )
    return found


def reservation_resources(pod: Mapping[str, Any] | None) -> list[str]:
    """The ``bcd.dev/rsv-…`` resources the pod asks (whose owners ``refusal`` may ask for)."""
    if pod is None:
        return []
    return sorted(r for r in effective(asks(pod)) if _is_reservation_resource(r))


def asks_bcd(pod: Mapping[str, Any] | None) -> bool:
    """Whether any container or init container of the pod asks a ``bcd.dev/`` resource."""
    return pod is not None and bool(asks(pod))


def effective(found: Iterable[Ask]) -> dict[str, int]:
    """What Kubernetes reserves for the pod, by resource (see the module docstring)."""
    found = list(found)
    total: dict[str, int] = {}
    running: dict[str, int] = {}  # sidecars started so far
    for ask in found:
        if not ask.init:
            continue
        for resource, count in ask.counts.items():
            if ask.sidecar:
                running[resource] = running.get(resource, 0) + count
            else:
                during_init = running.get(resource, 0) + count
                total[resource] = max(total.get(resource, 0), during_init)
    app: dict[str, int] = dict(running)
    for ask in found:
        if not ask.init:
            for resource, count in ask.counts.items():
                app[resource] = app.get(resource, 0) + count
    for resource, count in app.items():
        total[resource] = max(total.get(resource, 0), count)
    return total


def _label(pod: Mapping[str, Any] | None) -> str | None:
    labels = ((pod or {}).get("metadata") or {}).get("labels") or {}
    value = labels.get(names.POD_RESERVATION_LABEL) if isinstance(labels, Mapping) else None
    return str(value) if value is not None else None


def _is_reservation_resource(resource: str) -> bool:
    return resource.startswith(names.RESERVATION_RESOURCE_PREFIX)


# --- the mutating webhook ------------------------------------------------------------------------


def rewritten(pod: Mapping[str, Any], reservation: Booked | None) -> dict[str, Any] | None:
    """The pod's ``spec`` lists and annotations after the rewrite, or ``None`` to leave it.

    Only a labelled pod whose Reservation (in the pod's namespace) is live, ``kubernetes``-bound
    and has its own resource name is rewritten, and only the classes it holds; everything else
    is left for ``refusal`` to judge, so the reason reaches the user in one place.
    """
    if reservation is None or _label(pod) != reservation.name:
        return None
    if (
        reservation.resource_name is None
        or reservation.binding != "kubernetes"
        or reservation.state is None
        or reservation.state in states.TERMINAL
    ):
        return None
    target = reservation.resource_name
    held = {names.RESOURCE_NAMES[c] for c in reservation.per_node if c in names.RESOURCE_NAMES}
    original: dict[str, dict[str, dict[str, dict[str, Any]]]] = {}
    lists: dict[str, list[Any]] = {}
    for key in _CONTAINER_LISTS:
        spec_list = (pod.get("spec") or {}).get(key)
        if not isinstance(spec_list, list):
            continue
        new_list: list[Any] = []
        for container in spec_list:
            new_list.append(_rewrite_container(container, held, target, key, original))
        lists[key] = new_list
    if not original:
        return None
    meta = pod.get("metadata") or {}
    annotations = dict(meta.get("annotations") or {})
    annotations[names.ORIGINAL_RESOURCES] = json.dumps(original, sort_keys=True)
    return {"spec": lists, "annotations": annotations}


def _rewrite_container(
    container: Any,
    held: set[str],
    target: str,
    key: str,
    original: dict[str, dict[str, dict[str, dict[str, Any]]]],
) -> Any:
    if not isinstance(container, Mapping) or not isinstance(container.get("resources"), Mapping):
        return container
    resources = dict(container["resources"])
    changed = False
    for kind in ("requests", "limits"):
        entries = resources.get(kind)
        if not isinstance(entries, Mapping):
            continue
        moving = {r: v for r, v in entries.items() if r in held}
        quantities = [_quantity(v) for v in moving.values()]
        if not moving or any(q is None for q in quantities):
            continue  # nothing to move, or a quantity ``refusal`` will name
        kept = {r: v for r, v in entries.items() if r not in held}
        already = _quantity(kept.get(target, 0)) or 0
        kept[target] = str(already + sum(q for q in quantities if q is not None))
        resources[kind] = kept
        name = str(container.get("name") or "")
        original.setdefault(key, {}).setdefault(name, {})[kind] = dict(moving)
        changed = True
    if not changed:
        return container
    return {**container, "resources": resources}


# --- the validating webhook ----------------------------------------------------------------------

#: Finds a Reservation by (namespace, name), and the one whose resource name this is.
Named = Callable[[str, str], Booked | None]
Owning = Callable[[str], Owned | None]


def refusal(
    *,
    operation: str | None,
    pod: Mapping[str, Any] | None,
    old: Mapping[str, Any] | None,
    reservation_named: Named,
    owner_of: Owning,
) -> str | None:
    """Why this pod create or update must be refused, or ``None`` to allow it."""
    if pod is None:
        return None
    if operation == "UPDATE" and old is not None:
        if asks_bcd(old) and _label(old) != _label(pod):
            return (
                f"{_LABEL}: cannot change on a pod that asks bcd devices "
                f"(it was {_label(old)!r}); delete the pod and create it again"
            )
        if effective(asks(old)) == effective(asks(pod)):
            # Nothing device-related changed: a later update (a label of another key, a
            # finalizer) is never refused because its reservation has ended since.
            return None
    elif operation != "CREATE":
        return None
    return _create_refusal(pod, reservation_named=reservation_named, owner_of=owner_of)


def needs_reservation(
    *, operation: str | None, pod: Mapping[str, Any] | None, old: Mapping[str, Any] | None
) -> bool:
    """Whether ``refusal`` will ask for the labelled Reservation (so the caller reads it)."""
    if pod is None or _label(pod) is None:
        return False
    if operation == "UPDATE" and old is not None:
        return effective(asks(old)) != effective(asks(pod))
    return operation == "CREATE"


def _create_refusal(
    pod: Mapping[str, Any], *, reservation_named: Named, owner_of: Owning
) -> str | None:
    namespace = str((pod.get("metadata") or {}).get("namespace") or "")
    label = _label(pod)
    found = asks(pod)
    for ask in found:
        for field, value in ask.malformed:
            return f"{field}: {value!r} is not a whole number of devices"
    wanted = effective(found)
    for resource in sorted(wanted):
        problem = _resource_problem(resource, namespace=namespace, label=label, owner_of=owner_of)
        if problem is not None:
            return problem
    if label is None:
        return None
    reservation = reservation_named(namespace, label) if namespace else None
    problem = _reservation_problem(reservation, label=label, namespace=namespace)
    if problem is not None or reservation is None:
        return problem
    if reservation.claim_template is not None and wanted:
        # A dra pool advertises no extended resource: the pod would wait forever, unexplained.
        where = next(a.where for a in found if a.counts)
        return (
            f"{where}: asks {', '.join(sorted(wanted))}, but Reservation {label!r} hands its "
            "devices to pods through Dynamic Resource Allocation: list its ResourceClaimTemplate "
            f"in spec.resourceClaims (resourceClaimTemplateName: "
            f"{reservation.claim_template}) and name that claim in the container's "
            "resources.claims instead"
        )
    return _fit_problem(reservation, wanted, found)


def _resource_problem(
    resource: str, *, namespace: str, label: str | None, owner_of: Owning
) -> str | None:
    if resource in CLASS_OF:
        return None
    if not _is_reservation_resource(resource):
        known = ", ".join(sorted(CLASS_OF))
        return (
            f"asks {resource}, which bcd does not advertise: ask {known} "
            f"(with the label {names.POD_RESERVATION_LABEL} to use your Reservation's devices)"
        )
    owner = owner_of(resource)
    if owner is None:
        return f"asks {resource}, which is no Reservation's resource"
    if owner.namespace != namespace:
        return (
            f"asks {resource}, the resource of a Reservation in another namespace: "
            "a pod may use only the reservations of its own namespace"
        )
    if label is None:
        return (
            f"asks {resource} without the label {names.POD_RESERVATION_LABEL}: "
            f"label the pod {names.POD_RESERVATION_LABEL}={owner.name} and ask bcd.dev/gpu"
        )
    if owner.name != label:
        return (
            f"asks {resource}, the resource of Reservation {owner.name!r}, "
            f"but its label names Reservation {label!r}"
        )
    return None


def _reservation_problem(reservation: Booked | None, *, label: str, namespace: str) -> str | None:
    if not namespace:
        return "the pod has no namespace: cannot tell whose Reservation it names"
    if reservation is None:
        return f"{_LABEL}: Reservation {label!r} does not exist in namespace {namespace!r}"
    if reservation.binding != "kubernetes":
        return (
            f"{_LABEL}: Reservation {label!r} has binding {reservation.binding!r}; only a "
            "Reservation with binding 'kubernetes' hands its devices to pods"
        )
    if reservation.state is None:
        return (
            f"{_LABEL}: Reservation {label!r} is not admitted yet (it has no state); "
            "create the pod once its status shows one"
        )
    if reservation.state in states.TERMINAL:
        return (
            f"{_LABEL}: Reservation {label!r} is {reservation.state}: it holds no devices any more"
        )
    return None


def _fit_problem(reservation: Booked, wanted: Mapping[str, int], found: list[Ask]) -> str | None:
    name = reservation.name
    holds = ", ".join(f"{n} {c}" for c, n in sorted(reservation.per_node.items())) or "nothing"
    if reservation.resource_name is not None:
        for resource in sorted(wanted):
            if resource not in CLASS_OF:
                continue
            where = next(a.where for a in found if resource in a.counts)
            if CLASS_OF[resource] in reservation.per_node:
                # Held but not rewritten: the Reservation was admitted between the two webhooks,
                # or a later mutating webhook added it. Creating the pod again rewrites it.
                return (
                    f"{where}: asks {resource}; a pod of Reservation {name!r} gets its devices "
                    f"as {reservation.resource_name} (the mutating pod webhook rewrites "
                    f"{resource} on create: create the pod again)"
                )
            return (
                f"{where}: asks {resource}, which Reservation {name!r} does not hold "
                f"(it holds {holds} per node)"
            )
        asked = wanted.get(reservation.resource_name, 0)
        if asked > reservation.held:
            return (
                f"asks {asked} devices of Reservation {name!r}, which holds {reservation.held} "
                f"per node ({holds}); a pod runs on one node"
            )
        return None
    # Pod access ``shared``: the pod asks the shared names; it still may not ask more than held.
    for resource in sorted(wanted):
        device_class = CLASS_OF.get(resource)
        held = reservation.per_node.get(device_class or "", 0)
        if wanted[resource] > held:
            return (
                f"asks {wanted[resource]} {resource}, more than Reservation {name!r} holds "
                f"per node ({holds})"
            )
    return None


def shares_devices(pool_spec: Mapping[str, Any] | None) -> bool:
    """Whether a GPUPool's ``spec`` hands its ``kubernetes`` devices to any pod (``shared``)."""
    policy = (pool_spec or {}).get("policy") or {}
    return policy.get("kubernetes") not in (None, False) and policy.get("podAccess") == "shared"


def warning(pod: Mapping[str, Any], *, shared_pool_exists: bool) -> str | None:
    """A word for a pod that asks plain ``bcd.dev/gpu`` without a label, when it can only wait."""
    if shared_pool_exists or _label(pod) is not None:
        return None
    plain = sorted(r for r in effective(asks(pod)) if r in CLASS_OF)
    if not plain:
        return None
    return (
        f"asks {', '.join(plain)} without the label {names.POD_RESERVATION_LABEL}, and no "
        "GPUPool shares its devices (policy.podAccess: shared); the pod stays Pending. "
        f"Label it {names.POD_RESERVATION_LABEL}=<your Reservation> to use its devices"
    )
