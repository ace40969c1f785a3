"""Arena compaction: ``compact`` slides listed blocks up past free space (never past an unlisted
block), ``move_block`` moves one block into a free block; both carry the bytes along, keep the
region's invariants, and reject bad input before changing anything. Runs under ASan/UBSan too
(test_sanitizers.py), so only the arena module is used here; the storage side is in test_runtime."""
import ctypes
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from arena_module import C

ALIGN = 512


def fill(addr: int, size: int, byte: int) -> None:
    ctypes.memset(addr, byte, size)


def content(addr: int, size: int) -> bytes:
    return ctypes.string_at(addr, size)


def check_tiling(arena):
    blocks = [b for b in arena.blocks() if b.region == "main"]
    pos = arena.base
    for prev, b in zip([None] + blocks[:-1], blocks):
        assert b.addr == pos and b.size % ALIGN == 0
        if prev is not None:
            assert prev.allocated or b.allocated, "adjacent free blocks left uncoalesced"
        pos += b.size
    return blocks


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(2, 40), listed_share=st.floats(0.0, 1.0))
def test_compact_slides_listed_blocks_up_and_keeps_their_bytes(seed, n, listed_share):
    rnd = random.Random(seed)
    arena = C.Arena(256 * ALIGN, backing="host", small_threshold=0)
    live = {}
    for i in range(n):
        size = rnd.randint(1, 12) * ALIGN
        try:
            a = arena.allocate(size)
        except Exception:
            break
        fill(a, size, i % 251 + 1)
        live[a] = (size, i % 251 + 1)
        if rnd.random() < 0.4:  # holes
            victim = rnd.choice(list(live))
            arena.free(victim)
            del live[victim]
    listed = [a for a in live if rnd.random() < listed_share]
    before = arena.stats()
    moves = dict(arena.compact(listed))
    after = arena.stats()
    assert set(moves) <= set(listed)
    assert after["allocated_bytes.current"] == before["allocated_bytes.current"]
    assert after["free_bytes"] == before["free_bytes"]
    assert after["num_frees"] == before["num_frees"]  # a move is not a release
    assert after["num_moved_blocks"] - before["num_moved_blocks"] == len(moves)
    now = {moves.get(a, a): v for a, v in live.items()}
    blocks = check_tiling(arena)
    assert {b.addr for b in blocks if b.allocated} == set(now)
    for a, (size, byte) in now.items():
        assert content(a, size) == bytes([byte]) * size
    # Slid up: every listed block ends where the next allocated block (or the region) begins.
    moved_to = {moves.get(a, a) for a in listed}
    allocated = [b for b in blocks if b.allocated]
    top = arena.base + sum(b.size for b in blocks)
    for k, b in enumerate(allocated):
        if b.addr in moved_to:
            nxt = allocated[k + 1].addr if k + 1 < len(allocated) else top
            assert b.addr + b.size == nxt
    assert arena.compact(listed and [moves.get(a, a) for a in listed]) == []  # already compact


def test_compact_merges_holes_into_one_block_below_the_listed_run():
    arena = C.Arena(64 * ALIGN, backing="host", small_threshold=0)
    a, b, c, d = (arena.allocate(8 * ALIGN) for _ in range(4))
    for addr, byte in ((a, 1), (b, 2), (c, 3), (d, 4)):
        fill(addr, 8 * ALIGN, byte)
    arena.free(b)
    arena.free(d)
    assert arena.stats()["largest_free_block"] == 40 * ALIGN  # d's hole joined the tail
    moves = dict(arena.compact([a, c]))
    top = arena.base + 64 * ALIGN
    assert moves == {c: top - 8 * ALIGN, a: top - 16 * ALIGN}
    assert content(moves[a], 8 * ALIGN) == b"\x01" * 8 * ALIGN
    assert content(moves[c], 8 * ALIGN) == b"\x03" * 8 * ALIGN
    s = arena.stats()
    assert s["largest_free_block"] == s["free_bytes"] == 48 * ALIGN
    assert s["num_compactions"] == 1 and s["moved_bytes"] == 16 * ALIGN


def test_an_unlisted_block_is_a_wall():
    arena = C.Arena(64 * ALIGN, backing="host", small_threshold=0)
    a, wall, c = arena.allocate(4 * ALIGN), arena.allocate(4 * ALIGN), arena.allocate(4 * ALIGN)
    moves = dict(arena.compact([a, c]))
    assert moves[c] == arena.base + 60 * ALIGN  # to the top of the region
    assert a not in moves                        # stopped by the wall right above it
    assert wall == a + 4 * ALIGN


def test_move_block_into_a_free_block():
    arena = C.Arena(64 * ALIGN, backing="host", small_threshold=0)
    a, b, c = arena.allocate(10 * ALIGN), arena.allocate(8 * ALIGN), arena.allocate(8 * ALIGN)
    fill(c, 8 * ALIGN, 7)
    arena.free(a)
    arena.move_block(c, a + ALIGN)
    assert content(a + ALIGN, 8 * ALIGN) == b"\x07" * 8 * ALIGN
    layout = [(x.addr - arena.base, x.size // ALIGN, x.allocated) for x in check_tiling(arena)]
    assert layout == [(0, 1, False), (ALIGN, 8, True), (9 * ALIGN, 1, False), (10 * ALIGN, 8, True),
                      (18 * ALIGN, 46, False)]
    arena.free(a + ALIGN)
    arena.free(b)
    assert arena.stats()["free_bytes"] == arena.stats()["largest_free_block"] == 64 * ALIGN


def test_bad_moves_are_clear_errors_and_change_nothing():
    arena = C.Arena(64 * ALIGN, backing="host", small_threshold=0)
    a, b = arena.allocate(8 * ALIGN), arena.allocate(8 * ALIGN)
    before = [(x.addr, x.size, x.allocated) for x in arena.blocks()]
    with pytest.raises(ValueError, match="compact: .* is inside this arena but is not the start"):
        arena.compact([a, a + ALIGN])
    with pytest.raises(ValueError, match="move_block: .* is not inside one free block"):
        arena.move_block(a, b)
    with pytest.raises(ValueError, match="move_block: .* is not inside one free block"):
        arena.move_block(a, arena.base + 60 * ALIGN)  # runs past the region
    arena.set_pinned(a, True)
    with pytest.raises(ValueError, match="compact: .* is pinned"):
        arena.compact([b, a])
    assert [(x.addr, x.size, x.allocated) for x in arena.blocks()] == before


def test_virtual_arenas_compact_addresses_only():
    arena = C.Arena(1 << 40, backing="virtual", small_threshold=0)
    a, b = arena.allocate(1 << 30), arena.allocate(1 << 30)
    arena.free(a)
    assert dict(arena.compact([b])) == {b: arena.base + (1 << 40) - (1 << 30)}
