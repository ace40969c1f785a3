"""The public runtime API: enable, disable, budget scopes, stats."""
import contextlib
import logging
from typing import Callable, Iterator, List, Optional, Union

import torch

from . import _C, snapshot
from .budget import format_bytes, parse_budget, parse_host_budget  # noqa: F401  (format_bytes: pymem.api's)
from .cost_model import CostModel
from .runtime import Runtime
from .runtime.hooks import check_cuda_order  # part of the API: tested, documented
from .runtime.settings import check_choices, check_device

log = logging.getLogger("pymem")
log.addHandler(logging.NullHandler())  # silent unless the application configures logging

_current: Optional[Runtime] = None
_settings: Optional[tuple] = None  # enable()'s checked arguments for the active runtime
_last_stats: dict = {}


def _resolve_device(device: Optional[str]) -> str:
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if not isinstance(device, str):
        raise ValueError(f"device must be a string like 'cpu' or 'cuda', got {device!r}")
    return device


def enable(budget: Union[int, str], policy: str = "dtr", device: Optional[str] = None,
           allocator: Optional[str] = None, sampling: bool = False,
           cost: Union[None, str, CostModel] = None, offload: Optional[str] = None,
           prefetch: bool = True, plan: str = "auto", host_budget: Union[None, int, str] = None,
           offload_leaves: Optional[bool] = None, verify: bool = False) -> Runtime:
    """Keep every tensor allocated from now on inside ``budget``, evicting (recomputed on next use)
    or offloading (copied back) tensors under pressure; training gives bitwise the same results. Tensors that exist already stay where
    they are (outside the budget).

    budget: bytes (int) or a string — ``"20GB"``, ``"20GiB"``, ``"512MB"``, ``"1.5TB"``, ``"80%"`` of the
    device's memory (see ``pymem.budget``'s module doc for the units).
    policy: one of ``pymem.policies.policy_names()`` (``dtr``, ``dtr-chain``, ``dtr-local``, ``lru``,
    ``size``, ``msps``, ``coop``).
    device: ``None`` (CUDA when available, else CPU), ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.
    allocator: ``"arena"`` (the default) or ``"native"``.
    ``"arena"`` — pymem's arena of exactly ``budget`` bytes replaces PyTorch's allocator: the budget
    holds for every allocation, eviction happens before an allocation that does not fit, and blocks
    are placed against fragmentation (and compacted, on the CPU). On CUDA the arena is one
    cudaMalloc slab served through ``libpymem_cuda.so`` (``CUDAPluggableAllocator``), which PyTorch
    accepts only before CUDA initialises, and keeps for the rest of the process: after ``disable()``
    CUDA requests go straight to cudaMalloc / cudaFree, without the caching allocator's reuse. It
    gives up cudagraphs, CUDA IPC and ``torch.cuda.memory_stats`` (use ``pymem.memory_stats``).
    ``"native"`` — PyTorch's own allocator stays (on CUDA: the caching allocator, so cudagraphs and
    CUDA IPC keep working), capped at the budget; a request over the cap fails, and pymem releases
    values and runs the op again. It gives up placement and compaction (on CUDA the cap holds for
    reserved memory, so the cache's fragmentation counts against the budget), and an allocation
    outside an op pymem sees (a C++ extension's own buffer) fails instead of making room.
    sampling: score about sqrt(N) randomly drawn candidates instead of all N at each eviction (DTR's
    candidate sampling: cheaper decisions, worse ones at tight budgets). Off by default.

    cost: how an op's compute cost (what eviction weighs) is known. ``"measured"``: its wall time
    (the CPU default; CPU ops are synchronous). ``"estimate"``: FLOPs and bytes moved at rates timed
    on the device once per process (``pymem.cost_model``; the CUDA default, where a host timer would
    see only the kernel launch). Or a ``pymem.cost_model.CostModel`` with fixed rates. Estimates make
    the same decisions every time a program runs in one process; fixed rates, on every machine.

    offload: for each value the policy releases, whether it goes to host memory (copied back when
    used, or before) or is evicted (recomputed when used) — a director from
    ``pymem.policies.director_names()``: ``"delta"`` (offload when copying out and back costs less
    than recomputing it with its evicted ancestors; the CUDA default), ``"never"`` (the CPU default:
    there host memory is the memory the budget caps), ``"always"``, ``"capuchin"`` (from the step
    plan: offload when the copy back hides behind the compute before the next use, or what it
    leaves exposed costs less than the recompute; evict what the step does not read again; DELTA's
    rule until a plan exists). Host copies (pinned memory on
    CUDA) are outside the budget; ``memory_stats()["host_bytes"]`` says how much they hold.
    prefetch: bring offloaded values back ahead of use (in the step plan's order, else newest first:
    backward reads activations in reverse), into free arena memory only, on a side stream (a worker thread on the CPU). Needs
    ``allocator="arena"``.
    plan: ``"auto"`` (the default): from the third training step on, each step is planned from the
    one before (the step trace): under pressure the value released is the one whose return costs
    least per byte and per second until its next use in the step (Belady's rule weighted by cost),
    and values the step before released under pressure are released right after their last use
    before that, where the step still follows its plan; a step that leaves it (other ops, other
    shapes) falls back to ``policy`` for the rest of that step. ``"off"``: ``policy`` alone. While
    the step follows its plan, offloaded values come back in the order the plan reads them.
    host_budget: a cap on the host memory holding offloaded values (the same forms as ``budget``;
    ``"N%"`` of the machine's physical memory), or None (the default): no cap. Host copies come
    from pymem's host pool (pinned on CUDA), which grows in large chunks; when the cap leaves no
    room for a copy, the value is evicted instead.
    offload_leaves: whether values with no recipe (gradients, optimizer state, parameters made
    under pymem) may be released too, offloaded: copied back byte-exact (``_version`` unchanged)
    when next used, weighed by the policy like any value at the cost of their copy. ``None`` (the
    default): whenever ``offload`` offloads anything (so by default on CUDA). A leaf the host pool
    has no room for stays.
    verify: check every value pymem releases as it comes back, recomputed or copied back, against a
    checksum taken when it left (``PYMEM_VERIFY=1``, ``pymem run --verify``): one that differs raises
    ``pymem.RestoreMismatchError`` naming it, where training would otherwise go on with a wrong value.
    A debugging aid: it reads each released value's bytes twice. Off by default.

    Enabling again with the same settings is a no-op; with different ones, a RuntimeError.
    """
    global _current, _settings
    device = _resolve_device(device)
    if allocator is None:
        allocator = "arena"
    check_choices(policy, allocator, sampling, cost, offload, prefetch, plan=plan,
                  offload_leaves=offload_leaves, verify=verify)  # a typo first, by name
    if isinstance(budget, str) and budget.strip().endswith("%") and device.startswith("cuda") and \
            not torch.cuda.is_available():
        check_device(device, allocator)  # says so, before "80%" would ask NVML for a GPU's memory
    nbytes = parse_budget(budget, device)
    host_nbytes = parse_host_budget(host_budget)
    settings = (nbytes, policy, device, allocator, sampling, cost, offload, prefetch, plan, host_nbytes,
                offload_leaves, verify)
    if _current is not None:
        if settings == _settings:
            return _current
        names = ("budget", "policy", "device", "allocator", "sampling", "cost", "offload", "prefetch", "plan",
                 "host_budget", "offload_leaves", "verify")
        raise RuntimeError(f"pymem is already enabled with {_describe(names, _settings)}; call pymem.disable() "
                           f"before enabling it with {_describe(names, settings)}")
    check_cuda_order(device, allocator)  # before the runtime looks at the device
    rt = Runtime(nbytes, policy=policy, device=device, allocator=allocator, sampling=sampling, cost=cost,
                 offload=offload, prefetch=prefetch, plan=plan, host_budget=host_nbytes,
                 offload_leaves=offload_leaves, verify=verify)
    rt.start()
    _current, _settings = rt, settings
    log.info("pymem enabled: budget %d B, policy %s, device %s, allocator %s", rt.budget, policy, device, allocator)
    return rt


