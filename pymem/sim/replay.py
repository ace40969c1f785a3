"""Replay a Trace under a budget: what the runtime would release, recompute and copy, and what that
costs, at a scale no machine here has (issue 16's simulator).

The pieces are the runtime's own: the C++ arena (``virtual`` backing: addresses, no memory) places
every value, searches windows and compacts; the policy and director classes of ``pymem.policies``
choose; ``pymem.compaction_plan`` plans compactions; DTR's evicted neighbourhood is the same
union-find; ``pymem.restore_order`` orders recomputes. Only the bookkeeping around them is the
simulator's, and it follows the runtime's (``runtime/run_op``, ``pressure.py``, ``remat.py``):

- an op locks its inputs and brings back those that are away (an evicted one by replaying its
  missing ancestry forward, as remat.py does; an offloaded one by a copy), allocates its fresh outputs (an
  in-place op's output takes over the bytes of the value it rewrote), runs, and advances the
  clock by its cost; then the values that die after it are freed; while a kernel (an op or a
  recompute) runs, the blocks it reads or fills stay put, and nothing else is held in place (a
  locked value may move); a functional kernel refused its outputs runs once more after every
  block that may move, its inputs included, slides together (runtime.run_again);
- under pressure the handler compacts first where the free bytes cover the request and the moves
  cost less than the releases would (pressure._compact_first), else releases the lowest-scoring
  value one at a time while the bytes released for the request fall short of it, and compacts once
  they do not (Coop's window search for ``coop``); a released value is offloaded when it has a host copy already (an earlier
  offload's, a copy out ahead's) or the director says so (leaves are only ever offloaded, and only
  when offloading is on), evicted otherwise;
- costs: an op's seconds from the GPU cost model (``launch + max(flops / rate, bytes /
  bandwidth)``, pymem.gpus) or as the trace recorded them; a copy out is exposed (it completes
  before its buffer is reused; made on the compute stream, it shares the link with the copies out
  ahead, each at half its rate while both run), unless it was started ahead
  (``copy_ahead``: swap.py's copies out ahead of the values the step before offloaded, started
  from the op that made the value, the release expected first first, while fewer than
  ``_OUT_QUEUE_BYTES`` are queued, and waited for only by its release, or by an op that
  writes it in place; a block being copied out does not move; the plan's early release of such a
  value happens once its copy is done); copies back run on one queue
  beside compute, started ahead of
  use as swap.py starts them (the plan's next read first, ``_LEAD`` copy times ahead, further for
  a value whose use waited in an earlier step, or sooner when the copies queued behind it would
  otherwise come late, at most ``_PREFETCH_DEPTH`` in flight, only into
  free memory with the runtime's headroom; under pressure with nothing else to release, one in
  flight is waited for and given up, and prefetches leave that request's room free after), and an
  op waits only for what is left of its inputs' copies: ``copy_seconds_hidden`` is the rest.

A compaction's moves are copies on the device (``launch + bytes / (memory bandwidth / 2)`` each: read
and written), on the compute stream. With ``releases`` (a step plan's: pymem/sim/plan.py) values are
also released right after the op the plan names, as ``runtime.release_planned`` does; with
``retain`` (a ``rebuild`` plan's holds) a value the program frees stays in memory, releasable, until
right after the op the plan lets it go at, as the step trace holds its storage (csrc/step_plan.h).

Overhead = (the step's own seconds + recomputes + exposed copies + moves) / the step's own seconds.
Deterministic: nothing here reads a timer or a random number.
"""
import bisect
import heapq
import math
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from .. import _C
from .. import compaction_plan, restore_order
from ..errors import OutOfBudgetError
from ..gpus import LAUNCH_SECONDS, gpu_cost_model, gpu_spec
from ..policies import EvictedNeighbourhood, Planned, get_director, get_policy
from ..runtime.swap import (_BACKLOG_READS, _HEADROOM_SHARE, _LEAD, _MAX_LEAD_BOOST, _OUT_QUEUE_BYTES,
                            _PREFETCH_DEPTH, BacklogWindow)
from .trace import Trace

NEW, RESIDENT, EVICTED, OFFLOADED, GONE = range(5)
THRASH = 2.0  # overhead above which a run counts as thrashing


class SimError(RuntimeError):
    """The trace asks for something the replay cannot do (a value read before it is made, or one
    that is gone with no way back)."""


class _Value:
    """One value of the trace, as a policy sees it (pymem.policies.TensorView)."""

    __slots__ = ("sim", "index", "nbytes", "compute_cost", "last_access", "recipe", "state", "addr", "locks",
                 "busy", "host", "host_at", "dead", "ready_at", "waits", "need_rank")

    def __init__(self, sim: "Simulator", index: int, nbytes: int, recipe: bool) -> None:
        self.sim, self.index, self.nbytes, self.recipe = sim, index, nbytes, recipe
        self.compute_cost = 0.0
        self.last_access = 0.0
        self.state = NEW
        self.addr = 0
        self.locks = 0      # > 0: an op or recompute needs it: not released (it may move)
        self.busy = 0       # > 0: a kernel now running reads or fills it (runtime: rt.running): stays put
        self.host = False   # a host copy exists, or is being made (then complete at host_at)
        self.host_at = 0.0
        self.dead = False   # the program freed it: it lives on only for recomputes that read it
        self.ready_at = 0.0  # > 0: copied back ahead of use; its copy completes at this clock
        self.waits = 0       # > 0: a pending restore reads it (released only as a last resort)
        self.need_rank = 0   # how soon that restore reads it (higher: sooner)

    @property
    def evicted_neighbour_cost(self) -> float:
        return self.sim.neighbourhood.neighbour_cost(self.sim.neighbours(self.index))

    @property
    def evicted_ancestor_cost(self) -> float:
        sim = self.sim
        total, seen = 0.0, set()
        stack = list(sim.parents(self.index)) if self.recipe else []
        while stack and len(seen) < 64:
            r = sim.values[stack.pop()]
            if r.index in seen or r.state == RESIDENT:
                continue
            seen.add(r.index)
            if r.host:
                total += r.swap_cost
                continue
            total += r.compute_cost
            if r.recipe:
                stack.extend(sim.parents(r.index))
        return total

    @property
    def swap_cost(self) -> float:
        return self.nbytes / self.sim.link_bytes_per_s

    @property
    def has_host_copy(self) -> bool:
        return self.host and self.host_at <= self.sim.clock

    @property
    def next_use(self) -> Optional[float]:
        return self.sim.seconds_to_next_use(self.index, 8) if self.sim.planned else None


