"""Record the allocation trace of a real CPU training step, and replay it on a virtual arena.

Recording runs the step with a host arena installed as PyTorch's CPU allocator and a
TorchDispatchMode that, after every aten op, diffs the arena's allocated blocks: new blocks are the
op's outputs, vanished blocks were freed, and the op's tensor inputs are uses. Blocks that outlive
the step (parameters, gradients, optimizer state) and those alive before it are leaves: never
released. Everything else can be released and is recomputed (re-allocated) at its next use.

Replay drives a virtual arena of a smaller budget through the same ops: inputs are made resident
(re-allocated if released) and pinned with the outputs for the op's duration; under pressure the
handler refreshes every block's cost to Coop's h = c / s (producer op cost over staleness; the
cost is MegEngine's bytes-in-plus-out estimate, so a replay is repeatable) and
releases the window the arena picks (`window`) or the single cheapest block (`one_at_a_time`).
"""
from dataclasses import dataclass, field
from typing import Dict, List, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import pymem

COSTLY_OPS = ("mm", "addmm", "bmm", "matmul", "convolution", "conv", "linear", "_scaled_dot_product")


@dataclass
class Trace:
    initial: List[Tuple[int, int]] = field(default_factory=list)  # (id, size) alive before the step
    # per op: (input ids, [(id, size, cost, cheap)], freed ids); cost = bytes read + written
    ops: List[Tuple[List[int], List[Tuple[int, int, float, bool]], List[int]]] = field(default_factory=list)
    leaves: set = field(default_factory=set)
    peak: int = 0


class _Recorder(TorchDispatchMode):
    def __init__(self, arena, trace):
        super().__init__()
        self.arena, self.trace = arena, trace
        self.ids: Dict[int, int] = {}
        self.next_id = 0
        for b in arena.blocks():
            if b.allocated:
                self._new(b.addr, b.size, initial=True)

    def _new(self, addr, size, initial=False):
        self.next_id += 1
        self.ids[addr] = self.next_id
        if initial:
            self.trace.initial.append((self.next_id, size))
            self.trace.leaves.add(self.next_id)
        return self.next_id

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = set()
        for a in list(args) + list(kwargs.values()):
            for t in (a if isinstance(a, (list, tuple)) else [a]):
                if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes():
                    i = self.ids.get(t.untyped_storage().data_ptr())
                    if i is not None:
                        inputs.add(i)
        out = func(*args, **kwargs)
        live = {b.addr: b.size for b in self.arena.blocks() if b.allocated}
        # MegEngine's estimate (bytes in + bytes out), not a timer: the replay must be repeatable.
        cost = float(sum(live.get(a, 0) for a, i in self.ids.items() if i in inputs) +
                     sum(s for a, s in live.items() if a not in self.ids))
        cheap = not any(k in func.__name__ for k in COSTLY_OPS)
        allocs = [(self._new(a, s), s, cost, cheap) for a, s in live.items() if a not in self.ids]
        freed = [self.ids.pop(a) for a in list(self.ids) if a not in live]
        self.trace.ops.append((sorted(inputs), allocs, freed))
        self.trace.peak = max(self.trace.peak, sum(live.values()))
        return out


def record(step, warmup=1, arena_bytes=2 << 30) -> Trace:
    """Trace one call of `step()` (after `warmup` untraced calls) under a host arena."""
    arena = pymem.Arena(arena_bytes, small_threshold=0)
    pymem.install_cpu_hook(arena)
    try:
        for _ in range(warmup):
            step()
        trace = Trace()
        rec = _Recorder(arena, trace)
        with rec:
            step()
        trace.leaves |= set(rec.ids.values())  # outlived the step
    finally:
        pymem.uninstall_cpu_hook()
    return trace


def replay(trace: Trace, budget: int, search: str) -> dict:
    """Replay `trace` in a virtual arena of `budget` bytes; returns the arena's stats plus counts."""
    budget = (budget + 511) // 512 * 512
    arena = pymem.Arena(budget, backing="virtual", search=search)
    addr: Dict[int, int] = {}       # resident id -> address
    size: Dict[int, int] = {}
    cost: Dict[int, float] = {}
    last_use: Dict[int, float] = {}
    owner_of: Dict[int, int] = {}    # address -> id (releasable ones)
    clock = [0.0]
    counts = {"evictions": 0, "rematerializations": 0, "remat_cost": 0.0}

    def release(request, window):
        for i, a in list(addr.items()):  # Coop's h = c / s, with fresh staleness
            if a in owner_of:
                arena.set_cost(a, cost[i] / max(clock[0] - last_use[i], 1.0))
        w = arena.find_window(request)
        for v in (w.victims if w else []):
            i = owner_of.pop(v.addr)
            del addr[i]
            arena.free(v.addr)
            counts["evictions"] += 1

    arena.set_pressure_handler(release)

    def allocate(i, pinned):
        cheap = trace_cheap.get(i, False)
        owner = 0 if i in trace.leaves else i
        a = arena.allocate(size[i], "cheap" if cheap else "costly", owner, 0.0, pinned)
        addr[i] = a
        if owner:
            owner_of[a] = i

    trace_cheap: Dict[int, bool] = {}
    for i, s in trace.initial:
        size[i], cost[i], last_use[i] = s, 0.0, 0.0
        allocate(i, False)
    for inputs, allocs, freed in trace.ops:
        pinned = []
        for i in inputs:
            if i not in addr:  # released earlier: recompute it
                allocate(i, True)
                counts["rematerializations"] += 1
                counts["remat_cost"] += cost[i]
                clock[0] += cost[i]
            else:
                arena.set_pinned(addr[i], True)
            pinned.append(i)
        for i, s, c, cheap in allocs:
            size[i], cost[i], trace_cheap[i] = s, c, cheap
            allocate(i, True)
            pinned.append(i)
        clock[0] += max((c for _, _, c, _ in allocs), default=1.0)
        for i in pinned:
            last_use[i] = clock[0]
            if i in addr:
                arena.set_pinned(addr[i], False)
        for i in freed:
            if i in addr:
                a = addr.pop(i)
                owner_of.pop(a, None)
                arena.free(a)
    stats = arena.stats()
    stats.update(counts)
    return stats
