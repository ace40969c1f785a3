"""libpymem_cuda.so: the C-ABI CUDA allocator library, driven through a fake CUDA runtime table.

Everything except the last test runs without a GPU: FakeCuda implements pymem_cuda_table with ctypes
callbacks (malloc hands out ctypes buffers; events are integers whose completion the test controls;
streams are plain integers), so the stream-ordering logic is checked exactly.
"""
import ctypes
import importlib.util
import os
import struct
import subprocess
import sys
import textwrap
import threading

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CUDA_LIB_PY = os.path.join(ROOT, "pymem", "cuda_lib.py")  # loaded alone in the torch-free subprocess tests


from pymem import cuda_lib  # noqa: E402

LIB_PATH = cuda_lib.library_path()
if LIB_PATH is None:
    pytest.skip("pymem/libpymem_cuda.so is not built (setup.py builds it only when a CUDA toolkit is "
                "found)", allow_module_level=True)

from fake_cuda import NOT_READY, FakeCuda, align  # noqa: E402

KiB = 1024
BUDGET = 1024 * KiB
S1, S2, S3 = 0x5100, 0x5200, 0x5300  # stream handles: any integers will do


class Client:
    """The library, remembering what the test allocated so teardown can clean up after a failure."""

    def __init__(self, lib):
        self.lib = lib
        self.live = {}  # addr -> device

    def alloc(self, size, device=0, stream=S1):
        p = self.lib.alloc(size, device, stream)
        if p:
            self.live[p] = device
        return p

    def free(self, ptr, device=0):
        self.lib.free(ptr, device)
        self.live.pop(ptr, None)

    def __getattr__(self, name):
        return getattr(self.lib, name)


@pytest.fixture(scope="module")
def lib():
    return cuda_lib.load()


@pytest.fixture
def fake(lib):
    lib.set_pressure_handler(None)
    lib.reset()
    f = FakeCuda()
    lib.set_table(f.table)
    lib.configure(BUDGET, small_threshold=0)
    yield f
    lib.set_pressure_handler(None)


@pytest.fixture
def cu(lib, fake):
    c = Client(lib)
    yield c
    for p, dev in list(c.live.items()):
        lib.raw.pymem_cuda_free_checked(p, dev)
    fake.complete()
    lib.reset()
    # every event the library created was destroyed, and every slab given back
    assert all(e["destroyed"] for e in fake.events.values())
    assert not fake.buffers


# ---- the shared object itself ---------------------------------------------------------------------


def _elf_dynamic(path):
    """(NEEDED entries, undefined dynamic symbols) of a 64-bit little-endian ELF file."""
    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b"\x7fELF" and data[4] == 2 and data[5] == 1, "expected ELF64 little-endian"
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = []
    for i in range(shnum):
        (_name, sh_type, _flags, _addr, offset, size, link, _info, _align,
         entsize) = struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize)
        sections.append((sh_type, offset, size, link, entsize))

    def cstr(strtab, off):
        base = sections[strtab][1] + off
        return data[base:data.index(b"\0", base)].decode()

    needed, undefined = [], []
    for sh_type, offset, size, link, entsize in sections:
        if sh_type == 6:  # SHT_DYNAMIC
            for pos in range(offset, offset + size, 16):
                tag, val = struct.unpack_from("<qQ", data, pos)
                if tag == 0:
                    break
                if tag == 1:  # DT_NEEDED
                    needed.append(cstr(link, val))
        elif sh_type == 11:  # SHT_DYNSYM
            for pos in range(offset + entsize, offset + size, entsize):
                st_name, _info, _other, shndx = struct.unpack_from("<IBBH", data, pos)
                if shndx == 0 and st_name:
                    undefined.append(cstr(link, st_name))
    return needed, undefined


