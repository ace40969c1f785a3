"""Four threads allocating and freeing on one arena at once (the binding releases the GIL)."""
import random
import threading

from arena_module import C, OutOfBudget


def test_four_threads_allocate_and_free_concurrently():
    arena = C.Arena(64 << 20, backing="host")
    errors, mine = [], [[] for _ in range(4)]
    barrier = threading.Barrier(4)

    def worker(t):
        rng = random.Random(t)
        live = mine[t]
        try:
            barrier.wait()
            for _ in range(4000):
                if live and rng.random() < 0.5:
                    arena.free(live.pop(rng.randrange(len(live))))
                else:
                    try:
                        live.append(arena.allocate(rng.choice([100, 4096, 20_000, 300_000])))
                    except OutOfBudget:
                        pass
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    live = [a for l in mine for a in l]
    assert len(live) == len(set(live)), "two threads were given the same block"
    blocks = {b.addr: b for b in arena.blocks() if b.allocated}
    assert set(blocks) == set(live)
    spans = sorted((b.addr, b.addr + b.size) for b in blocks.values())
    assert all(e <= s for (_, e), (s, _) in zip(spans, spans[1:])), "allocated blocks overlap"
    s = arena.stats()
    assert s["num_allocs"] - s["num_frees"] == len(live)
    for a in live:
        arena.free(a)
    assert arena.stats()["allocated_bytes.current"] == 0
    assert arena.stats()["num_blocks"] == 2  # one free block per region: everything coalesced
