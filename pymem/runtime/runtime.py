"""The runtime: one arena of exactly ``budget`` bytes as the device allocator, and a lean
TorchDispatchMode that records every aten op's outputs, restores evicted inputs before an op runs,
and lets the policy release values when the arena is under pressure."""
import operator
import time
import weakref
from typing import Dict, List, Optional

import torch
from torch.utils._pytree import tree_leaves

from .. import _C
from .. import cost_model as _cost_model
from .. import cupy as _cupy
from ..errors import OutOfBudgetError
from ..policies import Planned, Policy
from . import fixed_threads, interception as _interception, remat, settings as _settings
from .backends import ArenaBackend, NativeBackend
from .hooks import CpuHook, CudaLibHook
from .ops import covers_storage, in_flight, mutated_tensors, op_info
from .pressure import PressureHandler
from .compile_warning import CompileWarning
from .fallbacks import KernelFallbacks, refusals_here as _refusals_here
from .heap_freeze import HeapFreeze
from .optimizer_steps import OptimizerSteps
from .raw_access import RawAccess
from .threads import ThreadCoverage
from .records import ArgRef, Recipe, Record, Slot
from .residency import Residency
from .verify import RestoreCheck
from .swap import _HEADROOM_SHARE, NO_SWAP_STATS, Swapper

_Tensor = torch.Tensor
_weakref = weakref.ref
_storage_key = _C.storage_key
_StorageRef = _C.StorageRef
_perf = time.perf_counter
_FOREVER = 1 << 40  # added to a record's pins: no count of unpins takes it back
_grad_enabled = torch.is_grad_enabled
_graph_task_id = torch._C._current_graph_task_id  # -1 outside a backward pass
_use_count = _C.storage_use_count
_handler_seconds = _C.handler_seconds
# Longest chain of recipes a value may stand at the end of (a deep model's forward is a few thousand
# ops). Beyond it an op's outputs are leaves: a loop that keeps extending one value (a generation
# loop's KV cache, a running sum) would otherwise keep every op it ever ran reachable.
_DEPTH_LIMIT = 16384
_SNAPSHOT_LIMIT = 64 << 10  # leaf buffers an op mutates are snapshotted for its recipe up to this size
# A refused allocation: pymem's OutOfBudgetError (its subclass), or the CUDA caching allocator's
# out-of-memory under allocator="native"'s memory fraction. Either leaves a functional op no trace.
_Refused = torch.OutOfMemoryError


def _with_figures(e: BaseException) -> BaseException:
    """A refusal thrown through the CUDA library is c10's OutOfMemoryError (so that cuDNN can retry
    with a smaller workspace), which PyTorch hands to Python as torch.OutOfMemoryError with its
    message only: the OutOfBudgetError it stands for, with its figures."""
    if isinstance(e, OutOfBudgetError):
        return e
    taken = _C.take_last_refusal()
    return taken if taken is not None and str(taken) in str(e) else e


def _collect(values, out: List[_Tensor]) -> None:
    for a in values:
        if isinstance(a, _Tensor):
            out.append(a)
        elif a.__class__ is list or a.__class__ is tuple:
            for x in a:
                if isinstance(x, _Tensor):
                    out.append(x)


def _gather(args, kwargs) -> List[_Tensor]:
    """Tensor arguments in order (one level of lists: cat, foreach); no pytree on the hot path."""
    out: List[_Tensor] = []
    _collect(args, out)
    if kwargs:
        _collect(kwargs.values(), out)
    return out


def _gather_nested(args, kwargs) -> List[_Tensor]:
    """Every tensor argument, at any depth (a collective's Tensor[][]): off the hot path."""
    return [a for a in tree_leaves((args, kwargs)) if isinstance(a, _Tensor)]


_SLOTS = [Slot(i) for i in range(256)]  # shared: a recipe's template allocates no Slot objects
_NO_KWARGS: dict = {}


def _slot(counter: List[int]) -> Slot:
    i = counter[0]
    counter[0] = i + 1
    return _SLOTS[i] if i < 256 else Slot(i)


def _template(values, counter: List[int]) -> list:
    """``values`` with each tensor replaced by a Slot, in _gather's order (one level of lists)."""
    out = []
    for a in values:
        if isinstance(a, _Tensor):
            out.append(_slot(counter))
        elif a.__class__ is list or a.__class__ is tuple:
            out.append(a.__class__([_slot(counter) if isinstance(x, _Tensor) else x for x in a]))
        else:
            out.append(a)
    return out


def _unlist(running: List[list], entry: list) -> None:
    """Takes ``entry`` out of ``running``: the last one, unless another thread's op started meanwhile."""
    if running and running[-1] is entry:
        running.pop()
        return
    for i in range(len(running) - 1, -1, -1):
        if running[i] is entry:
            del running[i]
            return