def test_library_links_neither_torch_nor_cudart():
    needed, undefined = _elf_dynamic(LIB_PATH)
    assert needed, "no NEEDED entries found: the ELF parser is broken"
    for name in needed:
        assert not name.startswith(("libtorch", "libc10", "libcudart", "libcuda.")), needed
    assert not [s for s in undefined if s.startswith("cuda")], undefined


def test_exports_the_c_abi(lib):
    for name in ["pymem_cuda_alloc", "pymem_cuda_free", "pymem_cuda_configure", "pymem_cuda_set_table",
                 "pymem_cuda_record_stream", "pymem_cuda_set_primary_stream",
                 "pymem_cuda_set_pressure_handler", "pymem_cuda_set_owner", "pymem_cuda_set_pinned",
                 "pymem_cuda_get_stats", "pymem_cuda_reset", "pymem_cuda_last_error"]:
        assert hasattr(lib.raw, name)
    assert lib.raw.pymem_cuda_abi_version() == cuda_lib.ABI_VERSION
    # what PyTorch does with the path: a fresh CDLL handle finds the same entry points
    assert ctypes.CDLL(LIB_PATH).pymem_cuda_alloc


# ---- allocation -----------------------------------------------------------------------------------


def test_allocations_are_in_the_slab_aligned_and_disjoint(cu, fake):
    sizes = [1, 511, 512, 513, 4096, 100_000, 3 * KiB + 7, 64 * KiB]
    ptrs = [cu.alloc(n) for n in sizes]
    assert fake.mallocs == [BUDGET]  # one slab of exactly the budget
    base = fake.slab
    spans = sorted((p, p + align(n)) for p, n in zip(ptrs, sizes))
    for lo, hi in spans:
        assert lo % 512 == 0
        assert base <= lo and hi <= base + BUDGET
    for (_, hi), (lo, _) in zip(spans, spans[1:]):
        assert hi <= lo
    st = cu.stats()
    assert st["allocated_bytes"] == sum(align(n) for n in sizes)
    assert st["num_allocs"] == len(sizes)
    for p in ptrs:
        cu.free(p)
    assert cu.stats()["allocated_bytes"] == 0


def test_size_zero_and_bad_arguments(cu, fake):
    assert cu.alloc(0) == 0
    assert cu.raw.pymem_cuda_alloc(0, 0, None) is None
    assert cu.raw.pymem_cuda_alloc(-5, 0, None) is None
    assert cu.last_error_code() == cuda_lib.E_INVALID and "-5" in cu.last_error()
    assert cu.raw.pymem_cuda_alloc(512, -1, None) is None
    assert "device" in cu.last_error()
    cu.raw.pymem_cuda_free(None, 0, 0, None)  # freeing NULL is a no-op
    p = cu.alloc(BUDGET)  # exactly the budget fits
    cu.free(p)
    with pytest.raises(cuda_lib.CudaOutOfBudgetError, match=f"{BUDGET + 1} bytes"):
        cu.alloc(BUDGET + 1)


def test_same_stream_free_is_reusable_at_once(cu, fake):
    a = cu.alloc(10 * KiB)
    cu.free(a)
    st = cu.stats()
    assert st["pending_frees"] == 0 and st["num_frees"] == 1
    assert cu.alloc(10 * KiB) == a
    assert fake.records() == []  # no event for a block that only the primary stream used
    # PyTorch's entry point: the size and stream it passes back change nothing
    cu.raw.pymem_cuda_free(ctypes.c_void_p(a), 12345, 0, ctypes.c_void_p(S2))
    cu.live.pop(a)
    assert cu.stats()["pending_frees"] == 0 and cu.alloc(10 * KiB) == a


