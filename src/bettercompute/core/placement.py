"""Placement: which concrete devices ("atoms") of a pool a reservation books.

Why it exists: booking must name exact devices (a GPU UUID, a MIG instance, a time-slice slot),
and the choice decides how fragmented the pool becomes. Keeping that choice in one pure
function of (snapshot, demand) makes it exhaustively testable, deterministic for the same input,
and reusable both by the booking transaction and by dry runs that only explain a refusal.

What it must never do: I/O of any kind (database, network, files, logging) and never read a
clock. The caller takes the snapshot - including which atoms are already booked in an
overlapping window - and passes it in. A demand that cannot be placed is a ``NoFit`` value,
never an exception; ``ValueError`` is only for a demand that makes no sense.

How: each node goes through the filters ready -> labels -> health -> capacity -> topology and
is counted against the first that rejects it. Capacity covers the host too: a demand that books
host CPUs, memory or huge pages fits only a node whose bookable rows, less what other
reservations book there in the window, hold them. Among the nodes that fit, best fit wins: the node
left with the fewest free matching atoms, tie-broken by node name then id.

Why a ``PoolIndex``: a big pool's placements must not cost more than a small pool's. The index
is built once per inventory (the store caches it with the nodes and atoms) and holds each
node's atoms as counts, grouped with the nodes whose static shape is the same (readiness,
labels, host, atom counts). A placement then screens one node per group for every node that
no reservation touches in the window, one per group for the nodes booked full, and node by node
only the few that are partly booked: same verdicts, same best fit, far fewer nodes visited.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal, NamedTuple, TypeVar

AtomKind = Literal["gpu", "mig", "slot"]


@dataclass(frozen=True)
class Atom:
    """One bookable unit: a whole GPU, a MIG instance, or a time-slice/MPS slot."""

    id: str
    node_id: str
    kind: AtomKind
    device_id: str  # GPU UUID for gpu, MIG device UUID for mig, slot id for slot
    parent_gpu: str  # device id of the physical GPU (== device_id for a gpu atom)
    profile: str | None  # MIG profile like "1g.10gb" for mig atoms, else None
    numa_node: int | None
    nvlink_domain: str | None  # GPUs sharing a domain are NVLink-connected; None = no NVLink
    healthy: bool


@dataclass(frozen=True)
class Node:
    id: str
    name: str
    ready: bool
    connected: bool
    labels: Mapping[str, str]  # only labels whose source is "system"
    #: What the host can book (``vcpu`` less the CPUs it keeps for itself, ``memoryGiB``,
    #: ``hugepages1Gi`` …); a missing row gives none of that resource.
    host: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Snapshot:
    nodes: Sequence[Node]
    atoms: Sequence[Atom]  # all atoms of the pool's nodes
    busy: frozenset[str]  # atom ids already booked in an overlapping window
    #: Node id -> what other reservations book of its host in an overlapping window.
    host_busy: Mapping[str, Mapping[str, int]] = field(default_factory=dict)
    #: ``PoolIndex(nodes, atoms)`` when the caller keeps one per inventory; used only when it
    #: was built from these very ``nodes`` and ``atoms`` objects, otherwise built afresh.
    index: PoolIndex | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class DeviceDemand:
    device_class: AtomKind
    count: int
    topology: Literal["any", "nvlink-all"] = "any"
    profile: str | None = None  # required for "mig": only atoms with this profile match


@dataclass(frozen=True)
class Demand:
    devices: Sequence[DeviceDemand]  # all of these, per gang member, on ONE node
    gang_size: int = 1  # each member on a DISTINCT node
    # Binding "node": a member books every atom of a node, which must have no busy atom and
    # every atom healthy; ``devices`` is ignored.
    whole_node: bool = False
    # Value "*" means "label present with any value".
    required_labels: Mapping[str, str] = field(default_factory=dict)
    # What each member books of its node's host (``vcpu``, ``memoryGiB``, ``hugepages1Gi``).
    host: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Member:
    node_id: str
    atom_ids: tuple[str, ...]


@dataclass(frozen=True)
class Placed:
    members: tuple[Member, ...]  # one per gang member, in order


@dataclass(frozen=True)
class NoFit:
    message: str  # human summary, e.g. "0 of 8 nodes fit: 2 not ready, 5 too few free gpu"
    # Filter name -> number of nodes it rejected; names: "ready", "labels", "health",
    # "capacity", "topology", "gang". Only filters that rejected something appear.
    rejected: Mapping[str, int]
    #: No node of the pool could hold it even with every node ready and every device free and
    #: healthy (then ``message`` starts with ``NEVER``): waiting will not help until the pool
    #: changes.
    never: bool = False


#: How a ``NoFit`` that can never fit the pool as it is starts its message.
NEVER = "never fits this pool"


Outcome = Placed | NoFit

# The order filters run in; a node is counted against the first that rejects it, and the
# message lists reasons in this order too.
_FILTERS = ("ready", "labels", "health", "capacity", "topology", "gang")

# What one device entry may take from: the atom kind, plus the profile for MIG.
_Pool = tuple[str, str | None]

_T = TypeVar("_T")

# What an atom counts towards: its node, its pool (kind, and profile for MIG), its NVLink domain
# and its health.
_Key = tuple[str, str, str | None, str | None, bool]


class _Stock:
    """One node's atoms as counts, so screening a node is arithmetic rather than a scan."""

    __slots__ = ("free", "sick", "sick_domains", "size", "usable", "usable_domains")

    def __init__(self) -> None:
        self.size = 0  # all atoms, busy ones included
        self.free = 0  # atoms not in ``busy``
        self.usable: dict[_Pool, int] = {}  # healthy and not busy
        self.usable_domains: dict[str, int] = {}  # usable GPUs per NVLink domain
        self.sick: dict[_Pool, int] = {}  # unhealthy and not busy
        self.sick_domains: dict[str, int] = {}

    def count(self, key: _Key, n: int) -> None:
        """Add ``n`` atoms of ``key`` (a negative ``n`` takes them away)."""
        _, kind, profile, domain, healthy = key
        self.free += n
        counts, domains = (
            (self.usable, self.usable_domains) if healthy else (self.sick, self.sick_domains)
        )
        pool = (kind, profile)
        _add(counts, pool, n)
        if kind == "gpu" and domain is not None:
            _add(domains, domain, n)

    def copy(self) -> _Stock:
        out = _Stock()
        out.size, out.free = self.size, self.free
        out.usable, out.usable_domains = dict(self.usable), dict(self.usable_domains)
        out.sick, out.sick_domains = dict(self.sick), dict(self.sick_domains)
        return out

    def shape(self) -> tuple[object, ...]:
        """What screening reads of the stock, NVLink domains by their counts rather than their
        names: equal shapes, equal verdicts (only a plan's domain names differ)."""
        domains = self.usable_domains.keys() | self.sick_domains.keys()
        return (
            self.size,
            self.free,
            frozenset(self.usable.items()),
            frozenset(self.sick.items()),
            tuple(
                sorted(
                    (self.usable_domains.get(d, 0), self.sick_domains.get(d, 0)) for d in domains
                )
            ),
        )


