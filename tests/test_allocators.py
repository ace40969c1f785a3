"""allocator="native" (PyTorch's allocator capped at the budget, release-and-retry on refusal), the
budget hook under it, and the CUDA-order check of allocator="arena" (simulated on CPU by the check)."""
import types

import pytest
import torch

import pymem
from pymem import _C
from pymem.api import check_cuda_order
from pymem.runtime.native import CudaCap, requested_bytes


def test_budget_hook_refuses_past_the_budget_and_counts_frees():
    _C.install_budget_hook(1 << 20)
    try:
        x = torch.ones(1000)  # 4000 B
        with pytest.raises(pymem.OutOfBudgetError) as e:
            torch.ones(1 << 20)  # 4 MiB
        assert e.value.requested == 4 << 20 and e.value.budget == 1 << 20 and e.value.allocated == 4000
        assert "allocator='native'" in str(e.value)
        assert torch.equal(x, torch.ones(1000))  # the refusal left earlier tensors alone
        del x
        s = _C.budget_hook_stats()
        assert s["allocated_bytes.current"] == 0 and s["num_refused"] >= 1
        assert s["allocated_bytes.peak"] == 8000  # x and the torch.ones(1000) compared with it
    finally:
        _C.uninstall_budget_hook()
    assert not _C.budget_hook_installed()
    assert torch.ones(1 << 20).sum() == 1 << 20  # PyTorch's allocator is back, uncapped


def test_budget_hook_and_arena_hook_exclude_each_other():
    _C.install_budget_hook(1 << 20)
    try:
        with pytest.raises(ValueError, match="uninstall it before installing an arena"):
            pymem.install_cpu_hook(pymem.Arena(1 << 20))
    finally:
        _C.uninstall_budget_hook()
    pymem.install_cpu_hook(pymem.Arena(1 << 20))
    try:
        with pytest.raises(ValueError, match="the arena is installed as the CPU allocator"):
            _C.install_budget_hook(1 << 20)
    finally:
        pymem.uninstall_cpu_hook()


def test_pluggable_hook_and_the_other_hooks_exclude_each_other():
    # Addresses that are never called: nothing allocates a CPU tensor while the hook is installed.
    _C.install_pluggable_cpu_hook(1, 2)
    try:
        with pytest.raises(ValueError, match="the pluggable CPU hook is installed.*before installing an arena"):
            pymem.install_cpu_hook(pymem.Arena(1 << 20))
        with pytest.raises(ValueError, match="the pluggable CPU hook is installed.*before installing the budget hook"):
            _C.install_budget_hook(1 << 20)
    finally:
        _C.uninstall_pluggable_cpu_hook()
    pymem.install_cpu_hook(pymem.Arena(1 << 20))
    try:
        with pytest.raises(ValueError, match="the arena is installed.*before installing the pluggable CPU hook"):
            _C.install_pluggable_cpu_hook(1, 2)
    finally:
        pymem.uninstall_cpu_hook()
    assert pymem.cpu_hook_arena() is None and not _C.budget_hook_installed()
    assert torch.ones(1000).sum() == 1000  # PyTorch's allocator is back


def test_native_allocator_keeps_the_budget_by_releasing_and_retrying(managed):
    torch.manual_seed(0)
    w = torch.randn(128, 128, requires_grad=True)
    x0 = torch.randn(512, 128)

    def run():
        x = x0
        for _ in range(12):  # 12 saved 256 KiB activations and more
            x = torch.tanh(x @ w)
        x.sum().backward()
        g = w.grad.clone()
        w.grad = None
        return g

    # The chain is chaotic (pre-activations ~11, 12 layers): one ulp anywhere in the forward changes
    # the gradient wholesale, so a recompute that is not bitwise cannot pass. That also makes it see
    # the machine: on one CI run the *unmanaged* reference (the first matmul chain of the process)
    # came out different from what every later run, managed or not, gives. Warm up first.
    run()
    ref = run()
    pymem.enable("2MiB", allocator="native")
    got = run()
    s = pymem.memory_stats()
    pymem.disable()
    assert torch.equal(got, ref)
    assert s["allocator"] == "native" and s["budget_bytes"] == 2 << 20
    assert s["allocated_bytes.peak"] <= s["budget_bytes"]
    assert s["num_retries"] > 0 and s["num_evictions"] > 0 and s["num_rematerializations"] > 0


def test_native_allocator_has_no_snapshot_and_says_why(managed):
    pymem.enable("2MiB", allocator="native")
    with pytest.raises(RuntimeError, match="allocator='native' has no arena"):
        pymem.memory_snapshot()