def test_recorded_block_is_not_reused_until_its_events_complete(cu, fake):
    a = cu.alloc(10 * KiB, stream=S1)
    cu.record_stream(a, 0, S2)
    mark = len(fake.log)
    cu.free(a)
    recs = fake.records(mark)
    assert sorted(st for _, st in recs) == [S1, S2]  # one event per stream that used the block
    st = cu.stats()
    assert st["pending_frees"] == 1 and st["pending_bytes"] == 10 * KiB and st["num_frees"] == 0

    b = cu.alloc(10 * KiB)
    assert b != a  # still pending
    cu.free(b)
    fake.complete(S1)  # the S2 work is still running
    c = cu.alloc(10 * KiB)
    assert c != a
    cu.free(c)
    assert cu.stats()["pending_frees"] == 1

    fake.complete(S2)
    d = cu.alloc(10 * KiB)
    assert d == a  # released by the poll at the start of this allocation
    st = cu.stats()
    assert st["pending_frees"] == 0 and st["pending_bytes"] == 0
    cu.free(d)


def test_block_of_a_non_primary_stream_waits_for_that_stream(cu, fake):
    cu.alloc(KiB, stream=S1)  # S1 becomes the primary stream
    a = cu.alloc(10 * KiB, stream=S2)
    mark = len(fake.log)
    cu.free(a)
    assert [st for _, st in fake.records(mark)] == [S2]
    assert cu.stats()["pending_frees"] == 1
    fake.complete(S2)
    assert cu.alloc(10 * KiB, stream=S2) == a


def test_allocation_on_another_stream_waits_for_the_primary_stream(cu, fake):
    cu.alloc(KiB, stream=S1)
    mark = len(fake.log)
    cu.alloc(KiB, stream=S2)
    recs, waits = fake.records(mark), fake.waits(mark)
    assert len(recs) == 1 and len(waits) == 1
    ev, recorded_on = recs[0]
    assert recorded_on == S1
    assert waits[0] == (S2, ev)
    assert fake.log[mark:].index(("record", ev, S1)) < fake.log[mark:].index(("wait", S2, ev))
    # and nothing of the kind on the primary stream itself
    mark = len(fake.log)
    cu.alloc(KiB, stream=S1)
    assert fake.records(mark) == [] and fake.waits(mark) == []


def test_set_primary_stream(cu, fake):
    cu.set_primary_stream(0, S3)  # before the first allocation
    mark = len(fake.log)
    a = cu.alloc(KiB, stream=S3)
    assert fake.waits(mark) == []
    cu.free(a)
    assert cu.stats()["pending_frees"] == 0  # primary: straight back
    b = cu.alloc(KiB, stream=S1)
    assert fake.waits(mark) and fake.waits(mark)[-1][0] == S1
    # switching the primary orders the new one after the old
    mark = len(fake.log)
    cu.set_primary_stream(0, S1)
    (ev, st), = fake.records(mark)
    assert st == S3 and fake.waits(mark) == [(S1, ev)]
    cu.free(b)
    assert cu.stats()["pending_frees"] == 0
    c = cu.alloc(KiB, stream=S3)  # allocated on the old primary: now a side stream
    cu.free(c)
    assert cu.stats()["pending_frees"] == 1


def test_events_are_reused(cu, fake):
    for _ in range(50):
        a = cu.alloc(4 * KiB)
        cu.record_stream(a, 0, S2)
        cu.free(a)
        fake.complete()
    cu.alloc(KiB)  # polls the last one
    assert cu.stats()["pending_frees"] == 0
    assert fake.created <= 3
    assert all(e["flags"] == 0x02 for e in fake.events.values())  # cudaEventDisableTiming


def test_allocation_that_does_not_fit_synchronises_pending_frees(cu, fake):
    big = cu.alloc(700 * KiB)
    cu.record_stream(big, 0, S2)
    cu.free(big)
    assert cu.stats()["pending_frees"] == 1
    mark = len(fake.log)
    again = cu.alloc(700 * KiB)  # no room until the pending free is waited for
    assert again == big
    assert len(fake.syncs(mark)) == 2  # both of its events (S1 and S2)
    st = cu.stats()
    assert st["pending_frees"] == 0 and st["num_ooms"] == 0


