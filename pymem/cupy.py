"""CuPy shares the budget: CuPy's allocator takes its memory from the runtime's arena.

With pymem enabled on CUDA (allocator="arena"), ``Runtime.start`` calls ``attach``, which sets
CuPy's allocator (``cupy.cuda.set_allocator``) to an ``Allocator`` over the same libpymem_cuda.so
that serves PyTorch. A CuPy request then meets the same arena: under pressure the runtime's handler
releases PyTorch values first, exactly as for a torch allocation, and one that still cannot fit
raises ``pymem.OutOfBudgetError`` naming PyTorch's and CuPy's bytes. ``Runtime.stop`` calls
``detach``, which gives CuPy back the allocator it had. Arrays made meanwhile stay valid: a block
remembers where it came from, and goes back through the library when CuPy drops it.

CuPy is optional: this module imports without it, and only ``install`` needs it. CuPy's memory pool
is bypassed while installed (a cache inside the budget would hold bytes the runtime cannot release).
Not done: CuPy's pinned host allocator (pymem has no host pool yet); allocator="native" (CuPy keeps
its own allocator there, outside the cap).
"""
import importlib.util
import logging
import sys
import threading
import weakref
from typing import Callable, Optional, Tuple

from . import _C
from .errors import OutOfBudgetError

__all__ = ["install", "uninstall", "installed", "available", "Allocator"]

log = logging.getLogger("pymem")

# What CuPy had before install (restored by uninstall), and what replaced it.
_previous = None
_installed: Optional["Allocator"] = None
_lock = threading.Lock()
# Each runtime's allocator, for its memory_stats (kept after uninstall: arrays may outlive it).
_by_runtime: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def available() -> bool:
    """Whether CuPy can be imported (without importing it when it is not installed)."""
    try:
        return importlib.util.find_spec("cupy") is not None
    except (ImportError, ValueError):  # a broken entry in sys.modules
        return False


def _cupy():
    try:
        import cupy
    except ImportError as e:
        raise ImportError("pymem.cupy needs CuPy (pip install torch-pymem[cupy], or the cupy-cudaXXx "
                          "wheel of your CUDA version)") from e
    return cupy


def _cupy_current() -> Tuple[int, int]:
    """CuPy's current device and stream: where the library serves the request and orders its free."""
    cupy = _cupy()
    return cupy.cuda.runtime.getDevice(), cupy.cuda.get_current_stream().ptr


class _Block:
    """The owner CuPy keeps for one block: when CuPy drops it, the block goes back to the library."""

    __slots__ = ("allocator", "ptr", "device", "nbytes")

    def __init__(self, allocator: "Allocator", ptr: int, device: int, nbytes: int) -> None:
        self.allocator, self.ptr, self.device, self.nbytes = allocator, ptr, device, nbytes

    def __del__(self) -> None:
        if not sys.is_finalizing():  # at exit the library may call a torn-down CUDA: leave the block
            self.allocator.free(self)


