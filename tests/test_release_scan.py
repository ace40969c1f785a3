"""The runtime's release scan (csrc/release_scan.h) picks exactly the value the policy's Python
``evaluate`` picks: every scored policy, planned or not, with recompute and with offloading (leaves
too), on the models the runtime tests train. And a policy is its score as data (policies/base.py)."""
import pytest
import torch

import pymem
from pymem import _C
from pymem.cost_model import CostModel
from pymem.policies import Planned, Policy, get_policy
from pymem.policies.base import formula_score
from pymem.runtime import compaction
from pymem.runtime.pressure import native_scan
from bitwise_harness import assert_bitwise_equal, budget_at, measure_peak, run_unmanaged, state_of
import runtime_models

torch.set_num_threads(2)

FIXED = CostModel(3e10, 7e9, 4e-6)  # fixed costs: the same decisions every run


def _checking_windows(rt, marks):
    """rt's window marking (coop), done both ways: the arena's owners and costs, and the candidates."""
    handler = rt.pressure
    native = handler._mark_window

    def reset():  # a sentinel on every block, so a mark one side leaves out shows
        for b in rt.arena.blocks():
            if b.allocated:
                rt.arena.set_owner(b.addr, 987654321, 12345.0)

    def leaf_costs():  # leaf_releasable sets them
        return [r.compute_cost for r in rt.table.values() if r.recipe is None]

    def both():
        python_owners = None
        scan = handler.window_scan
        handler.window_scan = None
        reset()
        try:
            python_owners = native()
        finally:
            handler.window_scan = scan
        want = [(b.addr, b.owner, b.cost) for b in rt.arena.blocks() if b.allocated] + leaf_costs()
        reset()
        got_owners = native()
        got = [(b.addr, b.owner, b.cost) for b in rt.arena.blocks() if b.allocated] + leaf_costs()
        marks.append((got == want, {k: id(v) for k, v in got_owners.items()} == {k: id(v) for k, v in python_owners.items()}))
        return got_owners

    handler._mark_window = both


def _checking(rt, picks, plans=None, orders=None):
    """rt's pressure handler, made to find each pick (and each compaction plan, into ``plans``, and
    each release order compaction is priced against, into ``orders``) both ways and record the
    pair."""
    handler = rt.pressure
    native = handler._lowest_scoring
    if orders is not None:
        release_order = handler._release_order

        def order_both():
            got = release_order()
            scan = handler.scan
            handler.scan = None
            try:
                want = release_order()
            finally:
                handler.scan = scan
            orders.append(([(a, id(r)) for a, r in got], [(a, id(r)) for a, r in want]))
            return got

        handler._release_order = order_both
    if plans is not None:
        plan = compaction.plan

        def plan_both(rt_, request, movable):
            got = plan(rt_, request, movable)
            scan = handler.scan
            handler.scan = None
            try:
                want = plan(rt_, request, movable)
            finally:
                handler.scan = scan
            plans.append((got, want))
            return got

        compaction.plan = plan_both

    def both():
        scan = handler.scan
        got = native()
        handler.scan = None
        try:
            want = native()  # the Python loop over the policy's evaluate
        finally:
            handler.scan = scan
        picks.append((got, want))
        return got

    handler._lowest_scoring = both


PEAKS = {}
_PLAN = compaction.plan


def _peak(name):
    if name not in PEAKS:
        PEAKS[name] = measure_peak(lambda: runtime_models.trainer(name), 3)
    return PEAKS[name]


@pytest.mark.parametrize("name,policy,plan,offload,ratio", [
    ("gpt", "dtr", "auto", None, 0.45),
    ("gpt", "dtr-chain", "off", None, 0.45),
    ("gpt", "msps", "auto", None, 0.5),
    ("gpt", "lru", "off", None, 0.5),
    ("cnn", "dtr-local", "auto", None, 0.6),
    ("lstm", "size", "auto", None, 0.6),
    ("gpt", "dtr", "auto", "always", 0.35),  # offloaded ancestors; leaves offloadable (leaf_ok)
])
def test_scan_picks_what_evaluate_picks(managed, name, policy, plan, offload, ratio):
    make = lambda: runtime_models.trainer(name)  # noqa: E731
    outs, params, _ = run_unmanaged(make, 4)
    options = dict(policy=policy, plan=plan, cost=FIXED)
    if offload:
        options.update(offload=offload, offload_leaves=True)
    rt = pymem.enable(budget=budget_at(_peak(name), ratio), device="cpu", **options)
    assert rt.pressure.scan is not None
    picks, plans, orders = [], [], []
    _checking(rt, picks, plans, orders)
    step = make()
    try:
        got = [step() for _ in range(4)]
    finally:
        compaction.plan = _PLAN
    got_params = [t.clone() for t in state_of(step.model)]
    stats = dict(pymem.memory_stats())
    del step
    pymem.disable()
    assert_bitwise_equal("losses", outs, got)
    assert_bitwise_equal("parameters and buffers", params, got_params)
    assert stats["pressure_seconds"] > 0
    if offload:
        assert stats["num_offloads"] > 0 and stats["num_leaf_offloads"] > 0
    assert len(picks) > 20, len(picks)
    wrong = [(g, w) for g, w in picks if g is not w]
    assert not wrong, f"{len(wrong)} of {len(picks)} picks differ, the first {wrong[0]}"
    for got_plan, want_plan in plans:  # the same segment, moves, window and victims, in the same order
        if want_plan is None:
            assert got_plan is None
            continue
        assert got_plan[:4] == want_plan[:4]
        assert [id(r) for r in got_plan[4]] == [id(r) for r in want_plan[4]]
    assert plans or orders or name == "cnn", "no compaction was considered: the plans went unchecked"
    wrong = [(g, w) for g, w in orders if g != w]
    assert not wrong, f"{len(wrong)} of {len(orders)} release orders differ"