class Simulator:
    """``Simulator(trace, budget, policy="dtr", offload="never", plan="off", device="h100").run()``
    -> the result dict (see ``run``). ``device=None`` replays the costs the trace recorded.
    ``placement``: the runtime's step placement (csrc/step_placement.h), on with the plan the step
    before left, ``(offsets, sizes)`` as ``Arena.step_placement_plan()`` gives it (``([], [])``:
    on, nothing learned yet; None: off); after ``run``, ``next_placement`` is the next step's."""

    def __init__(self, trace: Trace, budget: int, policy: str = "dtr", offload: str = "never", plan: str = "off",
                 device: Optional[str] = "h100", search: str = "handler", link_bytes_per_s: Optional[float] = None,
                 prefetch: bool = True, releases: Sequence[Tuple[int, int]] = (), releases_chains: bool = False,
                 lead: Optional[Dict[int, float]] = None, move_bytes_per_s: Optional[float] = None,
                 copy_ahead: Optional[Dict[int, object]] = None,
                 placement: Optional[Tuple[Sequence[int], Sequence[int]]] = None,
                 retain: Optional[Dict[int, int]] = None) -> None:
        if plan not in ("auto", "off"):
            raise ValueError(f"plan must be 'auto' or 'off', got {plan!r}")
        releases = [(int(k), int(v)) for k, v in releases]
        if releases and plan != "auto":
            raise ValueError("early releases come from a step plan: give plan='auto' with them")
        bad = [(k, v) for k, v in releases if not (0 <= k < trace.num_ops and 0 <= v < trace.num_values)]
        if bad:
            raise ValueError(f"releases must be (op position, value) pairs of the trace (0..{trace.num_ops - 1}, "
                             f"0..{trace.num_values - 1}); got {bad[:3]}")
        copy_ahead = {int(v): (int(k), int(k)) if np.ndim(k) == 0 else (int(k[0]), int(k[1]))
                      for v, k in (copy_ahead or {}).items()}
        bad = [(v, k) for v, (k, _) in copy_ahead.items() if not (0 <= v < trace.num_values and -1 <= k < trace.num_ops)]
        if bad:
            raise ValueError(f"copy_ahead must map values of the trace (0..{trace.num_values - 1}) to the op "
                             f"after which their copy out may start (-1: the step's start), or to that and "
                             f"the position of their expected release; got {bad[:3]}")
        retain = {int(v): int(k) for v, k in (retain or {}).items()}
        bad = [(v, k) for v, k in retain.items() if not (0 <= v < trace.num_values and 0 <= k < trace.num_ops)]
        if bad:
            raise ValueError(f"retain must map values of the trace (0..{trace.num_values - 1}) to the op after "
                             f"which they are let go (0..{trace.num_ops - 1}); got {bad[:3]}")
        if retain and plan != "auto":
            raise ValueError("retained values come from a step plan: give plan='auto' with them")
        if placement is not None and (len(placement) != 2 or len(placement[0]) != len(placement[1])):
            raise ValueError("placement must be (offsets, sizes) of equal lengths, as "
                             "Arena.step_placement_plan() gives them")
        if not isinstance(budget, (int, np.integer)) or budget <= 0:
            raise ValueError(f"budget must be a positive number of bytes, got {budget!r}")
        self.trace, self.budget = trace, int(budget) // _C.ALIGNMENT * _C.ALIGNMENT  # the arena's unit
        base_policy = get_policy(policy)
        self.policy = Planned(base_policy) if plan == "auto" else base_policy
        self.planned = plan == "auto"
        self.director = get_director(offload)
        self.offload_leaves = offload != "never"
        self.uses_window = policy == "coop"
        self.seconds = _op_seconds(trace, device)
        # A compaction's move reads and writes the block on the device; with recorded costs, at
        # ``move_bytes_per_s`` if given (the runtime's is timed, so none is assumed here).
        if move_bytes_per_s is None and device:
            move_bytes_per_s = gpu_spec(device).memory_bytes_per_s / 2
        self.move_bytes_per_s = move_bytes_per_s
        self.launch = LAUNCH_SECONDS if device else 0.0
        if link_bytes_per_s is None:
            link_bytes_per_s = gpu_spec(device).host_bytes_per_s if device else 32e9
        self.link_bytes_per_s = float(link_bytes_per_s)
        # As the runtime's (hooks.py): the handler searches windows itself, when it wants one.
        self.arena = _C.Arena(self.budget, "virtual", search=search)
        self.arena.set_pressure_handler(self._on_pressure)
        # The runtime's step placement (csrc/step_placement.h, on with its plan): the plan the step
        # before left, taken over once the values made before the step are in; after the step,
        # next_placement is the plan for the step after it.
        self.placement = None if placement is None else ([int(x) for x in placement[0]], [int(x) for x in placement[1]])
        self.next_placement: Optional[Tuple[List[int], List[int]]] = None
        self.step_start: List[Tuple[int, int]] = []  # (address, size) of the blocks the step starts with
        self.main_end = self.arena.base + self.budget - self.arena.small_region_size  # the small region above
        self.neighbourhood = EvictedNeighbourhood()
        n, m = trace.num_ops, trace.num_values
        self.values: List[_Value] = [_Value(self, v, int(trace.value_bytes[v]), bool(trace.value_recomputable[v]))
                                     for v in range(m)]
        for v in self.values:  # a leaf's return costs its copies, out and back (residency.leaf_releasable)
            if not v.recipe:
                v.compute_cost = 2 * v.swap_cost
        self.by_addr: Dict[int, _Value] = {}
        # Each op's inputs and outputs as lists of ints: the policies' scores walk them (a slice
        # of the trace's arrays per visit cost a fifth of a replay).
        self.op_ins: List[List[int]] = [trace.op_inputs(k).tolist() for k in range(n)]
        self.op_outs: List[List[int]] = [trace.op_outputs(k).tolist() for k in range(n)]
        # readers[v]: ops that read v, ascending
        readers: List[List[int]] = [[] for _ in range(m)]
        for k in range(n):
            for v in self.op_ins[k]:
                if not readers[v] or readers[v][-1] != k:
                    readers[v].append(k)
        self.readers = readers
        self._neighbours: List[Optional[List[int]]] = [None] * m
        self.before = np.concatenate([[0.0], np.cumsum(self.seconds)])  # planned seconds before op k
        self.frees_after: Dict[int, List[int]] = {}
        for v, k in enumerate(trace.value_free_at):
            if k >= 0 and trace.value_producer[v] <= k:
                self.frees_after.setdefault(int(k), []).append(v)
        self.clock = 0.0
        self.position = 0
        self.recompute_seconds = 0.0
        self.copy_seconds = 0.0
        self.evictions = self.offloads = self.recomputes = self.copies_back = 0
        self.offloaded_bytes = 0
        self._allocs, self._freed = -1, 0
        self.released: List[int] = []  # values released under pressure, in order (the decisions)
        self.released_at: List[int] = []  # the op running (or recomputing for) at each
        # The step plan's early releases (csrc/step_plan.h): due[k], the values released right after
        # op k; a learned plan leaves a value with evicted readers to pressure, a cover does not.
        self.due: Dict[int, List[int]] = {}
        for k, v in releases:
            self.due.setdefault(k, []).append(v)
        self.releases_chains = releases_chains
        self.planned_releases = 0
        # The step plan's retained values (csrc/step_plan.h): retain[v], the op after which v, kept
        # past the program's free of it for a rerun that reads it, is let go; let_go[k], those held then.
        self.retain = retain
        self.let_go: Dict[int, List[_Value]] = {}
        self.retained = 0
        # What the step trace notes for the next step's plan (csrc/step_trace.h: releases, comebacks).
        self.events: Dict[str, List[int]] = {"released_at": [], "released_value": [], "back_at": [], "back_value": []}
        self.move_seconds = 0.0
        # Copies back ahead of use (swap.py's prefetch): by the plan's next read (a heap), else the
        # newest offloaded first; at most _PREFETCH_DEPTH in flight, only into free memory.
        self.prefetch = prefetch
        self.headroom = self.budget // _HEADROOM_SHARE  # as the runtime's (runtime.py)
        self.away_planned: List[tuple] = []
        self.away_stack: List[int] = []
        self.in_flight: Dict[int, float] = {}
        self.window = BacklogWindow()  # swap.latest_start of away_planned, as the runtime keeps it
        self.h2d_free = 0.0   # when the copy-back queue is next idle
        # swap.py's feedback: a value whose use waited for its copy back starts it twice as far
        # ahead in the steps after (kept across the steps pymem/sim/plan.py replays).
        self.lead: Dict[int, float] = {} if lead is None else lead
        self.late_uses = 0
        self.prefetches_cancelled = 0
        self.retries = 0  # kernels run again after a refused allocation (runtime: num_retries)
        self.prefetch_backoff = 0  # bytes a cancelled prefetch's request needed: left free after
        self.copy_hidden = 0.0
        self.prefetches = 0
        # Copies out ahead (swap.copy_ahead): ahead_after[k], the (expected release, value) pairs
        # whose copy may start after op k (-1: at the step's start); they wait in ahead_waiting
        # (a heap: the release expected first goes first) while _OUT_QUEUE_BYTES are queued
        # (out_queued: (done at, bytes)) on the queue to the host, idle from d2h_free.
        self.ahead_after: Dict[int, List[Tuple[int, int]]] = {}
        for v, (k, due) in sorted(copy_ahead.items()):
            self.ahead_after.setdefault(k, []).append((due, v))
        self.ahead_waiting: List[Tuple[int, int]] = []
        self.out_queued: List[Tuple[float, int]] = []
        self.out_queued_bytes = 0
        self.out_pending: List[_Value] = []  # values whose copy out ahead may not be done yet
        self.d2h_free = 0.0
        self.release_when_copied: List[_Value] = []  # planned releases waiting for their copy out
        self.copies_ahead = 0
        self.copy_out_exposed = 0.0
        self.offloaded_at: Dict[int, int] = {}  # value -> step position of its first offload (for the next step)

    # --- the graph ---
    def parents(self, v: int):
        """What a rerun of v's producer reads: its inputs, less the value it overwrote unread
        (value_blank_rerun: the runtime's recipe takes a blank buffer for it)."""
        p = int(self.trace.value_producer[v])
        if p < 0:
            return ()
        if self.trace.value_blank_rerun[v]:
            blank = int(self.trace.value_overwrites[v])
            return [w for w in self.op_ins[p] if w != blank]
        return self.op_ins[p]

    def neighbours(self, v: int) -> List[int]:
        """v's neighbours in the op graph (its recipe's inputs, the values made from it): fixed, so
        kept once computed (policies ask for them at every score)."""
        out = self._neighbours[v]
        if out is None:
            out = [int(i) for i in self.parents(v)] if self.values[v].recipe else []
            for k in self.readers[v]:
                out.extend(self.op_outs[k])
            self._neighbours[v] = out
        return out

    def seconds_to_next_use(self, v: int, depth: int) -> float:
        """Planned seconds from now to the next op reading v, or reading it through the recompute of
        an evicted value made from it (``depth`` levels of those); inf: none this step."""
        r = self.readers[v]
        i = bisect.bisect_left(r, self.position)
        d = self.before[r[i]] - self.before[self.position] if i < len(r) else math.inf
        if depth:
            for k in self.readers[v][:i]:  # ops already run: their outputs may be evicted now
                for c in self.op_outs[k]:
                    cv = self.values[c]
                    if cv.state == EVICTED and cv.recipe:  # dead too: it rebuilds a reader (records.py)
                        d = min(d, self.seconds_to_next_use(c, depth - 1))
        return d

    # --- memory ---
    def _allocate(self, v: _Value) -> None:
        if v.nbytes == 0:
            v.addr = 0
        else:
            try:
                v.addr = self.arena.allocate(v.nbytes, owner=v.index + 1)
            except OutOfBudgetError as e:
                raise _OOM(str(e)) from None
            self.by_addr[v.addr] = v
        v.state = RESIDENT

    def _free(self, v: _Value) -> None:
        if v.addr:
            self.by_addr.pop(v.addr, None)
            self.arena.free(v.addr)
        v.addr = 0

    def _release(self, v: _Value, at: Optional[int] = None) -> int:
        """Offload or evict a resident, unlocked value: its bytes are free after. ``at``: the step
        position the step trace notes it at (default: the op running)."""
        if at is None:
            self.released.append(v.index)
            self.released_at.append(self.position)
        self._note("released", self.position if at is None else at, v)
        if v.ready_at:  # copied back ahead of use, released again before it: that copy was for nothing
            self.in_flight.pop(v.index, None)
            v.ready_at = 0.0
        if not v.recipe or (not v.dead and (v.host or self.director.evaluate(v, self.clock))):
            self._copied_out(v)
            self.offloaded_at.setdefault(v.index, self.position if at is None else at)
            v.state = OFFLOADED
            self.offloads += 1
            self.offloaded_bytes += v.nbytes
            self._queue(v, at)
        else:
            v.state = EVICTED
            self.neighbourhood.on_evict(v.index, v.compute_cost, self.neighbours(v.index))
            self.evictions += 1
        self._free(v)
        return v.nbytes

    def _copied_out(self, v: _Value) -> None:
        """v's host copy is complete before its buffer is reused: the rest of a copy started ahead,
        else a copy now (``_copy_out_now``)."""
        if not v.host:
            self._copy_out_now(v)
        wait = max(0.0, v.host_at - self.clock)
        self.copy_out_exposed += wait
        self._spend_copy(wait)

    def _queue_out(self, v: _Value) -> None:
        """v's copy to the host, behind those queued: its host copy is complete at host_at."""
        v.host, v.host_at = True, max(self.clock, self.d2h_free) + v.swap_cost
        self.d2h_free = v.host_at

    def _copy_out_now(self, v: _Value) -> None:
        """A copy out that the release waits for runs on the compute stream (swap.py), beside the
        copies out ahead on their own stream, not behind them: while both run, each moves at half
        the link's rate. With q seconds of copies ahead queued and b of its own: it is done after
        2b when q >= b (the queue lost b), else after q + b (the queue took 2q)."""
        b = v.swap_cost
        q = max(0.0, self.d2h_free - self.clock)
        done, delay = (2 * b, b) if q >= b else (q + b, q)
        v.host, v.host_at = True, self.clock + done
        if delay > 0.0:  # every copy ahead not done yet ends later by what it lost
            now = self.clock
            self.d2h_free += delay
            self.out_queued = [(t + delay if t > now else t, n) for t, n in self.out_queued]
            pending = []
            for u in self.out_pending:
                if u.host and u.host_at > now:
                    u.host_at += delay
                    pending.append(u)
            self.out_pending = pending

    def _copy_ahead(self, at: int) -> None:
        """swap.copy_ahead: the values whose copy out may start after op ``at`` wait for the queue."""
        for item in self.ahead_after.get(at, ()):
            heapq.heappush(self.ahead_waiting, item)
        self._start_copies_out()

    def _start_copies_out(self) -> None:
        """swap._start_ahead: while fewer than _OUT_QUEUE_BYTES are queued to the host, start the
        copy out of the waiting value whose release is expected first, beside compute, while it
        stays resident."""
        queued = self.out_queued
        while queued and queued[0][0] <= self.clock:
            self.out_queued_bytes -= heapq.heappop(queued)[1]
        waiting = self.ahead_waiting
        while waiting and self.out_queued_bytes < _OUT_QUEUE_BYTES:
            v = self.values[heapq.heappop(waiting)[1]]
            if v.state == RESIDENT and not v.host and not v.dead and v.nbytes:
                self._queue_out(v)
                self.out_pending.append(v)
                heapq.heappush(queued, (v.host_at, v.nbytes))
                self.out_queued_bytes += v.nbytes
                self.copies_ahead += 1

    def _queue(self, v: _Value, at: Optional[int] = None) -> None:
        """Queue v's copy back by its next read at or after ``at`` (default: the op running; a
        planned release after op k: k + 1, as the runtime's plan has moved on by then)."""
        r = self.readers[v.index]
        i = bisect.bisect_left(r, self.position if at is None else at)
        if self.planned and i < len(r):
            heapq.heappush(self.away_planned, (r[i], v.index))
            self.window.queued((r[i], v.index))
        else:
            self.away_stack.append(v.index)

    def _worth_prefetching(self, v: _Value) -> bool:
        """Away on the host, and some op of the rest of the step reads it."""
        r = self.readers[v.index]
        return v.state == OFFLOADED and not v.dead and bisect.bisect_left(r, self.position) < len(r)

    def _prefetch(self) -> None:
        """Start copies back while they fit (swap.after_op): the plan's next read first, not before
        that read is _LEAD copy times away; else the newest offloaded first."""
        for i in [i for i, t in self.in_flight.items() if t <= self.clock]:
            del self.in_flight[i]  # adopted (swap._adopt): back, as the step trace notes it
            self._note("back", self.position, self.values[i])
        planned, stack = self.away_planned, self.away_stack
        while (planned or stack) and len(self.in_flight) < _PREFETCH_DEPTH:
            v = self.values[planned[0][1] if planned else stack[-1]]
            if not self._worth_prefetching(v):
                self.window.took(heapq.heappop(planned)) if planned else stack.pop()
                continue
            if planned:
                margin = _LEAD * self.lead.get(v.index, 1.0) * v.swap_cost
                if self.before[planned[0][0]] - self.before[self.position] > margin and \
                        not self._behind(margin - v.swap_cost):
                    return
            if self.arena.largest_free_block < v.nbytes + self.headroom + self.prefetch_backoff:
                return
            self.window.took(heapq.heappop(planned)) if planned else stack.pop()
            self._allocate(v)  # fits: no pressure
            start = max(self.clock, self.h2d_free)
            v.ready_at = self.h2d_free = start + v.swap_cost
            self.in_flight[v.index] = v.ready_at
            self.prefetches += 1

    def _behind(self, margin: float) -> bool:
        """swap._behind: the planned copies back queued are so many that the next must start now."""
        window = self.window
        if not window.valid:
            head = heapq.nsmallest(_BACKLOG_READS, self.away_planned)
            entries = [(at, i) for at, i in head if self._worth_prefetching(self.values[i])]
            window.build(entries, [(self.before[at], self.values[i].swap_cost) for at, i in entries],
                         head[-1] if head else None, len(self.away_planned) > len(head))
        busy = sum(self.values[i].swap_cost for i, t in self.in_flight.items() if t > self.clock)
        return window.latest() - self.before[self.position] - busy <= margin

    def _arrive(self, v: _Value) -> None:
        """v was copied back ahead of use and is read now: wait for what is left of its copy."""
        wait = max(0.0, v.ready_at - self.clock)
        if wait > 0:
            self._late(v)
        self._spend_copy(wait)
        self.copy_hidden += v.swap_cost - wait
        if self.in_flight.pop(v.index, None) is not None:  # not adopted yet: back now
            self._note("back", self.position, v)
        v.ready_at = 0.0
        self.copies_back += 1

    def _note(self, what: str, at: int, v: _Value) -> None:
        """As the step trace notes a value of the step (made in it) leaving or coming back."""
        if self.trace.value_producer[v.index] >= 0:
            self.events[what + "_at"].append(at)
            self.events[what + "_value"].append(v.index)

    def _late(self, v: _Value) -> None:
        """swap._late: a use waited for v's copy back; where a plan placed it, start it earlier."""
        if self.planned:
            self.late_uses += 1
            self.lead[v.index] = min(self.lead.get(v.index, 1.0) * 2.0, _MAX_LEAD_BOOST)

    def _spend_copy(self, seconds: float) -> None:
        self.copy_seconds += seconds
        self.clock += seconds

    def _releasable(self, v: _Value) -> bool:
        """As the runtime's records (backends.ArenaBackend.releasable): a block of the main region over
        one grain, not locked or read by a running kernel, and not a copy back in flight."""
        return v.state == RESIDENT and v.locks == 0 and v.busy == 0 and v.nbytes > _C.ALIGNMENT and \
            v.addr < self.main_end and (v.recipe or self.offload_leaves) and v.ready_at <= self.clock

    # --- the pressure handler (pressure.py's protocol) ---
    def _on_pressure(self, request: int, _window) -> None:  # searches windows itself, when it wants one
        allocs = self.arena.num_allocs
        fresh = allocs != self._allocs
        if fresh:
            self._allocs, self._freed = allocs, 0
            if not self.uses_window and self.arena.main_free_bytes >= request and self._compact_first(request):
                return
        if self.uses_window:
            if not self._release_window(request) and not self._compact(request):
                self._release_lowest(request, self._lowest())
        elif self._freed < request:
            best = self._lowest()
            # Only values a pending restore waits for are left: one released comes straight back,
            # so where the free bytes cover the request, sliding them together goes first (asked
            # above already on a request's first call, with nothing changed since).
            if (best is None or best.waits > 0) and not fresh and self.arena.main_free_bytes >= request and \
                    self._compact_first(request):
                return
            freed = self._release_lowest(request, best)
            self._freed += freed
            if not freed:
                self._compact(request)
        elif not self._compact(request):
            self._release_window(request)

    def _release_key(self, v: _Value) -> tuple:
        """The order pressure releases in: what no restore waits for first, by the policy's score,
        the oldest of equal scores first (as the runtime's scan)."""
        return (v.waits > 0 and v.need_rank, self.policy.evaluate(v, self.clock), v.index)

    def _lowest(self) -> Optional[_Value]:
        return min((v for v in self.by_addr.values() if self._releasable(v)), key=self._release_key, default=None)

    def _compact_first(self, request: int) -> bool:
        """pressure._compact_first: by moves alone where moving costs less than the comebacks of the
        values released, lowest score first, until ``request`` fits (or until their bytes reach it,
        and the moves of the compaction after them); the releases priced first, and no move
        planned where they cost nothing."""
        order = sorted(((a, v) for a, v in self.by_addr.items() if self._releasable(v)),
                       key=lambda av: self._release_key(av[1]))
        movable = self._movable()
        addrs = list(movable)

        def then(freed: set) -> float:
            after = self.arena.plan_moves(request, addrs, list(freed))
            return math.inf if after is None else self._move_seconds(after[3], compaction_plan.block_moves(after))
        path = compaction_plan.release_path_seconds_in(self.arena, request, order, compaction_plan.comeback_seconds,
                                                       then)
        if path == 0.0:
            return False
        return self._compact(request, lambda moved, blocks: path is None or self._move_seconds(moved, blocks) < path,
                             movable)

    def _move_seconds(self, nbytes: int, blocks: int) -> float:
        """Moving ``nbytes`` in at most ``blocks`` copies on the device (a price to compare, as the
        runtime's): each a launch, as each recompute's op cost holds one."""
        return nbytes / self.move_bytes_per_s + blocks * self.launch if self.move_bytes_per_s else 0.0

    def _movable(self) -> Dict[int, tuple]:
        """compaction.movable_blocks: addr -> (value, None, releasable) for the blocks that may move
        now (a block being copied out, or read by a kernel running, stays)."""
        return {a: (v, None, self._releasable(v)) for a, v in self.by_addr.items()
                if v.busy == 0 and v.host_at <= self.clock}

    def _release_lowest(self, request: int, best: Optional[_Value]) -> int:
        """pressure._release_lowest: ``best``, the lowest score among values no restore waits for,
        else the waited-on value read last (``_lowest``); else, as a last resort, a copy back still
        in flight."""
        if best is None:
            return self._cancel_prefetch(request)
        return self._release(best)

    def _cancel_prefetch(self, request: int) -> int:
        """swap.cancel_one: the oldest copy back in flight is waited for and its buffer given up;
        the value waits on the host again, and prefetches leave room for ``request`` from now on."""
        for i in self.in_flight:
            v = self.values[i]
            if v.locks == 0:
                break
        else:
            return 0
        del self.in_flight[i]
        self._spend_copy(max(0.0, v.ready_at - self.clock))
        v.ready_at = 0.0
        self._free(v)
        v.state = OFFLOADED
        self._queue(v)
        self.prefetches_cancelled += 1
        self.prefetch_backoff = max(self.prefetch_backoff, request)
        return v.nbytes

    def _release_window(self, request: int) -> bool:
        cost, now = self.policy.block_cost, self.clock
        for v in self.by_addr.values():
            self.arena.set_owner(v.addr, v.index + 1 if self._releasable(v) else 0,
                                 cost(v, now) if self._releasable(v) else 0.0)
        w = self.arena.find_window(request)
        if w is None:
            return False
        for owner in w.owners:
            v = self.values[owner - 1]
            if self._releasable(v):
                self._release(v)
        return True

    def _compact(self, request: int, worth: Optional[Callable[[int, int], bool]] = None,
                 movable: Optional[Dict[int, tuple]] = None) -> bool:
        """compaction.compact_for: with ``worth``, by moves alone (the arena's plan_moves), over
        ``movable`` where the caller found it already."""
        if movable is None:
            movable = self._movable()
        if worth is not None:
            chosen = self.arena.plan_moves(request, list(movable))
            if chosen is None or not worth(chosen[3], compaction_plan.block_moves(chosen)):
                return False
            _, moves, window, _ = chosen
            for old, new in moves:
                self.arena.move_block(old, new)
                self._moved(old, new)
            for old, new in self.arena.compact(window):
                self._moved(old, new)
            return True
        evaluate, cost, now = self.policy.evaluate, self.policy.block_cost, self.clock
        chosen = compaction_plan.plan_in(self.arena, request, movable, lambda vs: [evaluate(v, now) for v in vs],
                                         lambda v, _: cost(v, now))
        if chosen is None:
            return False
        _, moves, window, _, victims = chosen
        for old, new in moves:
            self.arena.move_block(old, new)
            self._moved(old, new)
        for v in victims:
            if self._releasable(v):
                self._release(v)
        for old, new in self.arena.compact(window):
            self._moved(old, new)
        return True

    def _moved(self, old: int, new: int) -> None:
        v = self.by_addr.pop(old)
        v.addr = new
        self.by_addr[new] = v
        if self.move_bytes_per_s:  # a device-to-device copy on the compute stream
            seconds = self.launch + v.nbytes / self.move_bytes_per_s
            self.move_seconds += seconds
            self.clock += seconds

    # --- running the step ---
    # --- bringing values back (remat.py's restore order, on the simulator's values) ---
    def _restore(self, targets: List[_Value]) -> None:
        """Make every target resident: their missing ancestry replayed forward in creation order."""
        targets = [v for v in targets if v.state != RESIDENT]
        if targets:
            left = [_THRASH_FACTOR * (len(self.by_addr) + 64)]

            def tick() -> None:
                left[0] -= 1
                if left[0] < 0:
                    raise _OOM(f"restoring value {targets[0].index} thrashes")
            restore_order.replay(_SimValues(self), targets, tick)

    def _bring_back(self, v: _Value) -> None:
        """One value back: copied (offloaded: on demand, behind the copies queued) or recomputed
        from its producer's inputs (resident now; locked while it runs)."""
        self._note("back", self.position, v)
        if v.state == OFFLOADED:
            self._late(v)
            self._allocate(v)
            done = max(self.clock, self.h2d_free) + v.swap_cost
            self.h2d_free = done
            self._spend_copy(done - self.clock)
            self.copies_back += 1
            v.last_access = self.clock
            return
        p = int(self.trace.value_producer[v.index])
        inputs = [self.values[i] for i in self.parents(v.index)]
        for a in inputs:
            a.locks += 1
        try:
            self._kernel_outputs(inputs, [v], retry=self.trace.value_overwrites[v.index] < 0)
        finally:
            for a in inputs:
                a.locks -= 1
        self.neighbourhood.on_rematerialize(v.index)
        cost = self.seconds[p]
        self.clock += cost
        self.recompute_seconds += cost
        self.recomputes += 1
        v.last_access = self.clock

    def _cut_dependents(self, leaf: _Value) -> None:
        """remat.invalidate_dependents: ``leaf`` is about to be written in place, so every recipe
        that read its old value, directly or through other recipes, is invalid (the first step's
        AdamW state, zeros_like of a parameter the step then rewrites). Those still alive come back
        now, while the old value is here, and become leaves."""
        closure, seen, stack = [], {leaf.index}, [leaf.index]
        while stack:
            for k in self.readers[stack.pop()]:
                for o in self.op_outs[k]:
                    c = self.values[o]
                    if c.index not in seen and c.recipe and c.state != NEW:
                        seen.add(c.index)
                        closure.append(c)
                        stack.append(c.index)
        if not closure:
            return
        closure.sort(key=lambda c: c.index)  # creation order: ancestors come back first
        held = [c for c in closure if c.state == RESIDENT]
        for c in held:
            c.locks += 1
        try:
            for c in closure:
                if c.state == EVICTED and not c.dead:
                    self._restore([c])
                    c.locks += 1
                    held.append(c)
        finally:
            for c in held:
                c.locks -= 1
        for c in closure:
            if not c.dead:
                c.recipe = False
                c.compute_cost = 2 * c.swap_cost  # a leaf's return: its copies, out and back

    def _kernel_outputs(self, ins: List[_Value], outs: List[_Value], retry: bool) -> None:
        """Allocate the fresh outputs of a kernel that reads ``ins``: none of them moves meanwhile
        (runtime: ``rt.running``; a block a kernel still fills is not the runtime's yet). A refused
        functional kernel exits leaving no trace, and the runtime runs it once more after sliding
        every block that may move, its inputs included (``run_again``, compaction.py's
        ``defragment_after_failure``): so does this."""
        for i in ins:
            i.busy += 1
        made: List[_Value] = []  # allocated so far, held in place (busy)
        try:
            try:
                self._allocate_held(outs, made)
            except _OOM:
                if not retry:
                    raise
                for v in made:  # the partial outputs died with the refused kernel
                    v.busy -= 1
                    self._free(v)
                    v.state = NEW
                made.clear()
                for i in ins:
                    i.busy -= 1
                moved = self._defragment()
                for i in ins:
                    i.busy += 1
                if not moved:
                    raise
                self.retries += 1
                self._allocate_held(outs, made)
        finally:
            for i in ins:
                i.busy -= 1
            for v in made:
                v.busy -= 1

    def _allocate_held(self, outs: List[_Value], made: List[_Value]) -> None:
        for v in outs:
            self._allocate(v)
            v.busy += 1
            made.append(v)

    def _defragment(self) -> bool:
        """compaction.defragment_after_failure: every block that may move slides up against the
        next one that may not. True when something moved."""
        main_hi = self.main_end  # the small region never compacts
        movable = sorted(a for a, v in self.by_addr.items() if a < main_hi and v.busy == 0 and v.host_at <= self.clock)
        moved = self.arena.compact(movable)
        for old, new in moved:
            self._moved(old, new)
        return bool(moved)

    def _drop(self, v: _Value) -> None:
        """The program freed v: its bytes go; a recipe keeps it reachable for recomputes (as an
        evicted value, in DTR's neighbourhood like one)."""
        if v.state == RESIDENT:
            self._free(v)
        if v.state in (RESIDENT, OFFLOADED):
            if v.recipe:
                self.neighbourhood.on_evict(v.index, v.compute_cost, self.neighbours(v.index))
            v.state = EVICTED if v.recipe else GONE
        v.host, v.host_at = False, 0.0

    def _run_op(self, k: int) -> None:
        t = self.trace
        self.position = k
        if self.release_when_copied:
            self._release_copied()
        if self.ahead_waiting:
            self._start_copies_out()
        if self.prefetch and (self.away_planned or self.away_stack or self.in_flight):  # swap.after_op's condition
            self._prefetch()
        ins = [self.values[i] for i in self.op_ins[k]]
        for i in ins:  # locked first, then the missing ones restored (runtime.run_op)
            i.locks += 1
        try:
            self._restore(ins)
            for i in ins:
                if i.ready_at:
                    self._arrive(i)
            fresh, taken = [], []
            for o in self.op_outs[k]:
                v = self.values[o]
                w = int(t.value_overwrites[o])
                if w >= 0 and self.values[w].state == RESIDENT:  # in place: v takes over w's bytes
                    old = self.values[w]
                    if not old.recipe:
                        self._cut_dependents(old)
                    if old.host_at > self.clock:  # its copy out reads them: done first
                        self._spend_copy(old.host_at - self.clock)
                    v.addr, old.addr = old.addr, 0
                    if v.addr:
                        self.by_addr[v.addr] = v
                        self.arena.set_owner(v.addr, v.index + 1, 0.0)
                    v.state = RESIDENT
                    taken.append(v)  # the kernel writes these bytes: they stay put as its inputs do
                    old.dead = True
                    old.state = EVICTED if old.recipe else GONE
                    if old.recipe:
                        self.neighbourhood.on_evict(old.index, old.compute_cost, self.neighbours(old.index))
                else:
                    fresh.append(v)
            if fresh:  # an op that writes in place may have written before it ran out: no retry
                self._kernel_outputs(ins + taken, fresh, retry=bool((t.value_overwrites[self.op_outs[k]] < 0).all()))
        finally:
            for i in ins:
                i.locks -= 1
        cost = self.seconds[k]
        self.clock += cost
        for i in ins:
            i.last_access = self.clock
        for o in self.op_outs[k]:
            v = self.values[o]
            v.last_access = self.clock
            if v.recipe:
                v.compute_cost = cost
        for d in self.frees_after.get(k, ()):
            v = self.values[d]
            v.dead = True
            until = self.retain.get(d, -1)
            if until > k and v.state == RESIDENT:  # held past the program's free (StepTrace::hold)
                self.let_go.setdefault(until, []).append(v)
                self.retained += 1
            elif v.locks == 0:
                self._drop(v)
        for v in self.let_go.pop(k, ()):  # the hold ends: what a rerun rebuilt or kept goes
            if v.state == RESIDENT and v.locks == 0:
                self._drop(v)
        if k in self.ahead_after:
            self._copy_ahead(k)
        for d in self.due.get(k, ()):
            self._release_planned(self.values[d], k)

    def _release_planned(self, v: _Value, k: int) -> None:
        """runtime.release_planned: a value the plan releases after op k, if it is still here, no
        restore waits for it, and (a learned plan) no evicted value's recompute reads it."""
        if not (v.recipe and not v.dead and v.waits == 0 and self._releasable(v)):
            return
        if not self.releases_chains and any(self.values[c].state == EVICTED and not self.values[c].dead
                                            for k in self.readers[v.index] for c in self.op_outs[k]):
            return
        if v.host_at > self.clock:  # its copy out ahead runs: released once it is done, not waited for
            self.release_when_copied.append(v)
            return
        self._release(v, at=k + 1)
        self.planned_releases += 1

    def _release_copied(self) -> None:
        """swap._adopt_out: planned releases whose copy out ahead is done now go (those still here)."""
        waiting = self.release_when_copied
        for v in [v for v in waiting if v.host_at <= self.clock]:
            waiting.remove(v)
            if v.recipe and not v.dead and v.waits == 0 and self._releasable(v):
                self._release(v, at=self.position)
                self.planned_releases += 1

    def run(self) -> Dict:
        """Replay the step once. Returns {"status": "ok" | "oom" | "thrash", "overhead",
        "peak_bytes", "budget_bytes", "fragmentation", "evictions", "offloads", "offloaded_bytes",
        "recompute_seconds", "copy_seconds_hidden", ...}."""
        t = self.trace
        status, error = "ok", None
        try:
            for v in np.flatnonzero(t.value_producer < 0):  # made before the step: resident at its start
                self._allocate(self.values[int(v)])
            if self.placement is not None:
                # The blocks every replayed step starts with: the next step's plan goes around them.
                self.step_start = [(b.addr, b.size) for b in self.arena.blocks() if b.allocated and b.addr < self.main_end]
                self.arena.step_placement = True
                self.arena.set_step_placement_plan(*self.placement)
            self._copy_ahead(-1)
            for k in range(t.num_ops):
                self._run_op(k)
        except _OOM as e:
            status, error = "oom", str(e)
        if self.placement is not None and status == "ok":
            self.arena.end_step(self.step_start)
            self.next_placement = self.arena.step_placement_plan()
        base = float(self.seconds.sum())
        total = base + self.recompute_seconds + self.copy_seconds + self.move_seconds
        overhead = total / base if base > 0 else 1.0
        if status == "ok" and overhead > THRASH:
            status = "thrash"
        st = self.arena.stats()
        out = {"status": status, "overhead": overhead if status != "oom" else None,
               "peak_bytes": int(st["allocated_bytes.peak"]), "budget_bytes": self.budget,
               "fragmentation": float(st["fragmentation.pressure"]), "evictions": self.evictions,
               "offloads": self.offloads, "offloaded_bytes": self.offloaded_bytes, "recompute_seconds": self.recompute_seconds,
               "copy_seconds_hidden": self.copy_hidden, "copy_seconds_exposed": self.copy_seconds,
               "copy_out_seconds_exposed": self.copy_out_exposed, "copies_ahead": self.copies_ahead,
               "prefetches": self.prefetches, "prefetches_cancelled": self.prefetches_cancelled,
               "late_uses": self.late_uses,
               "step_seconds": base, "recomputes": self.recomputes, "copies_back": self.copies_back,
               "compactions": int(st["num_compactions"]), "moved_bytes": int(st["moved_bytes"]),
               "compaction_seconds": self.move_seconds, "planned_releases": self.planned_releases,
               "retained": self.retained,
               "retries": self.retries,
               "placed_as_planned": int(st["num_placed_as_planned"]),
               "displaced_from_plan": int(st["num_displaced_from_plan"]),
               "ops_run": self.position + (status != "oom"), "num_ops": t.num_ops}
        if error is not None:
            out["error"] = error
        return out