def _add(counts: dict[_T, int], key: _T, n: int) -> None:
    # A count that drops to zero leaves the map: an empty map means "none" (``if stock.sick``).
    left = counts.get(key, 0) + n
    if left:
        counts[key] = left
    else:
        del counts[key]


@dataclass(frozen=True)
class _Group:
    """Nodes of one static shape: every one screens as ``members[0]`` does."""

    members: tuple[Node, ...]  # by name, then id: the best-fit tie-break
    stock: _Stock  # each member's stock with nothing booked
    emptied: _Stock  # the same with every atom booked


class PoolIndex:
    """A pool's nodes and atoms prepared once for many placements (see the module's "Why a
    ``PoolIndex``"). Placements only read it; the one thing added later is ``idle()``'s index,
    built the first time a refusal asks for it."""

    def __init__(self, nodes: Sequence[Node], atoms: Sequence[Atom]) -> None:
        self.nodes = nodes
        self.atoms = atoms
        self._idle: PoolIndex | None = None  # ``idle()``, once asked for
        #: The pool's nodes by id (a repeated id: the first one is the node).
        self.node_of: dict[str, Node] = {}
        for node in nodes:
            self.node_of.setdefault(node.id, node)
        #: Each node's stock with nothing booked.
        self.stocks: dict[str, _Stock] = {node_id: _Stock() for node_id in self.node_of}
        #: Every atom by id (a repeated id: the last one), for writing down what was booked.
        self.atom_of: dict[str, Atom] = {atom.id: atom for atom in atoms}
        #: Each node's atoms, in the snapshot's order (atoms of a node outside the pool: none).
        self.atoms_of: dict[str, list[Atom]] = {node_id: [] for node_id in self.node_of}
        stocks = self.stocks
        mine = [a for a in atoms if a.node_id in stocks]  # a node outside the pool: not here
        for atom in mine:
            self.atoms_of[atom.node_id].append(atom)
        # Each distinct key numbered, so busy atoms are counted per key in C on small ints.
        numbered: dict[_Key, int] = {}
        numbers = [numbered.setdefault(_key(a), len(numbered)) for a in mine]
        self._keys: list[_Key] = list(numbered)
        for number, n in Counter(numbers).items():
            key = self._keys[number]
            stocks[key[0]].size += n
            stocks[key[0]].count(key, n)
        #: Atom id -> the number of its key, for counting busy atoms without visiting the others.
        self._number_of: dict[str, int] = dict(zip([a.id for a in mine], numbers, strict=True))
        self._repeated: dict[str, list[int]] = {}  # atom ids listed more than once: their keys
        if len(self._number_of) < len(mine):
            listed = Counter(a.id for a in mine)
            for atom, number in zip(mine, numbers, strict=True):
                if listed[atom.id] > 1:
                    self._repeated.setdefault(atom.id, []).append(number)
            for atom_id in self._repeated:
                del self._number_of[atom_id]
        shapes: dict[tuple[object, ...], list[Node]] = {}
        for node in self.node_of.values():
            shape = (
                node.ready and node.connected,
                frozenset(node.labels.items()),
                frozenset(node.host.items()),
                self.stocks[node.id].shape(),
            )
            shapes.setdefault(shape, []).append(node)
        self.groups: tuple[_Group, ...] = tuple(
            _Group(
                members=tuple(sorted(members, key=lambda n: (n.name, n.id))),
                stock=self.stocks[members[0].id],
                emptied=_emptied(self.stocks[members[0].id]),
            )
            for members in shapes.values()
        )
        #: Node id -> the number of its group in ``groups``.
        self.group_of: dict[str, int] = {
            member.id: number
            for number, group in enumerate(self.groups)
            for member in group.members
        }

    def idle(self) -> PoolIndex:
        """The index of the pool at rest (every node ready, every device healthy): built once,
        for telling "never fits" from "not yet" at every refusal."""
        if self._idle is None:
            self._idle = PoolIndex(
                tuple(replace(n, ready=True, connected=True) for n in self.nodes),
                tuple(a if a.healthy else replace(a, healthy=True) for a in self.atoms),
            )
        return self._idle

    def booked(
        self, *, busy: frozenset[str], host_nodes: Iterable[str]
    ) -> tuple[dict[str, _Stock], set[str]]:
        """The nodes a window touches: the partly booked ones (some atoms busy, or some of the
        host booked) with their stock left, and the ones whose every atom is busy."""
        # Counted in C per key, over the smaller side: the busy ids in a big pool, the pool's
        # atoms when a small one (one node, as a search judges it) meets a big window's busy set.
        number_of = self._number_of
        if len(busy) <= len(number_of):
            per_key = Counter(map(number_of.get, busy))
            per_key.pop(None, None)  # not an atom of this pool
        else:
            per_key = Counter(map(number_of.__getitem__, number_of.keys() & busy))
        for atom_id in busy.intersection(self._repeated) if self._repeated else ():
            per_key.update(self._repeated[atom_id])
        per_node: dict[str, list[tuple[_Key, int]]] = {}
        for number, n in per_key.items():
            if number is not None:
                key = self._keys[number]
                per_node.setdefault(key[0], []).append((key, n))
        partial: dict[str, _Stock] = {}
        full: set[str] = set()
        for node_id, counted in per_node.items():
            if sum(n for _, n in counted) >= self.stocks[node_id].size:
                # Nothing left to book: the host does not matter, the devices reject it first.
                full.add(node_id)
                continue
            stock = partial[node_id] = self.stocks[node_id].copy()
            for key, n in counted:
                stock.count(key, -n)
        for node_id in host_nodes:
            if node_id in self.stocks and node_id not in full and node_id not in partial:
                partial[node_id] = self.stocks[node_id]
        return partial, full


