"""ctypes bindings of libpymem_cuda.so, the CUDA allocator library (ABI: csrc/cuda_lib.h).

The library serves every CUDA allocation of the process from one pymem arena per device. PyTorch
reaches it through ``pluggable_allocator()``; Python configures and inspects it through ``load()``.
Both open the same file, so they share one state.

This module imports without a GPU, without torch's CUDA build and without the library built (its
functions then raise a clear error), and it imports nothing else from pymem: it must work while
pymem._C is not built.
"""
import ctypes
import os
import threading
from collections import namedtuple

__all__ = ["library_path", "load", "pluggable_allocator", "CudaLib", "CudaTable", "Victim", "CudaStats",
           "VictimInfo", "CudaLibError", "CudaOutOfBudgetError", "ABI_VERSION", "LIB_NAME",
           "CUDA_ERROR_NOT_READY"]

LIB_NAME = "libpymem_cuda.so"
ABI_VERSION = 4  # PYMEM_CUDA_ABI_VERSION
CUDA_ERROR_NOT_READY = 600  # PYMEM_CUDA_ERROR_NOT_READY (cudaErrorNotReady)

# Error codes (PYMEM_CUDA_E_*).
OK, E_INVALID, E_STATE, E_OOM, E_CUDA, E_INTERNAL = range(6)

SEARCH_MODES = {"window": 0, "one_at_a_time": 1}
DEFAULT_SMALL_THRESHOLD = 16 * 1024  # pymem::kDefaultSmallThreshold

_HERE = os.path.dirname(os.path.abspath(__file__))


class CudaLibError(RuntimeError):
    """The library reported an error (its message is the exception's)."""

    def __init__(self, message, code=E_INTERNAL):
        super().__init__(message)
        self.code = code


class CudaOutOfBudgetError(CudaLibError, MemoryError):
    """An allocation does not fit the device's budget, even after releasing what could be."""


# ---- C structures (same field order as csrc/cuda_table.h and csrc/cuda_lib.h) -------------------

MALLOC_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t)
FREE_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)
GET_DEVICE_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_int))
SET_DEVICE_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int)
EVENT_CREATE_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint)
EVENT_DESTROY_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)
EVENT_RECORD_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
EVENT_QUERY_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)
EVENT_SYNCHRONIZE_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)
STREAM_WAIT_EVENT_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint)
HOST_ALLOC_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_uint)
FREE_HOST_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)
MEMCPY_ASYNC_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                   ctypes.c_void_p)
MEMCPY_DEVICE_TO_DEVICE = 3  # cudaMemcpyDeviceToDevice


class CudaTable(ctypes.Structure):
    """pymem_cuda_table: the CUDA runtime entry points (fill with fakes to test without a GPU).

    Keep the CFUNCTYPE objects alive as long as the library may call them; ``CudaLib.set_table``
    keeps the table it was given.
    """

    _fields_ = [
        ("malloc", MALLOC_FN),
        ("free", FREE_FN),
        ("get_device", GET_DEVICE_FN),
        ("set_device", SET_DEVICE_FN),
        ("event_create", EVENT_CREATE_FN),
        ("event_destroy", EVENT_DESTROY_FN),
        ("event_record", EVENT_RECORD_FN),
        ("event_query", EVENT_QUERY_FN),
        ("event_synchronize", EVENT_SYNCHRONIZE_FN),
        ("stream_wait_event", STREAM_WAIT_EVENT_FN),
        ("host_alloc", HOST_ALLOC_FN),
        ("free_host", FREE_HOST_FN),
        ("memcpy_async", MEMCPY_ASYNC_FN),
    ]


class Victim(ctypes.Structure):
    """pymem_victim."""

    _fields_ = [("owner", ctypes.c_uint64), ("addr", ctypes.c_uint64), ("size", ctypes.c_uint64),
                ("cost", ctypes.c_double)]


