"""The arena as PyTorch's CPU allocator."""
import pytest
import torch

import pymem


@pytest.fixture
def hooked():
    arena = pymem.Arena(256 << 20)
    pymem.install_cpu_hook(arena)
    try:
        yield arena
    finally:
        pymem.uninstall_cpu_hook()


def in_arena(arena, t):
    p = t.untyped_storage().data_ptr()
    return arena.base <= p < arena.base + arena.budget


def test_torch_ops_allocate_from_the_arena(hooked):
    before = hooked.stats()
    x = torch.randn(256, 256)
    y = x @ x
    after = hooked.stats()
    assert in_arena(hooked, x) and in_arena(hooked, y)
    assert after["num_allocs"] >= before["num_allocs"] + 2
    assert after["allocated_bytes.current"] >= before["allocated_bytes.current"] + 2 * 256 * 256 * 4
    assert pymem.cpu_hook_arena() is hooked
    del x, y
    assert hooked.stats()["allocated_bytes.current"] <= before["allocated_bytes.current"]


def test_tensors_from_before_and_during_stay_valid_after_uninstall():
    before = torch.arange(1000, dtype=torch.float32)
    arena = pymem.Arena(64 << 20)
    pymem.install_cpu_hook(arena)
    try:
        during = torch.arange(1000, dtype=torch.float32) * 2
        mixed = before + during  # an op reading both kinds of memory
        assert not in_arena(arena, before) and in_arena(arena, during)
    finally:
        pymem.uninstall_cpu_hook()
    assert pymem.cpu_hook_arena() is None
    after = torch.arange(1000, dtype=torch.float32)
    assert not in_arena(arena, after)
    assert torch.equal(mixed, before * 3) and torch.equal(during, before * 2)
    held = arena.stats()["allocated_bytes.current"]
    del during, mixed
    assert arena.stats()["allocated_bytes.current"] < held  # freed into the arena after uninstall
    del before, after
    assert pymem._C.cpu_hook_bad_frees() == 0


def test_reinstall_and_switch_arenas():
    a, b = pymem.Arena(16 << 20), pymem.Arena(16 << 20)
    try:
        pymem.install_cpu_hook(a)
        ta = torch.ones(1000)
        pymem.install_cpu_hook(b)
        tb = torch.ones(1000)
        pymem.install_cpu_hook(a)
        ta2 = torch.ones(1000)
    finally:
        pymem.uninstall_cpu_hook()
    assert in_arena(a, ta) and in_arena(b, tb) and in_arena(a, ta2)
    del ta, tb, ta2
    assert a.stats()["num_allocated_blocks"] == 0 and b.stats()["num_allocated_blocks"] == 0


def test_hook_needs_host_memory():
    with pytest.raises(ValueError, match="the CPU hook needs a 'host' arena"):
        pymem.install_cpu_hook(pymem.Arena(1 << 20, backing="virtual"))


def test_out_of_budget_inside_a_torch_op(hooked):
    keep = torch.ones(1024)
    with pytest.raises(pymem.OutOfBudgetError) as e:
        torch.empty(300 << 20, dtype=torch.uint8)
    assert isinstance(e.value, torch.OutOfMemoryError)
    assert e.value.requested == 300 << 20 and e.value.budget == 256 << 20
    assert "larger than the whole budget" in str(e.value)
    assert torch.equal(keep, torch.ones(1024))  # earlier tensors untouched


def test_pressure_handler_frees_tensors_from_inside_an_op(hooked):
    """The handler runs with the GIL from inside the allocator and frees other storages."""
    owned = {}
    for i in range(1, 5):  # four 48 MiB tensors, releasable, in a 256 MiB budget
        t = torch.full((12 << 20,), float(i))
        hooked.set_owner(t.untyped_storage().data_ptr(), i, float(i))
        owned[i] = t
    del t  # only `owned` may keep them alive
    released = []

    def release(request, window):
        for owner in window.owners:
            released.append(owner)
            del owned[owner]  # the storage dies -> its deleter frees into the arena

    hooked.set_pressure_handler(release)
    try:
        big = torch.zeros(100 << 20, dtype=torch.uint8)  # needs 100 MiB: some tensors must go
    finally:
        hooked.set_pressure_handler(None)
    assert big.numel() == 100 << 20 and not big.any()
    assert released and set(released) | set(owned) == {1, 2, 3, 4}
    del big
    for i, t in owned.items():
        assert torch.equal(t, torch.full((12 << 20,), float(i)))
    s = hooked.stats()
    assert s["num_pressure_events"] >= 1 and s["num_released_blocks"] == len(released)
    assert s["allocated_bytes.peak"] <= s["budget_bytes"]


def test_training_under_the_hook_is_bitwise_identical():
    def train():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
        losses = []
        for _ in range(3):
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses, [p.detach().clone() for p in model.parameters()]

    ref_losses, ref_params = train()
    arena = pymem.Arena(64 << 20)
    pymem.install_cpu_hook(arena)
    try:
        losses, params = train()
    finally:
        pymem.uninstall_cpu_hook()
    assert losses == ref_losses
    assert all(torch.equal(a, b) for a, b in zip(params, ref_params))
    assert arena.stats()["num_allocs"] > 50


def test_allocation_class_places_cheap_buffers_at_the_top_of_a_free_block(hooked):
    """The hooks cannot pass a placement class; the thread's class set around an allocation does
    (the runtime's prefetch buffers are cheap: they settle away from long-lived costly blocks)."""
    costly = torch.empty(1 << 20, dtype=torch.uint8)
    previous = pymem._C.set_allocation_class("cheap")
    try:
        cheap = torch.empty(1 << 20, dtype=torch.uint8)
    finally:
        assert pymem._C.set_allocation_class(previous) == "cheap"
    assert previous == "costly"
    main_top = hooked.base + hooked.budget - hooked.small_region_size
    assert costly.data_ptr() == hooked.base  # the bottom of the empty arena's one free block
    assert cheap.data_ptr() == main_top - (1 << 20)  # the top of the same block
    with pytest.raises(ValueError, match="cost_class must be 'costly' or 'cheap', got 'free'"):
        pymem._C.set_allocation_class("free")
