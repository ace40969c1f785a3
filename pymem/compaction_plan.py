"""Compaction planning, on a picture of the arena (its blocks in address order) and of what may
move or be released: which segment between unmovable blocks to clear, what to move out of it and
what to release in it so that a request fits once the segment slides together. Pure: the runtime
(runtime/compaction.py) and the simulator (sim/replay.py) both plan with it and carry the plan out.

The plans the runtime and the simulator carry out run in C++ over the arena itself
(csrc/move_plan.h): by moves alone (``plan`` with nothing releasable, then ``bytes_to_move``:
Arena.plan_moves, also ``bytes_to_move_after``'s question), the general plan (``plan`` with
releases: Arena.plan_compaction, asked through ``plan_in``) and the release path's walk
(Arena.release_path, priced by ``release_path_seconds_in``). The Python ``plan`` is the reference
tests/test_compaction_plan.py holds them to.
"""
import math
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple


class _Segment:
    __slots__ = ("free", "holes", "movable", "releasable", "blocks")

    def __init__(self) -> None:
        self.blocks: List[Tuple[int, int, bool]] = []  # (addr, size, allocated), address order
        self.free = 0
        self.holes: List[Tuple[int, int]] = []       # free blocks (addr, size)
        self.movable: List[Tuple[int, int]] = []     # blocks that may move (addr, size), address order
        self.releasable: List[Tuple] = []            # (score, record, addr, size)


def _segments(blocks, movable: Dict[int, tuple], release_key: Callable) -> List[_Segment]:
    segments = [_Segment()]
    for b in blocks:
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
        if m[2]:
            seg.releasable.append((release_key(m[0]), m[0], b.addr, b.size))
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


def plan(blocks, request: int, movable: Dict[int, tuple], release_key: Callable, block_cost: Callable):
    """(segment, moves out of it, values to release in it) so that ``request`` fits after the
    segment is compacted, at least release cost (then fewest bytes moved); None when none can.
    ``blocks``: the arena's blocks in address order; ``movable``: addr -> (value, handle,
    releasable) for the blocks that may move; ``release_key(value)``: the order values are
    released in (lowest first); ``block_cost(value)``: what releasing it costs."""
    segments = _segments(blocks, movable, release_key)
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
                cost += block_cost(r)
                deficit -= size
                if deficit <= 0:
                    break
        if cost > best_key[0]:
            continue
        chosen = {id(r) for r in victims}
        moved_bytes = bytes_to_move(seg, moves, request, {a for _, r, a, _ in seg.releasable if id(r) in chosen})
        if cost < best_key[0] or moved_bytes < best_key[1]:
            best, best_key = (seg, moves, victims), (cost, moved_bytes)
    return best


def plan_in(arena, request: int, movable: Dict[int, tuple], scores_of: Callable[[list], list],
            cost_of: Callable[[object, float], float]):
    """Arena.plan_compaction over ``movable``'s releasable values, released in the order ``plan``
    takes them: what no restore waits for first, then by score, the lower address of equal ones
    first. ``scores_of(values)``: their scores, as a list; ``cost_of(value, score)``: releasing one.
    The runtime's and the simulator's plan: None, or (the segment's movable addresses, moves, the
    window to slide after them and the releases, bytes moved, the values to release)."""
    addrs = [a for a, m in movable.items() if m[2]]
    values = [movable[a][0] for a in addrs]
    scores = scores_of(values)
    order = sorted(range(len(addrs)), key=lambda i: (values[i].waits > 0, values[i].need_rank, scores[i], addrs[i]))
    chosen = arena.plan_compaction(request, list(movable), [addrs[i] for i in order],
                                   lambda j: cost_of(values[order[j]], scores[order[j]]))
    if chosen is None:
        return None
    seg_movable, moves, window, moved, released = chosen
    return seg_movable, moves, window, moved, [values[order[j]] for j in released]


def cheapest_window(seg: _Segment, gone: set, request: int) -> List[int]:
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


