"""The arena's pressure handler: asks the policy what to release, and releases it before the
allocation proceeds (so the budget is hard).

``coop`` releases the cheapest address-contiguous window covering the request (block cost
h = c'/s, refreshed in the arena at each call). Scored policies (``dtr``, ``lru``, ...) release
the lowest-scoring value, one per call, while that can still help: once the values released for
one allocation add up to the request and it still does not fit (the free bytes are scattered), they
release the cheapest window under their own block cost instead. A hard budget cannot grow past
fragmentation the way a caching allocator does, and this keeps one-at-a-time eviction from
emptying the arena for a single large request.
"""
import math


class PressureHandler:
    def __init__(self, rt) -> None:
        self.rt = rt
        self.uses_window = rt.policy.name == "coop"
        self._allocs = -1   # the arena's allocation count when we last ran: same -> same request
        self._freed = 0     # bytes released one at a time for the pending request

    def __call__(self, request: int, window) -> None:
        rt = self.rt
        allocs = rt.arena.num_allocs
        if allocs != self._allocs:  # a new request (the arena calls us again until it fits)
            self._allocs, self._freed = allocs, 0
            rt.sweep()  # values whose last tensor died are freed already: count them as evicted
        if self.uses_window:
            self._release_window(request)
        elif self._freed < request:
            self._freed += self._release_lowest()
        else:
            self._release_window(request)

    def _candidates(self):
        """Every value we may release now (inputs held by a running op or restore are locked)."""
        for r in self.rt.table.values():
            if r.recipe is not None and not r.evicted and r.locks == 0 and r.in_arena:
                yield r, r.sref
        for r, (sref, _) in self.rt.cache.items():
            if r.recipe is not None and r.locks == 0:
                yield r, sref

    def _release_lowest(self) -> int:
        rt = self.rt
        now, evaluate = rt.clock, rt.policy.evaluate
        best, best_score = None, math.inf
        for r, _ in self._candidates():
            s = evaluate(r, now)
            if s < best_score:
                best, best_score = r, s
        if best is None:
            return 0
        rt.release(best)
        return best.nbytes

    def _release_window(self, request: int) -> None:
        rt = self.rt
        arena, now, cost = rt.arena, rt.clock, rt.policy.block_cost
        owners = {}
        for r in rt.table.values():  # owner 0: not releasable; resets the window
            if r.in_arena and not r.evicted and (r.recipe is None or r.locks):
                addr = r.sref.data_ptr
                if addr:
                    arena.set_owner(addr, 0, 0.0)
        for r, (sref, _) in rt.cache.items():
            if r.locks:
                arena.set_owner(sref.data_ptr, 0, 0.0)
        for r, sref in list(self._candidates()):
            addr = sref.data_ptr
            if addr and rt.lo <= addr < rt.hi:
                arena.set_owner(addr, r.id, cost(r, now))
                owners[r.id] = r
        w = arena.find_window(request)
        if w is None:
            self._release_lowest()  # no window at all: release what we can, the arena will decide
            return
        for owner in w.owners:
            r = owners.get(owner)
            if r is not None and r.locks == 0 and rt.is_available(r):
                rt.release(r)
