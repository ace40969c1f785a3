"""Where the runtime's memory comes from, behind one interface: the arena, or PyTorch's own allocator
capped at the budget (``enable(allocator=...)``). The runtime asks both the same questions, so no
other module branches on which one it has.

  ArenaBackend   an arena of exactly ``budget`` bytes as PyTorch's allocator (``hooks.py``). Its
                 pressure handler releases values *before* an allocation proceeds; a refused
                 request is retried once, after a compaction with the op's inputs movable.
  NativeBackend  PyTorch's allocator with a cap (``native.py``). Nothing runs before a refusal:
                 after one, values are released for the request's deficit and the op retried, as
                 long as each round releases something.

Both answer: ``install`` / ``uninstall``, ``stats`` / ``reset_peak``, ``releasable`` (whether a
storage's buffer is ours to release), ``set_pinned``, ``history`` (the arena while a snapshot
history records, to label), ``make_room`` after a refusal, and ``retries``.
"""
from .. import _C
from .. import cupy as _cupy
from .. import snapshot as _snap
from . import compaction
from .native import cap_for

_NATIVE_RETRIES = 64  # rounds of release-and-retry for one op under the native allocator
# Values of at most one arena grain (a loss, a norm, a step count) are never released by pressure:
# freeing one gains at most 512 bytes, while bringing back a scalar at the end of a chain can mean
# replaying the whole forward pass (the loss a training step still holds at its optimizer step).
_TINY = _C.ALIGNMENT


class ArenaBackend:
    name = "arena"
    retries = 1

    def __init__(self, hook, budget: int) -> None:
        self.hook = hook
        self.arena = hook.make_arena(budget)
        self.can_compact = True
        self.lo, self.hi = self.arena.base, self.arena.base + budget
        self.main_hi = self.hi - self.arena.small_region_size  # [lo, main_hi): blocks that compact
        self.releasable_range = (self.lo, self.main_hi)  # see releasable (the fast path reads it)

    def install(self, rt) -> None:
        self.arena.set_pressure_handler(rt.pressure)
        _snap.attach(self.arena)
        self.hook.install(self.arena)
        _cupy.attach(rt)  # on CUDA, CuPy (when installed) allocates from the arena too

    def uninstall(self, rt) -> None:
        _cupy.detach(rt)  # CuPy gets its own allocator back
        self.hook.uninstall()
        self.arena.set_pressure_handler(None)

    def stats(self) -> dict:
        return self.arena.stats()

    def reset_peak(self) -> None:
        self.arena.reset_peak_memory_stats()

    def releasable(self, ptr: int, nbytes: int) -> bool:
        """A buffer of the arena's main region over one grain (_TINY): the policy may release it.
        Blocks of the small region are never scanned by eviction (csrc/arena.h), and memory from
        before ``enable`` is not the arena's. A small request that found its region full lies in the
        main region: releasable, or a model of small tensors could release nothing at all."""
        lo, hi = self.releasable_range
        return nbytes > _TINY and lo <= ptr < hi

    def set_pinned(self, ptr: int, pinned: bool) -> None:
        """Compaction refuses a pinned block, and ``pinned_bytes`` counts it."""
        if self.lo <= ptr < self.hi:
            self.arena.set_pinned(ptr, pinned)

    def history(self):
        return self.arena if _snap.recording() else None

    def before_moves(self) -> None:
        """Compaction is about to move blocks: on CUDA, order the copies on this thread's stream."""
        stream = getattr(self.hook, "move_stream", None)
        if stream is not None:
            self.arena.set_move_stream(stream())

    def make_room(self, rt, e: BaseException, round: int) -> bool:
        """The handler released all it could before refusing: compact, the op's inputs movable."""
        return compaction.defragment_after_failure(rt)


class NativeBackend:
    name = "native"
    retries = _NATIVE_RETRIES
    arena = None
    hook = None
    can_compact = False
    lo = hi = main_hi = 0
    releasable_range = (0, (1 << 64) - 1)  # any address

    def __init__(self, device, budget: int) -> None:
        self.cap = cap_for(device, budget)

    def install(self, rt) -> None:
        self.cap.install()

    def uninstall(self, rt) -> None:
        self.cap.uninstall()

    def stats(self) -> dict:
        return self.cap.stats()

    def reset_peak(self) -> None:
        self.cap.reset_peak()

    def releasable(self, ptr: int, nbytes: int) -> bool:
        return nbytes > _TINY

    def set_pinned(self, ptr: int, pinned: bool) -> None:
        pass  # nothing moves blocks; a pin only stops release, which the record's count does

    def history(self):
        return None

    def make_room(self, rt, e: BaseException, round: int) -> bool:
        return rt.pressure.release_for(self.cap.deficit(e, round))