def _key(atom: Atom) -> _Key:
    return (
        atom.node_id,
        atom.kind,
        atom.profile if atom.kind == "mig" else None,
        atom.nvlink_domain,
        atom.healthy,
    )


def _emptied(stock: _Stock) -> _Stock:
    out = _Stock()
    out.size = stock.size
    return out


class _Ask(NamedTuple):
    """The demand, prepared once so the per-node loop does no sorting of its own."""

    devices: tuple[DeviceDemand, ...]
    pools: tuple[_Pool, ...]  # per entry
    distinct_pools: frozenset[_Pool]
    order: list[int]  # the order entries are solved in
    total: int  # atoms one member takes
    labels: list[tuple[str, str]]  # required labels, sorted by name
    host: list[tuple[str, int]]  # host resources one member books, sorted by name


class _Reject(NamedTuple):
    filter: str
    reason: str


_NOT_READY = _Reject("ready", "not ready")

# Plan: per device entry, the NVLink domain it must take from, or None for "anywhere".
_Plan = list[str | None]


class _Fit(NamedTuple):
    node: Node
    leftover: int  # free matching atoms the node still has after this placement
    plan: _Plan | None  # None for a whole node


class _Shortfall(NamedTuple):
    entry: DeviceDemand
    topology: bool  # True: enough atoms, but no single NVLink domain holds them


