"""compaction_plan's pricing of the pressure handler's two ways when the free bytes cover a request
only scattered: compacting (bytes_to_move) against releasing until it fits (release_path_seconds)."""
import math
import random
from collections import namedtuple

from pymem import compaction_plan

Block = namedtuple("Block", "addr size allocated region")
Value = namedtuple("Value", "next_use has_host_copy swap_cost compute_cost evicted_ancestor_cost")


def layout(*sizes_and_states):
    """Main-region blocks from (size, allocated) in address order."""
    blocks, addr = [], 0
    for size, allocated in sizes_and_states:
        blocks.append(Block(addr, size, allocated, "main"))
        addr += size
    return blocks


def test_releasing_stops_where_the_request_fits_beside_a_hole():
    blocks = layout((1, True), (1, False), (1, True), (1, False), (1, True))  # A . B . C
    order = [(4, "c"), (0, "a")]
    cost = {"a": 1.0, "b": 4.0, "c": 2.0}.__getitem__
    assert compaction_plan.release_path_seconds(blocks, 2, order, cost) == 2.0  # C and the hole below it
    # Three contiguous bytes: A and its hole are two, B joins both holes.
    assert compaction_plan.release_path_seconds(blocks, 3, [(0, "a"), (2, "b")], cost) == 5.0


def test_releases_that_add_up_to_the_request_without_fitting_leave_it_to_compaction():
    blocks = layout((2, True), (1, True), (2, True), (1, False))  # A B C .
    order = [(0, "a"), (3, "c")]
    assert compaction_plan.release_path_seconds(blocks, 4, order, lambda v: 1.0) is None
    # Another region's blocks are not the main region's holes.
    small = blocks + [Block(6, 8, False, "small")]
    assert compaction_plan.release_path_seconds(small, 4, order, lambda v: 1.0) is None


def test_a_comeback_costs_nothing_where_the_plan_reads_the_value_no_more():
    gone = Value(math.inf, False, 5.0, 3.0, 4.0)
    assert compaction_plan.comeback_seconds(gone) == 0.0
    assert compaction_plan.comeback_seconds(gone._replace(next_use=0.5)) == 7.0  # recompute + evicted ancestors
    assert compaction_plan.comeback_seconds(gone._replace(next_use=None, has_host_copy=True)) == 5.0  # copy back


def test_releases_that_add_up_to_the_request_are_priced_with_the_compaction_after_them():
    """The handler, having released A and C, slides B (1 byte) to fit 4: that move is part of the
    release path's price. Where B may not move, no compaction fits it by moves alone: inf."""
    blocks = layout((2, True), (1, True), (2, True), (1, False))  # A B C .
    order = [(0, "a"), (3, "c")]
    movable = {0: ("a", None, True), 2: ("b", None, False), 3: ("c", None, True)}
    assert compaction_plan.bytes_to_move_after(blocks, {0, 3}, 4, movable) == 1
    assert compaction_plan.bytes_to_move_after(blocks, {0, 3}, 4, {0: movable[0], 3: movable[3]}) is None

    def then(freed):
        moved = compaction_plan.bytes_to_move_after(blocks, freed, 4, movable)
        return math.inf if moved is None else 10.0 * moved
    assert compaction_plan.release_path_seconds(blocks, 4, order, lambda v: 1.0, then) == 12.0
    # Releases that never reach the request: compaction is the only way (None).
    assert compaction_plan.release_path_seconds(blocks, 6, order, lambda v: 1.0, then) is None


# ---- Arena.plan_moves (csrc/move_plan.h): the moves-only plan in C++, held to the Python one ------

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from pymem import _C  # noqa: E402


UNIT = 512
ARENA_OPS = st.lists(st.tuples(st.integers(1, 12), st.integers(0, 9)), min_size=1, max_size=40)


def _random_arena(ops, rng):
    """A 32 KiB virtual arena after ``ops``: (size in 512-byte units, action), action < 3 freeing a
    live block chosen by ``rng`` (if any), else allocating (a request that does not fit is skipped)."""
    arena = _C.Arena(64 * UNIT, "virtual", small_threshold=0)
    live = []
    for size, action in ops:
        if action < 3 and live:
            arena.free(live.pop(rng.randrange(len(live))))
            continue
        try:
            live.append(arena.allocate(size * UNIT))
        except Exception:  # full: the picture stays as it is
            pass
    return arena