def test_pending_frees_are_synchronised_before_the_pressure_handler(cu, fake):
    calls = []
    cu.set_pressure_handler(lambda dev, req, victims: calls.append(victims))
    a = cu.alloc(600 * KiB)
    cu.set_owner(a, 0, owner=7, cost=1.0)
    b = cu.alloc(300 * KiB)
    cu.record_stream(b, 0, S2)
    cu.free(b)
    c = cu.alloc(400 * KiB)  # fits once b's free completes: the handler is not needed
    assert calls == []
    assert c == b
    cu.free(c)
    cu.free(a)


def test_pressure_handler_receives_victims_and_the_allocation_succeeds(cu, fake):
    costs = [5.0, 1.0, 2.0, 9.0]
    blocks = []
    for i, cost in enumerate(costs):
        p = cu.alloc(256 * KiB)
        cu.set_owner(p, 0, owner=100 + i, cost=cost)
        blocks.append(p)
    seen = []

    def handler(device, request, victims):
        seen.append((device, request, victims))
        for v in victims:
            assert cu.free_owned(v.addr, device, v.owner)
            cu.live.pop(v.addr)

    cu.set_pressure_handler(handler)
    p = cu.alloc(400 * KiB)
    assert len(seen) == 1
    device, request, victims = seen[0]
    assert device == 0 and request == 400 * KiB
    # the cheapest two adjacent blocks covering 400 KiB: costs 1.0 + 2.0
    assert [v.owner for v in victims] == [101, 102]
    assert [v.addr for v in victims] == blocks[1:3]
    assert all(v.size == 256 * KiB for v in victims) and sum(v.cost for v in victims) == 3.0
    assert p == blocks[1]
    st = cu.stats()
    assert st["num_pressure_events"] == 1 and st["num_released_blocks"] == 2 and st["num_ooms"] == 0
    for q in (blocks[0], blocks[3], p):
        cu.free(q)


def test_pressure_victims_used_on_other_streams_are_waited_for(cu, fake):
    a = cu.alloc(512 * KiB, stream=S1)
    b = cu.alloc(512 * KiB, stream=S2)  # side stream: its free goes pending
    cu.set_owner(a, 0, owner=1, cost=5.0)
    cu.set_owner(b, 0, owner=2, cost=1.0)
    cu.set_pressure_handler(lambda dev, req, victims: [cu.free(v.addr) for v in victims])
    mark = len(fake.log)
    p = cu.alloc(300 * KiB)
    assert p == b and fake.syncs(mark)  # b's event was synchronised inside the protocol
    cu.free(p)
    cu.free(a)


def test_free_owned_frees_only_the_owners_block(cu, fake):
    a = cu.alloc(4 * KiB)
    assert not cu.free_owned(a, 0, 1)  # owner 0 until set_owner
    cu.set_owner(a, 0, owner=42, cost=1.0)
    assert not cu.free_owned(a, 0, 41)
    assert "owner 41" in cu.last_error()
    assert cu.free_owned(a, 0, 42)
    cu.live.pop(a)
    assert not cu.free_owned(a, 0, 42)  # already released
    b = cu.alloc(4 * KiB)
    assert b == a and not cu.free_owned(b, 0, 42)  # the address was handed out again
    st = cu.stats()
    assert st["bad_frees"] == 0 and st["num_frees"] == 1
    cu.free(b)


def test_pinned_and_unowned_blocks_are_not_victims(cu, fake):
    a = cu.alloc(512 * KiB)
    b = cu.alloc(512 * KiB)
    cu.set_owner(a, 0, owner=1, cost=0.0)
    cu.set_owner(b, 0, owner=2, cost=10.0)
    cu.set_pinned(a, 0, True)
    seen = []

    def handler(device, request, victims):
        seen.append([v.owner for v in victims])
        for v in victims:
            cu.free(v.addr)

    cu.set_pressure_handler(handler)
    p = cu.alloc(100 * KiB)
    assert seen == [[2]] and p == b
    cu.set_pinned(a, 0, False)
    cu.free(p)
    cu.free(a)