class CudaStats(ctypes.Structure):
    """pymem_cuda_stats."""

    _fields_ = [(name, ctypes.c_uint64) for name in (
        "budget", "allocated_bytes", "peak_allocated_bytes", "num_allocs", "num_frees",
        "num_pressure_events", "num_released_blocks", "num_ooms", "largest_free_block", "num_blocks",
        "pending_frees", "pending_bytes", "bad_frees")]


PRESSURE_FN = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_size_t, ctypes.POINTER(Victim), ctypes.c_size_t,
                               ctypes.c_void_p)

# What a Python pressure handler receives: handler(device, request, [VictimInfo, ...]).
VictimInfo = namedtuple("VictimInfo", "owner addr size cost")


def library_path():
    """Path of pymem/libpymem_cuda.so, or None when it was not built (no CUDA toolkit at build)."""
    path = os.path.join(_HERE, LIB_NAME)
    return path if os.path.isfile(path) else None


def _require_path(path):
    if path is None:
        path = library_path()
    if path is None:
        raise CudaLibError(
            f"{LIB_NAME} is not built: setup.py builds it only when a CUDA toolkit "
            "(cuda_runtime_api.h) is found; rebuild with CUDA_HOME set", E_STATE)
    if not os.path.isfile(path):
        raise CudaLibError(f"no {LIB_NAME} at {path}", E_STATE)
    return os.path.realpath(path)


def _ptr(value):
    """An address or stream as c_void_p: int, None, a ctypes pointer, or an object with
    ``cuda_stream`` (torch.cuda.Stream)."""
    if value is None:
        return None
    if hasattr(value, "cuda_stream"):
        value = value.cuda_stream
    if isinstance(value, ctypes.c_void_p):
        return value
    return ctypes.c_void_p(int(value)) if int(value) else None


