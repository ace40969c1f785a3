"""Step placement (csrc/step_placement.h): while on, each step's large blocks go to the offsets the
step before showed block nothing later, so a repeating step leaves its free bytes where the next
request needs them and compaction has nothing to move. The plan only ever picks among free
addresses: a step that differs from the one before is placed by best fit, and the arena's
invariants hold whatever the steps do. Runs under ASan/UBSan too (test_sanitizers.py): only the
arena module is used here; the runtime's use (on with plan="auto") is tested in test_plan_cover.py."""
import ctypes
import random

import pytest

from hypothesis import given, settings
from hypothesis import strategies as st

from arena_module import C
from test_compaction import check_tiling

MiB = 2 ** 20


def _compacting_arena(budget, placement):
    """A host arena with no small region whose pressure handler compacts every block (nothing is
    releasable: what fragmentation costs shows as moved bytes). ``live`` maps names to addresses
    and follows the moves."""
    a = C.Arena(budget, "host", small_threshold=0, search="handler")
    a.step_placement = placement
    live = {}

    def compact(request, window):
        moved = dict(a.compact([b.addr for b in a.blocks() if b.allocated]))
        for name, addr in live.items():
            live[name] = moved.get(addr, addr)

    a.set_pressure_handler(compact)
    return a, live


def _fragmenting_step(a, live):
    """x, y, z of 1 MiB, x and z freed, then 2 MiB: in 3 MiB, best fit leaves the two free MiB
    apart (x's and z's); placed with y at the top, they are one block."""
    for name in "xyz":
        live[name] = a.allocate(MiB)
        ctypes.memset(live[name], ord(name), MiB)
    a.free(live.pop("x"))
    a.free(live.pop("z"))
    live["w"] = a.allocate(2 * MiB)
    assert ctypes.string_at(live["y"], MiB) == b"y" * MiB  # moved or not, y kept its bytes
    a.free(live.pop("y"))
    a.free(live.pop("w"))
    a.end_step()


def _repeat(a, live, events, sizes, steps=4):
    """``steps`` steps of ``events`` ("+x": allocate x's ``sizes[x]`` MiB, "-x": free it), each
    ended: per step, the plan's offsets for the next and the bytes compaction moved."""
    plans = []
    for _ in range(steps):
        before = a.stats()["moved_bytes"]
        for ev in events:
            name = ev[1]
            if ev[0] == "+":
                live[name] = a.allocate(sizes[name] * MiB)
            else:
                a.free(live.pop(name))
        a.end_step()
        plans.append((list(a.step_placement_plan()[0]), a.stats()["moved_bytes"] - before))
    return plans


def test_a_repeated_step_moves_nothing_after_the_first():
    moved = {}
    for placement in (False, True):
        a, live = _compacting_arena(3 * MiB, placement)
        per_step = []
        for _ in range(4):
            before = a.stats()["moved_bytes"]
            _fragmenting_step(a, live)
            per_step.append(a.stats()["moved_bytes"] - before)
        moved[placement] = per_step
        stats = a.stats()
    assert moved[False] == [MiB] * 4  # best fit fragments every step
    assert moved[True] == [MiB, 0, 0, 0]  # learned from the first step
    assert stats["num_placed_as_planned"] == 3 * 4 and stats["num_displaced_from_plan"] == 0


def test_lifetimes_that_largest_first_cannot_pack_are_packed_in_another_order():
    """x (2 MiB) lives while y (3 MiB) comes and goes, then z and w (2 MiB each) overlap x's end, in
    6 MiB. Largest first puts y at 0, x above it at 3, z at 0 and leaves w no offset (5 + 2 > 6):
    best fit then finds w's 2 MiB free in two holes, and compaction moves 4 MiB every step. In the
    order they were allocated all four fit (x 0, y 2, z 2, w 4): the plan takes that order, and the
    repeated step moves nothing."""
    a, live = _compacting_arena(6 * MiB, True)
    moved = []
    for _ in range(4):
        before = a.stats()["moved_bytes"]
        live["x"], live["y"] = a.allocate(2 * MiB), a.allocate(3 * MiB)
        a.free(live.pop("y"))
        live["z"] = a.allocate(2 * MiB)
        live["w"] = a.allocate(2 * MiB)
        for name in "xzw":
            a.free(live.pop(name))
        a.end_step()
        moved.append(a.stats()["moved_bytes"] - before)
        offsets, sizes = a.step_placement_plan()
        assert list(sizes) == [2 * MiB, 3 * MiB, 2 * MiB, 2 * MiB]
        assert -1 not in list(offsets)  # every block of the next step has its place
    assert moved[1:] == [0, 0, 0]
    assert a.stats()["num_displaced_from_plan"] == 0


