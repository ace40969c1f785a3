"""Evicting a storage in place and adopting a recomputed buffer without a copy (the runtime's
restore path): views and autograd-saved tensors see both, _version stays, backward is exact."""
import pytest
import torch

import pymem
from pymem import _C


def test_evict_then_adopt_restores_saved_tensor_for_backward():
    torch.manual_seed(0)
    x = torch.randn(64, 32, requires_grad=True)
    ref_y = x.exp()
    (ref_y * 3).sum().backward()
    ref_grad = x.grad.clone()
    x.grad = None

    y = x.exp()  # exp saves its output for backward
    view = y[3:5]
    version = y._version
    nbytes = _C.evict_storage(y)
    assert nbytes == 64 * 32 * 4
    assert _C.storage_is_evicted(y) and _C.storage_is_evicted(view)
    assert y.shape == (64, 32) and y.stride() == (32, 1)  # metadata queries need no bytes

    with torch.no_grad():
        again = x.exp()  # the recompute
    src_ptr = again.untyped_storage().data_ptr()
    _C.adopt_storage(y, again, nbytes)
    assert y.untyped_storage().data_ptr() == src_ptr  # moved, not copied
    assert _C.storage_is_evicted(again)
    assert y._version == version
    assert torch.equal(view, ref_y[3:5])
    (y * 3).sum().backward()  # autograd accepts the restored saved tensor
    assert torch.equal(x.grad, ref_grad)


def test_evict_frees_into_the_arena():
    arena = pymem.Arena(16 << 20)
    pymem.install_cpu_hook(arena)
    try:
        t = torch.ones(1 << 20)
    finally:
        pymem.uninstall_cpu_hook()
    held = arena.stats()["allocated_bytes.current"]
    _C.evict_storage(t)
    assert arena.stats()["allocated_bytes.current"] == held - (4 << 20)


def test_bad_adopt_and_evict_are_clear_errors_and_change_nothing():
    a = torch.arange(16.0)
    tail = a[2:]
    with pytest.raises(RuntimeError, match="the destination storage is not evicted"):
        _C.adopt_storage(a, torch.zeros(16), 64)
    n = _C.evict_storage(a)
    with pytest.raises(RuntimeError, match="the storage holds no bytes"):
        _C.evict_storage(a)
    with pytest.raises(RuntimeError, match="the recomputed storage holds 32 bytes, the evicted one held 64"):
        _C.adopt_storage(a, torch.zeros(8), n)
    with pytest.raises(RuntimeError, match="source and destination share one storage"):
        _C.adopt_storage(a, tail, n)
    _C.adopt_storage(a, torch.arange(16.0), n)
    assert torch.equal(a, torch.arange(16.0)) and torch.equal(tail, torch.arange(2.0, 16.0))


def test_relocate_refuses_buffers_the_hook_did_not_allocate():
    t = torch.arange(16.0)  # PyTorch's own allocator
    with pytest.raises(RuntimeError, match="allocated neither by pymem's CPU hook nor through pymem's CUDA library, so it cannot be moved"):
        _C.StorageRef(t).relocate(t.data_ptr() + 512)
    assert torch.equal(t, torch.arange(16.0))


def test_relocate_follows_a_compacted_block_for_every_view():
    arena = pymem.Arena(1 << 20, small_threshold=0)
    pymem.install_cpu_hook(arena)
    try:
        gap = torch.empty(8192)
        t = torch.arange(8192.0)
    finally:
        pymem.uninstall_cpu_hook()
    view = t[100:200]
    ref = _C.StorageRef(t)
    del gap
    (old, new), = arena.compact([ref.data_ptr])
    ref.relocate(new)
    assert t.data_ptr() == new and view.data_ptr() == new + 400
    assert torch.equal(view, torch.arange(100.0, 200.0)) and torch.equal(t, torch.arange(8192.0))
    del t, view
    assert arena.stats()["allocated_bytes.current"] == 0  # the new address was freed at death


def test_the_storage_ref_cpp_reads_is_the_one_python_set_last():
    """A record's `sref` set from Python is read by C++ (the sweep, the movable blocks) through a
    pointer found once at the assignment: each assignment replaces it, None clears it."""
    live = torch.empty(4096, dtype=torch.uint8)
    dying = torch.empty(4096, dtype=torch.uint8)
    r = _C.RecordBase()
    table = {1: r}

    def movable():
        return list(_C.movable_blocks(table, {}, 0, 2**63, [], None))

    r.sref = _C.StorageRef(dying)
    assert movable() == [dying.data_ptr()]
    r.sref = _C.StorageRef(live)
    assert movable() == [live.data_ptr()]
    r.sref = _C.StorageRef(dying)
    del dying
    _C.sweep_records(table, None, {})  # its storage died: dropped
    assert table == {}
    table[1] = r
    r.sref = _C.StorageRef(live)
    _C.sweep_records(table, None, {})  # the live one it holds now: kept
    assert table == {1: r} and movable() == [live.data_ptr()]
    r.sref = None
    assert movable() == []