def _describe(names, values) -> str:
    return ", ".join(f"{k}={v} B" if k in ("budget", "host_budget") and v is not None else f"{k}={v!r}"
                     for k, v in zip(names, values))


@contextlib.contextmanager
def budget(limit: Union[int, str], policy: str = "dtr", device: Optional[str] = None,
           allocator: Optional[str] = None, sampling: bool = False,
           cost: Union[None, str, CostModel] = None, offload: Optional[str] = None,
           prefetch: bool = True, plan: str = "auto", host_budget: Union[None, int, str] = None,
           offload_leaves: Optional[bool] = None, verify: bool = False) -> Iterator[Runtime]:
    """``with pymem.budget("2GB"): ...`` — pymem enabled for the block only; on leaving it, every
    evicted tensor is restored and PyTorch's allocator is back. Not nestable inside ``enable``."""
    if _current is not None:
        raise RuntimeError("pymem.budget() cannot be used while pymem is already enabled; "
                           "call pymem.disable() first")
    rt = enable(limit, policy=policy, device=device, allocator=allocator, sampling=sampling, cost=cost,
                offload=offload, prefetch=prefetch, plan=plan, host_budget=host_budget,
                offload_leaves=offload_leaves, verify=verify)
    try:
        yield rt
    finally:
        disable()


