"""Compacting release: when the free bytes of a hard budget are split into holes no request fits,
move what cannot be released instead of giving up.

The arena's main region is cut into *segments* by blocks that must not move now: inputs of the
kernels running now (``rt.running``: a kernel may hold their addresses), buffers handed to a
collective (``Record.pins``: its communication thread may still hold their addresses), and blocks
the runtime does not own (buffers a kernel is still filling), and values a copy out ahead reads
(swap.py). Locked values that no kernel reads yet
(inputs held for a pending recompute) may move: a lock only forbids releasing them. Everything else
in a segment can move (parameters, gradients, optimizer state) or be released (recomputable values).
A request fits in a segment once its free bytes plus the bytes released there cover it: the plan
picks the segment where the cheapest such release (lowest policy score first) costs least, releases
that, and slides the segment's remaining blocks up, which leaves its free bytes as one block at the
bottom.

Cost: one memmove of the segment's surviving blocks. It replaces evictions that a contiguous window
would have forced (a window cannot span a parameter), and DTR-style runtimes that grow past the
budget instead (a caching allocator's fragmentation) are not an option under a hard cap.
"""
from typing import Callable, Dict, List, Optional

from .. import _C
from .. import compaction_plan as _plan
from .. import snapshot as _snap
from .records import Record