def test_lifetimes_no_order_packs_by_lowest_offset_are_packed_into_the_smallest_gaps():
    """Six blocks in 6 MiB whose lifetimes no order (largest first, longest lived, bytes x clock,
    allocation order) packs at the lowest free offsets: each leaves one block without an offset,
    and compaction would move what best fit scatters every step. Put into the smallest gap that
    holds them (TFLite's greedy by size), all six fit, and the repeated step moves nothing."""
    a, live = _compacting_arena(6 * MiB, True)
    events = ["+a", "+b", "-b", "+c", "+d", "-a", "+e", "-c", "+f", "-d", "-e", "-f"]
    sizes = {"a": 2, "b": 3, "c": 1, "d": 2, "e": 1, "f": 3}
    plans = _repeat(a, live, events, sizes)
    assert all(-1 not in offsets for offsets, _ in plans)
    assert [moved for _, moved in plans][1:] == [0, 0, 0]
    assert a.stats()["num_displaced_from_plan"] == 0


def test_lifetimes_no_single_pass_packs_are_packed_with_the_left_out_blocks_first():
    """Five blocks in 6 MiB: a (3 MiB) with b (2), then c and d (2 each) with b, then e (3) with c.
    None of the eight single passes (four orders, at the lowest offset or into the smallest gap)
    packs them: largest first puts a and e at 0, b at 3 and d at 0, and leaves c no room beside b
    and e. On the build before, the plan left c to best fit and compaction moved 6 MiB every step.
    Passed over again with what each pass left out first, allocation order's third pass (c, d, a,
    b, e) packs all five (a and c at 0, d and e at 2, b at 4), and the repeated step moves nothing."""
    a, live = _compacting_arena(6 * MiB, True)
    events = ["+a", "+b", "-a", "+c", "+d", "-d", "-b", "+e", "-e", "-c"]
    sizes = {"a": 3, "b": 2, "c": 2, "d": 2, "e": 3}
    plans = _repeat(a, live, events, sizes)
    assert all(offsets == [0, 4 * MiB, 0, 2 * MiB, 2 * MiB] for offsets, _ in plans)
    assert [moved for _, moved in plans][1:] == [0, 0, 0]
    assert a.stats()["num_displaced_from_plan"] == 0


def test_a_block_that_outlives_its_step_is_planned_around_its_successor():
    """g (a gradient) is made late in a step and freed early in the next, before the next g: the
    plan puts the next g where the last one was, not beside it."""
    a, live = _compacting_arena(4 * MiB, True)
    addrs = []
    for step in range(4):
        if "g" in live:
            a.free(live.pop("g"))  # zero_grad
        live["act"] = a.allocate(2 * MiB)
        live["g"] = a.allocate(MiB)
        a.free(live.pop("act"))
        addrs.append(live["g"] - a.base)
        a.end_step()
    assert addrs[2] == addrs[3]
    assert a.stats()["num_displaced_from_plan"] == 0


def test_a_displaced_block_goes_where_its_plan_keeps_room_and_the_step_keeps_its_plan():
    """p lives all step; b dies at once; x comes after b's death, then y. The plan puts x where b
    was (offset 1 MiB) and y beside it (2 MiB). A step where b outlives its counterpart displaces
    x: it goes to the room the plan keeps free over x's lifetime (3 MiB: 0 is p's, 2 is y's), not
    by best fit (2 MiB, y's), and y still gets its planned offset."""
    a, live = _compacting_arena(4 * MiB, True)

    def step(b_dies_first):
        p, b = a.allocate(MiB), a.allocate(MiB)
        if b_dies_first:
            a.free(b)
        x, y = a.allocate(MiB), a.allocate(MiB)
        offsets = [x - a.base, y - a.base]
        for addr in (x, y, p) + (() if b_dies_first else (b,)):
            a.free(addr)
        a.end_step()
        return offsets

    step(True)  # the step the plan is learned from
    assert step(True) == [MiB, 2 * MiB]
    before = a.stats()
    assert step(False) == [3 * MiB, 2 * MiB]
    after = a.stats()
    assert after["num_displaced_from_plan"] - before["num_displaced_from_plan"] == 1
    assert after["num_placed_as_planned"] - before["num_placed_as_planned"] == 3  # p, b, y
    assert after["moved_bytes"] == before["moved_bytes"]
    a.set_step_placement_keeps_plan(False)  # the runtime's choice after a switch of ways: best fit from there
    step(True)
    before = a.stats()
    step(False)
    after = a.stats()
    assert after["num_displaced_from_plan"] - before["num_displaced_from_plan"] == 1
    assert after["num_placed_as_planned"] - before["num_placed_as_planned"] == 2  # p, b; y by best fit


def test_a_plan_taken_over_by_a_fresh_arena_places_its_step_as_in_the_arena_that_learned_it():
    """The simulator's use: each replay in its own arena, the plan carried over; and the step's end
    planned around the blocks the next step starts with (next_start) rather than those left now."""
    a, live = _compacting_arena(3 * MiB, True)
    _fragmenting_step(a, live)
    offsets, sizes = a.step_placement_plan()
    assert sizes == [MiB, MiB, MiB, 2 * MiB] and len(offsets) == 4
    b, live_b = _compacting_arena(3 * MiB, True)
    b.set_step_placement_plan(offsets, sizes)
    _fragmenting_step(b, live_b)
    assert b.stats()["moved_bytes"] == 0 and b.stats()["num_placed_as_planned"] == 4
    c, live_c = _compacting_arena(3 * MiB, True)
    keep = c.allocate(MiB)  # the next step starts with this block: the plan goes around it
    c.free(keep)
    c.end_step(next_start=[(c.base, MiB)])
    assert all(o == -1 or o >= MiB for o in c.step_placement_plan()[0])