def disable() -> None:
    """Return to plain PyTorch: every evicted tensor is restored; all tensors stay valid. (With the
    arena on CUDA, PyTorch keeps pymem's library as its allocator, which passes requests to cudaMalloc.)"""
    global _current, _settings, _last_stats
    rt = _current
    if rt is None:
        return
    _current, _settings = None, None
    try:
        rt.stop()
    finally:
        _last_stats = rt.memory_stats()
        log.info("pymem disabled: peak %d B of %d B, %d evictions, %d rematerializations",
                 _last_stats.get("allocated_bytes.peak", 0), rt.budget, rt.residency.num_evictions, rt.residency.num_rematerializations)


def is_enabled() -> bool:
    """True between ``enable`` and ``disable``."""
    return _current is not None


def current() -> Optional[Runtime]:
    """The active runtime, or None."""
    return _current


def memory_stats() -> dict:
    """Statistics of the active runtime (or of the last one, after ``disable``), named after
    ``torch.cuda.memory_stats``.

    Always: ``budget_bytes``, ``allocated_bytes.current`` / ``.peak``, ``num_allocs``, ``num_frees``,
    ``allocator`` (``"arena"`` or ``"native"``), ``num_ops``, ``num_evictions``, ``evicted_bytes``,
    ``num_rematerializations``, ``remat_seconds``, ``pressure_seconds`` (time in the arena's pressure
    handler: choosing, releasing, compacting; copies out included), ``num_invalidations``, ``num_leaf_copies``,
    ``num_orphaned_leaves`` (inputs freed once only recipes held them, their readers made leaves),
    ``num_retries`` (ops run again after a refused allocation), ``num_records``,
    ``num_verified_restores`` (values checked as they came back, under ``verify=True``),
    ``num_pinned_storages`` (shared outside torch, or pinned with ``pymem.pin``) and
    ``num_pins.numpy`` / ``.dlpack`` / ``.data_ptr`` / ``.cuda array interface`` / ``.shared memory`` /
    ``.user`` / ``.collective`` (pins made, by reason; the arena's ``pinned_bytes.current`` counts their
    bytes); offloading:
    ``num_offloads`` / ``offloaded_bytes`` (values released to host memory; evictions count the
    others), ``offload_copied_bytes`` (copied out: a value released again reuses its copy),
    ``num_swap_ins`` / ``swapped_in_bytes`` (copied back when an op needed them),
    ``num_prefetches`` / ``prefetched_bytes`` (copied back ahead of use), ``num_prefetches_cancelled``,
    ``num_copies_ahead`` / ``copied_ahead_bytes`` (copies out started ahead of release, beside compute,
    by the step plan), 
    ``swap_seconds`` (time the program waited on copies), ``host_bytes`` / ``host_bytes.peak``;
    the copies' own time (CUDA: timing events around each copy on its stream, read once the copy is
    found complete, so copies still running are not counted yet; CPU: each copy timed where it runs):
    ``offload_copy_seconds`` / ``offload_copy_timed_bytes`` (out; ``copy_ahead_seconds`` of it
    ahead), ``swap_in_copy_seconds`` /
    ``swap_in_copy_timed_bytes`` (back, on demand and prefetched, cancelled prefetches included):
    bytes / seconds is the rate achieved; ``swap_stall_seconds``, the part compute stood still for
    (the copies on the compute stream, out and on demand, and waits for prefetches and copies out
    ahead not done;
    on the CPU, in the calling thread).
    With the arena: ``requested_bytes.current``, ``pinned_bytes.current``, ``free_bytes``,
    ``largest_free_block``, ``fragmentation.largest_free`` / ``.peak`` / ``.pressure``,
    ``num_pressure_events``, ``num_compactions``, ``num_moved_blocks``, ``moved_bytes``,
    ``num_placed_as_planned`` / ``num_displaced_from_plan`` (the step placement's, with ``plan="auto"``), ...
    With ``allocator="native"``: ``num_refused``; on CUDA also ``reserved_bytes.current`` / ``.peak``
    (what the cap holds). With ``cost="estimate"``, ``remat_seconds`` sums the recomputed ops'
    estimates."""
    return _current.memory_stats() if _current is not None else dict(_last_stats)


