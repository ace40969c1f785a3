"""Compacting release: when the free bytes of a hard budget are split into holes no request fits,
move what cannot be released instead of giving up.

The arena's main region is cut into *segments* by blocks that must not move now: inputs of the
kernels running now (``rt.running``: a kernel may hold their addresses), buffers handed to a
collective (``Record.pins``: its communication thread may still hold their addresses), and blocks
the runtime does not own (buffers a kernel is still filling). Locked values that no kernel reads yet
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
import math
from typing import Dict, List, Optional, Tuple

from .. import _C
from .. import snapshot as _snap
from .records import Record


def _relocate(rt, movable: Dict[int, tuple], old: int, new: int) -> None:
    r, sref, _ = movable[old]
    sref.relocate(new)
    if _snap.recording():
        size = -(-r.nbytes // _C.ALIGNMENT) * _C.ALIGNMENT  # the block's size, as the arena logs it
        rt.arena.history_note("free_completed", old, size, f"pymem compact {r.op} (moved out)")
        rt.arena.history_note("alloc", new, size, f"pymem compact {r.op} (moved in)")


class _Segment:
    __slots__ = ("free", "holes", "movable", "releasable", "blocks")

    def __init__(self) -> None:
        self.blocks: List[Tuple[int, int, bool]] = []  # (addr, size, allocated), address order
        self.free = 0
        self.holes: List[Tuple[int, int]] = []       # free blocks (addr, size)
        self.movable: List[Tuple[int, int]] = []     # blocks that may move (addr, size), address order
        self.releasable: List[Tuple] = []            # (score, record, addr, size)


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


def movable_blocks(rt) -> Dict[int, tuple]:
    """addr -> (record, StorageRef, releasable) for every block of the main region that may move now."""
    lo, hi = rt.lo, rt.main_hi
    busy = _busy_addresses(rt)
    leaf_ok = rt.residency.leaf_releasable
    out = {}
    for r in rt.table.values():
        s = r.sref
        if s is None or r.evicted or r.pins:  # pinned: someone outside torch holds its address
            continue
        addr = s.data_ptr
        if lo <= addr < hi and addr not in busy:
            out[addr] = (r, s, r.in_arena and not r.locks and (r.recipe is not None or leaf_ok(r)))
    for r, (s, _) in rt.cache.items():
        addr = s.data_ptr
        if lo <= addr < hi and addr not in busy:
            out[addr] = (r, s, r.recipe is not None and not r.locks)
    return out


def _segments(rt, movable: Dict[int, tuple]) -> List[_Segment]:
    now, evaluate = rt.clock, rt.policy.evaluate
    segments = [_Segment()]
    for b in rt.arena.blocks():
        if b.region != "main":
            break
        seg = segments[-1]
        if not b.allocated:
            seg.blocks.append((b.addr, b.size, False))
            seg.free += b.size
            seg.holes.append((b.addr, b.size))
            continue
        m = movable.get(b.addr)
        if m is None:  # cannot move: ends the segment
            segments.append(_Segment())
            continue
        seg.blocks.append((b.addr, b.size, True))
        seg.movable.append((b.addr, b.size))
        if m[2]:  # waited-on inputs of a pending recompute go last
            r = m[0]
            seg.releasable.append(((r.waits > 0, r.need_rank, evaluate(r, now)), r, b.addr, b.size))
    return segments


def _evacuate(target: _Segment, segments: List[_Segment], deficit: int) -> Tuple[list, int]:
    """Moves of target's blocks into free blocks of other segments (largest block first, best fit)
    until `deficit` bytes are covered or nothing more fits. Returns the moves and what is left."""
    holes = [[a, n] for seg in segments if seg is not target for a, n in seg.holes]
    if not holes:
        return [], deficit
    moves = []
    for addr, size in sorted(target.movable, key=lambda x: -x[1]):
        if deficit <= 0:
            break
        fit = None
        for h in holes:
            if h[1] >= size and (fit is None or h[1] < fit[1]):
                fit = h
        if fit is None:
            continue
        moves.append((addr, fit[0]))
        fit[0] += size
        fit[1] -= size
        deficit -= size
    return moves, deficit


def plan(rt, request: int, movable: Dict[int, tuple]):
    """(segment, moves out of it, records to release in it) so that ``request`` fits after the
    segment is compacted, at least release cost (then fewest bytes moved); None when none can."""
    now, cost_of = rt.clock, rt.policy.block_cost
    segments = _segments(rt, movable)
    best, best_key = None, (math.inf, math.inf)
    for seg in segments:
        moves, deficit = _evacuate(seg, segments, request - seg.free)
        victims, cost = [], 0.0
        if deficit > 0:
            moved = {a for a, _ in moves}
            pool = sorted((x for x in seg.releasable if x[2] not in moved), key=lambda x: x[0])
            if sum(x[3] for x in pool) < deficit:
                continue
            for _, r, _, size in pool:
                victims.append(r)
                cost += cost_of(r, now)
                deficit -= size
                if deficit <= 0:
                    break
        moved_bytes = sum(n for _, n in seg.movable)
        if cost < best_key[0] or (cost == best_key[0] and moved_bytes < best_key[1]):
            best, best_key = (seg, moves, victims), (cost, moved_bytes)
    return best


def _slide(rt, movable: Dict[int, tuple], addrs: List[int]) -> bool:
    """arena.compact(addrs) and repoint the moved storages. True when something moved."""
    slid = rt.arena.compact(addrs)
    for old, new in slid:
        _relocate(rt, movable, old, new)
    return bool(slid)


def compact_for(rt, request: int) -> bool:
    """Release and move so that ``request`` fits in one block; False when no segment can hold it."""
    if not rt.can_compact:
        return False
    movable = movable_blocks(rt)
    chosen = plan(rt, request, movable)
    if chosen is None:
        return False
    seg, moves, victims = chosen
    keep = []  # nothing moved may die mid-move
    for a, _ in seg.movable:
        sref = movable[a][1]
        if not sref.alive:  # died since the picture (a collection freed it): its block is free, plan again
            return True
        keep.append(sref.strong())
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
    released = {id(r) for r in victims}
    gone = {a for a, _ in moves} | {a for _, r, a, _ in seg.releasable if id(r) in released}
    try:
        slid = _slide(rt, movable, _cheapest_window(seg, gone, request))
    except ValueError:  # stale in the same way
        slid = False
    del keep
    return bool(moves or victims or slid)


def _cheapest_window(seg: _Segment, gone: set, request: int) -> List[int]:
    """The blocks to slide so that ``request`` fits, once the blocks at the addresses in ``gone``
    (moved out, released) are free: of the runs of the segment that end with a free block and
    hold ``request`` free bytes, the one with the fewest allocated bytes to move (sliding up
    gathers a run's free bytes at its bottom). Sliding the whole segment would move everything in
    it, most of the arena when few blocks are pinned. The whole segment when no run holds enough."""
    blocks = [(a, n, used and a not in gone) for a, n, used in seg.blocks]
    best, best_cost = None, None
    i, free, used = 0, 0, 0
    for j, (_, size, allocated) in enumerate(blocks):
        if allocated:
            used += size
            continue
        free += size
        # Shrink from the left while the run still holds enough: drop leading allocated blocks
        # (they need not move) and leading free blocks that are not needed.
        while i < j:
            _, s_i, alloc_i = blocks[i]
            if alloc_i:
                used -= s_i
            elif free - s_i >= request:
                free -= s_i
            else:
                break
            i += 1
        if free >= request and (best_cost is None or used < best_cost):
            best, best_cost = (i, j), used
    lo, hi = best if best is not None else (0, len(blocks) - 1)
    return [a for a, _, allocated in blocks[lo:hi + 1] if allocated]


def defragment_after_failure(rt) -> bool:
    """The innermost running kernel (``rt.running[-1]``) ran out of budget and exited, leaving no
    trace: with its inputs movable too, slide every block that may move up against the next one that
    may not. True when something moved (then running it again may fit)."""
    if not rt.can_compact:
        return False
    entry = rt.running.pop() if rt.running else None
    try:
        movable = movable_blocks(rt)
        keep = [m[1].strong() for m in movable.values()]
        moved = _slide(rt, movable, sorted(movable))
        del keep
        return moved
    finally:
        if entry is not None:
            rt.running.append(entry)
