"""Offloading: released values copied to host memory and brought back on use (swap-in) or ahead of
it (prefetch), as the director (``pymem.policies.director``) chooses per value.

A record's value never changes (an in-place op makes a new record), so a host copy stays valid for
the record's life: the record keeps it (``Record.host``), bringing the value back leaves it in
place, and releasing the value again copies nothing. It goes when no tensor holds the value any
more (the next sweep: each pressure event starts with one), or when a leaf is written in place.
Host copies live outside the budget, in the host pool (csrc/host_pool.h): host memory on the CPU
device (outside the arena), pinned memory on CUDA, capped by ``host_budget``.

Prefetch, in the order of next use: while the step follows its plan (step_plan.h), the offloaded
value the plan reads first comes back first (its position is fixed while it is away, since nothing
reads it then, so a heap keyed by it stays right), and not before its read is a few copy times
away (Capuchin's in-trigger: memory the plan freed early is not filled again at once). A use that
still had to wait for its copy (Capuchin's feedback) makes that value's copy start twice as far
ahead in the steps to come (``num_late_uses``). Values the plan cannot
place (no plan yet, a step that diverged, no read left in the step) fall back to DELTA's
prefetcher: the backward pass reads offloaded activations roughly in the reverse order of their
offload, so the newest whose storage is still alive comes first. Either way a value comes back only
when the arena's largest free block holds it with ``headroom`` bytes to spare: nothing is
released for it, and a contiguous ``headroom`` stays free for the ops to come. The
copy runs beside compute: a worker thread on the CPU device, a side stream on CUDA. The value counts
as evicted until it is adopted: when its copy is done (checked after each op) or when an op needs it
(then the op waits for the copy). Under pressure, a copy in flight is the last thing given up.

Copy out ahead (Capuchin's swap-out ahead of release, ZeRO-Offload's overlapped transfers): a copy
out in compute's order (the compute stream, the calling thread) stalls compute for its whole time,
at the moment memory is shortest. While the steps follow their plan, a value whose counterpart the
step before offloaded (the same index of the step trace: csrc/step_trace.h, note_offload) may start
its copy out as soon as it exists, beside compute (a second worker thread on the CPU device, a
second side stream on CUDA: one queue per direction) while it stays resident. The copies wait in
the order of the releases the step before made, the first expected first, and start while fewer
than ``_OUT_QUEUE_BYTES`` are queued (a stream runs its copies in order: a copy wanted first must
not wait behind the state of a whole optimizer). Its release then copies nothing, or waits only for
the rest of that copy (the plan's early release of it happens once the copy is done); an op that
writes it in place waits for the copy first (run_op). The copy holds the value's storage, so its
block is neither freed nor moved (compaction.movable_blocks) before the copy is done; the host copy
is the record's once the copy is done (checked after each op).
"""
import collections
import concurrent.futures
import heapq
import itertools
import math
import threading
import time
import weakref
from typing import Dict, List, Optional, Tuple

import torch

from .. import _C
from .interception import own_work
from .records import Record

_perf = time.perf_counter
_PREFETCH_DEPTH = 2  # copies in flight at most
# A prefetch leaves a free block of 1/_HEADROOM_SHARE of the budget for the ops to come. 1/8 left
# ResNet-152's copies back at 0.3 no room at all in the simulator (all 313 waited for), at 1/32 none
# did (1.448x -> 1.352x on an H100's model; Llama-7B at 0.5 1.833x -> 1.734x); 1/64 crowded the ops.
_HEADROOM_SHARE = 32
_MIN_CHUNK, _MAX_CHUNK = 2 << 20, 256 << 20  # the host pool's chunk, bounds
_LEAD = 3.0  # a planned copy back starts when its value's read is this many copy times away
_MAX_LEAD_BOOST = 64.0  # at most this many times further ahead after late uses (feedback)
_NONE = float("inf")  # StepTrace.next_use_at: no read left in the step
# Planned reads the in-trigger looks ahead at (copies queue one after another): an optimizer's
# step reads thousands of offloaded states in a burst (AdamW on GPT-2 XL: 1160; in the simulator
# 256 left 0.064 s of its copies back exposed at 0.3 of the peak, 2048 0.037 s).
_BACKLOG_READS = 2048
# Copies out ahead queued at most (bytes not yet copied): a few ms of a PCIe link, so that a copy
# whose release comes first is never queued behind many that can wait (the queue is in order).
_OUT_QUEUE_BYTES = 256 << 20


def latest_start(reads) -> float:
    """The plan's clock by which the next copy back must start for every read of ``reads``
    ((planned seconds before the read, seconds of its copy), in read order, copied one after
    another on one queue) to find its value back: the least of each read's time less the copies
    up to and including its own. Its definition, in one pass: ``BacklogWindow`` keeps it as the
    queue's head is taken (the tests hold the two together)."""
    queued, latest = 0.0, math.inf
    for at, seconds in reads:
        queued += seconds
        latest = min(latest, at - queued)
    return latest