def _reference_moves_plan(arena, request, movable, freed):
    """compaction_plan.plan with nothing releasable on the arena's picture after `freed`, and what
    carrying it out moves: the plan Arena.plan_moves must give."""
    blocks = arena.blocks()
    picture = [compaction_plan._PictureBlock(b.addr, b.size, b.allocated and b.addr not in freed, b.region)
               for b in blocks]
    kept = {a: (a, None, False) for a in movable if a not in freed}
    chosen = compaction_plan.plan(picture, request, kept, lambda v: 0, lambda v: 0.0)
    if chosen is None:
        return None
    seg, moves, victims = chosen
    assert not victims
    window = compaction_plan.cheapest_window(seg, {a for a, _ in moves}, request)
    return ([a for a, _ in seg.movable], [tuple(m) for m in moves], window,
            compaction_plan.bytes_to_move(seg, moves, request))


@settings(max_examples=300, deadline=None)
@given(ARENA_OPS, st.integers(1, 30), st.integers(0, 2**32 - 1))
def test_the_moves_only_plan_in_cpp_is_the_python_plan(ops, request_units, seed):
    """Arena.plan_moves picks the segment, moves, window and byte count compaction_plan's plan,
    cheapest_window and bytes_to_move give with nothing releasable, on random arenas: random
    allocations and frees, a random part of the blocks fixed, another counted as freed."""
    rng = random.Random(seed)
    arena = _random_arena(ops, rng)
    allocated = [b.addr for b in arena.blocks() if b.allocated]
    movable = [a for a in allocated if rng.random() < 0.7]
    freed = {a for a in allocated if rng.random() < 0.15}
    request = request_units * UNIT
    got = arena.plan_moves(request, movable, sorted(freed))
    want = _reference_moves_plan(arena, request, movable, freed)
    if want is None:
        assert got is None
    else:
        assert got is not None
        assert (list(got[0]), [tuple(m) for m in got[1]], list(got[2]), got[3]) == want


@settings(max_examples=300, deadline=None)
@given(ARENA_OPS, st.integers(1, 30), st.integers(0, 2**32 - 1))
def test_the_release_path_walked_in_cpp_prices_what_the_python_walk_prices(ops, request_units, seed):
    """release_path_seconds_in (Arena.release_path) releases the same blocks in the same order as
    release_path_seconds, and ends the same way (fits, reached: then priced on the same addresses,
    or never), on random arenas and random orders (with addresses that are free, repeated, or no
    block's)."""
    rng = random.Random(seed)
    arena = _random_arena(ops, rng)
    addrs = [b.addr for b in arena.blocks()] + [arena.blocks()[0].addr + 7 * UNIT + 1]
    order = [(rng.choice(addrs), f"v{k}") for k in range(rng.randrange(0, 2 * len(addrs) + 1))]
    price = {f"v{k}": 2.0 ** k for k in range(len(order))}.__getitem__  # a sum names its releases

    def then(gone):
        return 1e6 * len(gone) + sum(gone) / 1e9

    request = request_units * UNIT
    for then_ in (then, None):
        want = compaction_plan.release_path_seconds(arena.blocks(), request, order, price, then_)
        got = compaction_plan.release_path_seconds_in(arena, request, order, price, then_)
        assert got == want


