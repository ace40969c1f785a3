"""Retention (csrc/step_plan.h, kRebuild's holds): a small value the program freed that a rerun of the
step before rebuilt is held from the program's free until that rerun, releasable; the trace keeps
the program's deaths; the simulator holds it as the runtime does."""
import numpy as np
import pytest
import torch

import pymem
from pymem import _C
from pymem.cost_model import CostModel
from pymem.sim.replay import EVICTED, RESIDENT, Simulator
import runtime_models as rm
from bitwise_harness import assert_bitwise_equal, budget_at
from test_sim import MiB, _trace

torch.set_num_threads(2)


def _step(free_at, back=(), released=(), overwrites=None, recomputable=None, nbytes=None):
    """Five ops (op k reads value k), five values (value 0 made before the step, value v by op v - 1);
    ``back``/``released``: (position, value) events."""
    n = m = 5
    return {"op": np.zeros(n, np.int32), "op_cost": np.ones(n), "inputs_start": np.arange(n + 1),
            "inputs": np.array([0, 1, 2, 3, 4], np.int32), "outputs_start": np.array([0, 1, 2, 3, 4, 4]),
            "outputs": np.array([1, 2, 3, 4], np.int32),
            "value_bytes": np.array(nbytes or [1024] * m, np.int64),
            "value_producer": np.array([-1, 0, 1, 2, 3], np.int32),
            "value_recomputable": np.array(recomputable or [1] * m, np.uint8),
            "value_free_at": np.array(free_at, np.int32),
            "value_overwrites": np.array(overwrites or [-1] * m, np.int32),
            "back_at": np.array([a for a, _ in back], np.int32), "back_value": np.array([v for _, v in back], np.int32),
            "released_at": np.array([a for a, _ in released], np.int32),
            "released_value": np.array([v for _, v in released], np.int32)}


def test_a_small_value_rebuilt_after_its_free_is_held_until_its_last_rerun():
    free = [-1, 1, -1, -1, -1]  # value 1, made by op 0, freed by the program after op 1
    assert _C.retained_values(_step(free, back=[(3, 1), (4, 1)]), 4096) == [(1, 1, 4)]
    assert _C.retained_values(_step(free, back=[(1, 1)]), 4096) == []  # back before its free: no hold
    assert _C.retained_values(_step(free, back=[(3, 1)]), 512) == []   # larger than the limit
    assert _C.retained_values(_step(free, back=[(3, 1)]), 0) == []     # a limit of 0 holds nothing
    assert _C.retained_values(_step(free, back=[(3, 1)], recomputable=[1, 0, 1, 1, 1]), 4096) == []  # a leaf
    # value 2's producer wrote over value 1: its storage is value 2's, never held
    assert _C.retained_values(_step(free, back=[(3, 1)], overwrites=[-1, -1, 1, -1, -1]), 4096) == []
    no_deaths = {k: v for k, v in _step(free, back=[(3, 1)]).items() if k not in ("value_free_at", "value_overwrites")}
    assert _C.retained_values(no_deaths, 4096) == []  # deaths not observed: nothing known to hold
    with pytest.raises(ValueError, match="retain_limit is a number of bytes"):
        _C.StepTrace().retain_limit = -1


def test_a_value_held_before_stays_held_while_pressure_leaves_it_alone():
    free = [-1, 1, -1, -1, -1]
    assert _C.retained_values(_step(free), 4096, [(1, 1, 3)]) == [(1, 1, 3)]  # held, so no comeback shows
    assert _C.retained_values(_step(free, released=[(2, 1)]), 4096, [(1, 1, 3)]) == []  # pressure took it
    assert _C.retained_values(_step(free, released=[(4, 1)]), 4096, [(1, 1, 3)]) == [(1, 1, 3)]  # after the hold
    assert _C.retained_values(_step(free, back=[(4, 1)]), 4096, [(1, 1, 3)]) == [(1, 1, 4)]  # read later now
    assert _C.retained_values(_step([-1, 2, -1, -1, -1]), 4096, [(1, 1, 3)]) == []  # freed elsewhere: another program


def _masked_rerun():
    """m (4 KiB, a chain of two ops from the leaf x) is freed by the program after op 2, which read
    it to make a; a is evicted and read again at op 4, so its rerun reads m."""
    ops = [("k", 5.0, [0], [1]), ("m", 5.0, [1], [2]), ("a", 1.0, [2, 0], [3]), ("other", 1.0, [0], [4]),
           ("read", 1.0, [3], [5])]
    values = [(MiB, -1, 0, -1), (4096, 0, 1, 1), (4096, 1, 1, 2), (MiB, 2, 1, -1), (MiB, 3, 1, -1), (1024, 4, 1, -1)]
    return _trace(ops, values)