class Allocator:
    """CuPy's allocator (``size -> cupy.cuda.MemoryPointer``) over libpymem_cuda.so, whose blocks on
    ``device`` come from ``arena`` (the runtime's); other devices' blocks pass through to cudaMalloc
    (outside the budget, as PyTorch's are). ``current() -> (device, stream)``: where a request goes
    (default: CuPy's current device and stream)."""

    def __init__(self, lib, arena, device: int, current: Optional[Callable[[], Tuple[int, int]]] = None) -> None:
        from cupy.cuda.memory import MemoryPointer, UnownedMemory
        self._pointer, self._memory = MemoryPointer, UnownedMemory
        self.lib = lib
        self.arena = arena
        self.device = device
        self.current = current or _cupy_current
        self._alloc_fn = lib.entry_points()[0]
        self._lock = threading.Lock()
        self.bytes = 0      # arena bytes CuPy's live blocks hold
        self.peak = 0
        self.num_allocs = 0

    def __call__(self, size: int):
        device, stream = self.current()
        if size == 0:
            return self._pointer(self._memory(0, 0, None, device), 0)
        try:
            ptr = _C.call_pluggable_alloc(self._alloc_fn, size, device, stream)
        except OutOfBudgetError as e:
            raise self._error(size, device, e) from None
        if not ptr:  # the library refused by itself (no provider: pymem is not serving this device)
            raise MemoryError(f"pymem: libpymem_cuda.so gave CuPy no memory for {size} B on device "
                              f"{device}: {self.lib.last_error()}")
        nbytes = self.arena.block_size(ptr) if device == self.device and self._in_arena(ptr) else 0
        with self._lock:
            self.bytes += nbytes
            self.peak = max(self.peak, self.bytes)
            self.num_allocs += 1
        return self._pointer(self._memory(ptr, size, _Block(self, ptr, device, nbytes), device), 0)

    def _in_arena(self, ptr: int) -> bool:
        return self.arena.base <= ptr < self.arena.base + self.arena.budget

    def free(self, block: _Block) -> None:
        with self._lock:
            self.bytes -= block.nbytes
        self.lib.free(block.ptr, block.device)  # ordered after its stream's work by the library

    def _error(self, size: int, device: int, e: OutOfBudgetError) -> OutOfBudgetError:
        s = self.arena.stats()
        cupy_bytes = self.bytes
        torch_bytes = s["allocated_bytes.current"] - cupy_bytes
        err = OutOfBudgetError.from_cause(
            f"pymem: CuPy asked for {size} B on cuda:{device}, but the budget is {s['budget_bytes']} B and "
            f"nothing else can be released: PyTorch holds {torch_bytes} B and CuPy {cupy_bytes} B (largest "
            f"free block {s['largest_free_block']} B). Raise the budget, or free CuPy arrays. Cause: {e}", e)
        err.torch_bytes, err.cupy_bytes = torch_bytes, cupy_bytes
        return err

    def stats(self) -> dict:
        return {"cupy_bytes.current": self.bytes, "cupy_bytes.peak": self.peak,
                "num_cupy_allocs": self.num_allocs}


def install(rt=None, current: Optional[Callable[[], Tuple[int, int]]] = None) -> Allocator:
    """CuPy allocates from ``rt``'s arena (default: the active runtime) until ``uninstall``.
    ``rt`` must serve its arena through libpymem_cuda.so (allocator="arena" on CUDA).
    ``current() -> (device, stream)`` overrides CuPy's current device and stream (tests)."""
    cupy = _cupy()
    if rt is None:
        from .api import current as active
        rt = active()
        if rt is None:
            raise RuntimeError("pymem.cupy.install(): pymem is not enabled; call pymem.enable(device='cuda') first")
    lib = getattr(getattr(rt, "hook", None), "lib", None)
    if lib is None or rt.arena is None:
        raise ValueError("CuPy shares pymem's budget only with allocator='arena' on CUDA, where the arena "
                         "is served through libpymem_cuda.so")
    global _previous, _installed
    with _lock:
        allocator = Allocator(lib, rt.arena, rt.hook.index, current)
        if _installed is None:
            _previous = cupy.cuda.get_allocator()
        cupy.cuda.set_allocator(allocator)
        _installed = allocator
        _by_runtime[rt] = allocator
    return allocator


def uninstall() -> None:
    """CuPy gets back the allocator it had before ``install`` (unless someone replaced ours since).
    Arrays made meanwhile stay valid; their blocks go back through the library when freed."""
    global _previous, _installed
    with _lock:
        if _installed is None:
            return
        cupy = _cupy()
        if cupy.cuda.get_allocator() is _installed:
            cupy.cuda.set_allocator(_previous)
        else:
            log.warning("pymem: CuPy's allocator was replaced while pymem's was installed; leaving it")
        _previous, _installed = None, None


def installed() -> Optional[Allocator]:
    """The allocator CuPy uses now, if it is pymem's."""
    return _installed


# ---- what Runtime.start / stop / memory_stats call ------------------------------------------------

def attach(rt) -> None:
    """On CUDA with the arena, CuPy (when installed) allocates from it too. A CuPy that fails to
    import is logged and left alone: it must not stop pymem."""
    if rt.arena is None or rt.device.type != "cuda" or getattr(rt.hook, "lib", None) is None or not available():
        return
    try:
        install(rt)
    except Exception as e:  # noqa: BLE001 (a broken CuPy install, a CuPy without a GPU)
        log.warning("pymem: CuPy is installed but does not share the budget: %s", e)


def detach(rt) -> None:
    if _installed is not None and _by_runtime.get(rt) is _installed:
        uninstall()


def stats(rt) -> dict:
    """CuPy's share of ``rt``'s arena, if CuPy allocated from it."""
    allocator = _by_runtime.get(rt)
    return allocator.stats() if allocator is not None else {}