def place(*, snapshot: Snapshot, demand: Demand) -> Outcome:
    """Choose the nodes and atoms for ``demand``, or explain why nothing fits, telling a
    demand that could fit once devices are free from one that never can (``NoFit.never``)."""
    outcome = _place(snapshot=snapshot, demand=demand)
    if isinstance(outcome, Placed):
        return outcome
    never = never_fits(snapshot=snapshot, demand=demand)
    return outcome if never is None else replace(never, rejected=outcome.rejected)


def never_fits(*, snapshot: Snapshot, demand: Demand) -> NoFit | None:
    """Why no node of the pool could hold ``demand`` even with every node ready and every
    device free and healthy (a ``NoFit`` whose message starts with ``NEVER``), or ``None``."""
    idle = _place(snapshot=_idle(snapshot), demand=demand)
    if isinstance(idle, Placed):
        return None
    why = idle.message if not snapshot.nodes else f"even with every device free, {idle.message}"
    return NoFit(message=f"{NEVER}: {why}", rejected=idle.rejected, never=True)


def try_place(*, snapshot: Snapshot, demand: Demand) -> Outcome:
    """``place`` without telling "never" from "not yet": for callers that try many snapshots of
    one pool (``windows``) and ask the pool at rest once themselves."""
    return _place(snapshot=snapshot, demand=demand)


def _idle(snapshot: Snapshot) -> Snapshot:
    """The pool as it would be with every node ready and every device free and healthy."""
    idle = _index(snapshot).idle()
    return Snapshot(nodes=idle.nodes, atoms=idle.atoms, busy=frozenset(), index=idle)


def _index(snapshot: Snapshot) -> PoolIndex:
    """The snapshot's index when it is the one of these nodes and atoms, else a new one."""
    index = snapshot.index
    if index is None or index.nodes is not snapshot.nodes or index.atoms is not snapshot.atoms:
        index = PoolIndex(snapshot.nodes, snapshot.atoms)
    return index