class BacklogWindow:
    """``latest_start`` of the first _BACKLOG_READS planned copies back, kept as the queue's head is
    taken (its copy starts, or its value needs none): the least over the reads left of (read time
    less the copies up to its own), which taking the head shifts by the head's copy, so suffix
    minima of those terms and an offset give it in O(1). Built again (``valid`` False) when a copy
    is queued inside the window, or half the window is used up; one queued after the window's last
    entry, while the queue holds more than the window, changes nothing. Keys order the queue."""

    def __init__(self) -> None:
        self.valid = False
        self.version = 0  # changes whenever latest() may: what Swapper's quiet head remembers

    def build(self, keys: list, reads: list, last_key, more: bool) -> None:
        """``keys``, ``reads`` ((read time, copy seconds)): the window's entries, in queue order;
        ``last_key``: the last queue entry looked at (with or without a read); ``more``: the queue
        holds entries after it."""
        terms, queued = [], 0.0
        for at, seconds in reads:
            queued += seconds
            terms.append(at - queued)
        suffix = [math.inf] * (len(terms) + 1)
        for i in range(len(terms) - 1, -1, -1):
            suffix[i] = min(terms[i], suffix[i + 1])
        self.keys, self.seconds, self.suffix = keys, [c for _, c in reads], suffix
        self.taken, self.offset, self.last_key, self.more, self.valid = 0, 0.0, last_key, more, True
        self.version += 1

    def latest(self) -> float:
        return self.suffix[self.taken] + self.offset

    def took(self, key) -> None:
        """The queue's head (``key``) was taken."""
        if not self.valid:
            return
        self.version += 1
        j = self.taken
        if j < len(self.keys) and self.keys[j] == key:
            self.offset += self.seconds[j]
            self.taken = j + 1
            if self.more and 2 * (len(self.keys) - self.taken) < _BACKLOG_READS:
                self.valid = False
        elif not (j < len(self.keys) and key < self.keys[j]):  # else one the window left out
            self.valid = False

    def queued(self, key) -> None:
        """A copy was queued at ``key``."""
        if self.valid and not (self.more and self.last_key is not None and key > self.last_key):
            self.valid = False