@pytest.mark.parametrize("plan", ["auto", "off"])
def test_window_marks_match_the_python_ones(managed, plan):
    """coop: every block's owner and cost, and the candidates, as the Python loop sets them."""
    make = lambda: runtime_models.trainer("gpt")  # noqa: E731
    outs, params, _ = run_unmanaged(make, 4)
    rt = pymem.enable(budget=budget_at(_peak("gpt"), 0.45), device="cpu", policy="coop", plan=plan, cost=FIXED)
    assert rt.pressure.window_scan is not None
    marks = []
    _checking_windows(rt, marks)
    step = make()
    got = [step() for _ in range(4)]
    got_params = [t.clone() for t in state_of(step.model)]
    del step
    pymem.disable()
    assert_bitwise_equal("losses", outs, got)
    assert_bitwise_equal("parameters and buffers", params, got_params)
    assert len(marks) > 20
    assert all(blocks and owners for blocks, owners in marks), \
        f"{sum(not (b and o) for b, o in marks)} of {len(marks)} markings differ"


def test_pressure_seconds_count_only_the_handler(managed):
    pymem.enable(budget="256MB", device="cpu")
    step = runtime_models.trainer("mlp")
    for _ in range(2):
        step()
    assert pymem.memory_stats()["pressure_seconds"] == 0.0  # no pressure, no handler
    del step


class _Custom(Policy):
    name = "custom-test"

    def evaluate(self, t, now):
        return -t.nbytes


def test_which_policies_scan_natively():
    assert native_scan(get_policy("dtr")) is not None
    assert native_scan(Planned(get_policy("dtr-chain"))) is not None
    assert native_scan(_Custom()) is None             # its own evaluate: scored in Python
    assert native_scan(Planned(_Custom())) is None


def test_a_policy_is_its_score_as_data():
    class T:
        nbytes, compute_cost, last_access = 1000, 2.0, 10.0
        evicted_neighbour_cost, evicted_ancestor_cost = 0.5, 1.5

    t = T()
    assert get_policy("dtr").evaluate(t, 50.0) == (2.0 + 0.5) / (1000 * 40.0)
    assert get_policy("dtr-chain").evaluate(t, 50.0) == (2.0 + 0.5 + 1.5) / (1000 * 40.0)
    assert get_policy("msps").evaluate(t, 50.0) == (2.0 + 1.5) / 1000
    assert get_policy("lru").evaluate(t, 50.0) == 10.0
    assert get_policy("size").evaluate(t, 50.0) == 1.0 / 1000
    assert formula_score(("compute_cost",), ("nbytes", "next_use"), t, 0.0, 4.0) == 2.0 / (1000 * 4.0)

    class Backwards(Policy):  # declared in any order, summed and multiplied in the canonical one
        name = "backwards-test"
        costs = ("evicted_neighbour_cost", "compute_cost")
        per = ("staleness", "nbytes")

    assert Backwards.costs == ("compute_cost", "evicted_neighbour_cost") and Backwards.uses_neighbourhood
    assert Backwards().evaluate(t, 50.0) == get_policy("dtr").evaluate(t, 50.0)


def test_unknown_terms_are_refused():
    with pytest.raises(ValueError, match=r"unknown score term\(s\) \['bytes'\]; accepted: costs"):
        class Bad(Policy):  # noqa: F841
            name = "bad-test"
            per = ("bytes",)
    with pytest.raises(ValueError, match="unknown cost term 'cost'; accepted: compute_cost"):
        _C.ReleaseScan(("cost",), ())
    with pytest.raises(ValueError, match="unknown per term 'm'; accepted: nbytes, staleness, next_use"):
        _C.ReleaseScan((), ("m",))
    with pytest.raises(ValueError, match="a formula that reads next_use needs a fallback"):
        _C.ReleaseScan(("compute_cost",), ("next_use",))
