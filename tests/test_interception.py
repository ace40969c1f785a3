"""How pymem sees ops (runtime/interception.py): the dispatcher fallback with its C++ fast path
(csrc/intercept.cpp, csrc/fast_op.cpp) against the Python TorchDispatchMode, which books every op
in runtime.py's run_op."""
import pytest
import torch
import torch.nn as nn

import pymem
from pymem import _C

pytestmark = pytest.mark.skipif(_C.install_interception() != "",
                                reason="this torch refuses pymem's dispatcher fallback")


def _train(steps=3, budget=None):
    """A small MLP with dropout (a seeded op: the Python path) trained with Adam: its gradients and
    parameters, and the runtime's op count."""
    torch.manual_seed(0)
    if budget is not None:
        rt = pymem.enable(budget=budget, device="cpu")
    try:
        model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Dropout(0.1), nn.Linear(256, 256), nn.Tanh(),
                              nn.Linear(256, 8))
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        x = torch.randn(512, 64)
        for _ in range(steps):
            opt.zero_grad()
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
        out = [p.detach().clone() for p in model.parameters()] + [p.grad.clone() for p in model.parameters()]
        stats = rt.memory_stats() if budget is not None else {}
        name = rt.interception.name if budget is not None else None
    finally:
        if budget is not None:
            pymem.disable()
    return out, stats, name


@pytest.fixture
def under_dispatcher(monkeypatch):
    """A runtime at a budget far above need, seeing ops through the dispatcher."""
    monkeypatch.setenv("PYMEM_INTERCEPT", "dispatcher")
    rt = pymem.enable(budget="64MB", device="cpu")
    try:
        yield rt
    finally:
        pymem.disable()


