"""The evicted neighbourhood e*(t) of DTR, approximated with union-find (h_DTR^eq).

Evicted tensors that are neighbours in the op graph (one produced the other, or one is an input of
the other's recompute) form classes; each class keeps its members' total compute cost. Releasing a
resident tensor t would make a future recompute redo every class t touches, so
e*(t) ~= sum of the costs of the distinct classes among t's evicted neighbours.

Rematerializing a member does not split its class (splitting is what union-find cannot do
cheaply); its cost is subtracted instead — the DTR paper's approximation. A tensor evicted again
later starts a fresh node, so stale nodes only ever link classes, never add cost.
"""
from typing import Dict, Hashable, Iterable, List


class EvictedNeighbourhood:
    def __init__(self) -> None:
        self._parent: List[int] = []
        self._size: List[int] = []
        self._cost: List[float] = []        # valid at roots: the class's total cost
        self._node: Dict[Hashable, int] = {}  # evicted key -> its current node
        self._own: Dict[Hashable, float] = {}

    def _find(self, n: int) -> int:
        root = n
        while self._parent[root] != root:
            root = self._parent[root]
        while self._parent[n] != root:  # path compression
            self._parent[n], n = root, self._parent[n]
        return root

    def _union(self, a: int, b: int) -> int:
        a, b = self._find(a), self._find(b)
        if a == b:
            return a
        if self._size[a] < self._size[b]:
            a, b = b, a
        self._parent[b] = a
        self._size[a] += self._size[b]
        self._cost[a] += self._cost[b]
        return a

    def __len__(self) -> int:
        """Nodes allocated (evicted keys plus the stale nodes of rematerialized ones)."""
        return len(self._parent)

    def is_evicted(self, key: Hashable) -> bool:
        return key in self._node

    def on_evict(self, key: Hashable, cost: float, neighbours: Iterable[Hashable]) -> None:
        """`key` (compute cost `cost`) was just evicted; `neighbours` are its graph neighbours
        (evicted or not: resident ones are ignored)."""
        if key in self._node:
            raise ValueError(f"{key!r} is already evicted")
        if cost < 0:
            raise ValueError(f"compute cost must be >= 0, got {cost}")
        n = len(self._parent)
        self._parent.append(n)
        self._size.append(1)
        self._cost.append(float(cost))
        self._node[key] = n
        self._own[key] = float(cost)
        for other in neighbours:
            m = self._node.get(other)
            if m is not None:
                n = self._union(n, m)

    def on_rematerialize(self, key: Hashable) -> None:
        """`key` is resident again: its cost leaves its class; the class is not split."""
        n = self._node.pop(key)
        self._cost[self._find(n)] -= self._own.pop(key)

    def neighbour_cost(self, neighbours: Iterable[Hashable]) -> float:
        """e*: the total cost of the distinct classes among `neighbours` that are evicted."""
        roots = {self._find(self._node[k]) for k in neighbours if k in self._node}
        return sum(max(self._cost[r], 0.0) for r in roots)