class _OOM(Exception):
    pass


_THRASH_FACTOR = 4  # remat.py's: recomputes per value of one restore before it counts as thrashing


class _SimValues(restore_order.Values):
    """The simulator's values, as the restore order sees them."""

    __slots__ = ("sim",)

    def __init__(self, sim: Simulator) -> None:
        self.sim = sim

    def available(self, v: _Value) -> bool:
        return v.state == RESIDENT

    def copied(self, v: _Value) -> bool:
        return v.state == OFFLOADED

    def inputs(self, v: _Value):
        if v.state != EVICTED or not v.recipe:
            return None
        return [self.sim.values[i] for i in self.sim.parents(v.index)]

    def key(self, v: _Value) -> int:
        return v.index

    def unrecoverable(self, v: _Value) -> Exception:
        return SimError(f"value {v.index} is read at op {self.sim.position} but was "
                        f"{'never made' if v.state == NEW else 'freed with no way back'}")

    def bring_back(self, v: _Value) -> None:
        self.sim._bring_back(v)

    def thrashing(self, v: _Value, nesting: int) -> Exception:
        return _OOM(f"restoring value {v.index} thrashes: {nesting} nested restores")


def _op_seconds(trace: Trace, device: Optional[str]) -> np.ndarray:
    """Each op's seconds: on a GPU's published rates, or as the trace recorded them."""
    if device is None:
        if np.isnan(trace.op_cost).any():
            raise ValueError("this trace recorded no op costs (captured on the meta device): give a device, "
                             "e.g. device='h100'")
        return trace.op_cost.astype(np.float64)
    tensor_cores, fp32 = gpu_cost_model(device, torch.bfloat16), gpu_cost_model(device, torch.float32)
    seconds = np.where(trace.op_fp32 == 1, fp32.price(trace.op_flops, trace.op_bytes),
                       tensor_cores.price(trace.op_flops, trace.op_bytes))
    return np.where(trace.op_kernel == 1, seconds, 0.0)


def simulate(trace: Trace, budget: int, **kw) -> Dict:
    """One replay: ``Simulator(trace, budget, **kw).run()``; with ``plan="auto"``, the step the
    runtime's plan settles on (pymem/sim/plan.py)."""
    if kw.get("plan", "off") == "auto":
        from .plan import replay_planned
        return replay_planned(trace, budget, **kw)
    return Simulator(trace, budget, **kw).run()
