"""The evicted neighbourhood e*(t) of DTR, approximated with union-find (h_DTR^eq).

Evicted tensors that are neighbours in the op graph (one produced the other, or one is an input of
the other's recompute) form classes; each class keeps its members' total compute cost. Releasing a
resident tensor t would make a future recompute redo every class t touches, so
e*(t) ~= sum of the costs of the distinct classes among t's evicted neighbours.

Rematerializing a member does not split its class (splitting is what union-find cannot do
cheaply); its cost is subtracted instead — the DTR paper's approximation. A tensor evicted again
later starts a fresh node, so stale nodes only ever link classes, never add cost.

It lives in C++ (csrc/neighbourhood.h), because the runtime's release scan reads it for every
candidate; the runtime (keys: record ids) and the simulator (keys: value indices) share it. Keys are
ints. ``on_evict(key, cost, neighbours)``, ``on_rematerialize(key)`` (KeyError if not evicted),
``neighbour_cost(keys)``, ``is_evicted(key)``, ``len()``: nodes allocated (evicted keys plus the
stale nodes of rematerialized ones).

Read lazily: ``pymem.policies`` imports no torch (``pymem._C`` does), so a program may import it,
to register a policy, before torch and before ``PYMEM_BUDGET`` enables pymem.
"""

__all__ = ["EvictedNeighbourhood"]


def __getattr__(name: str):
    if name == "EvictedNeighbourhood":
        from .._C import EvictedNeighbourhood

        return EvictedNeighbourhood
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