def test_out_of_budget_returns_null_and_names_request_and_budget(cu, fake):
    a = cu.alloc(800 * KiB)  # owner 0: nothing releasable
    calls = []
    cu.set_pressure_handler(lambda *args: calls.append(args))
    assert cu.raw.pymem_cuda_alloc(300 * KiB, 0, S1) is None
    msg = cu.last_error()
    assert str(300 * KiB) in msg and str(BUDGET) in msg
    assert cu.last_error_code() == cuda_lib.E_OOM
    assert calls == []  # no window: the handler is not bothered
    with pytest.raises(cuda_lib.CudaOutOfBudgetError) as info:
        cu.alloc(300 * KiB)
    assert isinstance(info.value, MemoryError) and str(BUDGET) in str(info.value)
    # a handler that frees nothing: still NULL, no crash
    cu.set_owner(a, 0, owner=1, cost=1.0)
    assert cu.raw.pymem_cuda_alloc(300 * KiB, 0, S1) is None
    assert len(calls) == 1 and "released nothing" in cu.last_error()
    st = cu.stats()
    assert st["num_ooms"] == 3 and st["allocated_bytes"] == 800 * KiB
    cu.free(a)


def test_not_reusing_a_block_whose_event_could_not_be_recorded(cu, fake):
    a = cu.alloc(10 * KiB, stream=S1)
    cu.record_stream(a, 0, S2)
    fake.fail_event_record = 1
    with pytest.raises(cuda_lib.CudaLibError, match="kept out of use"):
        cu.free(a)
    cu.live.pop(a)
    fake.fail_event_record = 0
    fake.complete()
    assert cu.alloc(10 * KiB) != a
    assert cu.stats()["pending_frees"] == 1


# ---- errors ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("budget", [0, 1, 511, 1000, 512 * 3 + 1])
def test_bad_budget_is_an_error(lib, fake, budget):
    with pytest.raises(ValueError, match="512"):
        lib.configure(budget)
    assert lib.last_error_code() == cuda_lib.E_INVALID
    assert lib.raw.pymem_cuda_configure(budget, 0, 0) == cuda_lib.E_INVALID


def test_bad_search_mode(lib, fake):
    assert lib.raw.pymem_cuda_configure(BUDGET, 0, 7) == cuda_lib.E_INVALID
    assert "search_mode" in lib.last_error()
    with pytest.raises(ValueError):
        lib.configure(BUDGET, search_mode="nope")
    lib.configure(BUDGET, search_mode="one_at_a_time")  # accepted before any arena


def test_configure_and_set_table_only_before_the_first_allocation(cu, fake):
    cu.configure(2 * BUDGET, small_threshold=0)  # fine: no arena yet
    p = cu.alloc(KiB)
    assert cu.stats()["budget"] == 2 * BUDGET
    with pytest.raises(cuda_lib.CudaLibError, match="already initialised") as info:
        cu.configure(BUDGET)
    assert info.value.code == cuda_lib.E_STATE
    with pytest.raises(cuda_lib.CudaLibError, match="no arena exists"):
        cu.set_table(FakeCuda().table)
    cu.free(p)


def test_null_table_entry_is_rejected(lib, fake):
    t = FakeCuda().table
    t.event_query = cuda_lib.EVENT_QUERY_FN()
    with pytest.raises(ValueError, match="every entry"):
        lib.set_table(t)


