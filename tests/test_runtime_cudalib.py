"""The arena on CUDA, without a GPU: the runtime's arena behind libpymem_cuda.so (a block provider),
reached the way PyTorch reaches it on a GPU (alloc/free entry points with CUDAPluggableAllocator's
signatures), with the library on a fake CUDA table over host memory. CPU tensors go down that route
through the pluggable CPU hook, so everything but the real CUDA calls runs: the arena's slab from the
table's cudaMalloc, the pressure handler under the library, refusals thrown through the library (as
c10's OutOfMemoryError, raised in Python as pymem.OutOfBudgetError), the pass-through after disable,
and the CUDA-order rules.
"""
import gc
import types
import warnings

import pytest
import torch

import pymem
from pymem import cuda_lib
from pymem.runtime import hooks, ops
from pymem.runtime.runtime import Runtime

if cuda_lib.library_path() is None:
    pytest.skip("pymem/libpymem_cuda.so is not built (setup.py builds it only when a CUDA toolkit is "
                "found)", allow_module_level=True)

import runtime_models as rm  # noqa: E402
from fake_cuda import fresh_table  # noqa: E402
from test_runtime_training import STEPS, budget_for, check_same, reference  # noqa: E402

torch.set_num_threads(2)

@pytest.fixture
def fake():
    lib, f = fresh_table()
    yield f
    gc.collect()
    lib.set_provider(0, None)
    lib.reset()  # fails if a block served through the library was never freed


def run_managed(fake, name, budget, steps=STEPS, policy="dtr", **options):
    rt = Runtime(budget, policy=policy, hook=hooks.CudaLibHook(0, cuda_lib.load(), route="cpu"), **options)
    rt.start()
    try:
        step = rm.trainer(name)
        losses = [step() for _ in range(steps)]
        copies = rm.snapshot(step.model)
        stats = rt.memory_stats()
    finally:
        rt.stop()
    del step
    return rt, losses, copies, stats


@pytest.mark.parametrize("name", ["gpt", "cnn"])
def test_training_through_the_cuda_library_is_bitwise_equal(fake, name):
    budget = budget_for(name, 0.5)
    rt, losses, copies, stats = run_managed(fake, name, budget)
    check_same(name, reference(name), (losses, copies))
    assert rt.arena.backing == "cuda" and budget in fake.mallocs  # the slab is the table's cudaMalloc
    assert stats["allocated_bytes.peak"] <= stats["budget_bytes"] == budget, stats
    assert stats["num_evictions"] > 0 and stats["num_rematerializations"] > 0, stats
    # compaction moves the slab's blocks with the table's device-to-device copies, byte for byte
    assert rt.can_compact and sum(n for _, _, n, _ in fake.copies) == stats["moved_bytes"], stats


def test_compaction_through_the_cuda_library_moves_blocks_and_stays_bitwise(fake):
    """Below what placement alone reaches: blocks move (copies that never overlap, as CUDA
    requires: the fake table refuses overlapping ones), the library follows them to their new
    addresses, and every moved block is freed there in the end (the fixture's reset checks)."""
    name = "gpt"
    budget = budget_for(name, 0.35)
    rt, losses, copies, stats = run_managed(fake, name, budget)
    check_same(name, reference(name), (losses, copies))
    assert stats["allocated_bytes.peak"] <= stats["budget_bytes"] == budget, stats
    assert stats["num_compactions"] > 0 and stats["moved_bytes"] > 0, stats
    assert sum(n for _, _, n, _ in fake.copies) == stats["moved_bytes"], stats


def test_offloading_through_the_cuda_library_is_bitwise_equal(fake):
    """Copies out, back and ahead (the prefetch buffer is a library block filled beside compute)."""
    # 70%: offloading alone, no recompute (tighter runs are the recompute tests above).
    budget = budget_for("gpt", 0.7)
    rt, losses, copies, stats = run_managed(fake, "gpt", budget, offload="always")
    check_same("gpt", reference("gpt"), (losses, copies))
    assert stats["allocated_bytes.peak"] <= budget, stats
    assert stats["num_offloads"] > 0 and stats["num_prefetches"] > 0 and stats["num_rematerializations"] == 0, stats


