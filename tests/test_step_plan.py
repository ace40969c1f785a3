"""The step plan (csrc/step_plan.h, policies/planned.py): each training step planned from the one
before; next uses read from it; a step that leaves its plan falls back and stays bitwise equal."""
import math

import pytest
import torch
import torch.nn as nn

import pymem
from pymem.cost_model import CostModel
from pymem.policies import DTR, Planned
from bitwise_harness import assert_bitwise_equal, budget_at, measure_peak, run_managed, run_unmanaged

torch.set_num_threads(2)

FIXED = CostModel(3e10, 7e9, 4e-6)  # fixed rates: the same costs, so the same plan, every run


def _chain_step(x):
    """Four ops: a = x*2, b = a+1, c = b*3, d = a+c (op positions 0..3 of each step)."""
    a = x * 2
    b = a + 1
    c = b * 3
    return a, b, c, a + c


def test_next_use_is_read_from_the_step_before(managed):
    rt = pymem.enable(budget="64MB", device="cpu", cost=FIXED, plan="auto")
    x = torch.ones(1000)
    for _ in range(3):  # the first step also made x: the second leaves its plan, the third keeps it
        _chain_step(x)
        pymem.step()
    diverged = pymem.memory_stats()["plan_divergences"]
    cost = rt.trace.last_step()["op_cost"]
    assert len(cost) == 4 and rt.trace.following
    a = x * 2                                    # position 0 ran; next is 1
    rec_a = rt.table[pymem._C.storage_key(a)]
    assert rt.trace.seconds_to_next_use(rec_a) == 0.0  # b = a + 1 reads it now
    assert rec_a.next_use == 0.0
    b = a + 1                                    # position 1 ran
    rec_b = rt.table[pymem._C.storage_key(b)]
    assert rt.trace.seconds_to_next_use(rec_a) == pytest.approx(cost[2])  # c runs first, then a + c
    c = b * 3                                    # position 2 ran
    assert rt.trace.seconds_to_next_use(rec_b) == math.inf  # nothing reads b again in this step
    a + c
    assert rt.trace.following
    assert pymem.memory_stats()["plan_divergences"] == diverged
    pymem.step()
    x - 5                                        # not the plan's first op (x * 2): the step left its plan
    assert not rt.trace.following and rt.trace.seconds_to_next_use(rec_a) is None
    assert pymem.memory_stats()["plan_divergences"] == diverged + 1