def _place(*, snapshot: Snapshot, demand: Demand) -> Outcome:
    _validate(demand)
    ask = _prepare(demand)
    index = _index(snapshot)
    if not index.stocks:
        return NoFit(message="the pool has no nodes", rejected={})
    host_busy = snapshot.host_busy
    partial, full = index.booked(busy=snapshot.busy, host_nodes=host_busy.keys())
    fits: list[_Fit] = []  # the best ``gang_size`` of each group, and every partly booked fit
    fit_count = 0
    rejects: Counter[_Reject] = Counter()
    for node_id, stock in partial.items():
        verdict = _screen(
            node=index.node_of[node_id],
            stock=stock,
            ask=ask,
            whole_node=demand.whole_node,
            host_busy=host_busy.get(node_id),
        )
        if isinstance(verdict, _Fit):
            fits.append(verdict)
            fit_count += 1
        else:
            rejects[verdict] += 1
    special = Counter(map(index.group_of.__getitem__, partial))
    full_in = Counter(map(index.group_of.__getitem__, full))
    special.update(full_in)
    for number, group in enumerate(index.groups):
        # Every node of a group answers as its first does: screen that one for the group.
        for count, stock, skip in (
            (len(group.members) - special[number], group.stock, True),
            (full_in[number], group.emptied, False),
        ):
            if not count:
                continue
            verdict = _screen(
                node=group.members[0],
                stock=stock,
                ask=ask,
                whole_node=demand.whole_node,
                host_busy=None,
            )
            if isinstance(verdict, _Reject):
                rejects[verdict] += count
                continue
            fit_count += count
            # Members are in (name, id) order: the first ones not booked are the group's best.
            shown = (
                (m for m in group.members if m.id not in partial and m.id not in full)
                if skip
                else (m for m in group.members if m.id in full)
            )
            for member, _ in zip(shown, range(demand.gang_size), strict=False):
                # Its own plan: the group shares the verdict, not the NVLink domains' names.
                own = _screen(
                    node=member,
                    stock=index.stocks[member.id] if skip else stock,
                    ask=ask,
                    whole_node=demand.whole_node,
                    host_busy=None,
                )
                if isinstance(own, _Fit):
                    fits.append(own)
    if fit_count < demand.gang_size:
        node_count = fit_count + rejects.total()
        return _no_fit(node_count=node_count, fit_count=fit_count, rejects=rejects, demand=demand)
    fits.sort(key=lambda f: (f.leftover, f.node.name, f.node.id))
    chosen = fits[: demand.gang_size]
    return Placed(
        members=tuple(
            Member(
                node_id=fit.node.id,
                atom_ids=_take(
                    fit=fit, atoms=index.atoms_of[fit.node.id], ask=ask, busy=snapshot.busy
                ),
            )
            for fit in chosen
        )
    )


def _validate(demand: Demand) -> None:
    # The same class rules as the request layer, so a demand built by hand can't slip past them.
    if demand.gang_size < 1:
        raise ValueError(f"gang_size must be at least 1, got {demand.gang_size}")
    if demand.whole_node:
        return
    if not demand.devices:
        raise ValueError("a demand needs at least one device entry unless it is whole_node")
    for entry in demand.devices:
        if entry.count < 1:
            raise ValueError(f"device count must be at least 1, got {entry.count}")
        if entry.device_class == "mig" and entry.profile is None:
            raise ValueError("a mig device needs a profile such as '1g.10gb'")
        if entry.device_class != "mig" and entry.profile is not None:
            raise ValueError("profile is only for class 'mig'")
        if entry.topology == "nvlink-all" and entry.device_class != "gpu":
            raise ValueError("topology 'nvlink-all' is only for whole GPUs (class 'gpu')")


def _prepare(demand: Demand) -> _Ask:
    devices = () if demand.whole_node else tuple(demand.devices)
    # Greedy, most constrained first: NVLink entries need a whole domain and larger counts are
    # harder to fit, so they choose before entries that can take atoms from anywhere.
    order = sorted(
        range(len(devices)), key=lambda i: (devices[i].topology != "nvlink-all", -devices[i].count)
    )
    return _Ask(
        devices=devices,
        pools=tuple((e.device_class, e.profile) for e in devices),
        distinct_pools=frozenset((e.device_class, e.profile) for e in devices),
        order=order,
        total=sum(e.count for e in devices),
        labels=sorted(demand.required_labels.items()),
        host=sorted((k, v) for k, v in demand.host.items() if v > 0),
    )


