"""Memory shared outside torch (NumPy views, DLPack) is never released or moved while shared."""
import ctypes
import gc

import numpy as np
import pytest
import torch
from torch.utils.dlpack import from_dlpack, to_dlpack  # imported before enable, as a user would

import pymem


@pytest.fixture
def managed():
    pymem.enable(budget="64MB", device="cpu")
    try:
        yield pymem.current()
    finally:
        pymem.disable()
        gc.collect()


def test_the_shared_repro_every_sharing_path_keeps_its_bytes(managed):
    """../shared/repro/shared_storage_after_release.py; its last line expected y untouched by a
    write through y's own NumPy view, which plain PyTorch does not do either: the view is y's memory."""
    x = torch.randn(512, 512, requires_grad=True)
    y = (x * 2).exp()
    ref = y.detach().clone()
    as_numpy = y.detach().numpy()
    via_dlpack = np.from_dlpack(y.detach())
    torch_via_dlpack = from_dlpack(to_dlpack(y.detach()))
    pymem.evict(y)  # pinned: it stays
    others = [torch.full((512, 512), 7.0) for _ in range(20)]  # would reuse freed bytes
    assert np.array_equal(as_numpy, ref.numpy())
    assert np.array_equal(via_dlpack, ref.numpy())
    assert torch.equal(torch_via_dlpack, ref)
    as_numpy[:] = 0.0
    assert all(bool((o == 7.0).all()) for o in others)   # nobody else's bytes
    assert torch.equal(y.detach(), torch.zeros_like(ref))  # y's own, as without pymem
    assert torch.equal(torch_via_dlpack, torch.zeros_like(ref))


def test_the_pin_of_a_numpy_view_ends_with_the_view_and_its_views(managed):
    x = torch.randn(256, 256, requires_grad=True)
    y = x * 3
    a = y.detach().numpy()
    b = a[10:20]  # a view of the view keeps the pin
    r = managed.table[pymem._C.storage_key(y)]
    assert r.pins == 1 and pymem.memory_stats()["num_pinned_storages"] == 1
    assert pymem.memory_stats()["pinned_bytes.current"] >= r.nbytes  # the arena's block too
    del a
    gc.collect()
    assert r.pins == 1
    del b
    gc.collect()
    assert r.pins == 0 and pymem.memory_stats()["num_pins.numpy"] == 1
    pymem.evict(y)
    assert pymem.is_evicted(y)


def test_numpy_views_survive_real_pressure_and_compaction():
    """Under a budget that forces evictions and compaction, exported activations keep their bytes
    and addresses while every other value comes and goes."""
    pymem.enable(budget=6 << 20, device="cpu")
    try:
        w = torch.randn(256, 256, requires_grad=True)
        h = torch.randn(256, 256)
        kept, addresses = [], []
        for i in range(40):
            h = torch.tanh(h @ w / 16)
            if i % 8 == 0:
                kept.append((h.detach().numpy(), h.detach().clone().numpy().copy(), h.data_ptr()))
            elif i % 8 == 4:  # only the address leaves torch, as a C extension would keep it
                addresses.append((h, h.data_ptr(), h.detach().clone().numpy().copy()))
        h.sum().backward()
        st = pymem.memory_stats()
        for arr, snap, addr in kept:
            assert arr.tobytes() == snap.tobytes()
            assert arr.ctypes.data == addr  # never moved
        for _, addr, snap in addresses:
            assert ctypes.string_at(addr, snap.nbytes) == snap.tobytes()
        assert st["num_evictions"] > 0 and st["allocated_bytes.peak"] <= st["budget_bytes"]
    finally:
        pymem.disable()


def test_pin_pinned_and_unpin(managed):
    x = torch.randn(128, 128, requires_grad=True)
    y = x * 2
    with pymem.pinned(y):
        pymem.evict(y)
        assert not pymem.is_evicted(y)  # pinned: evict leaves it in place
    pymem.evict(y)
    assert pymem.is_evicted(y)
    pymem.pin(y)  # brings it back first
    assert not pymem.is_evicted(y) and torch.equal(y, x * 2)
    pymem.unpin(y)
    with pytest.raises(TypeError, match="takes a tensor"):
        pymem.pin([y])
    assert pymem.memory_stats()["num_pins.user"] == 2