def bytes_to_move(seg: _Segment, moves: list, request: int, released: frozenset = frozenset()) -> int:
    """What carrying out a plan moves: its moves out of the segment, then the blocks slid
    (cheapest_window's, once the blocks at the addresses in ``released`` are free; those already
    in place counted too)."""
    sizes = dict(seg.movable)
    moved = {a for a, _ in moves}
    return sum(sizes[a] for a in moved) + sum(sizes[a] for a in cheapest_window(seg, moved | released, request))


def block_moves(chosen) -> int:
    """The block moves of an Arena.plan_moves plan, at most: its moves out, then every block of its
    window, each of which may slide (a compaction is priced per block: each is a copy)."""
    return len(chosen[1]) + len(chosen[2])


class _PictureBlock(NamedTuple):  # a block of an arena picture that differs from the arena's
    addr: int
    size: int
    allocated: bool
    region: str


def bytes_to_move_after(blocks, freed: set, request: int, movable: Dict[int, tuple]) -> Optional[int]:
    """What the compaction that follows releasing the blocks at the addresses in ``freed`` moves so
    that ``request`` fits, by moves alone (``plan`` on that picture, nothing released; fewest bytes
    moved); None where moves alone cannot make it fit."""
    picture = [_PictureBlock(b.addr, b.size, b.allocated and b.addr not in freed, b.region) for b in blocks]
    kept = {a: (m[0], m[1], False) for a, m in movable.items() if a not in freed}
    chosen = plan(picture, request, kept, lambda v: 0, lambda v: 0.0)
    return None if chosen is None else bytes_to_move(chosen[0], chosen[1], request)


def comeback_seconds(value) -> float:
    """What releasing ``value`` (a policy's TensorView) will cost: nothing where the step plan says
    nothing reads it again; else its copy back, or its recompute with the evicted ancestors that
    needs. Compacting instead is worth it where the moves cost less."""
    if value.next_use == math.inf:
        return 0.0
    if value.has_host_copy:
        return value.swap_cost
    return value.compute_cost + value.evicted_ancestor_cost


def release_path_seconds(blocks, request: int, order, seconds: Callable,
                         then: Optional[Callable[[set], float]] = None) -> Optional[float]:
    """What the pressure handler's other way costs: releasing ``order`` ((addr, value), lowest score
    first) one at a time until ``request`` fits in one free block of the main region, each priced by
    ``seconds(value)``. Where the released bytes reach the request first, the handler compacts
    then, having released them: that costs ``then(addresses released)`` more (inf: it cannot), or
    without ``then``, the result is None."""
    main = [b for b in blocks if b.region == "main"]
    index = {b.addr: i for i, b in enumerate(main)}
    free = [not b.allocated for b in main]
    released, total, gone = 0, 0.0, set()
    for addr, value in order:
        i = index.get(addr)
        if i is None or free[i]:
            continue
        free[i] = True
        gone.add(addr)
        released += main[i].size
        total += seconds(value)
        run, lo, hi = main[i].size, i, i  # the free run around it, summed as it grows
        while lo > 0 and free[lo - 1]:
            lo -= 1
            run += main[lo].size
        while hi + 1 < len(main) and free[hi + 1]:
            hi += 1
            run += main[hi].size
        if run >= request:
            return total
        if released >= request:
            return None if then is None else total + then(gone)
    return None


def release_path_seconds_in(arena, request: int, order, seconds: Callable,
                            then: Optional[Callable[[set], float]] = None) -> Optional[float]:
    """release_path_seconds on ``arena`` as it is now, the walk over its blocks in C++
    (Arena.release_path, csrc/move_plan.h): the same releases priced in the same order."""
    taken, how = arena.release_path(request, [a for a, _ in order])
    if how == "never":
        return None
    total = 0.0
    for k in taken:
        total += seconds(order[k][1])
    if how == "fits":
        return total
    return None if then is None else total + then({order[k][0] for k in taken})