def test_native_allocator_too_small_a_budget_names_the_op_and_keeps_tensors_valid(managed):
    a = torch.ones(100_000)
    pymem.enable(512 << 10, allocator="native")
    with pymem.no_recompute():
        b = a * 2  # 400 kB, and no recipe: nothing to release for the next 400 kB
    with pytest.raises(pymem.OutOfBudgetError, match="aten.mul.Tensor needs 400000 B more"):
        c = a * 3  # noqa: F841
    pymem.disable()
    assert torch.equal(a, torch.ones(100_000)) and torch.equal(b, torch.full((100_000,), 2.0))


def test_unknown_allocator_is_rejected_with_the_accepted_ones():
    with pytest.raises(ValueError, match="allocator 'malloc' is not accepted; accepted: 'arena', 'native'"):
        pymem.enable("1MiB", allocator="malloc")
    assert not pymem.is_enabled()


def test_enabling_the_arena_after_cuda_initialised_is_a_clear_error(monkeypatch):
    with pytest.raises(RuntimeError) as e:
        check_cuda_order("cuda", "arena", cuda_initialized=True)
    msg = str(e.value)
    assert "pymem.enable() came after CUDA was initialised" in msg
    assert "at the top of the script" in msg and "PYMEM_BUDGET" in msg and "allocator='native'" in msg
    check_cuda_order("cuda", "arena", cuda_initialized=False)
    check_cuda_order("cuda:1", "native", cuda_initialized=True)  # the caching allocator stays
    check_cuda_order("cpu", "arena", cuda_initialized=True)      # the CPU hook has no such order
    # Once pymem's library is PyTorch's allocator (an earlier enable), a new arena plugs into it;
    # a native cap would cap nothing.
    check_cuda_order("cuda", "arena", cuda_initialized=True, swapped=True)
    with pytest.raises(RuntimeError, match="allocator='native' caps PyTorch's CUDA caching allocator, but an "
                                           "earlier pymem.enable\\(allocator='arena'\\)"):
        check_cuda_order("cuda", "native", cuda_initialized=True, swapped=True)
    # Through enable(): the check comes first, before any allocator is touched.
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(RuntimeError, match="came after CUDA was initialised"):
        pymem.enable("1GB", device="cuda", allocator="arena")
    assert not pymem.is_enabled() and pymem.cpu_hook_arena() is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error of a machine without CUDA")
def test_cuda_device_without_cuda_is_a_clear_error():
    with pytest.raises(ValueError, match="device 'cuda': CUDA is not available here .*use device='cpu'"):
        pymem.enable("1GB", device="cuda")
    assert not pymem.is_enabled()


@pytest.mark.parametrize("device", ["tpu", "cuda:x", "meta"])
def test_unknown_device_is_a_clear_error(device):
    with pytest.raises(ValueError, match=f"device '{device}' is not accepted; accepted: 'cpu', 'cuda', 'cuda:N'"):
        pymem.enable("1GB", device=device)
    assert not pymem.is_enabled()


class FakeCuda:
    """torch.cuda's memory calls, for CudaCap's logic without a GPU: a caching allocator capped at
    fraction * total, whose stats the test sets."""

    def __init__(self, total):
        self.total, self.fraction, self.peak_resets = total, 1.0, 0
        self.stats = {"allocated_bytes.all.current": 0, "allocated_bytes.all.peak": 0, "num_ooms": 3,
                      "reserved_bytes.all.current": 0, "reserved_bytes.all.peak": 0,
                      "allocation.all.allocated": 0, "allocation.all.freed": 0}

    def get_device_properties(self, index):
        return types.SimpleNamespace(total_memory=self.total)

    def set_per_process_memory_fraction(self, fraction, index):
        assert 0 <= fraction <= 1 and index == 1
        self.fraction = fraction

    def reset_peak_memory_stats(self, index):
        self.peak_resets += 1

    def memory_stats(self, index):
        return dict(self.stats)

    def memory_reserved(self, index):
        return self.stats["reserved_bytes.all.current"]

    def empty_cache(self):
        self.stats["reserved_bytes.all.current"] = self.stats["allocated_bytes.all.current"]