def test_unknown_pointer_free_is_counted_not_fatal(cu, fake):
    a = cu.alloc(4 * KiB)
    with pytest.raises(ValueError, match="not allocated by pymem"):
        cu.lib.free(0x1234)
    with pytest.raises(ValueError, match="middle of a block"):
        cu.lib.free(a + 512)
    cu.raw.pymem_cuda_free(ctypes.c_void_p(0x1234), 0, 0, None)  # the void entry point: no crash
    cu.free(a)
    with pytest.raises(ValueError, match="already freed"):
        cu.lib.free(a)
    b = cu.alloc(4 * KiB, stream=S1)
    cu.record_stream(b, 0, S2)
    cu.free(b)
    with pytest.raises(ValueError, match="double free"):
        cu.lib.free(b)
    with pytest.raises(ValueError, match="which has no pymem blocks"):
        cu.lib.free(b, device=5)
    st = cu.stats()
    assert st["bad_frees"] == 5 and st["num_frees"] == 1
    for name in ("record_stream", "set_owner", "set_pinned"):
        with pytest.raises(ValueError, match="not a live pymem block"):
            getattr(cu, name)(0x1234, 0)
    with pytest.raises(ValueError, match="cost"):
        c = cu.alloc(KiB)
        cu.set_owner(c, 0, owner=1, cost=-1.0)


def test_stats(cu, fake):
    with pytest.raises(cuda_lib.CudaLibError, match="no arena"):
        cu.stats(3)
    a = cu.alloc(100 * KiB)
    b = cu.alloc(1000)  # rounded to 1024
    c = cu.alloc(50 * KiB, stream=S2)
    cu.free(b)
    cu.free(c)  # pending
    st = cu.stats()
    assert st == {
        "budget": BUDGET,
        "allocated_bytes": 150 * KiB,  # a + pending c
        "peak_allocated_bytes": 151 * KiB,
        "num_allocs": 3,
        "num_frees": 1,
        "num_pressure_events": 0,
        "num_released_blocks": 0,
        "num_ooms": 0,
        "largest_free_block": BUDGET - 151 * KiB,
        "num_blocks": 4,  # a | free (b) | c | free
        "pending_frees": 1,
        "pending_bytes": 50 * KiB,
        "bad_frees": 0,
    }
    cu.free(a)


def test_small_region(lib, fake):
    lib.configure(BUDGET)  # default small threshold: a small region of budget / 256 at the top
    c = Client(lib)
    small = c.alloc(KiB)
    large = c.alloc(64 * KiB)
    assert small >= fake.slab + BUDGET - BUDGET // 256
    assert large < fake.slab + BUDGET - BUDGET // 256
    c.free(small)
    c.free(large)
    lib.reset()


def test_devices_have_separate_arenas(cu, fake):
    fake.current_device = 0
    a = cu.alloc(KiB, device=0)
    b = cu.alloc(KiB, device=1, stream=S2)
    assert fake.mallocs == [BUDGET, BUDGET]
    assert fake.device_log == [1, 0]  # slab made on device 1, then the caller's device restored
    assert fake.current_device == 0
    assert cu.stats(0)["num_allocs"] == 1 and cu.stats(1)["num_allocs"] == 1
    with pytest.raises(ValueError, match="not a live pymem block of device 0"):
        cu.set_owner(b, 0, owner=1)
    cu.record_stream(b, 1, S3)
    cu.free(b, device=1)
    # events of device 1 were created with device 1 current
    assert {e["device"] for e in fake.events.values()} == {1}
    assert fake.current_device == 0
    cu.free(a)


def test_reset(cu, fake):
    a = cu.alloc(KiB)
    with pytest.raises(cuda_lib.CudaLibError, match="still allocated"):
        cu.reset()
    cu.record_stream(a, 0, S2)
    cu.free(a)
    slab = fake.slab
    cu.reset()  # only a pending free left: synchronised, then everything is dropped
    assert fake.syncs() and fake.frees == [slab]
    assert all(e["destroyed"] for e in fake.events.values())
    with pytest.raises(cuda_lib.CudaLibError, match="no arena"):
        cu.stats()
    p = cu.alloc(KiB)  # a new arena, same configuration
    assert fake.mallocs == [BUDGET, BUDGET]
    cu.free(p)