class CudaLib:
    """Typed access to one loaded libpymem_cuda.so (obtain with ``load()``)."""

    def __init__(self, path):
        self.path = path
        try:
            lib = ctypes.CDLL(path)
        except OSError as e:
            raise CudaLibError(f"cannot load {path}: {e}", E_STATE) from e
        self._lib = lib
        sig = {
            "pymem_cuda_abi_version": (ctypes.c_int, []),
            "pymem_cuda_configure": (ctypes.c_int, [ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int]),
            "pymem_cuda_set_table": (ctypes.c_int, [ctypes.POINTER(CudaTable)]),
            "pymem_cuda_alloc": (ctypes.c_void_p, [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]),
            "pymem_cuda_free": (None, [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]),
            "pymem_cuda_free_checked": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_int]),
            "pymem_cuda_free_owned": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64]),
            "pymem_cuda_record_stream": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]),
            "pymem_cuda_relocate": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]),
            "pymem_cuda_set_primary_stream": (ctypes.c_int, [ctypes.c_int, ctypes.c_void_p]),
            "pymem_cuda_set_pressure_handler": (None, [PRESSURE_FN, ctypes.c_void_p]),
            "pymem_cuda_set_owner": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64,
                                                    ctypes.c_double]),
            "pymem_cuda_set_pinned": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]),
            "pymem_cuda_get_stats": (ctypes.c_int, [ctypes.c_int, ctypes.POINTER(CudaStats)]),
            "pymem_cuda_reset": (ctypes.c_int, []),
            "pymem_cuda_set_provider": (ctypes.c_int, [ctypes.c_int, ctypes.c_void_p]),
            "pymem_cuda_passthrough_provider": (ctypes.c_void_p, []),
            "pymem_cuda_runtime_table": (ctypes.c_void_p, []),
            "pymem_cuda_last_error": (ctypes.c_char_p, []),
            "pymem_cuda_last_error_code": (ctypes.c_int, []),
        }
        for name, (restype, argtypes) in sig.items():
            fn = getattr(lib, name)
            fn.restype = restype
            fn.argtypes = argtypes
        version = lib.pymem_cuda_abi_version()
        if version != ABI_VERSION:
            raise CudaLibError(f"{path} has ABI version {version}, this module expects {ABI_VERSION}; "
                               "rebuild the library", E_STATE)
        # Objects the library holds pointers to: they must outlive its use of them.
        self._table = None
        self._handler = None

    @property
    def raw(self):
        """The ctypes.CDLL itself (for calls whose failure the caller inspects)."""
        return self._lib

    # ---- errors --------------------------------------------------------------------------------

    def last_error(self):
        """This thread's most recent error message (kept until the next failure)."""
        return (self._lib.pymem_cuda_last_error() or b"").decode("utf-8", "replace")

    def last_error_code(self):
        return self._lib.pymem_cuda_last_error_code()

    def _check(self, rc):
        if rc == OK:
            return
        msg = self.last_error()
        if rc == E_INVALID:
            raise ValueError(msg)
        if rc == E_OOM:
            raise CudaOutOfBudgetError(msg, rc)
        raise CudaLibError(msg, rc)

    # ---- set-up --------------------------------------------------------------------------------

    def configure(self, budget, small_threshold=DEFAULT_SMALL_THRESHOLD, search_mode="window"):
        """Per-device budget (bytes, a multiple of 512) etc.; before the first allocation."""
        if isinstance(search_mode, str):
            if search_mode not in SEARCH_MODES:
                raise ValueError(f"search_mode must be one of {sorted(SEARCH_MODES)}, got {search_mode!r}")
            search_mode = SEARCH_MODES[search_mode]
        if budget < 0 or small_threshold < 0:
            raise ValueError("budget and small_threshold must be >= 0")
        self._check(self._lib.pymem_cuda_configure(budget, small_threshold, int(search_mode)))

    def set_table(self, table):
        """Use ``table`` (a CudaTable) instead of the real CUDA runtime; None: the real one."""
        rc = self._lib.pymem_cuda_set_table(ctypes.byref(table) if table is not None else None)
        self._check(rc)
        self._table = table  # its callbacks must stay alive while arenas use them

    def set_provider(self, device, provider):
        """Serve ``device`` from a block provider (the address of a pymem_block_provider, e.g.
        ``pymem._C.arena_block_provider(arena)`` or ``passthrough_provider()``); None: from the
        library's own arena again. Blocks go back to the provider that made them.

        A provider reports failure by throwing through ``pymem_cuda_alloc``: with one set, leave
        allocation to C++ callers (PyTorch, the pluggable CPU hook) and do not call ``alloc``.
        """
        self._check(self._lib.pymem_cuda_set_provider(device, _ptr(provider)))

    def passthrough_provider(self):
        """Address of the built-in provider: plain cudaMalloc / cudaFree of the table in use."""
        return self._lib.pymem_cuda_passthrough_provider()

    def runtime_table(self):
        """Address of the CUDA runtime table the library uses (the one set, or libcudart loaded
        now); valid for the life of the process. For ``pymem._C.Arena(backing="cuda")``."""
        t = self._lib.pymem_cuda_runtime_table()
        if not t:
            self._check(self.last_error_code() or E_CUDA)
        return t

    def entry_points(self):
        """Addresses of pymem_cuda_alloc and pymem_cuda_free (CUDAPluggableAllocator's signatures)."""
        cast = ctypes.cast
        return (cast(self._lib.pymem_cuda_alloc, ctypes.c_void_p).value,
                cast(self._lib.pymem_cuda_free, ctypes.c_void_p).value)

    def relocation_points(self):
        """Addresses of pymem_cuda_relocate and pymem_cuda_free: what pymem._C needs to repoint a
        storage whose block compaction moved (``_C.set_pluggable_relocation``)."""
        cast = ctypes.cast
        return (cast(self._lib.pymem_cuda_relocate, ctypes.c_void_p).value,
                cast(self._lib.pymem_cuda_free, ctypes.c_void_p).value)

    def set_primary_stream(self, device, stream):
        self._check(self._lib.pymem_cuda_set_primary_stream(device, _ptr(stream)))

    def set_pressure_handler(self, handler):
        """``handler(device, request, victims)`` with victims a list of VictimInfo; None removes it.

        It runs in the allocating thread, with no pymem lock held; it releases what it can by
        calling ``free_owned(v.addr, device, v.owner)`` (or ``free``) on victims. Exceptions it raises are reported and otherwise ignored (the
        allocation then fails if nothing was freed).
        """
        if handler is None:
            self._lib.pymem_cuda_set_pressure_handler(PRESSURE_FN(), None)
            self._handler = None
            return

        def trampoline(device, request, victims, n, ctx):
            handler(device, request, [VictimInfo(victims[i].owner, victims[i].addr, victims[i].size,
                                                 victims[i].cost) for i in range(n)])

        cb = PRESSURE_FN(trampoline)
        self._lib.pymem_cuda_set_pressure_handler(cb, None)
        self._handler = cb

    # ---- allocation ----------------------------------------------------------------------------

    def alloc(self, size, device=0, stream=0):
        """Address of a new block (0 for size 0). Raises CudaOutOfBudgetError when it does not fit."""
        p = self._lib.pymem_cuda_alloc(size, device, _ptr(stream))
        if p:
            return p
        if size == 0:
            return 0
        self._check(self.last_error_code() or E_INTERNAL)
        return 0

    def free(self, ptr, device=0):
        """Free a block. It waits for its allocation stream and the streams given to
        ``record_stream`` (see cuda_lib.h). Raises ValueError for unknown pointers."""
        self._check(self._lib.pymem_cuda_free_checked(_ptr(ptr), device))

    def free_owned(self, ptr, device, owner):
        """Free ptr if it is still a live block of ``owner``; return whether it was freed.

        The safe way for a pressure handler to release a victim: ``free_owned(v.addr, device,
        v.owner)``. Another thread may have released it (and its address been reused) already.
        """
        rc = self._lib.pymem_cuda_free_owned(_ptr(ptr), device, owner)
        if rc == E_INVALID:
            return False
        self._check(rc)
        return True

    def record_stream(self, ptr, device=0, stream=0):
        self._check(self._lib.pymem_cuda_record_stream(_ptr(ptr), device, _ptr(stream)))

    def set_owner(self, ptr, device=0, owner=0, cost=0.0):
        self._check(self._lib.pymem_cuda_set_owner(_ptr(ptr), device, owner, float(cost)))

    def set_pinned(self, ptr, device=0, pinned=True):
        self._check(self._lib.pymem_cuda_set_pinned(_ptr(ptr), device, 1 if pinned else 0))

    # ---- inspection ----------------------------------------------------------------------------

    def stats(self, device=0):
        out = CudaStats()
        self._check(self._lib.pymem_cuda_get_stats(device, ctypes.byref(out)))
        return {name: getattr(out, name) for name, _ in CudaStats._fields_}

    def reset(self):
        """Drop all arenas (tests). Fails while blocks are still allocated."""
        self._check(self._lib.pymem_cuda_reset())


_loaded = {}
_loaded_lock = threading.Lock()


def load(path=None):
    """The CudaLib of ``path`` (default: ``library_path()``); one object per file, so the tables
    and handlers it keeps alive are never dropped while the library uses them."""
    real = _require_path(path)
    with _loaded_lock:
        lib = _loaded.get(real)
        if lib is None:
            lib = _loaded[real] = CudaLib(real)
        return lib


def pluggable_allocator():
    """``torch.cuda.memory.CUDAPluggableAllocator`` over libpymem_cuda.so.

    Install it with ``torch.cuda.memory.change_current_allocator`` before CUDA is initialised, and
    call ``load().configure(budget)`` (or ``set_provider``) before the first allocation. Note that
    PyTorch does not check the pointer a pluggable allocator returns: with the library's own arena,
    a request beyond the budget gives NULL, with the reason in ``load().last_error()``; pymem's
    runtime sets its arena as the provider instead, whose refusals raise ``pymem.OutOfBudgetError``.
    """
    path = _require_path(None)
    import torch  # only here: the rest of this module works without torch

    load(path)  # same file as PyTorch opens: one shared state
    return torch.cuda.memory.CUDAPluggableAllocator(path, "pymem_cuda_alloc", "pymem_cuda_free")