def test_bad_plans_and_spans_are_refused_and_nothing_changes():
    a, live = _compacting_arena(3 * MiB, True)
    _fragmenting_step(a, live)
    plan = a.step_placement_plan()
    for offsets, sizes, message in (
            ([0], [], r"a step placement plan needs one size per offset, got 1 offsets and 0 sizes"),
            ([0], [1000], r"a planned size must be a positive multiple of 512 up to the main region's 3145728 bytes, got 1000"),
            ([512 * 7000], [MiB], r"a planned offset must be -1 \(none\) or a multiple of 512 whose block ends inside "
                                  r"the main region's 3145728 bytes, got 3584000 for 1048576 bytes"),
            ([-2], [MiB], r"a planned offset must be -1 \(none\).*got -2")):
        with pytest.raises(ValueError, match=message):
            a.set_step_placement_plan(offsets, sizes)
    with pytest.raises(ValueError, match=r"a span the next step starts with must lie in the main region"):
        a.end_step(next_start=[(a.base + 2 * MiB, 2 * MiB)])
    assert a.step_placement_plan() == plan
    a.step_placement = False
    with pytest.raises(ValueError, match=r"step placement is off: set step_placement = True first"):
        a.step_placement_plan()
    with pytest.raises(ValueError, match=r"step placement is off"):
        a.set_step_placement_plan([], [])


def test_off_forgets_what_was_learned_and_places_by_best_fit():
    a, live = _compacting_arena(3 * MiB, True)
    _fragmenting_step(a, live)
    a.step_placement = False
    assert not a.step_placement
    before = a.stats()["moved_bytes"]
    _fragmenting_step(a, live)
    assert a.stats()["moved_bytes"] - before == MiB
    a.step_placement = True  # a fresh plan: nothing learned yet
    before = a.stats()["moved_bytes"]
    _fragmenting_step(a, live)
    assert a.stats()["moved_bytes"] - before == MiB


def test_a_step_of_other_sizes_is_placed_by_best_fit():
    a, live = _compacting_arena(3 * MiB, True)
    _fragmenting_step(a, live)
    for size in (512 * 1024, 1536 * 1024):  # none of the plan's sizes
        live["v"] = a.allocate(size)
        a.free(live.pop("v"))
    stats = a.stats()
    assert stats["num_placed_as_planned"] == 0 and stats["num_displaced_from_plan"] == 0
    check_tiling(a)


def test_a_step_too_long_to_plan_is_placed_by_best_fit():
    """Planning is quadratic in a step's large allocations: a step of more than kMaxPlanned (8192)
    gets no plan; one of exactly that many does."""
    unit = 64 * 1024
    for n, planned in ((8192, True), (8193, False)):
        a = C.Arena(n * unit, "virtual", small_threshold=0)
        a.step_placement = True
        for _ in range(2):
            blocks = [a.allocate(unit) for _ in range(n)]
            for b in blocks:
                a.free(b)
            a.end_step()
        assert (a.stats()["num_placed_as_planned"] == n) is planned
        assert a.stats()["num_displaced_from_plan"] == 0


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2 ** 32 - 1), steps=st.integers(2, 6), ops=st.integers(4, 40))
def test_whatever_the_steps_blocks_keep_their_bytes_and_the_region_its_invariants(seed, steps, ops):
    """Steps that repeat a random pattern with random changes: every live block keeps its bytes
    (moves included), blocks never overlap, and the region stays tiled and coalesced."""
    rnd = random.Random(seed)
    unit = 64 * 1024
    a, live = _compacting_arena(64 * unit, True)
    pattern = [(rnd.choice("af"), rnd.randint(1, 8)) for _ in range(ops)]
    fill = {}
    serial = 0
    for _ in range(steps):
        step = [op if rnd.random() < 0.8 else ("a", rnd.randint(1, 8)) for op in pattern]
        for kind, n in step:
            if kind == "a" and sum(a.block_size(x) for x in live.values()) + n * unit <= 48 * unit:
                serial += 1
                live[serial] = a.allocate(n * unit)
                fill[serial] = serial % 251
                ctypes.memset(live[serial], fill[serial], n * unit)
            elif kind == "f" and live:
                name = rnd.choice(sorted(live))
                a.free(live.pop(name))
        for name, addr in live.items():
            size = a.block_size(addr)
            assert ctypes.string_at(addr, size) == bytes([fill[name]]) * size
        spans = sorted((addr, a.block_size(addr)) for addr in live.values())
        assert all(lo + size <= hi for (lo, size), (hi, _) in zip(spans, spans[1:]))
        check_tiling(a)
        a.end_step()
