"""Random allocate / free / release sequences against the Python model (tests/arena_model.py).

After every step: blocks tile the range in address order, aligned, no two adjacent free blocks in
a region, the exact same blocks as the model, and the same stats.
"""
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from arena_model import ALIGN, ArenaModel, OutOfBudget as ModelOOB
from arena_module import C, OutOfBudget

budgets = st.integers(16, 512).map(lambda k: k * ALIGN)  # 8 KiB .. 256 KiB

# One flat tuple per step, read by `kind`: 0-5 allocate (so the arena fills and pressure happens),
# 6-7 free, 8 pin/unpin, 9 set owner and cost. Sizes come in three tiers: tiny (small region), mid
# (a few fill any budget), and larger than every budget.
size = st.tuples(st.integers(0, 9), st.integers(1, 4096), st.integers(1, 40), st.integers(300_000, 400_000)).map(
    lambda t: t[1] if t[0] < 3 else (t[2] * 2501 if t[0] < 9 else t[3]))
op = st.tuples(st.integers(0, 9), size, st.booleans(), st.sampled_from([1, 2, 3, 0]), st.integers(0, 8),
               st.integers(0, 4).map(lambda x: x == 0), st.integers(0, 10_000))


def check_invariants(arena, model):
    blocks = arena.blocks()
    expect = model.blocks()
    assert [(b.addr, b.size, b.allocated, b.owner, b.cost, b.pinned) for b in blocks] == \
           [(b.addr, b.size, b.allocated, b.owner, b.cost, b.pinned) for b in expect]
    pos = arena.base
    for prev, b in zip([None] + blocks[:-1], blocks):
        assert b.addr == pos, "blocks must tile the range with no gap or overlap"
        assert b.addr % ALIGN == 0 and b.size % ALIGN == 0 and b.size > 0
        if prev is not None and prev.region == b.region:
            assert prev.allocated or b.allocated, "two adjacent free blocks were not coalesced"
        pos += b.size
    assert pos == arena.base + arena.budget
    s = arena.stats()
    m = model.stats
    free = [b.size for b in blocks if not b.allocated]
    assert s["allocated_bytes.current"] == m["allocated"] == sum(b.size for b in blocks if b.allocated)
    assert s["allocated_bytes.peak"] == m["peak"]
    assert s["num_allocs"] == m["allocs"] and s["num_frees"] == m["frees"]
    assert s["num_pressure_events"] == m["pressure_events"]
    assert s["num_released_blocks"] == m["released"]
    assert s["num_ooms"] == m["ooms"]
    assert s["num_blocks"] == len(blocks)
    assert s["num_allocated_blocks"] == len(model.live)
    assert s["free_bytes"] == sum(free)
    assert s["largest_free_block"] == max(free, default=0)
    assert s["pinned_bytes.current"] == sum(b.size for b in blocks if b.allocated and b.pinned)


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(budget=budgets, threshold=st.sampled_from([0, 1024, 16384]),
       mode=st.sampled_from(["window", "one_at_a_time"]), use_handler=st.booleans(),
       ops=st.lists(op, min_size=4, max_size=60))
def test_arena_matches_model(budget, threshold, mode, use_handler, ops):
    arena = C.Arena(budget, backing="virtual", small_threshold=threshold, search=mode)
    model = ArenaModel(budget, small_threshold=threshold, mode=mode, base=arena.base)
    if use_handler:
        def release_window(request, window):
            if mode == "window":
                assert window.bytes >= request
            for v in window.victims:
                arena.free(v.addr)
        arena.set_pressure_handler(release_window)
    live = []
    for kind, n, cheap, owner, cost, flag, pick in ops:
        if kind <= 5:
            try:
                expect = model.allocate(n, cheap, owner, float(cost), flag, handler=use_handler)
            except ModelOOB:
                expect = None
            try:
                got = arena.allocate(n, "cheap" if cheap else "costly", owner, float(cost), flag)
            except OutOfBudget as e:
                assert "out of budget" in str(e)
                got = None
            assert got == expect
            live = [a for a in live if a in model.live]  # drop blocks the handler released
            if got is not None and got not in live:  # a released address may come back
                live.append(got)
        elif live:
            addr = live[pick % len(live)]
            if kind <= 7:
                arena.free(addr)
                model.free(addr)
                live.remove(addr)
            elif kind == 8:
                arena.set_pinned(addr, flag)
                model.live[addr].pinned = flag
            else:
                arena.set_owner(addr, owner, float(cost))
                model.live[addr].owner, model.live[addr].cost = owner, float(cost)
        check_invariants(arena, model)
    for a in list(live):
        arena.free(a)
        model.free(a)
    check_invariants(arena, model)
    assert arena.stats()["allocated_bytes.current"] == 0
