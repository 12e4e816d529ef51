"""``placement.PoolIndex``: a placement that visits only the nodes its window touches decides
exactly as the placement that screened every node did.

The reference below is the placer before the index (every node stocked from every atom, every
node screened, all fits sorted), kept here and only here: over random pools, busy sets, host use
and demands (gangs, MIG, slots, nvlink-all, host resources, whole nodes, labels) both must give
the same ``Placed`` or the same ``NoFit`` (and ``place`` the same "never fits"), with the index
passed in, built afresh, or stale.
Then a count of the work: a placement in a pool of 1,000 nodes screens about as many nodes as
one in a pool of 32.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import replace
from operator import attrgetter

import pytest

from bettercompute.core import placement
from bettercompute.core.placement import (
    NEVER,
    Atom,
    AtomKind,
    Demand,
    DeviceDemand,
    Node,
    NoFit,
    Outcome,
    Placed,
    PoolIndex,
    Snapshot,
)

# --------------------------------------------------------------------------- the reference

_ATOM_KEY = attrgetter("node_id", "kind", "profile", "nvlink_domain", "healthy")


def _reference_stock_up(*, snapshot: Snapshot, sizes: bool) -> dict[str, placement._Stock]:
    stocks = {node.id: placement._Stock() for node in snapshot.nodes}
    if sizes:
        for node_id, size in Counter(map(attrgetter("node_id"), snapshot.atoms)).items():
            if node_id in stocks:
                stocks[node_id].size = size
    busy = snapshot.busy
    free = [a for a in snapshot.atoms if a.id not in busy]
    for (node_id, kind, profile, domain, healthy), n in Counter(map(_ATOM_KEY, free)).items():
        stock = stocks.get(node_id)
        if stock is None:
            continue
        stock.free += n
        counts, domains = (
            (stock.usable, stock.usable_domains) if healthy else (stock.sick, stock.sick_domains)
        )
        pool = (kind, profile if kind == "mig" else None)
        counts[pool] = counts.get(pool, 0) + n
        if kind == "gpu" and domain is not None:
            domains[domain] = domains.get(domain, 0) + n
    return stocks


def reference_place(*, snapshot: Snapshot, demand: Demand) -> Outcome:
    """``placement.try_place`` as it was before ``PoolIndex``: every node, every atom."""
    placement._validate(demand)
    ask = placement._prepare(demand)
    stocks = _reference_stock_up(snapshot=snapshot, sizes=demand.whole_node)
    if not stocks:
        return NoFit(message="the pool has no nodes", rejected={})
    fits: list[placement._Fit] = []
    rejects: Counter[placement._Reject] = Counter()
    for node in snapshot.nodes:
        stock = stocks.pop(node.id, None)
        if stock is None:
            continue
        verdict = placement._screen(
            node=node,
            stock=stock,
            ask=ask,
            whole_node=demand.whole_node,
            host_busy=snapshot.host_busy.get(node.id),
        )
        if isinstance(verdict, placement._Fit):
            fits.append(verdict)
        else:
            rejects[verdict] += 1
    if len(fits) < demand.gang_size:
        node_count = len(fits) + rejects.total()
        return placement._no_fit(
            node_count=node_count, fit_count=len(fits), rejects=rejects, demand=demand
        )
    fits.sort(key=lambda f: (f.leftover, f.node.name, f.node.id))
    chosen = fits[: demand.gang_size]
    node_ids = {f.node.id for f in chosen}
    atoms_of: dict[str, list[Atom]] = {node_id: [] for node_id in node_ids}
    for atom in [a for a in snapshot.atoms if a.node_id in node_ids]:
        atoms_of[atom.node_id].append(atom)
    return Placed(
        members=tuple(
            placement.Member(
                node_id=fit.node.id,
                atom_ids=placement._take(
                    fit=fit, atoms=atoms_of[fit.node.id], ask=ask, busy=snapshot.busy
                ),
            )
            for fit in chosen
        )
    )


def reference_full_place(*, snapshot: Snapshot, demand: Demand) -> Outcome:
    """``placement.place`` as it was: a refusal tells "never" by placing on the pool at rest."""
    outcome = reference_place(snapshot=snapshot, demand=demand)
    if isinstance(outcome, Placed):
        return outcome
    rest = Snapshot(
        nodes=tuple(replace(n, ready=True, connected=True) for n in snapshot.nodes),
        atoms=tuple(a if a.healthy else replace(a, healthy=True) for a in snapshot.atoms),
        busy=frozenset(),
    )
    idle = reference_place(snapshot=rest, demand=demand)
    if isinstance(idle, Placed):
        return outcome
    why = idle.message if not snapshot.nodes else f"even with every device free, {idle.message}"
    return NoFit(message=f"{NEVER}: {why}", rejected=outcome.rejected, never=True)


# --------------------------------------------------------------------------- random pools

PROFILES = ("1g.10gb", "3g.40gb")
LABELS = ({}, {"zone": "x"}, {"zone": "y"}, {"zone": "x", "k8s": "1"})
HOSTS = ({}, {"vcpu": 30, "memoryGiB": 256}, {"vcpu": 60, "memoryGiB": 512, "hugepages1Gi": 4})


def random_pool(rng: random.Random) -> tuple[tuple[Node, ...], tuple[Atom, ...]]:
    """Nodes of a few shapes (so groups hold many nodes), with stray variations: not ready,
    labels, host rows, unhealthy atoms, a repeated node id, atoms of a node outside the pool."""
    shapes = [
        (
            [rng.randint(1, 4) for _ in range(rng.randint(0, 2))],  # NVLink domain sizes
            rng.randint(0, 2),  # GPUs without NVLink
            [rng.choice(PROFILES) for _ in range(rng.randint(0, 3))],  # MIG instances
            rng.randint(0, 3),  # slots
        )
        for _ in range(rng.randint(1, 3))
    ]
    nodes: list[Node] = []
    atoms: list[Atom] = []
    for n in range(rng.randint(0, 14)):
        name = f"n{rng.randint(0, 20):02d}"  # names may repeat: then the id breaks the tie
        node_id = f"id{n}"
        nodes.append(
            Node(
                id=node_id,
                name=name,
                ready=rng.random() > 0.1,
                connected=rng.random() > 0.05,
                labels=rng.choice(LABELS),
                host=rng.choice(HOSTS),
            )
        )
        domains, plain, migs, slots = rng.choice(shapes)
        sick = rng.random() < 0.15
        # (kind, suffix, domain, profile, parent GPU or None for the atom's own device)
        specs: list[tuple[AtomKind, str, str | None, str | None, str | None]] = []
        for d, size in enumerate(domains):
            specs += [("gpu", f"g{d}.{k}", f"{name}-d{d}", None, None) for k in range(size)]
        specs += [("gpu", f"g{k}", None, None, None) for k in range(plain)]
        specs += [("mig", f"m{k}", None, p, f"{node_id}.M{k // 2}") for k, p in enumerate(migs)]
        specs += [("slot", f"s{k}", None, None, f"{node_id}.S0") for k in range(slots)]
        for kind, suffix, domain, profile, parent in specs:
            atom_id = f"{node_id}.{suffix}"
            atoms.append(
                Atom(
                    id=atom_id,
                    node_id=node_id,
                    kind=kind,
                    device_id=f"dev-{atom_id}",
                    parent_gpu=parent or f"dev-{atom_id}",
                    profile=profile,
                    numa_node=None,
                    nvlink_domain=domain,  # named per node, as the inventory names them
                    healthy=not (sick and rng.random() < 0.4),
                )
            )
    if nodes and rng.random() < 0.2:
        nodes.append(
            Node(id=nodes[0].id, name="zz-repeated", ready=True, connected=True, labels={})
        )
    if rng.random() < 0.2:
        atoms.append(
            Atom("stray", "elsewhere", "gpu", "dev-stray", "dev-stray", None, None, None, True)
        )
    rng.shuffle(nodes)
    rng.shuffle(atoms)
    return tuple(nodes), tuple(atoms)


def random_busy(
    rng: random.Random, nodes: tuple[Node, ...], atoms: tuple[Atom, ...]
) -> tuple[frozenset[str], dict[str, dict[str, int]]]:
    """Some nodes booked full, some in part, some untouched; host use on some nodes; ids of
    atoms that are not in the pool."""
    busy: set[str] = set()
    for node in nodes:
        mine = [a.id for a in atoms if a.node_id == node.id]
        roll = rng.random()
        if roll < 0.3:
            busy.update(mine)
        elif roll < 0.6:
            busy.update(a for a in mine if rng.random() < 0.5)
    if rng.random() < 0.3:
        busy.add("gone-atom")
    host_busy = {
        node.id: {
            "vcpu": rng.choice((0, 15, 45)),
            "memoryGiB": rng.choice((0, 128, 400)),
            "hugepages1Gi": rng.choice((0, 2)),
        }
        for node in nodes
        if rng.random() < 0.3
    }
    return frozenset(busy), host_busy


def random_demand(rng: random.Random) -> Demand:
    host = rng.choice(({}, {}, {"vcpu": 15, "memoryGiB": 128}, {"hugepages1Gi": 2}))
    labels = rng.choice(({}, {}, {"zone": "x"}, {"zone": "*"}))
    gang = rng.choice((1, 1, 1, 2, 3))
    if rng.random() < 0.12:
        return Demand(
            devices=(), gang_size=gang, whole_node=True, required_labels=labels, host=host
        )
    entries: list[DeviceDemand] = []
    for _ in range(rng.choice((1, 1, 2, 3))):
        kind = rng.choice(("gpu", "gpu", "mig", "slot"))
        if kind == "gpu":
            topology = "nvlink-all" if rng.random() < 0.35 else "any"
            entries.append(DeviceDemand("gpu", rng.randint(1, 4), topology))  # type: ignore[arg-type]
        elif kind == "mig":
            entries.append(DeviceDemand("mig", rng.randint(1, 2), profile=rng.choice(PROFILES)))
        else:
            entries.append(DeviceDemand("slot", rng.randint(1, 2)))
    return Demand(devices=entries, gang_size=gang, required_labels=labels, host=host)


@pytest.mark.parametrize("chunk", range(4))
def test_the_index_decides_as_every_node_screened(chunk: int) -> None:
    checked = Counter[str]()
    for seed in range(chunk * 1000, (chunk + 1) * 1000):
        rng = random.Random(seed)
        nodes, atoms = random_pool(rng)
        index = PoolIndex(nodes, atoms)
        for _ in range(3):
            busy, host_busy = random_busy(rng, nodes, atoms)
            demand = random_demand(rng)
            plain = Snapshot(nodes=nodes, atoms=atoms, busy=busy, host_busy=host_busy)
            expected = reference_place(snapshot=plain, demand=demand)
            indexed = Snapshot(
                nodes=nodes, atoms=atoms, busy=busy, host_busy=host_busy, index=index
            )
            for snapshot in (plain, indexed):
                got = placement.try_place(snapshot=snapshot, demand=demand)
                assert got == expected, f"seed {seed}: {demand}"
            told = reference_full_place(snapshot=plain, demand=demand)
            assert placement.place(snapshot=indexed, demand=demand) == told, f"seed {seed}"
            if isinstance(told, NoFit) and told.never:
                checked["never"] += 1
            checked["placed" if isinstance(expected, Placed) else "no fit"] += 1
            if isinstance(expected, Placed) and len(expected.members) > 1:
                checked["gang placed"] += 1
    # The random pools cover both outcomes, gangs included, well enough to mean something.
    assert checked["placed"] > 300
    assert checked["no fit"] > 300
    assert checked["gang placed"] > 50
    assert checked["never"] > 100


def test_an_index_of_other_nodes_is_not_used() -> None:
    rng = random.Random(7)
    nodes, atoms = random_pool(rng)
    while not nodes:
        nodes, atoms = random_pool(rng)
    stale = PoolIndex(nodes[:1], atoms)  # built from another inventory
    demand = Demand(devices=[DeviceDemand("slot", 1)])
    snapshot = Snapshot(nodes=nodes, atoms=atoms, busy=frozenset(), index=stale)
    assert placement.try_place(snapshot=snapshot, demand=demand) == reference_place(
        snapshot=snapshot, demand=demand
    )


# --------------------------------------------------------------------------- the work


def bench_pool(size: int) -> tuple[tuple[Node, ...], tuple[Atom, ...]]:
    """``size`` nodes of 8 GPUs in two NVLink domains, as ``bench/admission.py`` builds them."""
    nodes = tuple(
        Node(id=f"id{n:04d}", name=f"n{n:04d}", ready=True, connected=True, labels={})
        for n in range(size)
    )
    atoms = tuple(
        Atom(
            f"id{n:04d}.g{g}",
            f"id{n:04d}",
            "gpu",
            f"G{n}-{g}",
            f"G{n}-{g}",
            None,
            g // 4,
            f"n{n:04d}-d{g // 4}",
            True,
        )
        for n in range(size)
        for g in range(8)
    )
    return nodes, atoms


def screened(size: int, monkeypatch: pytest.MonkeyPatch) -> int:
    """Nodes screened by one placement of 1 GPU in a window booked half full (best fit packs
    nodes in name order, so half the nodes are full, one is partly booked, the rest free)."""
    nodes, atoms = bench_pool(size)
    index = PoolIndex(nodes, atoms)
    busy = frozenset(a.id for a in atoms[: len(atoms) // 2 + 3])
    snapshot = Snapshot(nodes=nodes, atoms=atoms, busy=busy, index=index)
    calls = 0
    real = placement._screen

    def counting(**kw: object) -> object:
        nonlocal calls
        calls += 1
        return real(**kw)  # type: ignore[arg-type]

    monkeypatch.setattr(placement, "_screen", counting)
    outcome = placement.place(snapshot=snapshot, demand=Demand([DeviceDemand("gpu", 1)]))
    assert isinstance(outcome, Placed)
    assert outcome.members[0].node_id == f"id{size // 2:04d}"  # the partly booked node
    return calls


def test_a_placement_screens_as_many_nodes_in_1000_as_in_32(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    small, big = screened(32, monkeypatch), screened(1000, monkeypatch)
    assert big == small <= 4, (small, big)