def _replay_evicting_a_before_its_read(sim: Simulator) -> None:
    t = sim.trace
    for v in np.flatnonzero(t.value_producer < 0):
        sim._allocate(sim.values[int(v)])
    for k in range(t.num_ops):
        if k == 4:
            sim._release(sim.values[3])
        sim._run_op(k)


def test_the_simulator_holds_a_retained_value_for_its_rerun_then_lets_it_go():
    t = _masked_rerun()
    freed = Simulator(t, 1 << 30, policy="dtr", plan="auto", device=None)
    _replay_evicting_a_before_its_read(freed)
    assert freed.recomputes == 3 and freed.retained == 0  # k, m, then a
    assert freed.values[2].state == RESIDENT  # rebuilt for the rerun, kept as the runtime's cache keeps it
    held = Simulator(t, 1 << 30, policy="dtr", plan="auto", device=None, retain={2: 4})
    _replay_evicting_a_before_its_read(held)
    assert held.recomputes == 1 and held.retained == 1  # a alone: it read m, held since op 2
    assert held.values[2].state == EVICTED  # let go after op 4
    assert held.recompute_seconds == freed.recompute_seconds - 10.0
    with pytest.raises(ValueError, match="retain must map values of the trace"):
        Simulator(t, 1 << 30, plan="auto", device=None, retain={99: 4})
    with pytest.raises(ValueError, match="retained values come from a step plan"):
        Simulator(t, 1 << 30, plan="off", device=None, retain={2: 4})


def _gpt_planned(steps):
    """The unmanaged run of ``steps`` steps of runtime_models' gpt (losses, final parameters), then
    pymem enabled for it at 0.3 of its peak, plan="auto" at fixed costs, holding up to 1 MiB (its
    values that come back after their free are 256 KiB, over budget / 1024): (that run, the budget,
    the runtime)."""
    ref = rm.run("gpt", steps)
    budget = budget_at(rm.unmanaged_peak("gpt", 2), 0.3)
    rt = pymem.enable(budget=budget, device="cpu", cost=CostModel(3e10, 7e9, 4e-6), plan="auto")
    assert rt.trace.retain_limit == budget // _C.RETAIN_SHARE
    rt.trace.retain_limit = 1 << 20
    return ref, budget, rt


def test_rebuild_holds_what_its_reruns_read_and_the_trace_keeps_the_program_deaths(managed):
    """TinyGPT (runtime_models' gpt) at 0.3 of its peak: values the program frees in the forward pass
    (dropout's masks, block outputs) come back in backward for attention's and the MLP's reruns.
    `rebuild`'s steps hold them; every step that followed its plan records the same deaths, held or
    not; training stays bitwise equal, within the budget."""
    steps = 12
    (ref_losses, ref_params), budget, rt = _gpt_planned(steps)
    try:
        step = rm.trainer("gpt", 0)
        losses, deaths, ways, retained = [], [], [], []
        for _ in range(steps):
            ways.append(rt.trace.plan_releases)  # how the step about to run is planned
            held_before = rt.trace.num_retained
            losses.append(step())
            retained.append(rt.trace.num_retained - held_before)
            last = rt.trace.last_step()
            deaths.append(last.get("value_free_at"))
        params = [p.detach().clone() for p in step.model.parameters()]
        stats = dict(pymem.memory_stats())
    finally:
        pymem.disable()
    assert_bitwise_equal("gpt trained with holds", (ref_losses, ref_params), (losses, params))
    assert stats["allocated_bytes.peak"] <= budget, stats
    held = [i for i in range(steps) if retained[i]]
    assert held and stats["plan_retained"] == sum(retained), (ways, retained)
    assert all(ways[i] == "rebuild" for i in held), (ways, retained)
    observed = [i for i in range(steps) if deaths[i] is not None]
    assert set(held) <= set(observed)
    for i in observed:  # the program's deaths, whether the plan held values or not
        assert np.array_equal(deaths[i], deaths[observed[0]]), (i, ways[i])


def test_stopping_mid_step_lets_held_values_go_and_training_goes_on_bitwise(managed):
    """pymem.disable() in the middle of a `rebuild` step, right after the forward pass took its
    holds: the holds go with the runtime, what pressure evicted comes back, and the backward pass and
    the steps after run unmanaged, bitwise equal."""
    steps = 9
    (ref_losses, ref_params), _, rt = _gpt_planned(steps)
    step = rm.trainer("gpt", 0)
    seen = []

    def stop_once_holding(module, args, out):
        if not seen and rt.trace.plan_releases == "rebuild" and rt.trace.num_retained > 0:
            seen.append(rt.trace.num_retained)
            pymem.disable()

    step.model.register_forward_hook(stop_once_holding)
    losses = [step() for _ in range(steps)]
    assert seen and not pymem.is_enabled(), "no rebuild step held values before the forward pass ended"
    params = [p.detach().clone() for p in step.model.parameters()]
    assert_bitwise_equal("gpt stopped mid-step", (ref_losses, ref_params), (losses, params))