def max_memory_allocated() -> int:
    """Peak bytes held in the arena since enable (or the last reset), like torch.cuda's."""
    return memory_stats().get("allocated_bytes.peak", 0)


def reset_peak_memory_stats() -> None:
    """Start the peak over from what is allocated now."""
    if _current is not None:
        _current.reset_peak_memory_stats()


def evict(tensor: torch.Tensor) -> None:
    """Evict ``tensor``'s storage now; it is recomputed when next used."""
    if _current is None:
        raise RuntimeError("pymem is not enabled")
    _current.evict(tensor)


def pin(tensor: torch.Tensor) -> None:
    """Keep ``tensor``'s storage where it is, with its bytes, until ``unpin``: never released, moved
    by compaction or offloaded. For an address taken where pymem cannot see it (a C++ extension
    reading the pointer on its side of the binding); NumPy and DLPack exports and Python's
    ``data_ptr()`` are pinned by pymem itself. A storage pymem does not manage is left alone
    (nothing would release or move it)."""
    if _current is None:
        raise RuntimeError("pymem is not enabled")
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"pymem.pin takes a tensor, got {type(tensor).__name__}")
    _current.pin(tensor, "user")


def unpin(tensor: torch.Tensor) -> None:
    """Undo one ``pin`` of ``tensor``'s storage (pins count), or the pin its ``data_ptr()`` made
    (for code that only compared the address): a later ``data_ptr()`` pins again."""
    if _current is not None and isinstance(tensor, torch.Tensor):
        _current.unpin_key(_C.storage_key(tensor), by_user=True)


@contextlib.contextmanager
def pinned(*tensors: torch.Tensor) -> Iterator[None]:
    """``with pymem.pinned(a, b):`` — ``pin`` for the block only."""
    for t in tensors:
        pin(t)
    try:
        yield
    finally:
        if _current is not None:
            for t in tensors:
                if isinstance(t, torch.Tensor):
                    _current.unpin_key(_C.storage_key(t))  # this block's pin, not a data_ptr() one


@contextlib.contextmanager
def no_recompute() -> Iterator[None]:
    """``with pymem.no_recompute():`` — values the block's ops make are kept like parameters: never
    evicted or recomputed. For state written outside torch's ops (a C extension filling a tensor
    through ``data_ptr()``), whose recompute would not give its value back. A no-op context while
    pymem is not enabled."""
    rt = _current
    if rt is None:
        yield
        return
    with rt.lock:
        rt.no_recipes += 1
    try:
        yield
    finally:
        with rt.lock:
            rt.no_recipes -= 1


# Called at each pymem.step(), enabled or not: pymem profile's count of a script's steps.
step_observers: List[Callable[[], None]] = []


def step() -> None:
    """Marks the end of a training step for pymem's step trace (``step_trace``). A step that ends
    with an optimizer's ``step()`` needs no mark: pymem marks it. A no-op while pymem is not enabled
    (but for ``pymem profile``, which counts the marks of an unmanaged run too)."""
    for observe in step_observers:
        observe()
    rt = _current
    if rt is None:
        return
    rt.end_step()


def step_trace() -> Optional[dict]:
    """The last complete training step as pymem saw it: its ops in order and the values they read and
    made, as numpy arrays (``op``, ``op_cost``, ``inputs_start``/``inputs``, ``outputs_start``/
    ``outputs``, ``value_bytes``, ``value_producer``, ``value_recomputable``; and in a step that
    followed its plan, ``value_free_at`` and ``value_overwrites``; their meaning is in README, "Step
    trace"). None before a step completed or while pymem is not enabled."""
    rt = _current
    if rt is None:
        return None
    with rt.lock:
        return rt.trace.last_step() if rt.trace.num_steps else None