class HostMemory:
    """Host buffers for copies, outside the budget: blocks of pymem's host pool (csrc/host_pool.h),
    pinned on CUDA, with an optional cap (``host_budget``)."""

    def __init__(self, device: torch.device, budget: int, cap: Optional[int]) -> None:
        # Large chunks, so no pinned allocation on the hot path once the first step took what the
        # steady state needs; an eighth of the device budget is a few offloaded activations' worth.
        chunk = min(max(budget // 8, _MIN_CHUNK), _MAX_CHUNK)
        table = 0
        if device.type == "cuda":
            from ..cuda_lib import load  # the CUDA runtime table (cudaHostAlloc, events)

            table = load().runtime_table()
        self.pool = _C.HostPool(chunk, cap_bytes=cap or 0, cuda_table=table)
        self.capped = bool(cap)  # without a cap every request fits

    def empty(self, nbytes: int) -> Optional[torch.Tensor]:
        """A uint8 host buffer, or None when the cap leaves no room."""
        return self.pool.empty(nbytes)

    def fits(self, nbytes: int) -> bool:
        return not self.capped or self.pool.fits(nbytes)  # no call where every request fits

    def used_by_copy(self, buf: torch.Tensor, stream) -> None:
        """An async copy reading or writing ``buf`` was enqueued on ``stream``: its block is reused
        only after the copy completed."""
        self.pool.record_use(buf, stream.cuda_stream)

    def describe(self) -> str:
        s = self.pool.stats()
        cap = f"a cap of {self.pool.cap} B" if self.pool.cap else "no cap"
        return (f"host copies hold {s['host_bytes']} B of {s['host_reserved_bytes']} B in {s['num_host_chunks']} "
                f"chunk(s), under {cap}")

    def stats(self) -> dict:
        s = self.pool.stats()
        s["host_budget"] = self.pool.cap
        return s


# What a timed interval was (_CopyTimes): a copy out, a copy back on demand (on the compute stream,
# or in the calling thread), a prefetch (side stream, worker thread), a wait for a prefetch or a
# copy out ahead, a copy out ahead (its own side stream, worker thread).
_OUT, _IN, _PREFETCH, _WAIT, _AHEAD = range(5)


class _CopyTimes:
    """The copies' own time, by direction (out: to host memory; in: back, on demand or prefetched),
    so that bytes / seconds is the rate the copies achieved; and the stall, the part of it compute
    waited for: the copies on the compute stream (or in the calling thread), and the waits of uses
    for prefetches not done yet. ``swap_seconds`` is the calling thread's time in copy calls and
    waits. An interval whose time is not known yet waits in a queue per stream (intervals on one
    stream complete in order, so only each queue's head is ever asked); its time is taken once it is
    found complete, never waited for (only ``close`` waits). Booking happens under the runtime's
    lock, except from ``memory_stats`` (any thread): one thread books at a time, the others skip."""

    def __init__(self) -> None:
        self.seconds = {_OUT: 0.0, _IN: 0.0, _PREFETCH: 0.0, _WAIT: 0.0, _AHEAD: 0.0}
        self.nbytes = {_OUT: 0, _IN: 0, _PREFETCH: 0, _WAIT: 0, _AHEAD: 0}
        self.pending: Dict[object, collections.deque] = {}  # queue -> deque of (handle, nbytes, kind)
        self._booking = threading.Lock()

    def _book(self, kind: int, nbytes: int, seconds: float) -> None:
        with self._booking:
            self.seconds[kind] += seconds
            self.nbytes[kind] += nbytes

    def _track(self, queue, handle, nbytes: int, kind: int) -> None:
        q = self.pending.get(queue)
        if q is None:
            q = self.pending[queue] = collections.deque()
        q.append((handle, nbytes, kind))
        self.harvest()  # bounded even when nothing else asks (prefetch off)

    def harvest(self, wait: bool = False) -> None:
        """Book the intervals found complete (each queue from its head, stopping at the first still
        running); ``wait``: every one, waiting for those still running."""
        if not self._booking.acquire(blocking=wait):
            return  # another thread is booking
        try:
            for q in list(self.pending.values()):
                while q:
                    handle, nbytes, kind = q[0]
                    seconds = self._seconds(handle, wait)
                    if seconds is None:
                        break
                    q.popleft()
                    self.seconds[kind] += seconds
                    self.nbytes[kind] += nbytes
        finally:
            self._booking.release()

    def _seconds(self, handle, wait: bool) -> Optional[float]:
        """The interval's seconds, or None while it runs (``wait``: never None)."""
        raise NotImplementedError

    def time_stats(self) -> dict:
        self.harvest()
        with self._booking:
            t, n = dict(self.seconds), dict(self.nbytes)
        return {"offload_copy_seconds": t[_OUT] + t[_AHEAD], "offload_copy_timed_bytes": n[_OUT] + n[_AHEAD],
                "swap_in_copy_seconds": t[_IN] + t[_PREFETCH], "swap_in_copy_timed_bytes": n[_IN] + n[_PREFETCH],
                "copy_ahead_seconds": t[_AHEAD], "swap_stall_seconds": t[_OUT] + t[_IN] + t[_WAIT]}


def _timed_copy(dst: torch.Tensor, src: torch.Tensor) -> float:
    t0 = _perf()
    dst.copy_(src)
    return _perf() - t0


def _timed_copy_of(pair: list) -> float:
    """The worker's copy: it takes the tensors out of ``pair``, so that none of its references
    outlives the copy (the work item keeps its arguments until the worker moves on, after the
    result is out: a buffer given up then must be free at once)."""
    dst, src = pair
    pair.clear()
    return _timed_copy(dst, src)


class _CpuCopier(_CopyTimes):
    """Copies on the CPU device: in the calling thread, or on a worker thread per direction
    (prefetch; copies out ahead). Each copy is timed where it runs (perf_counter)."""

    def __init__(self) -> None:
        super().__init__()
        self.pools: Dict[bool, concurrent.futures.ThreadPoolExecutor] = {}  # out -> its worker

    def copy(self, dst: torch.Tensor, src: torch.Tensor, out: bool = False) -> None:
        self._book(_OUT if out else _IN, dst.nbytes, _timed_copy(dst, src))

    def start(self, dst: torch.Tensor, src: torch.Tensor, out: bool = False):
        """Begin ``dst.copy_(src)`` beside compute (``out``: to the host); returns a handle for
        ``wait``/``done``. A worker has no dispatch mode of its own (modes are per thread): the
        copy is not an op."""
        pool = self.pools.get(out)
        if pool is None:
            name = "pymem-copy-out" if out else "pymem-prefetch"
            pool = self.pools[out] = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=name)
        handle = pool.submit(_timed_copy_of, [dst, src])
        self._track(out, handle, dst.nbytes, _AHEAD if out else _PREFETCH)  # one worker each: in order
        return handle

    @staticmethod
    def done(handle) -> bool:
        return handle.done()

    def wait(self, handle, timed: bool = False) -> None:
        """``timed``: a use waits (its wait is stall time)."""
        if not timed:
            handle.result()
            return
        t0 = _perf()
        try:
            handle.result()
        finally:
            self._book(_WAIT, 0, _perf() - t0)

    @staticmethod
    def _seconds(handle, wait: bool) -> Optional[float]:
        if not (wait or handle.done()):
            return None
        try:
            return handle.result()
        except Exception:  # raised where the copy is waited for (copy_in): no time to book
            return 0.0

    def close(self) -> None:
        for pool in self.pools.values():
            pool.shutdown(wait=True)
        self.pools.clear()
        self.harvest(wait=True)


class _CudaCopier(_CopyTimes):
    """Copies on CUDA. Out, and in on demand: on the compute stream, never waited for by the host.
    The device buffer an out copy reads is freed right after it is enqueued, and that is safe
    without a wait: every later use of the block is ordered after the copy (later work on the
    compute stream runs after it, and the arena's library makes another stream's allocation wait
    for the compute stream's work so far; the caching allocator of allocator="native" orders its
    blocks by stream too), and the host block it writes is handed out again only after the copy's
    event (HostMemory.used_by_copy). Waiting here instead held the host back until the GPU had
    caught up, at each offload: under a budget the host could never run ahead. Out ahead: on a
    second side stream after the compute stream's work so far; the swapper holds the source
    storage until it is done, and the compute stream waits for it before anything frees or writes
    that block. In, on demand: ordered before every reader by the compute stream. Prefetch: on a
    side stream after the compute stream's work so far; the compute stream waits for it when the
    value is adopted. Each copy sits between two timing
    events on its stream (start, done): ``start.elapsed_time(done)`` is the copy engine's time for
    it (``start`` completes when the work before it on the stream has, so that is not counted); a
    wait for a copy still running sits between two on the compute stream (how long compute stood
    still). An elapsed time is read
    once its end event is known to have completed (a query, or the out copy's own wait): timing
    adds no synchronization."""

    def __init__(self, device: torch.device, host: HostMemory) -> None:
        super().__init__()
        self.device = device
        self.host = host
        self.sides: Dict[bool, object] = {}  # out -> its side stream

    @staticmethod
    def _event():
        return torch.cuda.Event(enable_timing=True)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, out: bool = False) -> None:
        stream = torch.cuda.current_stream(self.device)
        start, done = self._event(), self._event()
        start.record(stream)
        dst.copy_(src, non_blocking=True)
        done.record(stream)
        self.host.used_by_copy(dst if out else src, stream)  # the host block is in use until done
        self._track(stream.cuda_stream, (start, done), dst.nbytes, _OUT if out else _IN)

    def start(self, dst: torch.Tensor, src: torch.Tensor, out: bool = False):
        side = self.sides.get(out)
        if side is None:
            side = self.sides[out] = torch.cuda.Stream(self.device)
        compute = torch.cuda.current_stream(self.device)  # taken outside the side stream's context
        side.wait_stream(compute)  # dst was allocated (and possibly last used), src made, on compute
        start, done = self._event(), self._event()
        with torch.cuda.stream(side):
            start.record(side)
            dst.copy_(src, non_blocking=True)
            done.record(side)
        self.host.used_by_copy(dst if out else src, side)
        self._track(side.cuda_stream, (start, done), dst.nbytes, _AHEAD if out else _PREFETCH)
        return done

    @staticmethod
    def done(handle) -> bool:
        return handle.query()

    def wait(self, handle, timed: bool = False) -> None:
        """The compute stream waits for the copy; ``timed``: a use waits (between two events)."""
        compute = torch.cuda.current_stream(self.device)
        if not timed:
            compute.wait_event(handle)
            return
        start, end = self._event(), self._event()
        start.record(compute)
        compute.wait_event(handle)
        end.record(compute)
        self._track(compute.cuda_stream, (start, end), 0, _WAIT)

    @staticmethod
    def _seconds(handle, wait: bool) -> Optional[float]:
        start, done = handle
        if wait:
            done.synchronize()
        elif not done.query():
            return None
        return start.elapsed_time(done) / 1e3  # milliseconds

    def close(self) -> None:
        for side in self.sides.values():
            side.synchronize()
        self.harvest(wait=True)  # what is left was enqueued before now


