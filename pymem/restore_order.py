"""Bringing evicted values back: replay their missing ancestry forward, in creation order (no
recursion down a chain: chains are deep). The runtime (runtime/remat.py) and the simulator
(sim/replay.py) both restore with this; each says what a value is through a ``Values`` adapter.

Replaying forward keeps only values with a pending reader alive: for a chain (a recurrence,
backward through many layers) that is a few values, where a depth-first walk from the target holds
each level's inputs until the level below is back. Nothing is locked beyond the op that runs: a
value a later step reads ``waits`` (released only when nothing else is left), ranked by how soon it
is read (``need_rank``, Belady: the one read last goes first). A value released anyway is restored
by a nested replay when its reader's turn comes, with the reader's other inputs locked.

A value here has the integer fields ``locks``, ``waits`` and ``need_rank`` (records and the
simulator's values both do).
"""
from typing import Callable, Dict, List, Sequence

NESTING_LIMIT = 200  # nested restores (each one: a value released while a restore still needed it)


class Values:
    """What the replay asks of the values it restores."""

    def available(self, v) -> bool:            # in memory now
        raise NotImplementedError

    def copied(self, v) -> bool:               # comes back by a copy (its ancestors are not needed)
        raise NotImplementedError

    def inputs(self, v) -> Sequence:           # the values its recompute reads
        raise NotImplementedError

    def key(self, v) -> int:                   # unique, increasing with creation
        raise NotImplementedError

    def unrecoverable(self, v) -> Exception:   # v is needed but has no way back
        raise NotImplementedError

    def bring_back(self, v) -> None:           # recompute or copy v (its inputs are in memory)
        raise NotImplementedError

    def thrashing(self, target, nesting: int) -> Exception:  # too many nested restores
        raise NotImplementedError


def plan(values: Values, targets: List) -> List:
    """Every unavailable value the targets need, in creation order (a topological order: a recipe
    only reads values that existed before its output)."""
    need: Dict[int, object] = {}
    stack = list(targets)
    while stack:
        r = stack.pop()
        k = values.key(r)
        if k in need or values.available(r):
            continue
        if values.copied(r):
            need[k] = r
            continue
        inputs = values.inputs(r)
        if inputs is None:
            raise values.unrecoverable(r)
        need[k] = r
        stack.extend(inputs)
    return [need[k] for k in sorted(need)]


def replay(values: Values, targets: List, tick: Callable[[], None], rank_base: int = 1, nesting: int = 0) -> None:
    """Make every target available, recomputing (or copying back) what is missing; ``tick()`` is
    called before each bring-back (it raises when a restore thrashes)."""
    if nesting > NESTING_LIMIT:
        raise values.thrashing(targets[0], nesting)
    order = plan(values, targets)
    n = len(order)
    inputs_of = [() if values.copied(r) else values.inputs(r) for r in order]
    reads: Dict[int, list] = {}  # value key -> [value, positions of the plan's steps that read it, index of the next]
    for i, inputs in enumerate(inputs_of):
        for a in inputs:
            e = reads.get(values.key(a))
            if e is None:
                reads[values.key(a)] = [a, [i], 0]
            elif e[1][-1] != i:
                e[1].append(i)
    for r in targets:  # read by the caller, after the last step
        if values.key(r) not in reads:
            reads[values.key(r)] = [r, [n], 0]
    for a, pos, _ in reads.values():
        a.waits += 1
        _rank(a, rank_base + n - pos[0])
    try:
        for i, r in enumerate(order):
            inputs = inputs_of[i]
            if not values.available(r):
                while True:
                    missing = [a for a in inputs if not values.available(a)]
                    if not missing:
                        break
                    held = [a for a in inputs if values.available(a)]
                    for a in held:
                        a.locks += 1
                    try:
                        replay(values, missing, tick, rank_base + n + 1, nesting + 1)
                    finally:
                        for a in held:
                            a.locks -= 1
                tick()
                values.bring_back(r)
            for a in inputs:  # this step's read is done
                e = reads.get(values.key(a))
                if e is None or e[1][e[2]] != i:
                    continue
                e[2] += 1
                if e[2] == len(e[1]):
                    del reads[values.key(a)]
                    _unwait(a)
                else:
                    _rank(a, rank_base + n - e[1][e[2]])
        lost = [r for r in targets if not values.available(r)]
        if lost:  # released by the last steps' pressure before the caller could lock them
            replay(values, lost, tick, rank_base + n + 1, nesting + 1)
    finally:
        for a, _, _ in reads.values():
            _unwait(a)


def _rank(a, rank: int) -> None:
    """How soon a pending restore reads ``a`` (higher: sooner); the only waiter sets it."""
    a.need_rank = rank if a.waits == 1 or rank > a.need_rank else a.need_rank


def _unwait(a) -> None:
    a.waits -= 1
    if not a.waits:
        a.need_rank = 0