def manage_thread():
    """``with pymem.manage_thread():`` — the calling thread's ops go through pymem for the block.
    Threads started after ``enable()`` are managed already; this is for threads that existed before
    (their allocations count against the budget either way, but pymem can release only the tensors
    of threads it manages). A no-op context while pymem is not enabled."""
    if _current is None:
        return contextlib.nullcontext()
    return _current.threads.managing()


def is_evicted(tensor: torch.Tensor) -> bool:
    """True when ``tensor``'s storage is evicted now (it will be recomputed on its next use)."""
    return _current is not None and _current.is_evicted(tensor)


def memory_summary() -> str:
    """A readable table of ``memory_stats()`` (like ``torch.cuda.memory_summary``)."""
    s = memory_stats()
    if not s:
        return "pymem: not enabled and never was in this process\n"
    rows = [
        ("budget", f"{format_bytes(s['budget_bytes'])} (allocator {s.get('allocator', 'arena')})"),
        ("allocated now / peak", f"{format_bytes(s['allocated_bytes.current'])} / {format_bytes(s['allocated_bytes.peak'])}"),
        ("peak / budget", f"{s['allocated_bytes.peak'] / s['budget_bytes']:.1%}"),
        ("ops seen", str(s.get("num_ops", 0))),
        ("evictions (bytes)", f"{s.get('num_evictions', 0)} ({format_bytes(s.get('evicted_bytes', 0))})"),
        ("rematerializations (s)", f"{s.get('num_rematerializations', 0)} ({s.get('remat_seconds', 0.0):.3f} s)"),
        ("offloads (bytes)", f"{s.get('num_offloads', 0)} ({format_bytes(s.get('offloaded_bytes', 0))})"),
        ("swap-ins / prefetches", f"{s.get('num_swap_ins', 0)} / {s.get('num_prefetches', 0)} "
                                  f"({s.get('swap_seconds', 0.0):.3f} s waiting)"),
        ("host copies now / peak", f"{format_bytes(s.get('host_bytes', 0))} / {format_bytes(s.get('host_bytes.peak', 0))}"),
        ("compactions (moved)", f"{s.get('num_compactions', 0)} ({format_bytes(s.get('moved_bytes', 0))})"),
        ("pressure events", str(s.get("num_pressure_events", 0))),
        ("kernel fallbacks", f"{s.get('num_kernel_fallbacks', 0)} ({s.get('num_kernel_fallbacks.recompute', 0)} "
                             f"recomputing; ran with less memory than asked, e.g. cuDNN)"),
        ("fragmentation now", f"{s.get('fragmentation.largest_free', 0.0):.1%} (1 - largest free / free)"),
    ]
    width = max(len(k) for k, _ in rows)
    lines = ["pymem memory summary", "-" * (width + 30)]
    lines += [f"{k:<{width}}  {v}" for k, v in rows]
    return "\n".join(lines) + "\n"


def record_memory_history(enabled: bool = True, max_entries: int = 100_000) -> None:
    """Opt in to recording the arena's allocations and frees for ``memory_snapshot``, with evictions,
    rematerializations and compaction moves labelled; keeps the newest ``max_entries`` events. Off
    again with ``enabled=False``. Like ``torch.cuda.memory._record_memory_history``."""
    arena = _current.arena if _current is not None else None
    snapshot.record_memory_history(enabled, max_entries, arena)


def memory_snapshot() -> dict:
    """The arena's blocks (and the recorded history) in ``torch.cuda.memory._snapshot()``'s format."""
    if _current is None:
        raise RuntimeError("pymem is not enabled: there is no arena to snapshot")
    return snapshot.memory_snapshot(_arena_for_snapshot())


def dump_snapshot(path: str) -> None:
    """Pickle ``memory_snapshot()`` to ``path`` for ``python -m torch.cuda._memory_viz``."""
    if _current is None:
        raise RuntimeError("pymem is not enabled: there is no arena to snapshot")
    snapshot.dump_snapshot(_arena_for_snapshot(), path)


def _arena_for_snapshot():
    if _current.arena is None:
        raise RuntimeError("snapshots show the arena's blocks, and allocator='native' has no arena; "
                           "enable pymem with allocator='arena' (the default) to take one")
    return _current.arena
