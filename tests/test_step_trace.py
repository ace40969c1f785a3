"""The step trace (csrc/step_trace.h): every op of a training step and the values it reads and makes,
as arrays; the same for a step that repeats, whichever path booked each op."""
import numpy as np
import pytest
import torch
import torch.nn as nn

import pymem
from pymem import _C
from pymem.cost_model import CostModel
from pymem.runtime.ops import overwrites_unread

KEYS = ("op", "op_cost", "inputs_start", "inputs", "outputs_start", "outputs", "value_bytes", "value_producer",
        "value_recomputable")


def _train_traces(steps=3, optimizer=True, **options):
    """An MLP with dropout (Python path) and Adam trained under pymem; the trace after each step."""
    torch.manual_seed(0)
    pymem.enable(budget="64MB", device="cpu", cost=CostModel(3e10, 7e9, 4e-6), **options)
    try:
        model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 4))
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        x = torch.randn(16, 32)
        traces = []
        for _ in range(steps):
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            if optimizer:
                opt.step()
            else:
                pymem.step()
            traces.append(pymem.step_trace())
    finally:
        pymem.disable()
    return traces


def _same(a, b):
    return all(np.array_equal(a[k], b[k]) for k in KEYS)


def test_a_repeated_step_traces_the_same_ops_and_values(managed):
    first, second, third = _train_traces()
    assert _same(second, third)  # with a fixed cost model, costs repeat too
    names = [_C.op_name(int(c)) for c in third["op"]]
    assert "aten.addmm.default" in names and "aten.bernoulli_.float" in names
    n, m = len(third["op"]), len(third["value_bytes"])
    assert len(third["op_cost"]) == n and len(third["inputs_start"]) == n + 1 == len(third["outputs_start"])
    assert third["inputs_start"][-1] == len(third["inputs"]) and third["outputs_start"][-1] == len(third["outputs"])
    assert len(third["value_producer"]) == m == len(third["value_recomputable"])
    # Every value is made once: by an op of the step (listed among its outputs) or before the step.
    producer, outputs = third["value_producer"], third["outputs"]
    assert sorted(outputs.tolist()) == [v for v in range(m) if producer[v] >= 0]
    for k in range(n):
        for v in outputs[third["outputs_start"][k]:third["outputs_start"][k + 1]]:
            assert producer[v] == k
        for v in third["inputs"][third["inputs_start"][k]:third["inputs_start"][k + 1]]:
            assert producer[v] < k  # read after it was made (or made before the step)
    # The forward's activations get recipes; gradients and the optimizer's results are leaves.
    made = third["value_recomputable"][producer >= 0]
    assert made.any() and not made.all()
    backward = [k for k, name in enumerate(names) if name == "aten.threshold_backward.default"]
    assert backward and not any(third["value_recomputable"][producer == k].any() for k in backward)
    assert all((producer == k).sum() == 1 for k in backward)
    assert (third["value_bytes"] > 0).all()


def test_the_fast_path_and_run_op_trace_the_same_step(monkeypatch, managed):
    """The C++ fast path and Runtime.run_op record ops alike: the mode (every op by run_op) and the
    dispatcher trace the same step, but for views each interception alone sees."""
    monkeypatch.setenv("PYMEM_INTERCEPT", "dispatcher")
    by_cpp = _train_traces(steps=2)[-1]
    monkeypatch.setenv("PYMEM_INTERCEPT", "mode")
    by_mode = _train_traces(steps=2)[-1]
    keep = lambda t: [(_C.op_name(int(c)), t["outputs_start"][k + 1] - t["outputs_start"][k])  # noqa: E731
                      for k, c in enumerate(t["op"]) if t["outputs_start"][k + 1] > t["outputs_start"][k]]
    assert keep(by_cpp) == keep(by_mode)  # ops that made values: the same, in the same order
    assert sorted(by_cpp["value_bytes"].tolist()) == sorted(by_mode["value_bytes"].tolist())


def test_steps_are_marked_by_pymem_step_where_no_optimizer_steps(managed):
    traces = _train_traces(optimizer=False)
    assert _same(traces[1], traces[2])
    assert pymem.step_trace() is None  # not enabled
    pymem.enable(budget="64MB", device="cpu")
    assert pymem.step_trace() is None  # no step completed yet
    torch.ones(4).sum()
    pymem.step()
    assert [_C.op_name(int(c)) for c in pymem.step_trace()["op"]] == ["aten.ones.default", "aten.sum.default"]
    pymem.disable()