class Swapper:
    def __init__(self, rt, director, bandwidth: float, prefetch: bool, headroom: int,
                 host_budget: Optional[int] = None) -> None:
        self.rt = rt
        self.director = director
        self.bandwidth = bandwidth
        self.prefetch_enabled = prefetch
        self.headroom = headroom
        # After a prefetch was given up for an allocation, prefetches leave that allocation's bytes
        # free too, until the step ends (or nothing waits on the host): started into the same room
        # again, each would be waited for and given up at the next such allocation (a loop of
        # exposed copies).
        self.backoff = 0
        self.host = HostMemory(rt.device, rt.budget, host_budget)
        self.copier = _CudaCopier(rt.device, self.host) if rt.device.type == "cuda" else _CpuCopier()
        # Offloaded values the plan places: (position of next read, tie-break, weakref), a heap; and
        # the others, oldest first (weak: one nobody needs any more is not brought back).
        self.planned: List[Tuple[int, int, weakref.ref]] = []
        self._ties = itertools.count()
        self.window = BacklogWindow()  # latest_start of the planned queue
        self.offloaded: List[weakref.ref] = []
        self._prune_at = 4096
        self.in_flight: Dict[Record, tuple] = {}  # record -> (device buffer, copy handle)
        # Copies out ahead, oldest first (they complete in that order): record -> (host buffer,
        # a view of its storage held until done, copy handle).
        # Ordered: _adopt_out looks at the oldest after every op, and an OrderedDict finds it in
        # O(1) where a dict would skip every entry deleted before it.
        self.out_flight: "collections.OrderedDict[Record, tuple]" = collections.OrderedDict()
        self.release_when_out: set = set()  # planned releases waiting for their copy out ahead
        self.kept: List[torch.Tensor] = []  # views of released storages, dropped after the op
        # Copies out ahead not started: (expected release position, tie-break, weakref), a heap;
        # and the bytes of those started and not yet adopted.
        self.ahead_waiting: List[Tuple[int, int, weakref.ref]] = []
        self.out_bytes = 0
        self.num_copies_ahead = 0
        self.copied_ahead_bytes = 0
        self.num_offloads = 0
        self.offloaded_bytes = 0
        self.copied_out_bytes = 0
        self.num_swap_ins = 0
        self.swapped_in_bytes = 0
        self.num_prefetches = 0
        self.prefetched_bytes = 0
        self.num_prefetches_cancelled = 0
        self.num_leaf_offloads = 0  # offloads of values with no recipe (offload_leaves)
        # In-trigger boosts by trace value (Capuchin's feedback): how many times further ahead of
        # its read a value's copy back starts, doubled each time a use of it had to wait.
        self.lead: Dict[int, float] = {}
        # The planned head whose in-trigger last held it back, and what that test read: (heap entry,
        # window version, its read's planned time, its margin, the backlog's latest start, the copies
        # in flight's seconds then, the backlog's margin). Until that test could pass, after_op
        # answers it from these (_still_quiet).
        self._quiet: Optional[tuple] = None
        self.num_late_uses = 0
        self.seconds = 0.0  # the calling thread's time in copies and waits

    # ------------------------------------------------------------------ out
    def wants_offload(self, r: Record) -> bool:
        return self.director.evaluate(r, self.rt.clock)

    def copy_out(self, r: Record, sref) -> bool:
        """Give ``r`` a host copy of its value (held in ``sref``), unless it has one. False when the
        host pool's cap leaves no room: the caller evicts instead (a leaf is released only after
        the pool said it fits, residency.releasable)."""
        self.rt.trace.note_offload(r)  # its counterpart in the steps to come is copied out ahead
        if r.host is None:
            t0 = _perf()
            with own_work():  # not ops of the program (pymem.evict runs under the mode)
                host = self.host.empty(r.nbytes)
                if host is None:  # counted by the pool (num_host_refused)
                    return False
                self.copier.copy(host, sref.view(torch.uint8, [r.nbytes], [1], 0), out=True)
            r.host = host
            self.copied_out_bytes += r.nbytes
            self.seconds += _perf() - t0
        self.num_offloads += 1
        self.offloaded_bytes += r.nbytes
        if r.recipe is None:
            self.num_leaf_offloads += 1
        if self.prefetch_enabled:
            self._queue(r)
        return True

    # ------------------------------------------------------------------ out, ahead
    def copy_ahead(self, r: Record, due: int) -> None:
        """Copy resident ``r`` out ahead, beside compute (the step before offloaded its counterpart
        at step position ``due``): queued by ``due``, started by ``_start_ahead``."""
        heapq.heappush(self.ahead_waiting, (due, next(self._ties), weakref.ref(r)))
        self._start_ahead()

    def _start_ahead(self) -> None:
        """Start the waiting copies out ahead, the release expected first first, while fewer than
        _OUT_QUEUE_BYTES are queued. Nothing for a value with a host copy, not in the arena, or
        gone; nor when the host pool's cap leaves no room. Copies wait only while out_flight holds
        the cap's bytes, so after_op (which runs while out_flight is not empty) starts them."""
        waiting = self.ahead_waiting
        while waiting and self.out_bytes < _OUT_QUEUE_BYTES:
            r = heapq.heappop(waiting)[2]()
            if r is None or r.host is not None or r in self.out_flight or r.evicted or not r.in_arena or \
                    r in self.rt.cache:
                continue
            s = r.sref
            if s is None or not s.alive:
                continue
            with own_work():
                host = self.host.empty(r.nbytes)
                if host is None:
                    continue
                src = s.view(torch.uint8, [r.nbytes], [1], 0)
                self.out_flight[r] = (host, src, self.copier.start(host, src, out=True))
            self.out_bytes += r.nbytes
            self.num_copies_ahead += 1
            self.copied_ahead_bytes += r.nbytes

    def settle_out(self, r: Record) -> None:
        """r's buffer is about to be freed (a release, offload or eviction; a storage resize_) or
        written in place: a copy out ahead of it, running or still waiting for the CPU worker,
        reads that buffer, so it completes first, and r keeps its host copy. The copy's view may be
        all that holds the storage now (the program freed it): kept until the next op, so that a
        release finds it alive. Nothing when no such copy is in flight."""
        if r not in self.out_flight:
            return
        t0 = _perf()
        self.kept.append(self.finish_out(r))
        self.seconds += _perf() - t0

    def finish_out(self, r: Record) -> torch.Tensor:
        """r's copy out ahead is complete before what follows (the compute stream waits for it on
        CUDA; the CPU worker is waited for): r's value is about to be freed or written. r keeps the
        host copy (its value's: nothing wrote it meanwhile). Returns the view of r's storage the
        copy held (dropping it may free the storage)."""
        host, src, handle = self.out_flight.pop(r)
        self.out_bytes -= r.nbytes
        self.release_when_out.discard(r)
        self.copier.wait(handle, timed=True)
        self._out_done(r, host)
        return src

    def _out_done(self, r: Record, host: torch.Tensor) -> None:
        if r.host is None:
            r.host = host
            self.copied_out_bytes += r.nbytes

    def _adopt_out(self) -> None:
        """Copies out ahead that are done: their host copies are the records' (oldest first, and
        they complete in order: the first still running ends the look)."""
        done, flight = self.copier.done, self.out_flight
        while flight:
            r = next(iter(flight))
            host, _, handle = flight[r]
            if not done(handle):
                break
            del flight[r]
            self.out_bytes -= r.nbytes
            self._out_done(r, host)
            if r in self.release_when_out:  # the plan released it early: now it copies nothing
                self.release_when_out.discard(r)
                self.rt.release_copied(r)

    def _queue(self, r: Record) -> None:
        """Queue r's copy back: by its planned next read where the plan places one in this step."""
        plan = self.rt.residency.plan
        at = plan.next_use_at(r) if plan is not None else None
        if at is not None and at != _NONE:
            tie = next(self._ties)
            heapq.heappush(self.planned, (at, tie, weakref.ref(r)))
            self.window.queued((at, tie))
            return
        self.offloaded.append(weakref.ref(r))
        if len(self.offloaded) > self._prune_at:
            self._prune()

    def end_step(self) -> None:
        """The plan's positions were this step's: what is still queued by them waits, newest last,
        with the values the plan could not place. Prefetches may use all free room again."""
        self.backoff = 0
        self.window.valid = False
        if self.planned:
            self.offloaded.extend(w for _, _, w in sorted(self.planned))
            self.planned.clear()

    def _prune(self) -> None:
        """Drop entries no prefetch will take (dead, back already, storage gone): prefetch only
        looks at the newest, so under steady pressure the old ones would pile up step after step."""
        keep = []
        for w in self.offloaded:
            r = w()
            if r is not None and self._worth_prefetching(r):
                keep.append(w)
        self.offloaded = keep
        self._prune_at = max(4096, 2 * len(self.offloaded))

    # ------------------------------------------------------------------ in
    def copy_in(self, r: Record, for_use: bool = True):
        """(device buffer holding r's value, how it came): the prefetched one if a copy is in
        flight ("prefetch"), else a new one copied from the host copy now ("swap in").
        ``for_use``: an op (or a recompute) needs it now; a wait then is late (feedback, below)."""
        flight = self.in_flight.pop(r, None)
        t0 = _perf()
        if flight is not None:
            buf, handle = flight
            late = for_use and not self.copier.done(handle)
            if late:
                self._late(r)
            self.copier.wait(handle, timed=late)
            self.num_prefetches += 1
            self.prefetched_bytes += r.nbytes
        else:
            if for_use:
                self._late(r)
            buf = self.rt.allocating(_blank, r.nbytes, self.rt.device)
            with own_work():
                self.copier.copy(buf, r.host)
            self.num_swap_ins += 1
            self.swapped_in_bytes += r.nbytes
        self.seconds += _perf() - t0
        return buf, "swap in" if flight is None else "prefetch"

    def _late(self, r: Record) -> None:
        """Capuchin's feedback: a use of r waited for its copy back, so in the steps to come its copy
        starts twice as far ahead (per value of the step trace, while the step follows its plan)."""
        plan = self.rt.residency.plan
        if plan is None or plan.seconds_to_next_use(r) is None:
            return  # no plan placed it: nothing to move earlier
        self.num_late_uses += 1
        self._quiet = None  # its margin grows
        v = r.trace_value
        self.lead[v] = min(self.lead.get(v, 1.0) * 2.0, _MAX_LEAD_BOOST)

    # ------------------------------------------------------------------ prefetch
    def after_op(self) -> None:
        """Adopt finished copies (back, and out ahead); start new prefetches while they fit. Called
        after each op that left offloaded values or copies in flight."""
        self.kept.clear()
        if self.out_flight:
            self._adopt_out()
        if self.ahead_waiting:
            self._start_ahead()
        if self.in_flight:
            done = self.copier.done
            for r in [r for r, (_, h) in self.in_flight.items() if done(h)]:
                self._adopt(r)
        if not self.prefetch_enabled:
            return
        arena = self.rt.arena
        planned, stack = self.planned, self.offloaded
        if not (planned or stack):
            self.backoff = 0  # every value is back: no loop to break (a program with no step marks)
        plan = self.rt.residency.plan
        while (planned or stack) and len(self.in_flight) < _PREFETCH_DEPTH:
            r = planned[0][2]() if planned else stack[-1]()
            if r is None or not self._worth_prefetching(r):
                if planned:
                    at, tie, _ = heapq.heappop(planned)
                    self.window.took((at, tie))
                else:
                    stack.pop()
                continue
            if planned and plan is not None:
                # In-trigger: not before its read is a few copies away (a value the plan released
                # early stays away until then), unless the copies queued behind it would then come
                # too late for their reads; None: the step left its plan, bring it when it fits.
                if self._still_quiet(plan, planned[0]):
                    return
                d = plan.seconds_to_next_use(r)
                margin = _LEAD * self.lead.get(r.trace_value, 1.0) * r.swap_cost
                if d is not None and d > margin and not self._behind(plan, margin - r.swap_cost):
                    self._remember_quiet(plan, planned[0], r, margin)
                    return
            # Best fit takes the largest free block last: a contiguous headroom stays either way.
            if arena.largest_free_block < r.nbytes + self.headroom + self.backoff:
                return
            if planned:
                at, tie, _ = heapq.heappop(planned)
                self.window.took((at, tie))
            else:
                stack.pop()
            # Fits: no pressure, nothing released for it. Placed with the cheap blocks: a host copy
            # makes it free to release, and long-lived blocks should not settle around it.
            previous = _C.set_allocation_class("cheap")
            try:
                buf = _blank(r.nbytes, self.rt.device)
            finally:
                _C.set_allocation_class(previous)
            with own_work():
                self.in_flight[r] = (buf, self.copier.start(buf, r.host))
            self._quiet = None  # the copies in flight grew: what it read no longer bounds them

    def _still_quiet(self, plan, head: tuple) -> bool:
        """The in-trigger would hold ``head`` back again: the test that last held it back read what
        it reads now (the same head and backlog window), and what moved since only delays it: the
        plan's clock, against which both margins are measured as the same float expressions (while
        the clock is short of the read, the read is still the head's next); the copies in flight,
        which only finish (none starts while the head waits), so their busy seconds only fall. The
        answer the whole test gives, without its next-use lookup and its sum over the copies in
        flight, after most ops while values are away."""
        quiet = self._quiet
        if quiet is None or quiet[0] is not head or not self.window.valid or quiet[1] != self.window.version:
            return False
        now = plan.planned_seconds_before()
        if now is None:
            return False
        _, _, read_at, margin, latest, busy, behind_margin = quiet
        return read_at - now > margin and latest - now - busy > behind_margin

    def _remember_quiet(self, plan, head: tuple, r: Record, margin: float) -> None:
        """The in-trigger held ``head`` back (after _behind, which left the window valid): what
        _still_quiet reads."""
        window = self.window
        at = plan.next_use_at(r)  # the read its test measured to (later ops come before it: see above)
        read_at = None if at is None else math.inf if at == _NONE else plan.planned_seconds_before(at)
        if read_at is None or not window.valid:
            self._quiet = None
            return
        self._quiet = (head, window.version, read_at, margin, window.latest(), self._busy_seconds(),
                       margin - r.swap_cost)

    def _busy_seconds(self) -> float:
        """The copies back in flight and not done yet, in copy seconds."""
        done = self.copier.done
        return sum(q.swap_cost for q, (_, h) in self.in_flight.items() if not done(h))

    def _behind(self, plan, margin: float) -> bool:
        """Whether the queue of planned copies back is so long that the next must start now: some
        read among the next ones would wait otherwise, by the plan's clock, after the copies in
        flight (counted whole). ``margin``: the slack the head's own trigger keeps."""
        now = plan.planned_seconds_before()
        if now is None:
            return False
        window = self.window
        if not window.valid:  # the reads are plan positions: fixed while the step follows its plan
            keys, reads = [], []
            head = heapq.nsmallest(_BACKLOG_READS, self.planned)
            for at, tie, w in head:
                q = w()
                t = plan.planned_seconds_before(at) if q is not None and self._worth_prefetching(q) else None
                if t is not None:
                    keys.append((at, tie))
                    reads.append((t, q.swap_cost))
            window.build(keys, reads, head[-1][:2] if head else None, len(self.planned) > len(head))
        return window.latest() - now - self._busy_seconds() <= margin

    def _worth_prefetching(self, r: Record) -> bool:
        """Offloaded, not back yet, and a tensor still holds its storage (so some later op may read
        it; a value only recipes need comes back if a recompute asks)."""
        s = r.sref
        return r.evicted and r.host is not None and r not in self.in_flight and s is not None and s.alive

    def _adopt(self, r: Record) -> None:
        buf, how = self.copy_in(r, for_use=False)
        s = r.sref
        if s is not None and r.evicted and s.alive:  # else no tensor wants it any more: dropped
            self.rt.residency.bring_back(r, buf, self.rt.clock, how)

    def cancel_one(self, request: int = 0) -> int:
        """Pressure, and nothing else to release: give up a copy in flight (waits for it), and
        leave ``request`` bytes (what was being allocated) free of prefetches for the rest of the
        step. Returns the bytes freed."""
        if not self.in_flight:
            return self._settle_out()
        r = next(iter(self.in_flight))
        buf, handle = self.in_flight.pop(r)
        self.copier.wait(handle)
        if self.rt.device.type == "cuda":
            torch.cuda.current_stream(self.rt.device).synchronize()
        self.num_prefetches_cancelled += 1
        self.backoff = max(self.backoff, request)
        self._queue(r)
        del buf
        return r.nbytes

    def _settle_out(self) -> int:
        """Pressure, nothing else to give up: wait for the copies out ahead, whose hold on storages
        the program freed keeps their blocks. Returns the bytes those storages free."""
        held = list(self.out_flight)
        for r in held:
            self.finish_out(r)
        return sum(r.nbytes for r in held if r.sref is None or not r.sref.alive)

    def close(self) -> None:
        """Wait for every copy in flight and adopt it (stop: nothing may write after)."""
        for r in list(self.in_flight):
            self._adopt(r)
        for r in list(self.out_flight):
            self.finish_out(r)
        self.kept.clear()
        self.copier.close()

    def stats(self) -> dict:
        return {
            "num_offloads": self.num_offloads,
            "offloaded_bytes": self.offloaded_bytes,
            "offload_copied_bytes": self.copied_out_bytes,
            "num_swap_ins": self.num_swap_ins,
            "swapped_in_bytes": self.swapped_in_bytes,
            "num_prefetches": self.num_prefetches,
            "prefetched_bytes": self.prefetched_bytes,
            "num_prefetches_cancelled": self.num_prefetches_cancelled,
            "num_leaf_offloads": self.num_leaf_offloads,
            "num_late_uses": self.num_late_uses,
            "num_copies_ahead": self.num_copies_ahead,
            "copied_ahead_bytes": self.copied_ahead_bytes,
            "swap_seconds": self.seconds,
            **self.copier.time_stats(),
            **self.host.stats(),
        }


# What stats() reports for a runtime that offloads nothing (offload="never"): the same keys, zero.
NO_SWAP_STATS = {k: 0 for k in ("num_offloads", "offloaded_bytes", "offload_copied_bytes", "num_swap_ins",
                                "swapped_in_bytes", "num_prefetches", "prefetched_bytes", "num_prefetches_cancelled",
                                "host_bytes", "host_bytes.peak", "host_reserved_bytes", "num_host_chunks",
                                "num_host_allocs", "num_host_pending", "num_host_refused", "num_leaf_offloads",
                                "num_late_uses", "num_copies_ahead", "copied_ahead_bytes")}
NO_SWAP_STATS["host_budget"] = 0
NO_SWAP_STATS["swap_seconds"] = 0.0
NO_SWAP_STATS.update(offload_copy_seconds=0.0, offload_copy_timed_bytes=0, copy_ahead_seconds=0.0, swap_in_copy_seconds=0.0,
                     swap_in_copy_timed_bytes=0, swap_stall_seconds=0.0)


def _blank(nbytes: int, device) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, device=device)