class Runtime(_C.RuntimeBase):
    """State of one ``pymem.enable``: arena, records, policy, statistics. The fields every op
    touches (clock, num_ops, active, no_recipes, cost_model, swap) are C members of the base
    (csrc/runtime_state.h), which the C++ fast path reads without an attribute lookup."""

    def __init__(self, budget: int, policy="dtr", device: str = "cpu", allocator: str = "arena",
                 sampling: bool = False, cost=None, hook=None, offload=None, prefetch: bool = True,
                 link_bandwidth: Optional[float] = None, plan: str = "auto",
                 host_budget: Optional[int] = None, offload_leaves: Optional[bool] = None,
                 verify: bool = False) -> None:
        """``hook``: how the arena becomes PyTorch's allocator (``hooks.py``); by default the CPU
        hook on the CPU and libpymem_cuda.so on CUDA. ``offload``: a director's name
        (``pymem.policies.director_names()``) or a Director; default ``"delta"`` on CUDA and
        ``"never"`` on the CPU, where host memory is the very memory the budget caps.
        ``link_bandwidth``: bytes per second of a copy to or from host memory (default: timed once
        per process). ``host_budget``: bytes the host pool may hold for offloaded values (None: no cap)."""
        conf = _settings.check(budget, policy, device, allocator, sampling, cost, offload, prefetch,
                               link_bandwidth, plan, host_budget, offload_leaves, verify)
        self.settings = conf
        self.device = conf.device
        self._dynamic_threads_were = ()  # what fixed_threads.fix found at start, for stop
        # plan="auto": the policy's choice under pressure follows the step plan where it can say
        # (policies/planned.py; the plan is the step trace's, below).
        self.policy: Policy = conf.policy if conf.plan == "off" else Planned(conf.policy)
        self.allocator = conf.allocator
        if conf.allocator == "arena":
            hook = hook if hook is not None else \
                CpuHook() if not conf.on_cuda else CudaLibHook(self.device.index)
            hook.prepare()  # first: on CUDA, before anything below initialises it
            if conf.on_cuda and self.device.index is None:
                self.device = torch.device("cuda", hook.index)
        elif hook is not None:
            raise ValueError("hook applies to allocator='arena' only")
        if conf.on_cuda:
            torch.cuda.init()  # its generators and the calibration need it
        # An op's cost: its measured wall time (CPU ops are synchronous), or a calibrated FLOP/byte
        # estimate (what CUDA needs: a host timer sees only the launch). Calibrated before the
        # allocator is installed, so its buffers stay out of the budget.
        if isinstance(conf.cost, _cost_model.CostModel):
            self.cost_model: Optional[_cost_model.CostModel] = conf.cost
        else:
            self.cost_model = _cost_model.calibrated(str(self.device)) if conf.cost == "estimate" else None
        # Only directors read a copy's cost; "never" has no use for the timing.
        director = conf.director
        self.link_bandwidth = conf.link_bandwidth or \
            (_cost_model.host_link_bandwidth(str(self.device)) if director.name != "never" else float("inf"))
        budget -= budget % _C.ALIGNMENT  # the arena's granularity; rounding down keeps the cap hard
        self.budget = budget
        self.backend = ArenaBackend(hook, budget) if conf.allocator == "arena" else NativeBackend(self.device, budget)
        # What other modules and tests read of the backend: the arena (None under "native"), its
        # address range, and whether its blocks move.
        self.arena, self.hook, self.can_compact = self.backend.arena, self.backend.hook, self.backend.can_compact
        self.lo, self.hi, self.main_hi = self.backend.lo, self.backend.hi, self.backend.main_hi
        self.residency = Residency(self.backend, self.policy.uses_neighbourhood, self.link_bandwidth)
        self.pressure = PressureHandler(self, conf.sampling)
        # Offloading needs a buffer it can fill beside compute: the arena's (the native allocator
        # offers no way to ask whether a request fits without releasing anything).
        self.swap: Optional[Swapper] = None
        if director.name != "never":
            self.swap = Swapper(self, director, self.link_bandwidth, conf.prefetch and conf.allocator == "arena",
                                headroom=budget // _HEADROOM_SHARE, host_budget=conf.host_budget)
        self.residency.swap = self.swap
        self.residency.offload_leaves = conf.offload_leaves and self.swap is not None
        if conf.verify:
            self.residency.verify = RestoreCheck(self.device)
        # Inputs (records, or leaf tensors) of the kernels running now, innermost last: a kernel may
        # hold their addresses, so compaction leaves them where they are. Locks only stop release.
        self.running: List[list] = []
        self.table: Dict[int, Record] = {}   # storage key -> record of the storage's current value
        self.cache = self.residency.cache  # values recomputed only as inputs (residency.py)
        self.clock = 0.0
        self._sweep_at = 4096
        self.num_ops = 0
        self.num_invalidations = 0
        self.num_leaf_copies = 0  # overwritten leaves kept aside for their dependents' recipes
        self.num_orphaned_leaves = 0  # leaves freed when only recipes held them (their readers made leaves)
        self.num_planned_releases = 0  # values the step plan released right after their last use
        # > 0: ops get no recipes (an optimizer's step() runs, optimizer_steps.py; pymem.no_recompute)
        self.no_recipes = 0
        self.num_retries = 0
        self.interception = _interception.make(conf.intercept, self)
        self.active = False
        # Bookkeeping of every thread's ops, and the pressure handler, run under this lock; a kernel
        # runs without it (_kernel), its inputs locked and listed in `running`.
        self.trace = _C.StepTrace()  # every step's ops and values, as arrays (csrc/step_trace.h)
        self._moved_at_step = 0  # the arena's moved_bytes at the last step end
        self._moved_blocks_at_step = 0  # ... and its num_moved_blocks
        if conf.plan == "auto":
            self.trace.planning = True
            self.residency.plan = self.trace
            # The plan may cover the budget from the step's live bytes (csrc/plan_cover.h); it prices
            # recomputes only, so not where values are offloaded. It covers the main region's
            # bytes: the small region's serve no large request, and a plan that fills the whole
            # budget leaves requests short there, for the pressure handler to release unplanned.
            # (allocator="native" has no arena: the cap is the budget's.)
            small = self.arena.small_region_size if self.arena is not None else 0
            self.trace.budget = budget - small if self.swap is None else 0
            self.trace.retain_limit = budget // _C.RETAIN_SHARE  # rebuild's holds (csrc/step_plan.h)
            if self.arena is not None:  # each step's large blocks placed where the step before showed room
                self.arena.step_placement = True
        self.lock = _C.RuntimeLock()  # threading.RLock's contract; the fast path takes it without a call
        self.threads = ThreadCoverage(self, self.interception)
        self.raw_access = RawAccess(self)
        self.compile_warning = CompileWarning()
        self.fallbacks = KernelFallbacks()
        self.optimizer_step_hooks = OptimizerSteps(self)
        self.heap_freeze = HeapFreeze()
        # Tensors on this device are managed; others (the CPU batch of a CUDA run) are left alone.
        self._on_device = operator.attrgetter("is_cuda" if conf.on_cuda else "is_cpu")
        self._default_generator = torch.default_generator if not conf.on_cuda else \
            torch.cuda.default_generators[self.device.index]

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self.backend.install(self)
        # A recompute must run its op on the threads the first run had (fixed_threads.py).
        self._dynamic_threads_were = fixed_threads.fix() if self.device.type == "cpu" else ()
        self.active = True
        self.interception.start()
        self.threads.install()
        self.raw_access.install()
        self.compile_warning.install(own_code=self.interception.own_code,
                                     intercepting=self.interception.outside_modes)
        self.optimizer_step_hooks.install()
        self.heap_freeze.install()

    def stop(self) -> None:
        """Leave the mode, give PyTorch its allocator back, restore every evicted value."""
        self.active = False  # other threads' modes pass through from now on
        self.heap_freeze.uninstall()  # first: nothing below may leave the program's heap frozen
        self.threads.uninstall()
        self.raw_access.uninstall()
        self.compile_warning.uninstall()
        self.optimizer_step_hooks.uninstall()
        self.interception.stop()
        if self.swap is not None:
            self.swap.close()  # copies in flight land in the arena first
        self.backend.uninstall(self)
        with self.lock:  # an op another thread has in flight finishes its bookkeeping first
            self.trace.let_go()  # a value the plan held past its free is the program's no more: not restored
            evicted = [r for r in self.table.values() if r.evicted and r.sref.alive]
            remat.restore(self, evicted)
            self.table.clear()
            self.cache.clear()
        fixed_threads.restore(self._dynamic_threads_were)

    # ------------------------------------------------------------------ records
    def _new_record(self, t: _Tensor, key: int, cost: float, recipe, op: str) -> Record:
        sref = _StorageRef(t)
        nbytes = sref.nbytes
        r = Record(self.residency, sref, nbytes, cost, self.clock, recipe, op,
                   self.backend.releasable(sref.data_ptr, nbytes))
        table = self.table
        table[key] = r
        if len(table) > self._sweep_at:
            self.sweep()
        return r

    def sweep(self) -> None:
        """Drop table entries whose storage died. A value some live recipe still reads counts as
        evicted for DTR's neighbourhood from now on; one nothing reads is forgotten (banished)."""
        # In C++ (csrc/sweep.h): the table is mutated in place (run_op holds a reference across the op).
        residency = self.residency
        held = _C.sweep_records(self.table, residency.mark_gone if residency.uses_neighbourhood else None, self.cache)
        dropped = False  # the C++ answers hold for the graph until a leaf's readers lose their recipes
        for r, may_pay in held:
            if may_pay or dropped:
                dropped = self._drop_if_orphaned(r) or dropped
        self._sweep_at = max(4096, 2 * len(self.table))
        residency.rebuild_neighbourhood()

    def _drop_if_orphaned(self, r: Record) -> bool:
        """Leaf ``r``'s storage is held by recipes only (or by nothing: then its hold is gone):
        free it if its readers may become leaves (remat.release_orphaned_leaf). True if it did."""
        h = r.hold()
        if h is None:
            r.hold = None
            return False
        if r.pins or _use_count(h) > 1 or not remat.release_orphaned_leaf(self, r):
            return False
        self.num_orphaned_leaves += 1
        r.hold = None
        key = r.sref.key
        del h  # the recipes that held it are gone: the storage dies here
        if not r.sref.alive and self.table.get(key) is r:
            del self.table[key]
        return True

    def before_resize(self, storage, nbytes: int) -> None:
        """``storage.resize_(nbytes)`` is about to run. No op pymem sees, yet it destroys the value
        the storage holds (resizing to 0 frees it; growing it again leaves garbage), as an op
        overwriting it would: recipes that read that value are invalidated now, while it is still
        there (afterwards they would recompute from freed or uninitialised bytes), and the storage
        gets a new record, of its new size, when an op next sees it."""
        with self.lock:
            self._before_resize(storage, nbytes)

    def _before_resize(self, storage, nbytes: int) -> None:
        key = storage._cdata  # the StorageImpl's address, as _C.storage_key gives it
        r = self.table.get(key)
        if r is None or nbytes == storage.nbytes():
            return
        with _interception.own_work():  # pymem's own work, not ops of the program
            if self.swap is not None:
                self.swap.settle_out(r)  # a copy out ahead reads the bytes resize_ frees
            if r.evicted and nbytes:  # resize_ keeps the bytes that fit: bring them back first
                remat.restore(self, [r])
            del self.table[key]
            if r.recipe is None:
                if r.children:
                    self.num_invalidations += 1
                    remat.invalidate_dependents(self, r, "its storage was resized (UntypedStorage.resize_)",
                                                keep=True)
            else:  # the old value stays recomputable for the recipes that read it, without a storage
                r.sref = None
                self.residency.mark_gone(r)

    # ------------------------------------------------------------------ release / restore
    def stats_remat(self, seconds: float) -> None:
        """A recompute ran: count it, and advance the logical clock by its cost as for any op, so the
        values of one replay age in the order it made them (staleness stays meaningful)."""
        self.residency.count_remat(seconds)
        self.clock += seconds

    def evict(self, t: _Tensor) -> None:
        """Evict ``t``'s storage now (testing and explicit use); it is recomputed on next use.
        A storage of no bytes has nothing to free: a no-op."""
        with self.lock:
            self._evict(t)

    def _evict(self, t: _Tensor) -> None:
        key = _storage_key(t)
        r = self.table.get(key)
        if (r is not None and r.pins) or (key and t.untyped_storage().nbytes() == 0):
            return  # shared outside torch (pinned): it stays; or no bytes to free (empty, or evicted)
        if r is None or (r.recipe is None and not self.residency.offload_leaves):
            raise ValueError("pymem.evict: this tensor has no recipe (a leaf, or made outside pymem): "
                             "it cannot be evicted (a leaf can be offloaded: offload_leaves=True)")
        if r.locks:
            raise ValueError("pymem.evict: this tensor is an input of a running op")
        if not r.evicted:
            self.residency.release(r)

    def restore_for_read(self, r: Record) -> None:
        """Bring r's value back for a read outside any op (raw_access.py). The mode is off meanwhile:
        the recompute's ops are pymem's, not the program's."""
        with self.lock, _interception.own_work():
            try:
                remat.restore(self, [r])
            except _Refused as e:
                raise self._restore_error(f"reading {r.op}'s output", [r], e) from None

    def pin(self, t: _Tensor, reason: str) -> Optional[Record]:
        """``t``'s storage is shared outside torch: brought back if released, then never released,
        moved or offloaded until as many ``unpin_key`` calls. None if pymem does not manage it (a
        storage it never saw: nothing would release or move it anyway)."""
        with self.lock:
            return self._pin(t, reason)

    def _pin(self, t: _Tensor, reason: str) -> Optional[Record]:
        r = self.table.get(_storage_key(t))
        if r is None or not self._on_device(t):
            return None
        if r.evicted:
            self.restore_for_read(r)
        self.residency.add_pins(r, 1, reason)
        return r

    def pin_address(self, t: _Tensor) -> None:
        """``t.data_ptr()`` was handed out: one pin for the storage's life, taken once (raw_access.py)."""
        with self.lock:
            r = self.table.get(_storage_key(t))
            if r is not None and not r.address_out and self._pin(t, "data_ptr") is not None:
                r.address_out = True

    def pin_for_good(self, r: Record, reason: str) -> None:
        """A pin no unpin ends (a collective's buffer: pymem cannot see when its Work completes)."""
        if r.pins < _FOREVER:
            self.residency.add_pins(r, _FOREVER, reason)

    def unpin_key(self, key: int, by_user: bool = False) -> None:
        """One pin fewer. ``pymem.unpin`` (``by_user``) also ends a ``data_ptr()`` pin: the next
        ``data_ptr()`` pins again."""
        with self.lock:
            r = self.table.get(key)
            if r is not None and r.pins:
                self.residency.set_pins(r, r.pins - 1)
                if by_user:
                    r.address_out = False

    def pin_owner_of(self, addr: int, reason: str) -> None:
        """A storage pymem did not make lies at ``addr`` (a DLPack consumer's tensor on our memory):
        pin the record whose storage holds that address."""
        with self.lock:
            self._pin_owner_of(addr, reason)

    def _pin_owner_of(self, addr: int, reason: str) -> None:
        for r in list(self.table.values()):
            s = r.sref
            if s is not None and not r.evicted and s.data_ptr <= addr < s.data_ptr + r.nbytes:
                self.residency.add_pins(r, 1, reason)
                return

    def is_evicted(self, t: _Tensor) -> bool:
        r = self.table.get(_storage_key(t))
        return r is not None and r.evicted

    # ------------------------------------------------------------------ the hot path
    def run_op(self, func, args, kwargs):
        info = op_info(func)
        if kwargs is None:
            kwargs = {}
        ins = _gather(args, kwargs) if not info.collective else _gather_nested(args, kwargs)
        recs = []
        managed = True
        table = self.table
        on_device = self._on_device
        for t in ins:
            if not on_device(t):
                managed = False
                recs.append(None)
                continue
            key = _storage_key(t)
            r = table.get(key)
            if r is None:
                if not key:
                    managed = False
                    recs.append(None)
                    continue
                r = self._new_record(t, key, 0.0, None, "leaf")
            recs.append(r)
            r.locks += 1
        try:
            evicted = [r for r in recs if r is not None and r.evicted]
            if evicted:
                try:
                    remat.restore(self, evicted)
                except _Refused as e:
                    raise self._restore_error(info.name, evicted, e) from None
            self.running.append(recs)
            # Backward ops get no recipes (a graph task runs them, its nodes and the sums of their
            # gradients alike): gradients are leaves from birth. A gradient's recipe would replay the
            # backward pass down from the loss (a chain as deep as the model) for a value the engine
            # frees a few ops later anyway. Nor do optimizer steps: their writes are the next step's
            # leaves, and recipes would chain each step's state to the last. Nor does an op that
            # overwrites a tensor outside autograd (nn.init's uniform_, zero_, copy_ of loaded
            # weights, a KV cache's slot): that is state being set, not a value computed. Everything
            # else does, under no_grad and inference_mode too: inference below its own live peak
            # needs its activations recomputable. A chain that grows without end (a value a loop
            # keeps extending) is cut at _DEPTH_LIMIT.
            recomputable = managed and info.pure and not self.no_recipes and (
                _grad_enabled() or (_graph_task_id() < 0 and not info.overwrites))
            snapshots = None
            mut_recs = mut_slots = None
            if info.mutated or info.collective:
                # A collective writes buffers its schema does not mark (allreduce_, broadcast_):
                # everything it is handed counts as written.
                mut_ids = {id(t) for t in (ins if info.collective else mutated_tensors(info.mutated, args, kwargs))}
                mut_recs = {}
                mut_slots = set()
                for j, t in enumerate(ins):
                    if id(t) in mut_ids and recs[j] is not None:
                        mut_slots.add(j)
                        mut_recs.setdefault(recs[j].id, (recs[j], j))
                for r, j in mut_recs.values():
                    if self.swap is not None:
                        self.swap.settle_out(r)  # a copy out ahead reads what the op overwrites
                    if r.recipe is None:
                        r.host = None  # overwritten in place below: a host copy would be stale
                        if r.children:
                            self.num_invalidations += 1
                            remat.invalidate_dependents(self, r, f"{info.name} overwrote an input of its recipe")
                        shared = any(recs[k] is r and k not in mut_slots for k in range(len(ins)))
                        if recomputable and info.fresh_returns and r.nbytes <= _SNAPSHOT_LIMIT and not shared:
                            if snapshots is None:
                                snapshots = {}
                            snap = snapshots[j] = self.allocating(ins[j].clone)
                            self._new_record(snap, _storage_key(snap), 0.0, None, "snapshot")
                        else:
                            recomputable = False
            rng = None
            if info.seeded and (recomputable or (info.pure and not info.mutated)):  # replay, or retry
                gen = kwargs.get("generator") or self._default_generator
                rng = (gen, self.allocating(gen.get_state))
            handled = _handler_seconds()  # this thread's time in the pressure handler so far
            t0 = _perf()
            # A collective still in flight when it returns: its communication thread may read or
            # write these buffers until its Work completes, which pymem does not see. They never
            # move again (pinned); a collective's inputs are never released anyway (written: leaves).
            pin = info.collective and in_flight(info, args, kwargs)
            arena = self.backend.arena  # measures the kernel's temporaries (the step trace's op_transient)
            mark = arena.mark_op() if arena is not None else None
            try:
                out = self._kernel(func, args, kwargs)
                if pin:
                    for r in recs:
                        if r is not None:
                            self.pin_for_good(r, "collective")
            except _Refused as e:
                if info.mutated or not info.pure:  # it may have written before it ran out
                    raise self._run_error(info.name, recs, e) from None
                try:
                    out = self.run_again(func, args, kwargs, e, rng)
                except _Refused as e2:
                    raise self._run_error(info.name, recs, e2) from None
            transient = arena.transient_since(mark) if mark is not None else 0
            estimate = self.cost_model
            if estimate is None:
                cost = _perf() - t0 - (_handler_seconds() - handled)
            else:
                cost = estimate.seconds(func, args, kwargs, ins, out)
            if not recomputable:
                rng = None
            elif rng is not None:  # the state tensor lives in the arena: let compaction move it
                self._new_record(rng[1], _storage_key(rng[1]), 0.0, None, "rng state")
        finally:
            _unlist(self.running, recs)
            for r in recs:
                if r is not None:
                    r.locks -= 1
        self.num_ops += 1
        self.clock += cost
        now = self.clock
        for r in recs:
            if r is not None:
                r.last_access = now

        refs = targs = tkw = None
        depth = 1  # of the chain of recipes the outputs end, when they get recipes
        if recomputable and (mut_recs or info.fresh_returns):
            for r in recs:
                if r.recipe is not None and r.depth >= depth:
                    depth = r.depth + 1
            if depth <= _DEPTH_LIMIT:  # beyond it the outputs are leaves: the chain they hold is freed
                refs = self._refs(info, ins, recs, mut_slots, snapshots)
                counter = [0]
                targs = tuple(_template(args, counter))
                tkw = dict(zip(kwargs, _template(kwargs.values(), counter))) if kwargs else _NO_KWARGS
        made = []  # the fresh values this op made, for the step trace
        if mut_recs:
            # Several storages written by one op (foreach, BatchNorm's running stats): recomputing one
            # would redo them all, so the written values become leaves; fresh outputs stay recomputable.
            in_place_refs = refs if len(mut_recs) == 1 else None
            for r, j in mut_recs.values():
                if r.recipe is None:
                    continue  # a leaf stays a leaf
                if self._regrown(r, ins[j], cost, info.name):
                    made.append(table[_storage_key(ins[j])])
                    continue
                recipe = Recipe(func, targs, tkw, refs, ("arg", j), rng) if in_place_refs is not None else None
                new = Record(self.residency, r.sref, r.nbytes, cost, now, recipe, info.name, r.in_arena)
                new.depth = depth
                self.residency.hand_over_pins(r, new)
                r.sref = None  # r is now the old value: no storage, still recomputable by its recipe
                table[_storage_key(ins[j])] = new
                made.append(new)
                if recipe is not None:
                    self._link(recs, new)
                    # Gone from memory like an evicted value: DTR's e* must count it, or a chain of
                    # in-place ops (dropout's bernoulli_ then div_) looks as cheap as its last step.
                    self.residency.mark_gone(r)
        elif info.regrown:
            for t in mutated_tensors(info.regrown, args, kwargs):
                r = table.get(_storage_key(t))
                if r is not None and r.recipe is not None and self._regrown(r, t, cost, info.name):
                    made.append(table[_storage_key(t)])

        # Outputs: views of known storages just get touched; fresh storages get a record.
        if isinstance(out, _Tensor):
            outs = (out,)
        elif out.__class__ is tuple or out.__class__ is list:
            outs = remat._flat(out)
        else:
            self._booked(info.code, cost, recs, made, transient)
            return out
        for i, o in enumerate(outs):
            if not isinstance(o, _Tensor) or not on_device(o):
                continue
            key = _storage_key(o)
            if not key:
                continue
            r = table.get(key)
            if r is not None:
                r.last_access = now
                if pin:
                    self.pin_for_good(r, "collective")
                continue
            recipe = None
            if refs is not None:
                recipe = Recipe(func, targs, tkw, refs, ("ret", i), rng)
            new = self._new_record(o, key, cost, recipe, info.name)
            new.depth = depth
            made.append(new)
            if pin:  # a fresh output it may fill until its wait
                self.pin_for_good(new, "collective")
            if recipe is not None:
                self._link(recs, new)
        self._booked(info.code, cost, recs, made, transient)
        return out

    def _booked(self, code: int, cost: float, recs: list, made: list, transient: int) -> None:
        """The op ran and its outputs have records: the trace books it, the plan does what it has
        due, then copies back start (after the booking: the plan's position is the next op's)."""
        if self.trace.record(code, cost, recs, made, transient):
            self.plan_due()
        swap = self.swap
        if swap is not None and (swap.offloaded or swap.planned or swap.in_flight or swap.out_flight):
            swap.after_op()

    def _moved_seconds(self) -> float:
        """What the compactions since the last step end moved, priced as a copy: what the plan's
        choice counts beside its comebacks (csrc/plan_choice.h). By the cost model's byte rate
        (a move reads and writes its bytes), else at a host memory copy's timed rate (right on the
        CPU, where measured costs are the default and a move is one; on CUDA, measured costs time
        only launches, and moves are priced high by it)."""
        st = self.backend.stats()
        moved, blocks = st.get("moved_bytes", 0), st.get("num_moved_blocks", 0)
        delta, self._moved_at_step = moved - self._moved_at_step, moved
        delta_blocks, self._moved_blocks_at_step = blocks - self._moved_blocks_at_step, blocks
        if delta <= 0 or not self.trace.planning:
            return 0.0
        return self.move_seconds(delta, delta_blocks)

    def move_seconds(self, nbytes: int, blocks: int) -> float:
        """What moving ``nbytes`` in ``blocks`` block moves of a compaction costs (see
        _moved_seconds). With a cost model, each move is a copy paying the launch every op's
        estimate holds (a recompute's price holds one too: priced by bytes alone, a compaction of
        many small blocks looked cheaper than the release it was weighed against; on the
        simulator's ResNet-152 the moves chosen so cost 3.4x what they were priced)."""
        if self.cost_model is not None:
            return 2 * nbytes / self.cost_model.byte_rate + blocks * self.cost_model.launch
        return nbytes / _cost_model.host_copy_bandwidth()

    def end_step(self) -> None:
        """A training step is complete (its optimizer stepped, or ``pymem.step()``): the trace plans
        the next from it."""
        with self.lock:
            way = self.trace.plan_releases if self.trace.following else None  # how the step that ended was planned
            self.trace.end_step(self._moved_seconds())
            if self.arena is not None:
                self.arena.end_step()  # the step placement plans the next (nothing while off)
                if self.arena.step_placement:
                    upcoming = self.trace.plan_releases if self.trace.following else None
                    if way is not None and upcoming != way:
                        # Planned another way: the offsets were made around other releases, and
                        # carried over, a way's layout would depend on the way before it; best fit
                        # (step_placement.h). The first planned step keeps the unplanned step's.
                        self.arena.set_step_placement_plan([], [])
                    # Through a displacement only in a step planned as the step that ended was.
                    self.arena.set_step_placement_keeps_plan(way is not None and upcoming == way)
            if self.swap is not None:
                self.swap.end_step()

    def plan_due(self) -> None:
        """What the step plan has due after the op just booked (the fast path calls it too): copies
        out ahead of values the step before offloaded (swap.copy_ahead), then early releases."""
        ahead = self.trace.take_ahead()
        if ahead and self.swap is not None:
            for r, due in ahead:
                self.swap.copy_ahead(r, due)
        self.release_planned()

    def release_planned(self) -> None:
        """The step plan releases values after the op just booked (csrc/step_plan.h: the values the
        step before released under pressure, now right after their last use before that); one
        being copied out ahead goes once that copy is done (swap._adopt_out), not waited for.
        Under the lock, as run_op."""
        swap = self.swap
        for r in self.trace.take_due():
            if self._planned_releasable(r):
                if swap is not None and r in swap.out_flight:
                    swap.release_when_out.add(r)
                    continue
                self.residency.release(r)
                self.num_planned_releases += 1

    def release_copied(self, r: Record) -> None:
        """A planned release that waited for its copy out ahead to be done: made now, if it still may be."""
        if self._planned_releasable(r):
            self.residency.release(r)
            self.num_planned_releases += 1

    def _planned_releasable(self, r: Record) -> bool:
        # A learned plan does not price a longer recompute for evicted readers; a cover did.
        return r.recipe is not None and r.locks == 0 and r.waits == 0 and not r.pins and r.in_arena and \
            self.residency.is_available(r) and r not in self.cache and \
            (self.trace.covering or next(r.evicted_readers(), None) is None)

    def _kernel(self, func, args, kwargs):
        """The op itself, with the runtime's lock released so that other threads' ops proceed. Its
        inputs are locked (never released) and in `running` (never moved) meanwhile; its outputs
        are blocks no record owns yet, which nothing releases or moves either."""
        lock = self.lock
        lock.release()
        refusals = _refusals_here()
        try:
            out = func(*args, **kwargs)
        finally:
            lock.acquire()
        if _refusals_here() != refusals:
            self.fallbacks.note(str(func))
        return out

    def seen_on_this_thread(self) -> bool:
        """True when this thread's ops go through this runtime."""
        return self.interception.on_this_thread()

    def _regrown(self, r: Record, t: _Tensor, cost: float, op: str) -> bool:
        """True if the op just run grew ``r``'s storage (``t``'s): resize_, or an in-place or out= op
        that resizes its output (addbmm_ on a broadcast self). No replay on a buffer of the old size
        gives the new value back: it is a leaf, recorded at its new size; ``r`` keeps the old value."""
        if t.untyped_storage().nbytes() <= r.nbytes:
            return False
        r.sref = None
        self.residency.hand_over_pins(r, self._new_record(t, _storage_key(t), cost, None, op))
        return True

    def run_again(self, func, args, kwargs, e: OutOfBudgetError, rng=None, name=None, recompute=False):
        """``func`` (functional: its partial outputs died with the exception, it left no trace) ran
        out of budget. Make room and run it again (``name``, ``recompute``: what a kernel fallback
        is noted as; by default the op's name). The arena's handler has released all it could
        before refusing, so the arena compacts with the op's inputs movable now, once. A capped
        native allocator releases nothing by itself: release values for the refused request and
        retry, as long as each round releases something."""
        for round in range(self.backend.retries):
            if not self.make_room(e, round):
                break
            self.num_retries += 1
            if rng is not None:
                rng[0].set_state(rng[1])  # replay from the same generator state, as if it ran once
            refusals = _refusals_here()
            try:
                out = func(*args, **kwargs)
            except _Refused as again:
                # Drop the traceback: it holds this frame, whose locals hold the op's tensors, in a
                # cycle that only the garbage collector would break.
                e = again.with_traceback(None)
                continue
            if _refusals_here() != refusals:
                self.fallbacks.note(name or str(func), recompute)
            return out
        raise _with_figures(e)

    def allocating(self, fn, *args):
        """``fn(*args)`` allocates outside any op pymem sees (a recompute's scratch copy): under the
        native allocator nothing makes room before a refusal, so make it after one and retry."""
        try:
            return fn(*args)
        except _Refused as e:
            return self.run_again(fn, args, {}, e)

    def make_room(self, e: BaseException, round: int = 0) -> bool:
        """After a refused request (``round``: how many retries it already had): True if something
        was done that may let it through now."""
        return self.backend.make_room(self, e, round)

    @staticmethod
    def _link(recs, new: Record) -> None:
        """Make ``new`` a child of every input record, leaves included: overwriting a leaf must find
        (and invalidate) every recipe that read it. One weakref, shared by all the lists."""
        w = _weakref(new)
        done = []
        for r in recs:
            if r is not None and r not in done:
                done.append(r)
                r.children.append(w)

    def _refs(self, info, ins, recs, mut_slots, snapshots) -> List[ArgRef]:
        """How the recipe gets each tensor argument back (see ArgRef)."""
        refs = []
        for j, t in enumerate(ins):
            r = recs[j]
            if snapshots is not None and j in snapshots:  # pymem's own copy: no hold, it dies with the recipe
                snap = snapshots[j]
                refs.append(ArgRef(None, _StorageRef(snap).strong(), snap, True))
            elif r.recipe is None:
                refs.append(ArgRef(None, self._leaf_hold(r), t, False))
            elif mut_slots is not None and j in mut_slots:
                if info.overwrites and covers_storage(t, r.nbytes):
                    refs.append(ArgRef(None, None, t, True, blank_nbytes=r.nbytes))
                else:
                    refs.append(ArgRef(r, None, t, True))
            else:
                refs.append(ArgRef(r, None, t, False))
        return refs

    @staticmethod
    def _leaf_hold(r: Record) -> _Tensor:
        """The tensor through which recipes keep leaf ``r``'s storage: one for all of them, so that
        when it is the storage's last holder, no user tensor needs the value (sweep)."""
        w = r.hold
        h = w() if w is not None else None
        if h is None:
            h = r.sref.strong()
            r.hold = _weakref(h)
        return h

    def _restore_error(self, name: str, evicted, e: OutOfBudgetError) -> OutOfBudgetError:
        return self._op_error(name, e, f"needs {len(evicted)} evicted input(s) back "
                                       f"({sum(r.nbytes for r in evicted)} B), and recomputing them does not fit")

    def _op_error(self, name: str, e: OutOfBudgetError, needs: str = "") -> OutOfBudgetError:
        """The error a user sees when an op cannot run within the budget: the op, what it needed,
        the budget and the arena's state, and the arena's own message as the cause."""
        e = _with_figures(e)
        err = OutOfBudgetError.from_cause(
            f"pymem: {name} {needs}, but the budget is {self.budget} B and nothing else can be released "
            f"(allocated {getattr(e, 'allocated', 0)} B, largest free block "
            f"{getattr(e, 'largest_free_block', 0)} B). Raise the budget. Cause: {e}", e)
        err.op = name
        return err

    def _run_error(self, name: str, recs, e: OutOfBudgetError) -> OutOfBudgetError:
        held = sum(r.nbytes for r in {id(r): r for r in recs if r is not None}.values())
        return self._op_error(name, e, f"needs {getattr(e, 'requested', 0)} B more while its inputs ({held} B) "
                                       f"are held")

    # ------------------------------------------------------------------ stats
    def reset_peak_memory_stats(self) -> None:
        self.backend.reset_peak()

    def memory_stats(self) -> dict:
        s = self.backend.stats()
        s.update({
            "allocator": self.allocator,
            "num_retries": self.num_retries,
            "num_ops": self.num_ops,
        })
        s.update(self.residency.stats())
        s.update({
            "num_invalidations": self.num_invalidations,
            "num_leaf_copies": self.num_leaf_copies,
            "num_orphaned_leaves": self.num_orphaned_leaves,
            "pressure_seconds": self.pressure.seconds,
            "plan_hits": self.pressure.num_planned,
            "num_planned_releases": self.num_planned_releases,
            "plan_divergences": self.trace.num_divergences,
            "plan_cover_steps": self.trace.num_cover_steps,
            "plan_retained": self.trace.num_retained,
            "num_records": len(self.table),
            "num_pinned_storages": sum(1 for r in self.table.values() if r.pins),
            "num_managed_threads": len(self.threads.managed),
        })
        for reason in ("numpy", "dlpack", "data_ptr", "cuda array interface", "shared memory", "user",
                       "collective"):
            s[f"num_pins.{reason}"] = self.residency.pin_counts.get(reason, 0)
        s.update(self.swap.stats() if self.swap is not None else NO_SWAP_STATS)
        s.update(_cupy.stats(self))
        s.update(self.fallbacks.stats())
        return s
