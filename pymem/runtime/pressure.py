"""The arena's pressure handler: asks the policy what to release, and releases it before the
allocation proceeds (so the budget is hard).

``coop`` releases the cheapest address-contiguous window covering the request (block cost
h = c'/s, refreshed in the arena at each call). Scored policies (``dtr``, ``lru``, ...) release
the lowest-scoring value, one per call, while that can still help: once the values released for
one allocation add up to the request and it still does not fit (the free bytes are scattered), they
compact instead (compaction.py): release the cheapest values of one segment between unmovable blocks
and slide the rest of it together. Where the main region's free bytes cover the request from the
start (fragmentation alone), they compact first, if that releases nothing and its moves cost less
than releasing would: the comebacks (compaction_plan.comeback_seconds) of the values released,
lowest score first, until the request fits beside a hole; releases that add up to the request
without fitting end in a compaction anyway. The same question is asked again when only inputs a
pending recompute waits for are left to release: one released would be recomputed again within the
same restore. Recompute seconds a step at the fixed costs of
bench/plan_ways.py, before and after: TinyGPT at 0.3 of its peak 0.146 / 0.109 (plan off), the
CNN at 0.5 0.141 / 0.084 (plan auto). A hard budget cannot grow past fragmentation the way a caching
allocator does, and this keeps one-at-a-time eviction from emptying the arena for a single large
request. When no segment can hold the request, they fall back to the cheapest window.

A policy whose score is its declared data (every registered one, planned or not) is scored by the
C++ release scan (csrc/release_scan.h): the same formula over every candidate in one call, about
a hundredth of the Python cost. A policy with its own ``evaluate``, and candidate sampling, take the
Python loop below, which is also the scan's reference (tests/test_release_scan.py).
"""
import math
import random
import threading
import time

from .. import _C
from ..policies import Planned, Policy, sample_candidates
from ..compaction_plan import block_moves, comeback_seconds, release_path_seconds_in
from .compaction import MovableAddresses, compact_for

_perf = time.perf_counter


def _progress(arena) -> tuple:
    """What the arena counts as the handler's progress (frees, moves)."""
    s = arena.stats()
    return s["num_frees"], s["num_moved_blocks"]


_UNSCANNED = object()  # _release_lowest's default: the caller has not looked for the lowest yet


class _ThreadSeconds:
    """This thread's seconds in the handler: a C thread-local (csrc/runtime_state.h), which the
    fast path reads for every op."""

    @property
    def seconds(self) -> float:
        return _C.handler_seconds()


def native_scan(policy: Policy):
    """The C++ scan of ``policy``'s declared score, or None where it scores in Python (its own
    ``evaluate``)."""
    if type(policy) is Planned:
        fallback = policy.fallback
        if type(fallback).evaluate is not Policy.evaluate:
            return None
        return _C.ReleaseScan(policy.costs, policy.per, fallback.costs, fallback.per,
                              fallback_block_per_byte=fallback.block_cost_per_byte)
    if type(policy).evaluate is not Policy.evaluate:
        return None
    return _C.ReleaseScan(policy.costs, policy.per, block_per_byte=policy.block_cost_per_byte)


def declared_block_cost(policy: Policy) -> bool:
    """Whether ``policy.block_cost`` is the declared one (Policy's, from the score; Planned's when
    its fallback's is): then the scan prices blocks for Coop's window search."""
    base = policy.fallback if type(policy) is Planned else policy
    return type(base).block_cost is Policy.block_cost


def block_cost_from_score(policy: Policy) -> bool:
    """Whether ``policy.block_cost(t)`` is max(score, 0) * max(bytes, 1) for every value (Policy's
    default; Planned keeps it when its fallback does): then compaction prices a release from the
    scan's score."""
    base = policy.fallback if type(policy) is Planned else policy
    return declared_block_cost(policy) and base.block_cost_per_byte