def test_the_segment_chosen_is_the_one_that_moves_the_fewest_bytes():
    """Two segments (apart at a block that may not move) each hold the request free, scattered. The
    first has fewer movable bytes, but its request fits only by sliding its 2-unit block; the
    second fits by sliding one unit between two holes and leaves its 5-unit block in place. Both
    plans, Python's and the arena's, slide the one unit."""
    sizes = [(1, False), (2, True), (2, False), (1, True), (5, True), (1, False), (1, True), (2, False)]
    arena = _C.Arena(sum(n for n, _ in sizes) * UNIT, "virtual", small_threshold=0)
    addrs = [arena.allocate(n * UNIT) for n, _ in sizes]
    for a, (_, allocated) in zip(addrs, sizes):
        if not allocated:
            arena.free(a)
    pinned = addrs[3]
    movable = [a for a, (_, allocated) in zip(addrs, sizes) if allocated and a != pinned]
    seg, moves, victims = compaction_plan.plan(arena.blocks(), 3 * UNIT, {a: (a, None, False) for a in movable},
                                               lambda v: 0, lambda v: 0.0)
    assert not moves and not victims and [a for a, _ in seg.movable] == [addrs[4], addrs[6]]
    assert compaction_plan.cheapest_window(seg, set(), 3 * UNIT) == [addrs[6]]
    got = arena.plan_moves(3 * UNIT, movable)
    assert list(got[0]) == [addrs[4], addrs[6]] and not got[1] and list(got[2]) == [addrs[6]] and got[3] == UNIT


@settings(max_examples=300, deadline=None)
@given(ARENA_OPS, st.integers(1, 30), st.integers(0, 2**32 - 1))
def test_the_general_plan_in_cpp_is_the_python_plan(ops, request_units, seed):
    """Arena.plan_compaction picks the segment, moves, releases (in the order given, each priced by
    ``cost_of``), window and byte count that compaction_plan's plan, cheapest_window and
    bytes_to_move give, on random arenas: a random part of the blocks fixed, a random part of the
    movable ones releasable, with random scores (ties included) and costs."""
    rng = random.Random(seed)
    arena = _random_arena(ops, rng)
    allocated = [b.addr for b in arena.blocks() if b.allocated]
    movable = {a: (a, None, rng.random() < 0.6) for a in allocated if rng.random() < 0.8}
    score = {a: rng.randrange(4) for a in movable}
    cost = {a: rng.choice([0.0, 1.0, 2.0, 0.5 * rng.randrange(8)]) for a in movable}
    request = request_units * UNIT
    want = compaction_plan.plan(arena.blocks(), request, movable, score.__getitem__, cost.__getitem__)
    # The order the runtime passes: releasable blocks by score, of equal scores the lower address first.
    order = sorted((a for a, m in movable.items() if m[2]), key=lambda a: (score[a], a))
    asked = []

    def cost_of(i):
        asked.append(i)
        return cost[order[i]]
    got = arena.plan_compaction(request, list(movable), order, cost_of)
    if want is None:
        assert got is None
        return
    seg, moves, victims = want
    released = {a for a in victims}
    window = compaction_plan.cheapest_window(seg, {a for a, _ in moves} | released, request)
    assert got is not None
    assert list(got[0]) == [a for a, _ in seg.movable]
    assert [tuple(m) for m in got[1]] == [tuple(m) for m in moves]
    assert list(got[2]) == window
    assert got[3] == compaction_plan.bytes_to_move(seg, moves, request, released)
    assert [order[i] for i in got[4]] == victims
    assert set(asked) >= set(got[4])  # every release taken was priced


def test_the_general_plan_releases_in_the_segment_where_moves_alone_fall_short():
    """A | B C . with A unmovable: moves alone leave three units apart in two holes, so the request
    of three is met by releasing B (the only releasable block) and sliding C (one unit) up
    against the end; four units fit nowhere."""
    sizes = [(1, True), (2, True), (1, True), (1, False)]
    arena = _C.Arena(sum(n for n, _ in sizes) * UNIT, "virtual", small_threshold=0)
    addrs = [arena.allocate(n * UNIT) for n, _ in sizes]
    arena.free(addrs[3])
    movable = [addrs[1], addrs[2]]
    assert arena.plan_moves(3 * UNIT, movable) is None
    got = arena.plan_compaction(3 * UNIT, movable, [addrs[1]], lambda i: 5.0)
    assert got is not None
    seg_movable, moves, window, moved, released = got
    assert list(seg_movable) == movable and not moves and released == [0]
    assert list(window) == [addrs[2]] and moved == UNIT
    assert arena.plan_compaction(4 * UNIT, movable, [addrs[1]], lambda i: 5.0) is None
