"""How each step is planned (csrc/plan_choice.h): learned or cover, by the memory work the steps
that followed each cost; and the learned plan's releases as ``_C.learned_releases`` gives them to
the simulator (csrc/step_plan.h)."""
import pytest

import pymem
from test_plan_cover import _step


def _choices(costs, steps=12, cover_allowed=True):
    """The ways PlanChoice picks over ``steps`` steps, each step measured at costs[way]."""
    c, out = pymem._C.PlanChoice(), []
    for _ in range(steps):
        how = c.next(cover_allowed)
        out.append(how)
        c.measured(how, costs[how])
    return out


def test_each_way_is_tried_twice_then_the_cheaper_runs_with_a_probe_every_five_steps():
    assert _choices({"learned": 1.0, "cover": 2.0}) == \
        ["learned"] * 2 + ["cover"] * 2 + ["learned"] * 5 + ["cover"] + ["learned"] * 2
    assert _choices({"learned": 2.0, "cover": 1.0}) == \
        ["learned"] * 2 + ["cover"] * 2 + ["cover"] * 5 + ["learned"] + ["cover"] * 2


def test_a_tie_within_five_percent_goes_to_the_cover():
    assert _choices({"learned": 1.0, "cover": 1.05}, steps=6)[4:] == ["cover", "cover"]
    assert _choices({"learned": 1.0, "cover": 1.06}, steps=6)[4:] == ["learned", "learned"]


def test_without_a_budget_to_cover_every_step_is_learned():
    assert _choices({"learned": 9.0, "cover": 1.0}, cover_allowed=False) == ["learned"] * 12


def test_reset_starts_the_trials_over():
    c = pymem._C.PlanChoice()
    for _ in range(6):
        c.measured(c.next(True), 1.0)
    c.reset()
    assert [c.next(True) for _ in range(1)] == ["learned"]


def test_a_bad_way_is_a_clear_error():
    with pytest.raises(ValueError, match="'learned' or 'cover', got 'greedy'"):
        pymem._C.PlanChoice().measured("greedy", 1.0)


def _chain(n):
    """x (0) before the step; value k+1 = f(value k) for k < n; then one op reads value 1 again."""
    return _step([(1, [k]) for k in range(n)] + [(1, [1])])


def test_learned_releases_move_a_release_to_the_last_use_before_it():
    s = _chain(8)  # value 1 is read by op 1, then by op 8
    released = {"released_at": [5], "released_value": [1], "back_at": [], "back_value": []}
    assert pymem._C.learned_releases(s, released) == [(1, 1)]  # right after op 1, not at op 5
    # Brought back between (a recompute read it): it is needed where the plan sees no use.
    came_back = dict(released, back_at=[6], back_value=[1])
    assert pymem._C.learned_releases(s, came_back) == []
    # A short stretch (from its producer to its read by op 1: under a quarter of the step) is left
    # to pressure.
    assert pymem._C.learned_releases(s, dict(released, released_at=[1])) == []


def test_comeback_cost_prices_each_comeback_at_its_producer():
    s = _chain(4)
    s["op_cost"][2] = 5.0  # value 3's producer
    assert pymem._C.comeback_cost(dict(s, back_at=[4, 4], back_value=[3, 1])) == 6.0
    with pytest.raises(KeyError, match="the step has no 'back_at'"):
        pymem._C.comeback_cost(s)
    with pytest.raises(ValueError, match="one entry each per event"):
        pymem._C.learned_releases(s, {"released_at": [1], "released_value": [], "back_at": [], "back_value": []})