def _bitwise(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("budget_mib", [16, 4])  # no pressure; evictions and recomputes
def test_the_dispatcher_and_the_mode_book_the_same_ops_and_train_bitwise(monkeypatch, budget_mib):
    want, _, _ = _train()
    budget = budget_mib << 20
    monkeypatch.setenv("PYMEM_INTERCEPT", "mode")
    by_mode, mode_stats, name = _train(budget=budget)
    assert name == "mode"
    monkeypatch.setenv("PYMEM_INTERCEPT", "dispatcher")
    before = _C.fast_path_stats()["fast"]
    by_dispatcher, stats, name = _train(budget=budget)
    assert name == "dispatcher"
    assert _C.fast_path_stats()["fast"] - before > stats["num_ops"] // 2  # most ops took the C++ path
    assert _bitwise(by_mode, want) and _bitwise(by_dispatcher, want)
    # The same ops, but for a few views: each interception misses views the other sees (torch
    # hides some from modes alone, e.g. Tensor._make_subclass's detach).
    assert abs(stats["num_ops"] - mode_stats["num_ops"]) <= stats["num_ops"] // 20
    if budget_mib == 4:
        assert stats["num_evictions"] > 0 and stats["num_rematerializations"] > 0
        assert stats["allocated_bytes.peak"] <= budget


def test_the_dispatcher_turns_its_key_on_and_off_for_the_thread(under_dispatcher):
    assert under_dispatcher.interception.name == "dispatcher" and _C.interception_included()
    pymem.disable()
    assert not _C.interception_included()  # the thread's dispatch keys are as before


def test_the_dispatcher_is_the_default_and_the_mode_can_be_asked_for(monkeypatch):
    monkeypatch.delenv("PYMEM_INTERCEPT", raising=False)
    rt = pymem.enable(budget="64MB", device="cpu")
    try:
        assert rt.interception.name == "dispatcher" and _C.interception_included()
    finally:
        pymem.disable()
    monkeypatch.setenv("PYMEM_INTERCEPT", "mode")
    rt = pymem.enable(budget="64MB", device="cpu")
    try:
        assert rt.interception.name == "mode" and not _C.interception_included()
    finally:
        pymem.disable()


def test_an_unknown_interception_is_refused_with_the_accepted_ones(monkeypatch):
    monkeypatch.setenv("PYMEM_INTERCEPT", "python")
    with pytest.raises(ValueError, match=r"PYMEM_INTERCEPT='python' is not accepted; accepted: 'mode', 'dispatcher'"):
        pymem.enable(budget="64MB", device="cpu")
    assert not pymem.is_enabled()


def test_a_failing_kernel_raises_its_error_and_leaves_no_lock(under_dispatcher):
    rt = under_dispatcher
    a, b = torch.ones(2, 3), torch.ones(2, 3)
    with pytest.raises(RuntimeError, match="cannot be multiplied"):
        a @ b
    assert all(r.locks == 0 for r in rt.table.values()) and rt.running == []
    assert torch.equal(a + b, torch.full((2, 3), 2.0))  # and the runtime goes on


def test_fake_tensors_pass_through_untouched(under_dispatcher):
    """A FakeTensor reports the CPU as its device over a meta storage: not pymem's to manage."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    records = len(under_dispatcher.table)
    with FakeTensorMode():
        y = (torch.empty(1 << 20) + 1).sum()
    assert y.device.type == "cpu" and len(under_dispatcher.table) <= records + 1


def test_an_evicted_input_is_restored_through_the_python_path(under_dispatcher):
    x = torch.randn(256, 256)
    y = x.sin()
    want = y.clone()
    pymem.evict(y)
    assert pymem.is_evicted(y)
    z = y * 2  # the fast path refuses (an evicted input); run_op recomputes y first
    assert not pymem.is_evicted(y) and torch.equal(z, want * 2)
    assert under_dispatcher.residency.num_rematerializations == 1


@pytest.mark.parametrize("interception", ["mode", "dispatcher"])
def test_a_conv_without_bias_is_recomputable(monkeypatch, interception):
    """F.conv2d hands an absent bias to the dispatcher as an undefined tensor, not None: it is no
    input, so the output still gets a recipe (counted as an unmanaged input, every bias-less
    convolution's output was a leaf, never released: ResNet ran out of budget)."""
    monkeypatch.setenv("PYMEM_INTERCEPT", interception)
    rt = pymem.enable(budget="64MB", device="cpu")
    try:
        conv = nn.Conv2d(3, 4, 3, bias=False)
        y = conv(torch.randn(2, 3, 8, 8))
        want = y.detach().clone()
        assert rt.table[_C.storage_key(y)].recipe is not None
        pymem.evict(y)
        assert torch.equal(y.detach() + 0, want)
    finally:
        pymem.disable()


@pytest.mark.parametrize("interception", ["mode", "dispatcher"])
def test_a_python_number_is_no_input(monkeypatch, interception):
    """`x + 1` hands the dispatcher its 1 as a wrapped-number tensor, which a mode sees as the number:
    neither interception records it (as a leaf that every recipe of such an op would hold)."""
    monkeypatch.setenv("PYMEM_INTERCEPT", interception)
    rt = pymem.enable(budget="64MB", device="cpu")
    try:
        x = torch.randn(64)
        y = x + 1
        before = len(rt.table)
        z = y * 2.5
        assert len(rt.table) == before + 1  # z alone
        recipe = rt.table[_C.storage_key(z)].recipe
        assert recipe.args[1] == 2.5 and len(recipe.refs) == 1
        pymem.evict(z)
        assert torch.equal(z + 0, (x + 1) * 2.5)
    finally:
        pymem.disable()


def _described(recipe):
    """A recipe as plain data: its op, argument template (Slots by index) and ArgRefs."""
    from pymem.runtime.records import Slot

    def plain(v):
        if isinstance(v, Slot):
            return ("slot", v.i)
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        return v

    refs = [(a.rec is not None, a.leaf is not None, a.dtype, a.size, a.stride, a.offset, a.conj, a.neg, a.mutated,
             a.blank_nbytes) for a in recipe.refs]
    return (str(recipe.func), plain(list(recipe.args)), {k: plain(v) for k, v in recipe.kwargs.items()}, refs,
            recipe.out, recipe.rng, len(recipe.input_records()))


def _program():
    """Ops whose recipes hold what a template can: lists of tensors, optional tensors (Tensor?[] and
    an absent bias), keyword-only arguments, a Python number, a negative view, and several outputs."""
    torch.manual_seed(0)
    w, x = torch.randn(4, 3, 3, 3), torch.randn(2, 3, 8, 8)
    a = x * 1.5
    idx = torch.tensor([1, 0, 1])
    return [torch.cat([a, x, a], dim=1), a[idx], torch.add(a, x, alpha=2), torch.nn.functional.conv2d(a, w),
            a._neg_view() * 2, *torch.sort(a.flatten(), descending=True), torch.stack([a[0], a[1]]).sum(dim=(0, 1))]


def test_a_recipe_captured_in_cpp_reads_as_the_python_paths(under_dispatcher):
    """The fast path keeps a recipe in C++ and makes its Python fields on first read: they must be
    what run_op makes of the same op (remat.py recomputes from them), and recompute the same value."""
    rt = under_dispatcher
    by_cpp = _program()
    cpp = [_described(rt.table[_C.storage_key(t)].recipe) for t in by_cpp]
    _C.set_fast_path(None)  # every op by run_op
    try:
        by_python = _program()
        python = [_described(rt.table[_C.storage_key(t)].recipe) for t in by_python]
    finally:
        _C.set_fast_path(rt)
    assert cpp == python
    for t in by_cpp:
        want = t.clone()
        pymem.evict(t)
        assert torch.equal(t, want)


def test_records_and_recipes_made_in_cpp_are_collected(managed):
    """Records and recipes are C types (csrc/record.h, recipe.h) holding one another: once their
    tensors died and the runtime is gone, nothing of them is left."""
    import gc
    import weakref

    rt = pymem.enable(budget="64MB", device="cpu")
    if rt.interception.name != "dispatcher":
        pytest.skip("the mode makes no recipe in C++")
    outs = _program()
    watched = [weakref.ref(rt.table[_C.storage_key(t)]) for t in outs]
    watched += [weakref.ref(rt.table[_C.storage_key(t)].recipe) for t in outs]
    del outs, rt
    pymem.disable()
    gc.collect()
    assert all(w() is None for w in watched)


def _write_out_of_budget():
    """A write into out= tensors (leaves) that runs out: the error, the fast path's counters moved."""
    MiB = 1 << 20
    pymem.enable(int(2.8 * MiB))
    try:
        with pymem.no_recompute():
            a = torch.zeros(256 * 1024)  # 1 MiB
            v = torch.arange(256 * 1024, dtype=torch.float32)  # 1 MiB
            i = torch.empty(0, dtype=torch.long)
            before = _C.fast_path_stats()
            with pytest.raises(pymem.OutOfBudgetError) as info:
                torch.sort(v, out=(a, i))  # its indices need 2 MiB more
            after = _C.fast_path_stats()
    finally:
        pymem.disable()
    assert torch.equal(v, torch.arange(256 * 1024, dtype=torch.float32))  # the user's tensors stay valid
    return str(info.value), after["fast"] - before["fast"], after["slow"] - before["slow"]


def test_a_write_outside_recipes_is_booked_in_cpp_and_runs_out_as_under_the_mode(monkeypatch):
    """A write to leaves no recipe reads, outside recipes (a gradient summed in place in backward,
    ops under no_recompute), takes the fast path; one that runs out is not run again (it may have
    written before it did) but raises run_op's error, word for word."""
    monkeypatch.setenv("PYMEM_INTERCEPT", "mode")
    by_mode, _, _ = _write_out_of_budget()
    monkeypatch.setenv("PYMEM_INTERCEPT", "dispatcher")
    by_cpp, fast, slow = _write_out_of_budget()
    assert (fast, slow) == (0, 0)  # raised by the fast path: an op handed to Python counts as slow
    assert by_cpp == by_mode and "aten.sort.values needs 2097152 B more while its inputs" in by_cpp

    pymem.enable(budget="64MB", device="cpu")
    try:
        w = torch.randn(64, 64, requires_grad=True)
        x = torch.randn(8, 64)
        before = _C.fast_path_stats()
        (x @ w + x @ w).sum().backward()  # w's two gradients are summed in place
        assert _C.fast_path_stats()["slow"] == before["slow"]
        assert torch.equal(w.grad, 2 * (x.t() @ torch.ones(8, 64)))
    finally:
        pymem.disable()


def _priced_program(rt):
    """_program and a training step (matmuls priced by FLOPs, the rest by bytes, views among them):
    each output's record's cost, and the clock from 0."""
    rt.clock = 0.0
    outs = _program()
    torch.manual_seed(1)
    w, b = torch.randn(8, 16, requires_grad=True), torch.randn(8, requires_grad=True)
    torch.tanh(torch.addmm(b, torch.randn(4, 16), w.t())).sum().backward()
    outs += [w.grad, b.grad]
    return [rt.table[_C.storage_key(t)].compute_cost for t in outs], rt.clock


def test_estimated_costs_are_booked_in_cpp_as_the_cost_model_prices_them(monkeypatch):
    """Under cost estimates (the CUDA default) ops take the fast path, which prices them as
    CostModel.seconds does: the same cost for every record and the same clock, to the bit."""
    from pymem.cost_model import CostModel
    monkeypatch.setenv("PYMEM_INTERCEPT", "dispatcher")
    rt = pymem.enable(budget="64MB", device="cpu", cost=CostModel(3e10, 7e9, 4e-6))
    try:
        before = _C.fast_path_stats()
        by_cpp = _priced_program(rt)
        after = _C.fast_path_stats()
        _C.set_fast_path(None)  # every op by run_op
        try:
            by_python = _priced_program(rt)
        finally:
            _C.set_fast_path(rt)
    finally:
        pymem.disable()
    assert after["fast"] - before["fast"] > 3 * (after["slow"] - before["slow"])
    assert by_cpp == by_python
    assert len(set(by_cpp[0])) > 3  # priced apart: FLOPs and bytes both count