def _screen(
    *,
    node: Node,
    stock: _Stock,
    ask: _Ask,
    whole_node: bool,
    host_busy: Mapping[str, int] | None,
) -> _Fit | _Reject:
    """The node's fit (with its best-fit score), or the first filter that rejects it."""
    if not (node.ready and node.connected):
        return _NOT_READY
    labels = node.labels
    for name, value in ask.labels:
        actual = labels.get(name)
        if actual is None or (value != "*" and actual != value):
            return _Reject("labels", f"needs label {name}={value}")
    # The devices before the host: a node too small for the devices is the more fundamental
    # reason ("too few free gpu" for 9 GPUs on nodes of 8, not "too little free host memory").
    fit = (
        _screen_whole_node(node=node, stock=stock)
        if whole_node
        else _screen_devices(node=node, stock=stock, ask=ask)
    )
    if isinstance(fit, _Reject):
        return fit
    for name, need in ask.host:
        if node.host.get(name, 0) - (host_busy or {}).get(name, 0) < need:
            return _Reject("capacity", f"too little free host {name}")
    return fit


def _screen_devices(*, node: Node, stock: _Stock, ask: _Ask) -> _Fit | _Reject:
    """The node's fit for the devices asked (its best-fit score), or why they do not fit."""
    plan = _plan(ask=ask, counts=stock.usable, domains=stock.usable_domains)
    if isinstance(plan, _Shortfall):
        return _why_not(shortfall=plan, stock=stock, ask=ask)
    matching = 0
    for pool in ask.distinct_pools:  # a plain loop: this runs once per node that fits
        matching += stock.usable.get(pool, 0)
    return _Fit(node, matching - ask.total, plan)


def _screen_whole_node(*, node: Node, stock: _Stock) -> _Fit | _Reject:
    # A node without atoms can't be held exclusively (there is nothing to book), so it never fits.
    if not stock.size:
        return _Reject("capacity", "have no devices")
    if stock.free < stock.size:
        return _Reject("capacity", "have booked devices")
    if stock.sick:
        return _Reject("health", "have unhealthy devices")
    # Best fit for a whole node is the smallest one, so bigger nodes stay free for bigger asks.
    return _Fit(node=node, leftover=stock.size, plan=None)


def _plan(
    *, ask: _Ask, counts: Mapping[_Pool, int], domains: Mapping[str, int]
) -> _Plan | _Shortfall:
    """Decide each entry's NVLink domain from counts alone, or name the first entry that's short.

    ``_take`` then picks atoms by this plan; the counts guarantee it always finds enough.
    """
    used: dict[_Pool, int] = {}
    used_in: dict[str, int] = {}
    plan: _Plan = [None] * len(ask.devices)
    for index in ask.order:
        entry, pool = ask.devices[index], ask.pools[index]
        need = used.get(pool, 0) + entry.count
        if counts.get(pool, 0) < need:
            return _Shortfall(entry, False)
        used[pool] = need
        if entry.topology == "nvlink-all":
            # Best fit: the domain with the fewest free GPUs that still holds the whole entry.
            best: tuple[int, str] | None = None
            for domain, n in domains.items():
                free = n - used_in.get(domain, 0)
                if free >= entry.count and (best is None or (free, domain) < best):
                    best = (free, domain)
            if best is None:
                return _Shortfall(entry, True)
            used_in[best[1]] = used_in.get(best[1], 0) + entry.count
            plan[index] = best[1]
    return plan


def _why_not(*, shortfall: _Shortfall, stock: _Stock, ask: _Ask) -> _Reject:
    # Health comes first: if the node would fit counting its unhealthy atoms, they are the cause.
    if stock.sick:
        counts = Counter(stock.usable) + Counter(stock.sick)
        domains = Counter(stock.usable_domains) + Counter(stock.sick_domains)
        if not isinstance(_plan(ask=ask, counts=counts, domains=domains), _Shortfall):
            return _Reject("health", f"too few healthy {shortfall.entry.device_class}")
    entry = shortfall.entry
    if shortfall.topology:
        return _Reject("topology", f"no NVLink domain with {entry.count} free gpu")
    suffix = f" {entry.profile}" if entry.profile else ""
    return _Reject("capacity", f"too few free {entry.device_class}{suffix}")


