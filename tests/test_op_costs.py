"""bench/op_costs.py: op costs measured once, then fixed (bench/plan_ways.py --costs measured). Its
point is that decisions repeat run to run at the CPU's own relative costs."""
import gc
import os
import sys

import torch

import pytest

import pymem
import runtime_models as rm
from pymem.cost_model import CostModel

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
from op_costs import costs_for, load_costs, measured_costs, op_key  # noqa: E402

aten = torch.ops.aten
RATES = CostModel(1e11, 1e10, 5e-6)  # for what the table lacks


def test_an_op_seen_is_priced_at_its_median_and_an_op_not_seen_by_the_rates():
    a, b = torch.randn(64, 32), torch.randn(32, 48)
    costs = measured_costs(lambda: (a @ b, torch.empty(1000).bernoulli_(0.5)), RATES, steps=3)
    mm = op_key(aten.mm.default, (a, b), {})
    assert mm in costs.table and costs.table[mm] > 0
    out = aten.mm.default(a, b)
    assert costs.seconds(aten.mm.default, (a, b), {}, [a, b], out) == costs.table[mm]
    assert not costs.misses
    c = torch.randn(32, 16)  # shapes the steps never ran: the fallback rates, counted
    out = aten.mm.default(a, c)
    assert costs.seconds(aten.mm.default, (a, c), {}, [a, c], out) == RATES.seconds(
        aten.mm.default, (a, c), {}, [a, c], out)
    assert costs.misses == {"aten.mm.default": 1}
    assert any(name == "aten.bernoulli_.float" for name, _ in costs.table)


def test_a_table_saved_once_is_what_later_runs_price_by(tmp_path):
    a, b = torch.randn(64, 32), torch.randn(32, 48)
    path = str(tmp_path / "mm.json")
    first = costs_for(lambda: a @ b, RATES, path)  # measured, then saved

    def not_measured_again():
        raise AssertionError("the saved table should have been loaded, not measured again")

    again = costs_for(not_measured_again, RATES, path)
    assert again.table == first.table and again.flop_rate == RATES.flop_rate
    (tmp_path / "bad.json").write_text('[["aten.mm.default", [[64, 32]], -1]]')
    with pytest.raises(ValueError, match=r"each entry must be \[op name, \[shape, ...\], seconds >= 0\]"):
        load_costs(str(tmp_path / "bad.json"), RATES)


def _managed(costs, budget, steps):
    """From a collected heap with the cycle collector off: a collection at another point frees
    tensors held in cycles at another point, which moves blocks, not costs
    (test_runtime_training.test_estimated_costs_make_the_same_decisions_every_run)."""
    gc.collect()
    gc.disable()
    pymem.enable(budget, device="cpu", plan="auto", cost=costs)
    try:
        step = rm.trainer("gpt")
        losses = [step() for _ in range(steps)]
        stats = dict(pymem.memory_stats())
    finally:
        pymem.disable()
        gc.enable()
    return losses, stats


def test_decisions_at_measured_costs_repeat_run_to_run():
    """Dropout on (the gpt workload trains): the same releases, recomputes and recompute seconds in
    two runs, past the plan's start, and the losses of an unmanaged run."""
    steps = 6
    costs = measured_costs(rm.trainer("gpt"), RATES, steps=2)
    budget = int(0.4 * rm.unmanaged_peak("gpt", steps)) // 512 * 512
    ref, _ = rm.run("gpt", steps)
    first, second = _managed(costs, budget, steps), _managed(costs, budget, steps)
    assert first[0] == second[0] == ref
    keys = ("num_evictions", "num_rematerializations", "remat_seconds", "num_planned_releases")
    assert {k: first[1][k] for k in keys} == {k: second[1][k] for k in keys}
    assert first[1]["num_rematerializations"] > 0 and first[1]["allocated_bytes.peak"] <= budget