def test_an_unknown_op_code_is_a_clear_error():
    with pytest.raises(IndexError, match="no op has code"):
        _C.op_name(1 << 30)


def test_a_step_that_followed_its_plan_records_deaths_and_in_place_writes(managed):
    """value_free_at: where each value's storage died, observed (a value may outlive its last use,
    held by the program); value_overwrites: what an in-place op wrote over to make a value."""
    torch.manual_seed(0)
    w = torch.randn(64, 64)
    x = torch.randn(32, 64, requires_grad=True)
    pymem.enable(budget="64MB", device="cpu", cost=CostModel(3e10, 7e9, 4e-6), plan="auto")
    for i in range(3):
        a = x @ w            # read once, by tanh, then held until after the sum below
        b = a.tanh()
        c = (b * 2).sigmoid()  # b * 2: read once, by sigmoid, dropped at once
        mask = torch.empty_like(c).bernoulli_(0.5)  # empty_like, then overwritten in place
        s = (c * mask).sum()
        del a
        s.backward()
        x.grad = None
        pymem.step()
        if i == 0:  # no plan to follow yet: deaths not watched
            assert "value_free_at" not in pymem.step_trace() and "value_overwrites" not in pymem.step_trace()
    st = pymem.step_trace()
    pymem.disable()
    names = [_C.op_name(int(k)) for k in st["op"]]
    free_at, over, producer = st["value_free_at"], st["value_overwrites"], st["value_producer"]
    assert len(free_at) == len(over) == len(st["value_bytes"])
    first = lambda name: names.index(name)  # noqa: E731
    out = lambda k: int(st["outputs"][st["outputs_start"][k]])  # noqa: E731
    mm, tanh, mul, sig = first("aten.mm.default"), first("aten.tanh.default"), first("aten.mul.Tensor"), \
        first("aten.sigmoid.default")
    held, dropped = out(mm), out(mul)
    reads = lambda v: [k for k in range(len(names)) if v in st["inputs"][st["inputs_start"][k]:st["inputs_start"][k + 1]]]  # noqa: E731
    assert reads(held)[-1] == tanh and free_at[held] == first("aten.sum.default")  # held until `del a`
    assert reads(dropped) == [sig] and free_at[dropped] == sig  # died as soon as sigmoid read it
    bern = first("aten.bernoulli_.float")
    assert over[out(bern)] == out(first("aten.empty_like.default")) and (over[producer >= 0] >= 0).sum() == 1
    assert free_at[out(bern)] == -1  # `mask` holds it past the step's end


def test_in_place_writes_that_read_what_they_overwrite_are_told_apart(managed):
    """Dropout's mask: empty_like, bernoulli_ over it (unread: a rerun starts from a blank buffer),
    div_ over that (read: the mask's rerun needs bernoulli_'s value again). The trace records both
    writes; the lower bounds (bench/milp_optimum.py) take only the first as unread."""
    x = torch.randn(32, 64, requires_grad=True)
    pymem.enable(budget="64MB", device="cpu", cost=CostModel(3e10, 7e9, 4e-6), plan="auto")
    for _ in range(3):
        mask = torch.empty_like(x).bernoulli_(0.5).div_(0.5)
        (x * mask).sum().backward()
        x.grad = None
        pymem.step()
    st = pymem.step_trace()
    pymem.disable()
    names = [_C.op_name(int(k)) for k in st["op"]]
    over, producer = st["value_overwrites"], st["value_producer"]
    written = {names[producer[v]]: int(over[v]) for v in range(len(over)) if producer[v] >= 0 and over[v] >= 0}
    div = next(n for n in written if n.startswith("aten.div_."))  # .Tensor or .Scalar, by torch version
    assert set(written) == {"aten.bernoulli_.float", div}
    assert producer[written[div]] == names.index("aten.bernoulli_.float")
    assert {n: overwrites_unread(n) for n in written} == {"aten.bernoulli_.float": True, div: False}
    # What the covers read (csrc/plan_cover.cpp): the runtime's recipe for bernoulli_ takes a blank
    # buffer, so its rerun needs not empty_like's value (nor the x it was shaped from); div_'s reads.
    blank = st["value_blank_rerun"]
    made = {names[producer[v]]: int(blank[v]) for v in range(len(over)) if producer[v] >= 0 and over[v] >= 0}
    assert made == {"aten.bernoulli_.float": 1, div: 0}
    assert blank.sum() == 1
