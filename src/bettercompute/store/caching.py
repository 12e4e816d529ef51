"""A per-database cache of each pool's nodes and atoms, keyed by its ``inventory_version``.

Why: the static part of a placement snapshot (which nodes and devices a pool has) changes
rarely, but reading and decoding it is most of a placement's cost. Every node or atom change
bumps the pool's version in the same transaction, so a cached inventory is used only while it
is exactly current. Each inventory carries its ``placement.PoolIndex``, built once with it,
so a placement in a pool of a thousand nodes visits the few nodes its window touches rather
than every node. Never shared between databases; no module-level state.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from bettercompute.core import placement


@dataclass(frozen=True)
class Inventory:
    version: int
    nodes: tuple[placement.Node, ...]
    atoms: tuple[placement.Atom, ...]
    index: placement.PoolIndex = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "index", placement.PoolIndex(self.nodes, self.atoms))


class InventoryCache:
    """Nodes and atoms per pool, as of an ``inventory_version``. One per ``Database``."""

    def __init__(self) -> None:
        self._by_pool: dict[str, Inventory] = {}

    def get(self, pool_id: str, version: int) -> Inventory | None:
        found = self._by_pool.get(pool_id)
        return found if found is not None and found.version == version else None

    def put(self, pool_id: str, inventory: Inventory) -> None:
        current = self._by_pool.get(pool_id)
        if current is None or current.version <= inventory.version:
            self._by_pool[pool_id] = inventory