def test_data_ptr_pins_once_for_the_storages_life(managed):
    """A Python ``data_ptr()`` may be kept by a C extension: the value is brought back, then never
    released or moved; libraries call it again and again to compare addresses, so it pins once."""
    x = torch.randn(128, 128, requires_grad=True)
    y = (x * 2).exp()
    want = y.detach().clone()
    pymem.evict(y)
    addr = y.data_ptr()  # brought back, then pinned
    r = managed.table[pymem._C.storage_key(y)]
    assert addr == y.data_ptr() == y.detach()[0].data_ptr() and r.pins == 1
    pymem.evict(y)
    assert not pymem.is_evicted(y)
    assert ctypes.string_at(addr, want.nbytes) == want.numpy().tobytes()
    assert pymem.memory_stats()["num_pins.data_ptr"] == 1
    pymem.unpin(y)  # the caller only compared: the pin is taken back
    pymem.evict(y)
    assert pymem.is_evicted(y) and r.pins == 0
    y.data_ptr()  # handed out again: pinned again
    assert r.pins == 1 and pymem.memory_stats()["num_pins.data_ptr"] == 2 and torch.equal(y, want)


def test_data_ptr_keeps_one_pin_across_in_place_ops(managed):
    """An in-place op gives the storage a new record; its data_ptr() pin goes with it."""
    x = torch.randn(128, 128, requires_grad=True)
    y = (x * 2).clone()
    for _ in range(3):
        y.add_(1.0)
        y.data_ptr()
    r = managed.table[pymem._C.storage_key(y)]
    assert r.pins == 1 and pymem.memory_stats()["num_pins.data_ptr"] == 1
    pymem.unpin(y)
    assert r.pins == 0


def test_torchs_own_address_comparisons_do_not_pin():
    """allow_mutation_on_saved_tensors calls data_ptr() on every saved tensor to compare addresses:
    pinned, no activation could be released, and this run failed at a budget it fits."""
    from torch.autograd.graph import allow_mutation_on_saved_tensors

    def run(ctx):
        torch.manual_seed(0)
        w = torch.randn(256, 256, requires_grad=True)
        h = torch.randn(256, 256)
        with ctx():
            for _ in range(40):
                h = torch.tanh(h @ w / 16)
            h.sum().backward()
        return w.grad

    want = run(allow_mutation_on_saved_tensors)
    pymem.enable("8MB", device="cpu")
    try:
        got = run(allow_mutation_on_saved_tensors)
        st = pymem.memory_stats()
    finally:
        pymem.disable()
    assert st["num_evictions"] > 0 and st["num_pins.data_ptr"] == 0 and torch.equal(got, want)


def test_a_data_ptr_pin_outlives_a_numpy_views_pin(managed):
    x = torch.randn(128, 128, requires_grad=True)
    y = x * 2
    a = y.detach().numpy()
    y.data_ptr()
    with pymem.pinned(y):
        pass
    del a
    gc.collect()
    pymem.evict(y)
    assert not pymem.is_evicted(y)


def test_an_inplace_op_keeps_the_pin_of_its_storage(managed):
    x = torch.randn(128, 128, requires_grad=True)
    y = (x * 2).clone()
    a = y.detach().numpy()
    y.mul_(3)  # a new value of the same storage: still shared with a
    pymem.evict(y)
    assert not pymem.is_evicted(y) and np.array_equal(a, y.detach().numpy())


def test_pin_needs_pymem_enabled():
    with pytest.raises(RuntimeError, match="not enabled"):
        pymem.pin(torch.zeros(4))


def test_the_cuda_array_interface_pins_the_storage(monkeypatch):
    """``__cuda_array_interface__`` (CuPy's ``asarray``, Numba) exists for CUDA tensors only: a CPU
    stand-in with the same shape of result, installed before enable, is what pymem wraps here."""
    def interface(t):
        return {"shape": tuple(t.shape), "typestr": "<f4", "data": (t.data_ptr(), False), "version": 2}

    monkeypatch.setattr(torch.Tensor, "__cuda_array_interface__", property(interface))
    pymem.enable(budget="64MB", device="cpu")
    try:
        x = torch.randn(128, 128, requires_grad=True)
        y = x * 2
        pymem.evict(y)
        ptr = y.detach().__cuda_array_interface__["data"][0]  # brought back, then pinned
        assert ptr == y.data_ptr() != 0
        pymem.evict(y)
        assert not pymem.is_evicted(y) and pymem.memory_stats()["num_pins.cuda array interface"] == 1
    finally:
        pymem.disable()
    assert torch.Tensor.__dict__["__cuda_array_interface__"].fget is interface  # given back


def test_share_memory_pins_the_storage(managed):
    """share_memory_() moves the bytes to shared memory another process may map: never released."""
    x = torch.randn(128, 128, requires_grad=True)
    y = (x * 2).detach() * 1.0  # recorded under grad mode: it has a recipe
    want = y.clone()
    pymem.evict(y)
    y.share_memory_()  # brought back first, then moved to shared memory
    assert y.is_shared() and torch.equal(y, want)
    pymem.evict(y)
    assert not pymem.is_evicted(y) and pymem.memory_stats()["num_pins.shared memory"] == 1