def _relocate(rt, movable: Dict[int, tuple], old: int, new: int) -> None:
    r, sref, _ = movable[old]
    sref.relocate(new)
    if _snap.recording():
        size = -(-r.nbytes // _C.ALIGNMENT) * _C.ALIGNMENT  # the block's size, as the arena logs it
        rt.arena.history_note("free_completed", old, size, f"pymem compact {r.op} (moved out)")
        rt.arena.history_note("alloc", new, size, f"pymem compact {r.op} (moved in)")


def _busy_addresses(rt) -> set:
    """Buffer addresses the running kernels read."""
    busy = set()
    for entry in rt.running:
        for x in entry:
            if x is None:
                continue
            if isinstance(x, Record):
                c = rt.cache.get(x)
                s = c[0] if c is not None else x.sref
                if s is not None:
                    busy.add(s.data_ptr)
            else:  # a leaf alias tensor
                busy.add(x.untyped_storage().data_ptr())
    return busy


def _unmovable(rt) -> list:
    """Addresses that may not move now: the running kernels' inputs and what copies out ahead read."""
    busy = _busy_addresses(rt)
    if rt.swap is not None:  # a copy out ahead reads these
        busy.update(src.untyped_storage().data_ptr() for _, src, _ in rt.swap.out_flight.values())
    return list(busy)


class MovableAddresses:
    """The addresses of the blocks that may move now (csrc/movable.h), found on first use, and their
    records and StorageRefs, looked up only to move them: a question the pressure handler asks at most
    new requests, and that usually ends in releasing instead. One picture of the arena: taken and
    used under the runtime's lock, with nothing allocated or freed between."""

    __slots__ = ("rt", "_addrs", "_unmovable")

    def __init__(self, rt) -> None:
        self.rt, self._addrs, self._unmovable = rt, None, _unmovable(rt)  # the few running inputs: cheap

    @property
    def addresses(self) -> List[int]:
        if self._addrs is None:  # the walk over the table: only where moves are priced
            rt = self.rt
            self._addrs = _C.movable_addresses(rt.table, rt.cache, rt.lo, rt.main_hi, self._unmovable)
        return self._addrs

    def blocks(self) -> Dict[int, tuple]:
        """movable_blocks for the same picture (releasable left False for leaves: nothing is released)."""
        rt = self.rt
        return _C.movable_blocks(rt.table, rt.cache, rt.lo, rt.main_hi, self._unmovable, None)


def movable_blocks(rt) -> Dict[int, tuple]:
    """addr -> (record, StorageRef, releasable) for every block of the main region that may move now
    (csrc/movable.h: the table's values in memory and not pinned, then the recompute cache's)."""
    return _C.movable_blocks(rt.table, rt.cache, rt.lo, rt.main_hi, _unmovable(rt), rt.residency.leaf_rule())


def plan(rt, request: int, movable: Dict[int, tuple]):
    """The arena's general compaction plan (Arena.plan_compaction, compaction_plan.plan in C++) now:
    waited-on inputs of a pending recompute are released last, the one needed soonest last of all.
    Scores come from the release scan in one call where the policy has one (the same values its
    evaluate gives). Returns (the segment's movable addresses, moves, window, bytes moved, records
    to release) or None."""
    now, evaluate, cost = rt.clock, rt.policy.evaluate, rt.policy.block_cost
    handler = rt.pressure
    scanned = handler.scan is not None

    def scores_of(records):
        return handler.scores(records) if scanned else [evaluate(r, now) for r in records]
    if scanned and handler.cost_from_score:
        cost_of = lambda r, s: max(s, 0.0) * max(r.nbytes, 1)  # noqa: E731
    else:
        cost_of = lambda r, s: cost(r, now)  # noqa: E731
    return _plan.plan_in(rt.arena, request, movable, scores_of, cost_of)


def _slide(rt, movable: Dict[int, tuple], addrs: List[int]) -> bool:
    """arena.compact(addrs) and repoint the moved storages. True when something moved."""
    slid = rt.arena.compact(addrs)
    for old, new in slid:
        _relocate(rt, movable, old, new)
    return bool(slid)


def compact_for(rt, request: int, worth: Optional[Callable[[int, int], bool]] = None,
                picture: Optional[MovableAddresses] = None) -> bool:
    """Release and move so that ``request`` fits in one block; False when no segment can hold it.
    ``worth``: only by moves (the arena's plan_moves, csrc/move_plan.h, over ``picture``'s
    addresses), and only if ``worth(bytes to move, block moves at most)`` says so (else nothing is
    done). The block moves: the plan's moves and the blocks of its window, each of which may slide."""
    if not rt.can_compact:
        return False
    if worth is not None:
        picture = picture if picture is not None else MovableAddresses(rt)
        chosen = rt.arena.plan_moves(request, picture.addresses)
        if chosen is None or not worth(chosen[3], _plan.block_moves(chosen)):
            return False
        movable = picture.blocks()
        seg_movable, moves, window, _ = chosen
        victims = []
    else:
        movable = movable_blocks(rt)
        chosen = plan(rt, request, movable)
        if chosen is None:
            return False
        seg_movable, moves, window, _, victims = chosen
    rt.backend.before_moves()
    keep = []  # nothing moved may die mid-move
    for a in seg_movable:
        entry = movable.get(a)
        # Died since the picture (a collection freed it, perhaps while the blocks above were listed,
        # and the walk skipped it): its block is free, which the arena counts as progress; plan again.
        if entry is None or not entry[1].alive:
            return True
        keep.append(entry[1].strong())
    # The plan is a picture of the arena taken under the runtime's lock, but another thread's kernel
    # allocates under the arena's lock alone: it may take a planned destination meanwhile. The arena
    # then refuses the move (ValueError, nothing changed) and the plan is stale: stop there. Every
    # finished move stands; the arena asks the handler again.
    for i, (old, new) in enumerate(moves):
        try:
            rt.arena.move_block(old, new)
        except ValueError:
            return i > 0
        _relocate(rt, movable, old, new)
    for r in victims:
        rt.residency.release(r)
    try:
        slid = _slide(rt, movable, window)
    except ValueError:  # stale in the same way
        slid = False
    del keep
    return bool(moves or victims or slid)


def defragment_after_failure(rt) -> bool:
    """The innermost running kernel (``rt.running[-1]``) ran out of budget and exited, leaving no
    trace: with its inputs movable too, slide every block that may move up against the next one that
    may not. True when something moved (then running it again may fit)."""
    if not rt.can_compact:
        return False
    entry = rt.running.pop() if rt.running else None
    try:
        movable = movable_blocks(rt)
        keep, addrs = [], []
        for a, m in movable.items():
            if m[1].alive:  # else collected since the listing (as in compact_for): its block is free
                keep.append(m[1].strong())
                addrs.append(a)
        rt.backend.before_moves()
        moved = _slide(rt, movable, sorted(addrs))
        del keep
        return moved
    finally:
        if entry is not None:
            rt.running.append(entry)