def test_refusal_is_out_of_budget_error_through_the_library(fake):
    rt = Runtime(64 * 1024, hook=hooks.CudaLibHook(0, cuda_lib.load(), route="cpu"))
    rt.start()
    try:
        a = torch.ones(1024)
        with pytest.raises(pymem.OutOfBudgetError) as info:
            torch.ones(1 << 20)  # 4 MiB in a 64 KiB budget
        assert info.value.requested == 4 << 20 and info.value.budget == 64 * 1024
        assert "aten.ones.default" in str(info.value)
        assert torch.equal(a + 1, torch.full((1024,), 2.0))  # the runtime still works
    finally:
        rt.stop()
    assert torch.equal(a, torch.ones(1024))  # and the tensor made under it is intact


def test_a_refusal_lets_a_library_that_retries_with_less_go_on(fake):
    """cuDNN asks for its largest workspace first and, when the allocator raises c10's
    OutOfMemoryError, halves it and tries plans that need less. The library's refusal must be that
    type: the Python error it was before ended the convolution (a CNN on a GPU ran out of budget at
    0.75 of its peak, on an 831 MB workspace). A plain op's refusal stays pymem.OutOfBudgetError."""
    rt = Runtime(1 << 20, hook=hooks.CudaLibHook(0, cuda_lib.load(), route="cpu"))
    rt.start()
    try:
        a = torch.ones(1024)
        assert pymem._C.allocate_first_that_fits([4 << 20, 2 << 20, 256 << 10]) == 256 << 10
        with pytest.raises(pymem.OutOfBudgetError) as info:
            torch.ones(1 << 20)  # 4 MiB in a 1 MiB budget
        assert info.value.requested == 4 << 20 and info.value.budget == 1 << 20, vars(info.value)
        assert "aten.ones.default" in str(info.value)
        assert pymem._C.take_last_refusal() is None  # the error took it
        assert torch.equal(a + 1, torch.full((1024,), 2.0))
    finally:
        rt.stop()


# A kernel that asks for an 8 MiB workspace first and goes on with 64 KiB when refused (as cuDNN's).
_LIB = torch.library.Library("pymem_test_fallback", "DEF")
_LIB.define("workspace_add(Tensor x) -> Tensor")
_ASKS = [8 << 20, 64 << 10]  # what it asks for, in turn
_LIB.impl("workspace_add", lambda x: x + pymem._C.allocate_first_that_fits(_ASKS), "CPU")
_WORKSPACE_ADD = torch.ops.pymem_test_fallback.workspace_add.default


@pytest.mark.parametrize("intercept", ["dispatcher", "mode"])
def test_a_kernel_that_went_on_with_less_memory_is_counted_and_named_once(fake, monkeypatch, intercept):
    """Its results may differ from an unmanaged run's (another cuDNN plan): pymem says so, once per
    op, and counts each such kernel, a recompute's too."""
    monkeypatch.setenv("PYMEM_INTERCEPT", intercept)
    # a pure function of its input, as aten's convolution: its outputs get recipes
    monkeypatch.setattr(ops, "_PURE_NAMESPACES", ops._PURE_NAMESPACES + ("pymem_test_fallback",))
    rt = Runtime(2 << 20, hook=hooks.CudaLibHook(0, cuda_lib.load(), route="cpu"))
    rt.start()
    try:
        x = torch.ones(1 << 16)  # 256 KiB: released and recomputed below
        with pytest.warns(RuntimeWarning, match=r"pymem_test_fallback.workspace_add.default went on with less "
                                                r"memory than it asked for: the budget could not hold its 8388608 B"):
            y = _WORKSPACE_ADD(x)
        assert torch.equal(y, torch.full((1 << 16,), 1.0 + (64 << 10)))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            z = _WORKSPACE_ADD(x)
            rt.evict(y)
            assert rt.is_evicted(y)
            assert torch.equal(y + 0, z)  # recomputed, falling back again
        stats = rt.memory_stats()
        assert stats["num_kernel_fallbacks"] == 3 and stats["num_kernel_fallbacks.recompute"] == 1, stats
        assert stats["num_rematerializations"] == 1, stats
    finally:
        rt.stop()
    assert pymem._C.take_last_refusal() is None  # each note took its refusal: nothing stale is left


