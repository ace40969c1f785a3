"""Window search on hand-built layouts whose best window is known."""
import pytest

from arena_module import C

K = 512 * 8  # 4 KiB: every block in these layouts is a multiple of it


def layout(spec, search="window"):
    """Build a virtual arena from a spec of (kind, units, cost): kind 'o' owned, 'p' pinned,
    'u' unowned (owner 0), 'f' free. Returns (arena, list of block addresses)."""
    total = sum(u for _, u, _ in spec) * K
    arena = C.Arena(total, backing="virtual", small_threshold=0, search=search)
    addrs = []
    for i, (kind, units, cost) in enumerate(spec):
        owner = 0 if kind == "u" else i + 1
        addrs.append(arena.allocate(units * K, owner=owner, cost=float(cost), pinned=(kind == "p")))
    for (kind, _, _), a in zip(spec, addrs):
        if kind == "f":
            arena.free(a)
    return arena, addrs


def owners(w):
    return sorted(v.owner for v in w.victims)


def test_cheapest_window_wins():
    arena, addrs = layout([("o", 2, 5), ("o", 2, 1), ("o", 2, 1), ("o", 2, 9)])
    w = arena.find_window(4 * K)
    assert owners(w) == [2, 3] and w.bytes == 4 * K and w.cost == 2.0 and w.addr == addrs[1]


def test_pinned_block_resets_the_window():
    # Spanning the pinned block, blocks 1 and 3 would make a window of cost 2; it may not.
    arena, addrs = layout([("o", 2, 1), ("p", 1, 0), ("o", 2, 1), ("o", 2, 7), ("o", 2, 3)])
    w = arena.find_window(4 * K)
    assert owners(w) == [3, 4] and w.cost == 8.0 and w.addr == addrs[2]


def test_unowned_block_is_a_wall_too():
    arena, _ = layout([("o", 3, 1), ("u", 1, 0), ("o", 3, 2)])
    w = arena.find_window(3 * K)
    assert owners(w) == [1] and w.cost == 1.0
    assert arena.find_window(4 * K) is None  # no window may cross the unowned block


def test_free_gaps_count_bytes_at_no_cost():
    # A free gap next to a cheap block makes a cheaper window than one expensive big block.
    arena, addrs = layout([("o", 4, 10), ("o", 1, 9), ("f", 3, 0), ("o", 1, 1), ("o", 4, 10)])
    w = arena.find_window(4 * K)
    assert owners(w) == [4] and w.cost == 1.0 and w.bytes == 4 * K and w.addr == addrs[2]


def test_window_ending_at_the_last_block():
    arena, addrs = layout([("o", 2, 4), ("p", 1, 0), ("o", 2, 3), ("o", 2, 1), ("o", 3, 1)])
    w = arena.find_window(5 * K)
    assert owners(w) == [4, 5] and w.cost == 2.0 and w.addr == addrs[3] and w.bytes == 5 * K


def test_request_larger_than_any_window():
    arena, _ = layout([("o", 2, 1), ("p", 1, 0), ("o", 2, 1)])
    assert arena.find_window(3 * K) is None


def test_ties_go_to_fewer_bytes():
    arena, _ = layout([("o", 4, 2), ("p", 1, 0), ("o", 2, 1), ("o", 1, 1)])
    w = arena.find_window(2 * K)
    assert owners(w) == [3] and w.bytes == 2 * K


def test_one_at_a_time_takes_the_cheapest_single_block():
    arena, _ = layout([("o", 2, 3), ("o", 1, 1), ("p", 1, 0), ("o", 4, 2)], search="one_at_a_time")
    w = arena.find_window(4 * K)
    assert owners(w) == [2] and w.bytes == K  # cheapest, even though it does not cover the request
    arena.search = "window"
    assert owners(arena.find_window(4 * K)) == [4]


def test_pressure_releases_exactly_the_window():
    arena, addrs = layout([("o", 2, 5), ("o", 2, 1), ("o", 1, 1), ("o", 3, 9)])
    seen = []

    def handler(request, window):
        seen.append((request, owners(window)))
        for v in window.victims:
            arena.free(v.addr)

    arena.set_pressure_handler(handler)
    got = arena.allocate(3 * K)
    assert seen == [(3 * K, [2, 3])]
    assert got == addrs[1]  # the freed window is where the new block goes
    s = arena.stats()
    assert s["num_pressure_events"] == 1 and s["num_released_blocks"] == 2


def test_cheap_and_costly_placement_ends():
    arena = C.Arena(64 * K, backing="virtual", small_threshold=0)
    costly = arena.allocate(K, cost_class="costly")
    cheap = arena.allocate(K, cost_class="cheap")
    assert costly == arena.base
    assert cheap == arena.base + arena.budget - K
    with pytest.raises(ValueError, match="cost_class must be 'costly' or 'cheap', got 'free'"):
        arena.allocate(K, cost_class="free")
