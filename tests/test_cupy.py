"""CuPy shares the budget (pymem/cupy.py). Without a GPU CuPy arrays cannot be made, but its
allocator function can be called: here it runs over the runtime's arena behind libpymem_cuda.so on
the fake CUDA table (the route of test_runtime_cudalib.py), with torch's CPU tensors going down the
same library, so CuPy's blocks and torch's share one arena and one pressure handler. The whole path
on a GPU is the last test (marked cuda)."""
import contextlib
import ctypes
import gc
import os
import subprocess
import sys
import textwrap

import pytest
import torch

cupy = pytest.importorskip("cupy")

import pymem  # noqa: E402
import pymem.cupy as pcupy  # noqa: E402
from pymem.testing import bitwise_equal  # noqa: E402
from pymem import cuda_lib  # noqa: E402
from pymem.runtime import hooks  # noqa: E402
from pymem.runtime.runtime import Runtime  # noqa: E402

if cuda_lib.library_path() is None:
    pytest.skip("pymem/libpymem_cuda.so is not built", allow_module_level=True)

from fake_cuda import fresh_table  # noqa: E402

KiB = 1024
MiB = 1024 * KiB
@pytest.fixture
def fake():
    lib, f = fresh_table()
    original = cupy.cuda.get_allocator()
    yield f
    pcupy.uninstall()
    cupy.cuda.set_allocator(original)
    gc.collect()
    lib.set_provider(0, None)
    lib.reset()  # fails if a block served through the library (CuPy's too) was never freed


def runtime(budget, **options):
    return Runtime(budget, hook=hooks.CudaLibHook(0, cuda_lib.load(), route="cpu"), **options)


@contextlib.contextmanager
def managed(budget, **options):
    """A runtime on the library route, with CuPy's allocator over its arena (device 0, stream 0)."""
    rt = runtime(budget, **options)
    rt.start()
    try:
        yield rt, pcupy.install(rt, current=lambda: (0, 0))
    finally:
        pcupy.uninstall()
        rt.stop()


def allocated(rt):
    return rt.arena.stats()["allocated_bytes.current"]


def test_blocks_come_from_the_arena_and_go_back_when_cupy_drops_them(fake):
    with managed(4 * MiB) as (rt, alloc):
        assert cupy.cuda.get_allocator() is alloc
        before, frees = allocated(rt), rt.arena.stats()["num_frees"]
        p = alloc(MiB)
        assert isinstance(p, cupy.cuda.MemoryPointer)
        assert rt.lo <= p.ptr and p.ptr + MiB <= rt.hi  # inside the arena's slab
        ctypes.memset(p.ptr, 7, MiB)  # and usable memory (host memory under the fake table)
        assert allocated(rt) == before + MiB
        stats = rt.memory_stats()
        assert stats["cupy_bytes.current"] == stats["cupy_bytes.peak"] == MiB and stats["num_cupy_allocs"] == 1
        view = p + 4096  # a view keeps the block alive
        del p
        gc.collect()
        assert allocated(rt) == before + MiB
        del view
        gc.collect()
        assert allocated(rt) == before
        assert rt.arena.stats()["num_frees"] == frees + 1  # back through the library to the arena
        assert rt.memory_stats()["cupy_bytes.current"] == 0 and rt.memory_stats()["cupy_bytes.peak"] == MiB
        assert alloc(0).ptr == 0  # CuPy's empty arrays need no block


def test_pressure_from_cupy_releases_torch_values_first(fake):
    torch.manual_seed(0)
    x = torch.randn(256, 256, requires_grad=True)  # made before: outside the budget
    expected = [torch.sin(x * i).detach() for i in range(8)]
    with managed(6 * MiB) as (rt, alloc):
        values = [torch.sin(x * i) for i in range(8)]  # 8 x 2 x 256 KiB (sin saves x * i), recomputable
        assert rt.residency.num_evictions == 0
        p = alloc(3 * MiB)  # does not fit beside them all
        assert rt.residency.num_evictions > 0 and any(rt.is_evicted(v) for v in values)
        assert rt.lo <= p.ptr < rt.hi
        ctypes.memset(p.ptr, 1, 3 * MiB)
        for v, e in zip(values, expected):  # evicted ones come back, recomputed bitwise
            assert bitwise_equal(v.detach(), e)
        del p
        assert rt.memory_stats()["allocated_bytes.peak"] <= 6 * MiB