class PressureHandler:
    def __init__(self, rt, sampling: bool = False) -> None:
        self.rt = rt
        self.scan = None if sampling else native_scan(rt.policy)  # None: the Python loop
        self.cost_from_score = block_cost_from_score(rt.policy)
        self.window_scan = self.scan if declared_block_cost(rt.policy) else None
        self.uses_window = rt.settings.policy.name == "coop"  # rt.policy may wrap it (Planned)
        self.num_planned = 0  # releases the step plan chose (plan="auto")
        # DTR's candidate sampling: score ~sqrt(N) random values instead of all N (seeded, so a
        # run repeats itself). Off by default: it makes tight budgets fail at random.
        self.rng = random.Random(0) if sampling else None
        self._allocs = -1   # the arena's allocation count when we last ran: same -> same request
        self._freed = 0     # bytes released one at a time for the pending request
        self._large = rt.budget // 4  # requests from this size up are first checked to be in reach
        self._beyond = False  # the pending request is beyond reach (_beyond_reach)
        # Time spent here, inside some op's allocation: the runtime takes it out of that op's
        # measured cost, which would otherwise depend on whether the op happened to hit pressure.
        # Per thread: the handler runs on the allocating thread, and another thread's handling while
        # this thread's kernel ran is not this op's (a shared count made costs negative).
        self.spent = _ThreadSeconds()
        self.seconds = 0.0  # every thread's, for memory_stats()["pressure_seconds"]

    def __call__(self, request: int, window) -> None:
        rt = self.rt
        with rt.lock:  # any thread may allocate; one handler or op bookkeeping at a time
            t0 = _perf()
            unmanaged = threading.get_ident() not in rt.threads.managed
            before = _progress(rt.arena) if unmanaged else None
            try:
                self._make_room(request, window)
            finally:
                spent = _perf() - t0
                _C.add_handler_seconds(spent)
                self.seconds += spent
            if unmanaged and _progress(rt.arena) == before:
                rt.threads.check_current(request)

    def _make_room(self, request: int, window) -> None:
        rt = self.rt
        allocs = rt.arena.num_allocs
        fresh = allocs != self._allocs  # a new request (the arena calls us again until it fits)
        if fresh:
            self._allocs, self._freed = allocs, 0
            rt.sweep()  # values whose last tensor died are freed already: count them as evicted
            self._beyond = request >= self._large and self._beyond_reach(request)
        elif self._beyond:  # asked again (after compaction: still no bytes released)
            self._beyond = self._beyond_reach(request)
        if self._beyond:
            return  # refused with nothing released: the caller may ask for less (cuDNN does)
        if fresh:
            # The free bytes cover it, only not in one block: slide them together first where the
            # moves cost less than the comeback of what a release would take.
            if not self.uses_window and rt.arena.main_free_bytes >= request and self._compact_first(request):
                return
        if self.uses_window:
            if not self._release_window(request) and not compact_for(rt, request):
                self._release_lowest(request)
        elif self._freed < request:
            best = self._lowest_scoring()
            # Only values a pending recompute waits for are left: one released comes straight back,
            # so where the free bytes cover the request, sliding them together goes first (asked
            # above already on a request's first call, with nothing changed since).
            if best is None and not fresh and rt.arena.main_free_bytes >= request and \
                    self._compact_first(request):
                return
            freed = self._release_lowest(request, best)
            self._freed += freed
            if not freed:  # nothing left to release: the free bytes may still be enough together
                compact_for(rt, request)
        elif not compact_for(rt, request):
            self._release_window(request)

    def _beyond_reach(self, request: int) -> bool:
        """Releasing every value would still leave fewer than ``request`` bytes free in the main
        region. Then nothing is released: the request fails either way, and the caller may go on
        with less (cuDNN asks for its largest workspace first and, refused, for less; releasing
        every activation for it cost their recomputes for nothing). Asked of large requests only
        (``_large``): the loop over the table is Python."""
        rt = self.rt
        swap = rt.swap
        if swap is not None and (swap.in_flight or swap.out_flight):
            return False  # copies in flight free device blocks as they finish
        total = rt.arena.main_free_bytes
        for r, _ in self._candidates(waiting=True):
            if total >= request:
                return False
            total += r.nbytes
        return total < request

    def _compact_first(self, request: int) -> bool:
        """Compact by moves alone where they cost less than releasing would: the comebacks of the
        values released, lowest score first, until ``request`` fits, or where their bytes reach it
        first, those and the moves of the compaction that follows (one that gathers nearly all the
        free bytes may move most of the arena, where a few releases leave it little to move). True
        when it compacted. The releases are priced first: where they cost nothing (two questions
        in three on Hugging Face GPT-2's test model under a plan: values read no more this step),
        no move is cheaper, and none is planned."""
        rt = self.rt
        if not rt.can_compact:
            return False
        picture = MovableAddresses(rt)

        def then(freed: set) -> float:  # the same picture of the arena
            after = rt.arena.plan_moves(request, picture.addresses, list(freed))
            return math.inf if after is None else rt.move_seconds(after[3], block_moves(after))
        path = release_path_seconds_in(rt.arena, request, self._release_order(), comeback_seconds, then)
        if path == 0.0:
            return False
        return compact_for(rt, request, lambda moved, blocks: path is None or rt.move_seconds(moved, blocks) < path,
                           picture)

    def _release_order(self) -> list:
        """Every candidate as (address, record), in the order releases take them: lowest score
        first, the oldest of equal scores first (from the scan in C++ where the policy has one)."""
        rt = self.rt
        if self.scan is not None:
            return self.scan.ranked(rt.table, *self._scan_state(), self._leaf_ok())
        cands = list(self._candidates())
        records = [r for r, _ in cands]
        scores = [rt.policy.evaluate(r, rt.clock) for r in records]
        ranked = sorted(range(len(cands)), key=lambda i: (scores[i], records[i].id))
        return [(cands[i][1].data_ptr, records[i]) for i in ranked]

    def release_for(self, deficit: int) -> bool:
        """allocator='native': nothing calls us before a refusal, so after one, release the
        lowest-scoring values until ``deficit`` bytes (what the refused request lacked) are gone.
        Counted from now: the failed op's partial allocations died with it and come back when it
        runs again. True if something was released."""
        self.rt.sweep()
        released = 0
        while released < deficit:
            n = self._release_lowest()
            if not n:
                break
            released += n
        return released > 0

    def _candidates(self, waiting: bool = False):
        """Every value we may release now: never inputs of a running op (locked); inputs a pending
        recompute waits for only when ``waiting``."""
        leaf_ok = self.rt.residency.leaf_releasable
        for r in self.rt.table.values():
            # alive: a collection inside the handler (the Python it runs) may free a storage after the
            # request's sweep
            if not r.evicted and r.locks == 0 and r.in_arena and not r.pins and (waiting or r.waits == 0) and \
                    (r.recipe is not None or leaf_ok(r)) and r.sref.alive:
                yield r, r.sref
        for r, (sref, _) in self.rt.cache.items():
            if r.recipe is not None and r.locks == 0 and (waiting or r.waits == 0):
                yield r, sref

    def _scan_state(self) -> tuple:
        """What the release scan reads besides the table: (cache, now, plan, neighbourhood or None
        where none is kept, host-link bandwidth)."""
        rt = self.rt
        res = rt.residency
        return (rt.cache, rt.clock, res.plan, res.neighbourhood if res.uses_neighbourhood else None,
                res.link_bandwidth)

    def _leaf_ok(self):
        """Residency.leaf_rule: what the scans take for leaf_releasable (None: no leaf goes)."""
        return self.rt.residency.leaf_rule()

    def _lowest_scoring(self):
        """The candidate with the lowest score (of equal ones the oldest, by record id: the table's
        order follows the storages' addresses, which the heap reuses differently from run to run),
        or None."""
        rt = self.rt
        now = rt.clock
        if self.scan is not None:
            return self.scan.lowest(rt.table, *self._scan_state(), self._leaf_ok())
        evaluate = rt.policy.evaluate
        best, best_score = None, math.inf
        candidates = (r for r, _ in self._candidates())
        if self.rng is not None:
            pool = list(candidates)
            candidates = sample_candidates(pool, self.rng, [r.nbytes for r in pool])
        for r in candidates:
            s = evaluate(r, now)
            if s < best_score or (s == best_score and best is not None and r.id < best.id):
                best, best_score = r, s
        return best

    def scores(self, records):
        """The policy's score of each of ``records`` now, as a list, from the scan; None where the
        policy scores in Python."""
        if self.scan is None:
            return None
        return self.scan.scores(records, *self._scan_state())

    def _release_lowest(self, request: int = 0, best=_UNSCANNED) -> int:
        """Release the lowest-scoring value (``best``, where the caller has scanned for it already; a
        waited-on one last; a prefetch in flight as the last resort, given up for ``request``).
        Returns the bytes freed."""
        rt = self.rt
        now, evaluate = rt.clock, rt.policy.evaluate
        if best is _UNSCANNED:
            best = self._lowest_scoring()
        if best is None:  # only inputs a pending recompute waits for: the one needed last goes
            best_key = (math.inf, math.inf, math.inf)
            for r, _ in self._candidates(waiting=True):
                k = (r.need_rank, evaluate(r, now), r.id)
                if k < best_key:
                    best, best_key = r, k
        if best is None:  # last resort: a prefetch's buffer, still filling
            return rt.swap.cancel_one(request) if rt.swap is not None else 0
        if rt.residency.plan is not None and rt.trace.guided:
            self.num_planned += 1
        rt.residency.release(best)
        return best.nbytes

    def _mark_window(self) -> dict:
        """Every arena block's owner and release cost for Coop's window search: owner 0 for a value
        that must stay (resets a window), the record id and its block cost for a candidate.
        Returns {id: record} of the candidates."""
        rt = self.rt
        if self.window_scan is not None:
            return self.window_scan.mark_window(rt.arena, rt.table, *self._scan_state(), self._leaf_ok(), rt.lo, rt.hi)
        arena, now, cost = rt.arena, rt.clock, rt.policy.block_cost
        owners = {}
        for r in rt.table.values():  # owner 0: not releasable; resets the window
            if r.in_arena and not r.evicted and (r.locks or r.waits or r.pins or
                                                 (r.recipe is None and not rt.residency.leaf_releasable(r))):
                addr = r.sref.data_ptr
                if addr:
                    arena.set_owner(addr, 0, 0.0)
        for r, (sref, _) in rt.cache.items():
            if r.locks or r.waits:
                arena.set_owner(sref.data_ptr, 0, 0.0)
        for r, sref in list(self._candidates()):
            addr = sref.data_ptr
            if addr and rt.lo <= addr < rt.hi:
                arena.set_owner(addr, r.id, cost(r, now))
                owners[r.id] = r
        return owners

    def _release_window(self, request: int) -> bool:
        rt = self.rt
        owners = self._mark_window()
        w = rt.arena.find_window(request)
        if w is None:
            return False
        for owner in w.owners:
            r = owners.get(owner)
            if r is not None and r.locks == 0 and rt.residency.is_available(r):
                rt.residency.release(r)
        return True