def test_cuda_native_cap_is_a_memory_fraction_and_prices_refusals():
    cuda = FakeCuda(total=80 << 30)
    cap = CudaCap(20 << 30, torch.device("cuda:1"), cuda=cuda)
    cap.install()
    assert cuda.fraction == 0.25 and cuda.peak_resets == 1
    cuda.stats.update({"allocated_bytes.all.current": 5 << 30, "allocated_bytes.all.peak": 7 << 30,
                       "reserved_bytes.all.current": 19 << 30, "num_ooms": 5})
    s = cap.stats()
    assert s["budget_bytes"] == 20 << 30 and s["allocated_bytes.current"] == 5 << 30
    assert s["allocated_bytes.peak"] == 7 << 30 and s["reserved_bytes.current"] == 19 << 30
    assert s["num_refused"] == 2  # refusals since install only
    # PyTorch's message (c10's format_size: two decimals, binary units).
    oom = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.50 GiB. GPU 1 has a total capacity of "
                                 "80.00 GiB of which 1.00 GiB is free.")
    assert requested_bytes(oom) == int(2.5 * (1 << 30))
    assert cap.deficit(oom, 0) == int(2.5 * (1 << 30)) - (1 << 30)  # lacks what the cap leaves
    assert cap.deficit(oom, 1) == int(2.5 * (1 << 30))  # a retry that failed again: the whole request
    assert requested_bytes(torch.OutOfMemoryError("Tried to allocate 512 bytes")) == 512
    assert cap.deficit(torch.OutOfMemoryError("out of memory"), 0) == 1  # no size in the message
    cap.uninstall()
    assert cuda.fraction == 1.0


def test_cuda_native_cap_empties_the_cache_first_and_refuses_what_is_held_before_it():
    cuda = FakeCuda(total=80 << 30)
    cuda.stats.update({"allocated_bytes.all.current": 10 << 30, "reserved_bytes.all.current": 30 << 30})
    cap = CudaCap(20 << 30, torch.device("cuda:1"), cuda=cuda)
    cap.install()  # the cache's 20 GiB of freed blocks go back first
    assert cuda.memory_reserved(1) == 10 << 30 and cuda.fraction == 0.25
    cap.uninstall()
    cuda.stats.update({"allocated_bytes.all.current": 25 << 30, "reserved_bytes.all.current": 25 << 30})
    with pytest.raises(ValueError, match=r"tensors made before enable\(\) hold 26843545600 B there, more than the "
                                         r"budget 21474836480 B; raise the budget, free them first, or use "
                                         r"allocator='arena'"):
        CudaCap(20 << 30, torch.device("cuda:1"), cuda=cuda).install()
    assert cuda.fraction == 1.0  # nothing capped


def test_cuda_native_cap_refuses_a_budget_over_the_device():
    cap = CudaCap(100 << 30, torch.device("cuda:1"), cuda=FakeCuda(total=80 << 30))
    with pytest.raises(ValueError, match=r"budget 107374182400 B is more than cuda:1's memory \(85899345920 B\)"):
        cap.install()


def test_native_allocator_never_picks_an_empty_storage_to_release(managed):
    """Found by the property test: under the native allocator an empty storage (a 0-element op
    output) was a release candidate, and evicting it raised."""
    pymem.enable(512 << 10, policy="lru", allocator="native")  # lru: the oldest value goes first
    x = torch.ones(25_000, requires_grad=True)
    empty = x[:0] * 2  # 0 bytes, recomputable, and the oldest value
    values = [x * i for i in range(1, 8)]  # 100 kB each: the budget forces releases
    assert all(torch.equal(v, torch.full((25_000,), float(i + 1))) for i, v in enumerate(values))
    assert empty.shape == (0,) and pymem.memory_stats()["num_evictions"] > 0


def test_buffers_of_an_earlier_native_run_are_not_charged_to_the_next(managed):
    pymem.enable("1MiB", allocator="native")
    with pymem.no_recompute():
        kept = torch.ones(200_000)  # 800 kB, made in the first run and outliving it
    pymem.disable()
    pymem.enable("1MiB", allocator="native")
    with torch.no_grad():
        y = torch.ones(200_000)  # fits: the first run's 800 kB are not this run's
    assert pymem.memory_stats()["allocated_bytes.current"] == 800_000
    del kept  # freed later, into the first run's count: this run's count is untouched
    assert pymem.memory_stats()["allocated_bytes.current"] == 800_000
    assert y.sum().item() == 200_000


def test_a_bad_argument_is_named_before_the_cuda_order_is_checked(monkeypatch):
    """A typo gets its own error even in a process whose CUDA is initialised already."""
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(ValueError, match="cost 'bogus' is not accepted"):
        pymem.enable("1GB", device="cuda", cost="bogus")
    with pytest.raises(ValueError, match="allocator 'slab' is not accepted"):
        pymem.enable("1GB", device="cuda", allocator="slab")
    assert not pymem.is_enabled()