class Branchy(nn.Module):
    """Its op sequence changes with its input: a sample whose first feature is positive takes an
    extra block, and the count of such samples sets how often the last block repeats."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(32, 128)
        self.extra = nn.Sequential(nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 128))
        self.block = nn.Sequential(nn.Linear(128, 128), nn.Tanh())
        self.out = nn.Linear(128, 4)

    def forward(self, x):
        h = torch.relu(self.inp(x))
        if x[0, 0] > 0:
            h = h + self.extra(h)
        for _ in range(1 + int((x[:, 0] > 0).sum()) % 3):
            h = self.block(h)
        return self.out(h)


def _make_branchy():
    torch.manual_seed(0)
    model = Branchy()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    batches = [torch.randn(1024, 32) for _ in range(6)]
    turn = [0]

    def step():
        x = batches[turn[0] % len(batches)]
        turn[0] += 1
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        return loss.detach().clone()

    step.model = model
    return step


def test_a_step_that_leaves_its_plan_falls_back_and_trains_bitwise_equal(managed):
    steps = 6
    ref_out, ref_state, _ = run_unmanaged(_make_branchy, steps)
    budget = budget_at(measure_peak(_make_branchy, steps), 0.6)
    out, state, stats, _, _ = run_managed(_make_branchy, steps, budget, cost=FIXED, plan="auto")
    assert_bitwise_equal("losses", ref_out, out)
    assert_bitwise_equal("parameters", ref_state, state)
    assert stats["allocated_bytes.peak"] <= budget
    assert stats["num_evictions"] > 0
    assert stats["plan_divergences"] >= 2, stats  # the batches take different branches


def test_planned_wraps_the_policy_where_the_plan_cannot_say():
    class View:
        nbytes, compute_cost, last_access = 1000, 2.0, 1.0
        evicted_neighbour_cost, evicted_ancestor_cost, swap_cost, has_host_copy = 0.5, 1.0, 0.0, False
        next_use = None

    p, t = Planned(DTR()), View()
    assert p.evaluate(t, 3.0) == DTR().evaluate(t, 3.0)
    t.next_use = 4.0
    assert p.evaluate(t, 3.0) == (2.0 + 0.5 + 1.0) / (1000 * 4.0)
    t.next_use = math.inf  # not read again in this step: released first
    assert p.evaluate(t, 3.0) == 0.0
    assert p.uses_neighbourhood and p.name == p.fallback.name == "dtr"


def test_a_bad_plan_setting_is_a_clear_error(managed):
    with pytest.raises(ValueError, match=r"plan 'always' is not accepted; accepted: 'auto', 'off'"):
        pymem.enable(budget="64MB", device="cpu", plan="always")
    assert not pymem.is_enabled()


def test_values_released_at_their_last_forward_use_come_back_right_in_backward(managed):
    """The plan releases what the step before released under pressure right after its last use
    before that (forward activations waiting for backward); backward recomputes them bitwise."""
    import runtime_models as rm

    steps = 5
    ref_out, ref_state, _ = run_unmanaged(lambda: rm.trainer("gpt"), steps)
    budget = budget_at(measure_peak(lambda: rm.trainer("gpt"), steps), 0.5)
    out, state, stats, _, _ = run_managed(lambda: rm.trainer("gpt"), steps, budget, cost=FIXED, plan="auto")
    assert_bitwise_equal("losses", ref_out, out)
    assert_bitwise_equal("parameters", ref_state, state)
    assert stats["allocated_bytes.peak"] <= budget
    assert stats["num_planned_releases"] > 0 and stats["num_rematerializations"] > 0, stats



def _three_reads_step(x):
    """a, b, c made (positions 0-2), offloaded, one more op (3), then read in the order a, b, c
    (4-6): the reverse of what newest-first prefetching brings back."""
    a, b, c = x * 2, x * 3, x * 5
    for t in (a, b, c):
        if not pymem._C.storage_is_evicted(t):  # the plan may have released it already
            pymem.evict(t)
    y = x + 1
    return [float(t.sum()) for t in (a + y, b + y, c + y)]


def _spy_on_copies(rt, started):
    """Which of a, b, c (by their bytes: x * 2, 3, 5 of ones) each copy back is, in ``started``
    (name -> the runtime's op count then); every copy is done when asked (no timing in the test)."""
    start, names = rt.swap.copier.start, {2.0: "a", 3.0: "b", 5.0: "c"}

    def spy(dst, src, out=False):
        if out:  # a copy out ahead, not back
            return start(dst, src, out=True)
        started[names[float(src.view(torch.float32)[0])]] = rt.num_ops
        handle = start(dst, src)
        handle.result()
        return handle

    rt.swap.copier.start = spy


def test_offloaded_values_come_back_in_the_order_the_plan_reads_them(managed):
    rt = pymem.enable(budget="64MB", device="cpu", cost=FIXED, plan="auto", offload="always", prefetch=True)
    rt.swap.headroom = 0
    # A fixed copy time (8 us a copy), not the rate timed at start: on a loaded machine a slow timing
    # made the in-trigger reach over two reads, and two copies started after the same op.
    rt.residency.link_bandwidth = (1 << 16) / 8e-6
    rt.swap.copy_ahead = lambda r, due: None  # as below: copies back counted in ops, not worker timing
    x = torch.ones(1 << 14)
    expected = [float((x * k + (x + 1)).sum()) for k in (2, 3, 5)]
    started = {}
    _spy_on_copies(rt, started)
    for _ in range(4):
        started.clear()
        assert _three_reads_step(x) == expected
        pymem.step()
    assert rt.trace.following and pymem.memory_stats()["num_prefetches"] > 0
    assert sorted(started, key=started.get) == ["a", "b", "c"]  # the plan's order
    assert started["a"] < started["b"] < started["c"]  # each when its read is next


def test_a_use_that_waited_for_its_copy_moves_the_copy_earlier_next_step(managed):
    """Capuchin's feedback: when a use of a value waited for its copy back, the next step starts
    that value's copy twice as far ahead of its read."""
    rt = pymem.enable(budget="64MB", device="cpu", cost=FIXED, plan="auto", offload="always", prefetch=True)
    rt.swap.headroom = 0
    # One copy: 8 us, so three copies (the in-trigger) are 24 us, shorter than the 32 us of `a + y`.
    rt.residency.link_bandwidth = (1 << 16) / 8e-6
    # No copies out ahead: when one is done decides when the plan's early release happens (a
    # worker thread's timing), which would move the copies back this test counts in ops.
    rt.swap.copy_ahead = lambda r, due: None
    x = torch.ones(1 << 14)
    started = {}
    _spy_on_copies(rt, started)
    for _ in range(3):
        started.clear()
        _three_reads_step(x)
        pymem.step()
    assert rt.trace.following and started["b"] > started["a"]  # b's copy waits for its read to near
    assert pymem.memory_stats()["num_late_uses"] == 0
    done = rt.swap.copier.done
    rt.swap.copier.done = lambda handle: False  # every copy is still running when its use comes
    _three_reads_step(x)
    pymem.step()
    rt.swap.copier.done = done
    assert pymem.memory_stats()["num_late_uses"] >= 3
    started.clear()
    assert _three_reads_step(x) == [float((x * k + (x + 1)).sum()) for k in (2, 3, 5)]
    assert started["b"] == started["a"]  # now b's copy starts with a's, one op earlier