def test_passthrough_provider_orders_frees_by_stream(cu, fake):
    """A provider's blocks (here cudaMalloc's) get the same stream ordering as the arena's."""
    cu.set_provider(0, cu.passthrough_provider())
    a = cu.alloc(3000, stream=S1)  # the first allocation: S1 is the primary stream
    assert fake.mallocs == [3000] and a in fake.buffers
    cu.free(a)  # only the primary stream used it: straight back to cudaFree
    assert fake.frees == [a]
    n = len(fake.log)
    b = cu.alloc(1000, stream=S2)
    assert [st for st, _ in fake.waits(n)] == [S2]  # S2 waits for the primary's work so far
    cu.free(b)  # S2's work may still read it: pending (b may reuse a's address: count the frees)
    assert fake.frees == [a]
    fake.complete(S2)
    c = cu.alloc(10, stream=S1)  # polls the pending frees
    assert fake.frees == [a, b]
    for call in (cu.set_owner, cu.set_pinned):
        with pytest.raises(cuda_lib.CudaLibError, match="came from a block provider"):
            call(c, 0)
    cu.free(c)


def test_blocks_go_back_to_the_provider_that_made_them(cu, fake):
    cu.set_provider(0, cu.passthrough_provider())
    d = cu.alloc(2000)
    cu.set_provider(0, None)  # the library's own arena again
    e = cu.alloc(2000)
    slab = list(fake.buffers)[-1]
    assert fake.mallocs == [2000, BUDGET] and slab <= e < slab + BUDGET
    cu.free(d)
    assert fake.frees == [d]  # cudaFree, not the arena
    cu.free(e)
    assert cu.stats()["num_frees"] == 1


def test_bad_provider_is_rejected(lib, fake):
    with pytest.raises(ValueError, match="device must be >= 0"):
        lib.set_provider(-1, lib.passthrough_provider())
    empty = (ctypes.c_void_p * 3)()  # allocate and free both NULL
    with pytest.raises(ValueError, match="needs both allocate and free"):
        lib.set_provider(0, ctypes.addressof(empty))


def test_slab_allocation_failure(cu, fake):
    fake.fail_malloc = 2  # cudaErrorMemoryAllocation
    assert cu.raw.pymem_cuda_alloc(KiB, 0, None) is None
    assert cu.last_error_code() == cuda_lib.E_CUDA and "cudaMalloc" in cu.last_error()
    fake.fail_malloc = 0
    p = cu.alloc(KiB)
    assert p
    cu.free(p)


def test_threads(cu, fake):
    errors = []

    def work(seed):
        try:
            for i in range(300):
                p = cu.lib.alloc(512 * (1 + (seed + i) % 7), 0, S1)
                cu.lib.free(p, 0)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    cu.alloc(KiB)  # create the arena (and the primary stream) first
    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    st = cu.stats()
    assert st["num_allocs"] == 1201 and st["num_frees"] == 1200 and st["allocated_bytes"] == KiB


def _run_python(code, **kw):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env=env, timeout=120, cwd=ROOT, **kw)


LOAD_MODULE = f"""
import importlib.util
try:
    from pymem import cuda_lib
except ImportError:
    spec = importlib.util.spec_from_file_location("cuda_lib", {CUDA_LIB_PY!r})
    cuda_lib = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cuda_lib)
"""


def test_fresh_process_errors_without_crashing():
    r = _run_python(LOAD_MODULE + """
lib = cuda_lib.load()
assert lib.raw.pymem_cuda_alloc(1024, 0, None) is None
print("unconfigured:", lib.last_error_code(), lib.last_error())
lib.configure(1 << 20)
p = lib.raw.pymem_cuda_alloc(1024, 0, None)
print("runtime:", "allocated" if p else "refused", lib.last_error_code(), lib.last_error())
""")
    assert r.returncode == 0, r.stderr
    assert f"unconfigured: {cuda_lib.E_STATE} " in r.stdout and "pymem_cuda_configure" in r.stdout
    # with the real runtime: on a GPU machine the slab is made and the block comes from it; without
    # one, either no libcudart at all or no device to allocate the slab on: a CUDA error, no crash
    try:
        import torch
        has_gpu = torch.cuda.is_available()
    except ImportError:
        has_gpu = False
    if has_gpu:
        assert "runtime: allocated " in r.stdout, r.stdout
    else:
        assert f"runtime: refused {cuda_lib.E_CUDA} " in r.stdout, r.stdout