def _take(*, fit: _Fit, atoms: list[Atom], ask: _Ask, busy: frozenset[str]) -> tuple[str, ...]:
    """The atom ids for a node that fits, in the demand's entry order."""
    if fit.plan is None:
        return tuple(sorted(a.id for a in atoms))
    usable = [a for a in atoms if a.healthy and a.id not in busy]
    parent_free = Counter(a.parent_gpu for a in usable)

    def key(atom: Atom) -> tuple[int, str, str, str]:
        # Whole GPUs go in device order; MIG and slots pack onto the most used parent GPU first,
        # so lightly used GPUs stay whole for bigger requests.
        fullness = 0 if atom.kind == "gpu" else parent_free[atom.parent_gpu]
        return (fullness, atom.parent_gpu, atom.device_id, atom.id)

    taken: set[str] = set()
    picked: dict[int, list[Atom]] = {}
    for index in ask.order:
        entry, domain = ask.devices[index], fit.plan[index]
        pool = [
            a
            for a in usable
            if a.id not in taken
            and _matches(a, entry)
            and (domain is None or a.nvlink_domain == domain)
        ]
        picked[index] = _pick(pool=pool, entry=entry, key=key)
        taken.update(a.id for a in picked[index])
    return tuple(a.id for index in range(len(ask.devices)) for a in picked[index])


def _matches(atom: Atom, entry: DeviceDemand) -> bool:
    return atom.kind == entry.device_class and (
        entry.device_class != "mig" or atom.profile == entry.profile
    )


def _pick(
    *, pool: list[Atom], entry: DeviceDemand, key: Callable[[Atom], tuple[int, str, str, str]]
) -> list[Atom]:
    """``entry.count`` atoms of ``pool``, which the plan guarantees holds at least that many."""
    if entry.device_class != "gpu" or entry.topology == "nvlink-all":
        return sorted(pool, key=key)[: entry.count]  # nvlink-all: the pool is the planned domain
    by_domain: dict[str | None, list[Atom]] = defaultdict(list)
    for atom in pool:
        by_domain[atom.nvlink_domain].append(atom)
    # "any" still prefers one NVLink domain: the one with the fewest free GPUs that holds it all.
    fitting = sorted(
        (len(atoms), domain)
        for domain, atoms in by_domain.items()
        if domain is not None and len(atoms) >= entry.count
    )
    if fitting:
        return sorted(by_domain[fitting[0][1]], key=key)[: entry.count]
    # Otherwise spill: GPUs without NVLink first, then the smallest domains, so the big domains
    # stay whole for later nvlink-all requests.
    order = sorted(by_domain, key=lambda d: (d is not None, len(by_domain[d]), d or ""))
    spilled = [a for domain in order for a in sorted(by_domain[domain], key=key)]
    return spilled[: entry.count]


def _no_fit(*, node_count: int, fit_count: int, rejects: Counter[_Reject], demand: Demand) -> NoFit:
    rejected: dict[str, int] = {}
    for reject, count in rejects.items():
        rejected[reject.filter] = rejected.get(reject.filter, 0) + count
    if fit_count:
        # Some nodes fit on their own; the gang is what's short.
        rejected["gang"] = demand.gang_size - fit_count
        message = f"{fit_count} of {node_count} nodes fit, the gang needs {demand.gang_size}"
        return NoFit(message=message, rejected=_in_filter_order(rejected))
    parts = sorted(rejects.items(), key=lambda kv: (_FILTERS.index(kv[0].filter), kv[0].reason))
    reasons = ", ".join(f"{count} {reject.reason}" for reject, count in parts)
    return NoFit(
        message=f"0 of {node_count} nodes fit: {reasons}", rejected=_in_filter_order(rejected)
    )


def _in_filter_order(rejected: Mapping[str, int]) -> dict[str, int]:
    return {name: rejected[name] for name in _FILTERS if name in rejected}