def test_a_cupy_request_that_cannot_fit_names_both_libraries_bytes(fake):
    with managed(MiB) as (rt, alloc):
        with pymem.no_recompute():
            leaf = torch.ones(64 * KiB)  # 256 KiB PyTorch cannot release (a leaf)
        p = alloc(256 * KiB)
        with pytest.raises(pymem.OutOfBudgetError) as info:
            alloc(2 * MiB)
        e = info.value
        assert e.torch_bytes == 256 * KiB and e.cupy_bytes == 256 * KiB and e.requested == 2 * MiB
        assert "CuPy asked for 2097152 B" in str(e) and "PyTorch holds 262144 B and CuPy 262144 B" in str(e), str(e)
        assert isinstance(e, torch.OutOfMemoryError)
        assert float((leaf + 1).sum()) == 2 * 64 * KiB  # both still work
        q = alloc(128 * KiB)
        del p, q


def test_install_and_uninstall_restore_cupys_previous_allocator(fake):
    def theirs(size):
        raise AssertionError("not called")

    cupy.cuda.set_allocator(theirs)
    rt = runtime(MiB)
    rt.start()
    try:
        mine = pcupy.install(rt, current=lambda: (0, 0))
        assert cupy.cuda.get_allocator() is mine and pcupy.installed() is mine
        again = pcupy.install(rt, current=lambda: (0, 0))  # installing twice keeps the first previous
        pcupy.uninstall()
        assert cupy.cuda.get_allocator() is theirs and pcupy.installed() is None and again is not mine
        pcupy.uninstall()  # a no-op now
        assert cupy.cuda.get_allocator() is theirs
    finally:
        rt.stop()


def test_enable_on_cuda_sets_cupys_allocator_and_disable_gives_it_back(fake):
    """What Runtime.start / stop do on CUDA (the device is faked after the checks)."""
    before = cupy.cuda.get_allocator()
    rt = runtime(MiB)
    rt.device = torch.device("cuda", 0)
    rt.start()
    try:
        alloc = pcupy.installed()
        assert alloc is not None and cupy.cuda.get_allocator() is alloc
        alloc.current = lambda: (0, 0)
        p = alloc(128 * KiB)
        assert rt.memory_stats()["cupy_bytes.current"] == 128 * KiB
    finally:
        rt.stop()
    assert cupy.cuda.get_allocator() is before and pcupy.installed() is None
    base = allocated(rt)
    ctypes.memset(p.ptr, 3, 128 * KiB)  # made meanwhile: still valid after disable
    del p
    gc.collect()
    assert allocated(rt) == base - 128 * KiB  # and back to the arena through the library
    assert rt.memory_stats()["cupy_bytes.current"] == 0


def test_a_cpu_runtime_leaves_cupy_alone(fake):
    before = cupy.cuda.get_allocator()
    rt = runtime(MiB)  # the CPU device: attach does nothing
    rt.start()
    try:
        assert cupy.cuda.get_allocator() is before and "cupy_bytes.current" not in rt.memory_stats()
    finally:
        rt.stop()
    with pytest.raises(ValueError, match="allocator='arena' on CUDA"):
        pcupy.install(Runtime(MiB))  # the CPU hook: no library to share