def test_module_imports_without_the_library(tmp_path):
    r = _run_python(f"""
import importlib.util, sys
spec = importlib.util.spec_from_file_location("cuda_lib", {CUDA_LIB_PY!r})
m = importlib.util.module_from_spec(spec)
spec.loader.exec_module(m)
assert "torch" not in sys.modules
try:
    m.load({str(tmp_path / 'missing' / 'libpymem_cuda.so')!r})
except m.CudaLibError as e:
    print("raised", e)
""")
    assert r.returncode == 0, r.stderr
    assert "raised" in r.stdout


# ---- with a GPU ------------------------------------------------------------------------------------


@pytest.mark.cuda
def test_pluggable_allocator_on_gpu():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    r = _run_python(LOAD_MODULE + """
import torch
torch.cuda.memory.change_current_allocator(cuda_lib.pluggable_allocator())  # before CUDA init
lib = cuda_lib.load()
budget = 64 << 20
lib.configure(budget)
x = torch.ones(1 << 20, device="cuda")          # 4 MiB
y = x * 2
side = torch.cuda.Stream()
with torch.cuda.stream(side):
    z = torch.full((1 << 18,), 3.0, device="cuda")
torch.cuda.synchronize()
assert y.sum().item() == 2 * (1 << 20) and z.sum().item() == 3 * (1 << 18)
st = lib.stats(0)
assert st["budget"] == budget and st["allocated_bytes"] >= 9 << 20, st
try:
    w = torch.empty(budget + 4096, dtype=torch.uint8, device="cuda")
except (torch.OutOfMemoryError, RuntimeError, MemoryError):
    pass
else:
    # CUDAPluggableAllocator does not check the pointer it gets: NULL is the signal
    assert w.data_ptr() == 0, hex(w.data_ptr())
assert str(budget) in lib.last_error(), lib.last_error()
del x, y, z
torch.cuda.synchronize()
print("OK", lib.stats(0))
""")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "OK" in r.stdout


def test_a_cuda_arena_moves_an_overlapping_block_in_pieces_on_the_move_stream():
    """Compaction on a CUDA slab: cudaMemcpyAsync leaves overlapping ranges undefined, so a block
    sliding by less than its size goes in pieces of that distance, in memmove order (the fake table
    refuses any overlapping copy), all on the stream named by set_move_stream, bytes intact."""
    from fake_cuda import fresh_table

    lib, fake = fresh_table()
    from pymem import _C

    arena = _C.Arena(1 << 20, backing="cuda", cuda_table=lib.runtime_table(), small_threshold=0)
    x = arena.allocate(64 << 10)
    hole = arena.allocate(4096)
    z = arena.allocate(256 << 10)
    rest = arena.allocate(arena.base + (1 << 20) - (z + (256 << 10)))  # up to the top: z cannot move
    data = bytes(range(256)) * 256
    ctypes.memmove(x, data, len(data))
    arena.free(hole)
    arena.set_move_stream(0x5EED)
    assert arena.compact([x, z]) == [(x, x + 4096)]
    assert [(d, s, n, st) for d, s, n, st in fake.copies] == \
        [(x + 4096 + k * 4096, x + k * 4096, 4096, 0x5EED) for k in reversed(range(16))]
    assert ctypes.string_at(x + 4096, len(data)) == data
    arena.free(x + 4096), arena.free(z), arena.free(rest)
