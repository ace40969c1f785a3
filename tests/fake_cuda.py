"""A fake CUDA runtime for libpymem_cuda.so: pymem_cuda_table over Python callbacks (malloc hands
out ctypes buffers in host memory; events are integers whose completion the test controls; streams
are plain integers), so the library's logic runs, exactly, without a GPU."""
import ctypes

from pymem import cuda_lib

NOT_READY = cuda_lib.CUDA_ERROR_NOT_READY


def align(n):
    return (n + 511) // 512 * 512


class FakeCuda:
    """pymem_cuda_table over Python: records every call, and lets the test decide when events
    complete (event_query answers NOT_READY until ``complete`` or an event_synchronize)."""

    def __init__(self):
        self.buffers = {}   # slab address -> ctypes buffer (kept alive)
        self.mallocs = []   # sizes asked of cudaMalloc
        self.frees = []     # addresses given to cudaFree
        self.current_device = 0
        self.device_log = []
        self.events = {}    # handle -> {"done", "stream", "destroyed"}
        self.created = 0
        self.log = []       # ("record", ev, stream) ("wait", stream, ev) ("sync", ev) ("destroy", ev)
        self.fail_malloc = 0
        self.host_buffers = {}  # cudaHostAlloc: address -> ctypes buffer
        self.host_allocs = []
        self.host_frees = []
        self.fail_host_alloc = 0
        self.fail_event_record = 0
        self.copies = []    # (dst, src, bytes, stream) of each cudaMemcpyAsync
        self._next_event = 0xE000
        t = cuda_lib.CudaTable()
        self._callbacks = dict(
            malloc=cuda_lib.MALLOC_FN(self._malloc),
            free=cuda_lib.FREE_FN(self._free),
            get_device=cuda_lib.GET_DEVICE_FN(self._get_device),
            set_device=cuda_lib.SET_DEVICE_FN(self._set_device),
            event_create=cuda_lib.EVENT_CREATE_FN(self._event_create),
            event_destroy=cuda_lib.EVENT_DESTROY_FN(self._event_destroy),
            event_record=cuda_lib.EVENT_RECORD_FN(self._event_record),
            event_query=cuda_lib.EVENT_QUERY_FN(self._event_query),
            event_synchronize=cuda_lib.EVENT_SYNCHRONIZE_FN(self._event_synchronize),
            stream_wait_event=cuda_lib.STREAM_WAIT_EVENT_FN(self._stream_wait_event),
            host_alloc=cuda_lib.HOST_ALLOC_FN(self._host_alloc),
            free_host=cuda_lib.FREE_HOST_FN(self._free_host),
            memcpy_async=cuda_lib.MEMCPY_ASYNC_FN(self._memcpy_async),
        )
        for name, cb in self._callbacks.items():
            setattr(t, name, cb)
        self.table = t

    # table entries
    @staticmethod
    def _take(pptr, size, buffers, sizes, failure):
        """A 512-aligned ctypes buffer of ``size`` bytes into ``buffers`` (kept alive), or ``failure``."""
        if failure:
            return failure
        buf = ctypes.create_string_buffer(size + 512)
        addr = align(ctypes.addressof(buf))
        buffers[addr] = buf
        sizes.append(size)
        pptr[0] = addr
        return 0

    def _malloc(self, pptr, size):
        return self._take(pptr, size, self.buffers, self.mallocs, self.fail_malloc)

    def _free(self, ptr):
        self.frees.append(ptr)
        self.buffers.pop(ptr, None)
        return 0

    def _host_alloc(self, pptr, size, flags):
        return self._take(pptr, size, self.host_buffers, self.host_allocs, self.fail_host_alloc)

    def _free_host(self, ptr):
        self.host_frees.append(ptr)
        self.host_buffers.pop(ptr, None)
        return 0

    def _memcpy_async(self, dst, src, n, kind, stream):
        """Done at once (a fake stream runs in call order); refuses what CUDA leaves undefined."""
        assert kind == cuda_lib.MEMCPY_DEVICE_TO_DEVICE, kind
        assert dst + n <= src or src + n <= dst, f"overlapping cudaMemcpyAsync: {dst:#x} <- {src:#x}, {n} B"
        self.copies.append((dst, src, n, stream))
        ctypes.memmove(dst, src, n)
        return 0

    def _get_device(self, pdev):
        pdev[0] = self.current_device
        return 0

    def _set_device(self, dev):
        self.device_log.append(dev)
        self.current_device = dev
        return 0

    def _event_create(self, pev, flags):
        self._next_event += 16
        ev = self._next_event
        self.events[ev] = {"done": True, "stream": None, "destroyed": False, "flags": flags,
                           "device": self.current_device}
        self.created += 1
        pev[0] = ev
        return 0

    def _event_destroy(self, ev):
        self.events[ev]["destroyed"] = True
        self.log.append(("destroy", ev))
        return 0

    def _event_record(self, ev, stream):
        if self.fail_event_record:
            return self.fail_event_record
        e = self.events[ev]
        assert not e["destroyed"]
        e["done"] = False
        e["stream"] = stream or 0
        self.log.append(("record", ev, stream or 0))
        return 0

    def _event_query(self, ev):
        return 0 if self.events[ev]["done"] else NOT_READY

    def _event_synchronize(self, ev):
        self.events[ev]["done"] = True
        self.log.append(("sync", ev))
        return 0

    def _stream_wait_event(self, stream, ev, flags):
        self.log.append(("wait", stream or 0, ev))
        return 0

    # test controls
    @property
    def slab(self):
        assert len(self.buffers) >= 1
        return next(iter(self.buffers))

    def complete(self, stream=None):
        """Finish the work recorded on `stream` (every stream when None)."""
        for e in self.events.values():
            if stream is None or e["stream"] == stream:
                e["done"] = True

    def records(self, since=0):
        return [(ev, st) for kind, *rest in self.log[since:] if kind == "record" for ev, st in [rest]]

    def waits(self, since=0):
        return [(st, ev) for kind, *rest in self.log[since:] if kind == "wait" for st, ev in [rest]]

    def syncs(self, since=0):
        return [rest[0] for kind, *rest in self.log[since:] if kind == "sync"]


# The library keeps every table it was given, and arenas keep their slabs, for the life of the
# process: the fakes (their callbacks and buffers) must live as long.
_FAKES = []


def fresh_table():
    """The CUDA library (loaded) on a new fake table, with no provider or handler left from an
    earlier test: (library, fake)."""
    lib = cuda_lib.load()
    lib.set_pressure_handler(None)
    lib.set_provider(0, None)
    lib.reset()
    f = FakeCuda()
    _FAKES.append(f)
    lib.set_table(f.table)
    return lib, f