def test_pymem_works_without_cupy(fake, monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # `import cupy` fails from here
    assert not pcupy.available()
    rt = runtime(MiB)
    rt.device = torch.device("cuda", 0)
    rt.start()  # attach skips CuPy
    try:
        assert float(torch.ones(1000).sum()) == 1000.0 and pcupy.installed() is None
    finally:
        rt.stop()
    with pytest.raises(ImportError, match=r"torch-pymem\[cupy\]"):
        pcupy.install(rt)


def test_import_and_enable_never_import_cupy():
    code = ("import sys; sys.modules['cupy'] = None\n"
            "import pymem, torch\n"
            "with pymem.budget('8MB', device='cpu'):\n"
            "    y = torch.ones(1000) * 2\n"
            "print('ok', float(y.sum()), pymem.cupy.available())\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "ok 2000.0 False" in r.stdout, r.stderr[-2000:]


def test_a_dlpack_export_the_way_cupy_asks_pins_the_storage(fake):
    """cupy.from_dlpack(t) calls t.__dlpack__(stream=..., max_version=...): pinned for the storage's
    life (raw_access.py). CuPy refuses CPU tensors, so the GPU test below runs cupy.from_dlpack itself."""
    x = torch.randn(256, 256, requires_grad=True)
    with managed(4 * MiB) as (rt, _):
        y = torch.sin(x * 2)
        capsule = y.detach().__dlpack__(stream=None, max_version=(1, 0))
        rt.evict(y)
        assert not rt.is_evicted(y)
        assert rt.memory_stats()["num_pins.dlpack"] == 1
        del capsule


GPU_RUN = textwrap.dedent("""
    import cupy, torch, pymem
    theirs = cupy.cuda.get_allocator()
    rt = pymem.enable("256MiB", device="cuda", offload="never")
    assert pymem.cupy.installed() is not None and cupy.cuda.get_allocator() is pymem.cupy.installed()
    torch.manual_seed(0)
    x = torch.randn(1024, 1024, device="cuda", requires_grad=True)
    expected = [torch.sin(x * i).detach().cpu() for i in range(20)]
    values = [torch.sin(x * i) for i in range(20)]  # 160 MiB of recomputable values (sin saves x * i)
    a = cupy.arange(1 << 20, dtype=cupy.float64)  # a CuPy array computed under pymem
    assert rt.lo <= a.data.ptr < rt.hi
    assert float((a * 2).sum()) == float(2 * sum(range(1 << 20)))
    assert rt.residency.num_evictions == 0
    big = cupy.ones(120 << 18, dtype=cupy.float32)  # 120 MiB: torch values must go
    assert rt.residency.num_evictions > 0 and int(cupy.count_nonzero(big)) == 120 << 18
    assert all(torch.equal(v.detach().cpu(), e) for v, e in zip(values, expected))
    s = pymem.memory_stats()
    assert s["cupy_bytes.peak"] >= (120 << 20) and s["allocated_bytes.peak"] <= 256 << 20, s
    y = torch.sin(x * 3)
    c = cupy.from_dlpack(y.detach())  # pins y's storage
    pymem.evict(y)
    assert not pymem.is_evicted(y) and pymem.memory_stats()["num_pins.dlpack"] >= 1
    assert bool(cupy.all(c == cupy.from_dlpack(torch.sin(x * 3).detach())))
    try:
        cupy.empty(1 << 30, dtype=cupy.uint8)
        raise AssertionError("1 GiB fit a 256 MiB budget")
    except pymem.OutOfBudgetError as e:
        assert "PyTorch holds" in str(e) and "CuPy" in str(e), str(e)
    pymem.disable()
    assert cupy.cuda.get_allocator() is theirs
    assert float(a[:4].sum()) == 6.0  # made under pymem, valid after
    del a, big, c
    print("cupy ok")
""")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cupy_on_a_gpu_shares_the_budget():
    # A fresh process: pymem must replace PyTorch's CUDA allocator before CUDA initialises.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(pymem.__file__)),
                                                        os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", GPU_RUN], capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0 and "cupy ok" in r.stdout, (r.stdout[-2000:], r.stderr[-4000:])