def test_a_request_beyond_reach_releases_nothing(fake):
    """Releasing every value would not make room for it: it is refused at once and the values stay.
    Before, each was released first, to be recomputed for nothing while cuDNN went on to ask for a
    smaller workspace; a plain op's refusal kept nothing either."""
    rt = Runtime(2 << 20, hook=hooks.CudaLibHook(0, cuda_lib.load(), route="cpu"))
    rt.start()
    try:
        x = torch.ones(1 << 16)
        rt.pin(x, "user")  # 256 KiB that stay
        kept = [x * i for i in range(2, 5)]  # 768 KiB of values with recipes: releasable

        def beyond_reach():  # within the budget, 64 KiB more than the free and releasable bytes
            releasable = sum(r.nbytes for r, _ in rt.pressure._candidates(waiting=True))
            ask = rt.arena.main_free_bytes + releasable + (64 << 10)
            assert releasable >= 3 << 18 and ask <= rt.budget, (releasable, ask)
            return ask

        _ASKS[0] = beyond_reach()
        try:
            with pytest.warns(RuntimeWarning, match="went on with less memory"):
                y = _WORKSPACE_ADD(x)  # refused, 64 KiB granted
        finally:
            _ASKS[0] = 8 << 20
        with pytest.raises(pymem.OutOfBudgetError):
            torch.empty(beyond_reach(), dtype=torch.uint8)
        stats = rt.memory_stats()
        assert stats["num_evictions"] == 0 and not any(rt.is_evicted(t) for t in kept), stats
        assert torch.equal(y, x + (64 << 10)) and torch.equal(kept[2], torch.full((1 << 16,), 4.0))
    finally:
        rt.stop()


def test_after_disable_the_library_passes_requests_to_cuda_malloc(fake):
    rt = Runtime(1 << 20, hook=hooks.CudaLibHook(0, cuda_lib.load(), route="cpu"))
    rt.start()
    kept = torch.arange(1000.0)
    rt.stop()
    lib = cuda_lib.load()
    before = len(fake.mallocs)
    # A C++ caller (what PyTorch is on a GPU) gets its blocks from cudaMalloc now: the library's
    # entry points under the pluggable CPU hook.
    pymem._C.install_pluggable_cpu_hook(*lib.entry_points())
    try:
        t = torch.arange(5000.0)
    finally:
        pymem._C.uninstall_pluggable_cpu_hook()
    assert fake.mallocs[before:] == [5000 * 4]
    assert float(t.sum()) == sum(range(5000)) and torch.equal(kept, torch.arange(1000.0))
    addr = t.data_ptr()
    del t
    gc.collect()
    assert addr in fake.frees  # and back to cudaFree when it dies


def test_swap_refused_after_cuda_initialised(monkeypatch):
    monkeypatch.setattr(hooks, "_cuda_allocator_lib", None)
    cuda = types.SimpleNamespace(is_initialized=lambda: True)
    with pytest.raises(RuntimeError, match="came after CUDA was initialised.*before any CUDA work.*PYMEM_BUDGET.*native"):
        hooks._swap_cuda_allocator(cuda_lib.load(), cuda=cuda)
    assert not hooks.cuda_allocator_is_pymem()


def test_swap_happens_once_per_process(monkeypatch):
    swaps = []
    monkeypatch.setattr(hooks, "_cuda_allocator_lib", None)
    monkeypatch.setattr(cuda_lib, "pluggable_allocator", lambda: "pluggable")
    cuda = types.SimpleNamespace(is_initialized=lambda: False,
                                 memory=types.SimpleNamespace(change_current_allocator=swaps.append))
    hooks._swap_cuda_allocator(cuda_lib.load(), cuda=cuda)
    cuda.is_initialized = lambda: True  # a later enable, after training ran: no second swap
    hooks._swap_cuda_allocator(cuda_lib.load(), cuda=cuda)
    assert swaps == ["pluggable"] and hooks.cuda_allocator_is_pymem()


EXIT_RUN = """
import sys, torch
sys.path.insert(0, sys.argv[1])
from fake_cuda import FakeCuda
from pymem import cuda_lib
from pymem.runtime import hooks
from pymem.runtime.runtime import Runtime
fake = FakeCuda()
lib = cuda_lib.load()
lib.set_table(fake.table)
rt = Runtime(1 << 20, hook=hooks.CudaLibHook(0, lib, route="cpu"))
rt.start()
kept = torch.arange(1000.0) * 2  # a tensor in the arena, alive at exit
rt.stop()
print("ran", float(kept.sum()))
"""


def test_process_exits_cleanly_with_arena_and_tensors_alive():
    # The provider's arena and its slab outlive the interpreter: no destructor may free them at exit
    # (here that would call the fake's Python cudaFree after finalisation; on a GPU, a torn-down CUDA).
    import os
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-c", EXIT_RUN, os.path.dirname(__file__)], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and "ran 999000.0" in r.stdout, (r.returncode, r.stdout, r.stderr[-2000:])
