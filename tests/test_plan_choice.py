"""How each step is planned (csrc/plan_choice.h): learned, cover, rebuild (the covers of
csrc/plan_cover.h), belady (next uses only) or greedy (the policy alone), by the memory work the
steps that followed each cost; and the learned plan's releases as ``_C.learned_releases`` gives
them to the simulator (csrc/step_plan.h)."""
import itertools

import pytest

import pymem
from test_plan_cover import _step

WAYS = ["learned", "cover", "rebuild", "belady", "greedy"]
TRIALS = [w for w in WAYS for _ in range(2)]  # each way twice, in turn


def _choices(costs, steps=len(TRIALS) + 6, cover_allowed=True, c=None):
    """The ways PlanChoice ``c`` (a fresh one by default) picks over ``steps`` steps, each step
    measured at costs[way]."""
    c, out = c or pymem._C.PlanChoice(), []
    for _ in range(steps):
        how = c.next(cover_allowed)
        out.append(how)
        c.measured(how, costs[how])
    return out


def _runs(ways):
    """[(way, steps in a row)] of a sequence of ways."""
    return [(w, len(list(g))) for w, g in itertools.groupby(ways)]


def test_each_way_is_tried_twice_then_the_cheapest_runs_with_probes_of_the_others_ever_further_apart():
    """Two steps of another way after five of the cheapest; each probe that loses doubles the wait
    for the next turn, up to 64 steps (a probe and the step back after it move what the other way
    left: they carried the mean moves at 0.3 of the peak, bench/plan_ways.py)."""
    assert pymem._C.PlanChoice.TRIAL_STEPS == len(TRIALS)
    costs = {"learned": 1.2, "cover": 1.3, "rebuild": 1.35, "belady": 1.4, "greedy": 1.0}
    # The probes measure the other ways in turn (the cheapest skipped), two steps each: the second
    # follows a step run the same way.
    got = _choices(costs, steps=len(TRIALS) + 400)
    assert got[:len(TRIALS)] == TRIALS
    assert _runs(got[len(TRIALS):]) == [
        ("greedy", 5), ("learned", 2), ("greedy", 10), ("cover", 2), ("greedy", 20), ("rebuild", 2),
        ("greedy", 40), ("belady", 2), ("greedy", 64), ("learned", 2), ("greedy", 64), ("cover", 2),
        ("greedy", 64), ("rebuild", 2), ("greedy", 64), ("belady", 2), ("greedy", 53)]
    for cheapest in WAYS:
        costs = {w: 1.0 if w == cheapest else 1.2 for w in WAYS}
        assert _choices(costs)[len(TRIALS):len(TRIALS) + 5] == [cheapest] * 5


def test_a_change_of_the_cheapest_brings_the_probes_back_to_every_five_steps():
    """The program got cheaper to run another way: the probe that finds it takes over, and the
    turns after it come every five steps again, as they do when the cheapest's own measure rises
    over another's."""
    costs = {"learned": 1.2, "cover": 1.3, "rebuild": 1.35, "belady": 1.4, "greedy": 1.0}
    c = pymem._C.PlanChoice()
    seen = _choices(costs, len(TRIALS) + 5 + 2 + 10 + 2, c=c)  # probes of learned, then of cover (both lose)
    costs["rebuild"] = 0.8
    seen += _choices(costs, 20 + 2 + 5 + 2, c=c)
    assert _runs(seen[len(TRIALS):]) == [("greedy", 5), ("learned", 2), ("greedy", 10), ("cover", 2),
                                          ("greedy", 20), ("rebuild", 7), ("belady", 2)]
    costs["rebuild"] = 2.0  # its own steps got dearer: greedy again, probed every five steps
    assert _runs(_choices(costs, 1 + 1 + 5 + 2, c=c)) == [("rebuild", 2), ("greedy", 5), ("learned", 2)]


def test_only_a_step_after_one_run_the_same_way_updates_its_measure():
    """The first step after a switch pays for what the other way left (the step placement's plan
    is the other way's): past the trials it changes nothing; the second step run that way does."""
    c = pymem._C.PlanChoice()
    costs = {"learned": 2.0, "cover": 1.0, "rebuild": 3.0, "belady": 3.0, "greedy": 3.0}
    for _ in range(len(TRIALS)):
        how = c.next(True)
        c.measured(how, costs[how])
    assert c.next(True) == "cover"
    c.measured("cover", 9.0)  # after greedy's trial: a switch, not cover's own cost
    assert c.next(True) == "cover"
    c.measured("cover", 9.0)  # after cover: its cost now
    assert c.next(True) == "learned"


def test_a_ways_moves_count_by_their_mean_over_its_last_three_steady_steps():
    """Which blocks compaction moves turns on where pressure found them: one step's moves do not
    make a way dearer than another at once; three such steps in a row do."""
    c = pymem._C.PlanChoice()
    comeback = {"learned": 1.2, "cover": 2.0, "rebuild": 1.0, "belady": 2.0, "greedy": 2.0}
    for _ in range(len(TRIALS)):
        how = c.next(True)
        c.measured(how, comeback[how], 0.1)
    ran = []
    for moves in (0.1, 0.4, 0.4, 0.4):  # the first, after greedy's trial, measures nothing
        how = c.next(True)
        ran.append(how)
        c.measured(how, comeback[how], moves)
    # rebuild's measure after each: 1.1 (its trial's), 1.25, 1.3 (a cover within 5% of learned's
    # 1.2 + 0.1), 1.4; by its latest moves alone it read 1.4 after the second step.
    assert ran == ["rebuild"] * 4
    assert c.next(True) == "learned"


def _probes(ways):
    """The probes past the trials of a run whose cheapest way is greedy: [(way, steps)]."""
    return [(w, n) for w, n in _runs(ways[len(TRIALS):]) if w != "greedy"]


def test_a_way_far_behind_sits_out_probe_turns_twice_as_many_each_time():
    """A probe measuring over 1.5x the cheapest: its way sits out its next turn, then two, four,
    up to eight; one measuring near brings it back to every turn."""
    costs = {"learned": 1.2, "cover": 1.3, "rebuild": 1.3, "belady": 1.4, "greedy": 1.0}
    probes = _probes(_choices(dict(costs, belady=1.6), steps=len(TRIALS) + 1000))
    assert all(n == 2 for _, n in probes)  # two steps each
    # belady's turns: probed (far), sits out 1, probed (far), sits out 2, probed, sits out 4 ...
    assert [w for w, _ in probes[:15]] == ["learned", "cover", "rebuild", "belady", "learned", "cover", "rebuild",
                                           "learned", "cover", "rebuild", "belady", "learned", "cover", "rebuild",
                                           "learned"]
    c = pymem._C.PlanChoice()
    way_costs = dict(costs, belady=1.6)
    seen = []
    for step in range(len(TRIALS) + 800):
        how = c.next(True)
        if how == "belady" and step >= len(TRIALS):
            way_costs["belady"] = 1.1  # the program changed its mind: near again
        seen.append(how)
        c.measured(how, way_costs[how])
    assert [w for w, _ in _probes(seen)[:8]] == ["learned", "cover", "rebuild", "belady",
                                                 "learned", "cover", "rebuild", "belady"]


def test_every_other_way_sitting_out_leaves_the_cheapest_running():
    costs = {"learned": 3.0, "cover": 3.0, "rebuild": 3.0, "belady": 3.0, "greedy": 1.0}
    got = _choices(costs, steps=len(TRIALS) + 300)[len(TRIALS):]
    # Each sits its next turn out: the turn 64 steps after belady's probe probes nothing, the one
    # after it (64 steps on) probes learned again.
    assert _runs(got) == [("greedy", 5), ("learned", 2), ("greedy", 10), ("cover", 2), ("greedy", 20),
                          ("rebuild", 2), ("greedy", 40), ("belady", 2), ("greedy", 64 + 1 + 64),
                          ("learned", 2), ("greedy", 64), ("cover", 2), ("greedy", 20)]


def test_a_probe_whose_first_step_left_its_plan_is_given_up():
    """A probe step not measured (it diverged): the next step is the cheapest's again."""
    c, costs = pymem._C.PlanChoice(), {"learned": 2.0, "cover": 3.0, "rebuild": 3.0, "belady": 4.0, "greedy": 1.0}
    for _ in range(len(TRIALS) + 5):
        how = c.next(True)
        c.measured(how, costs[how])
    assert c.next(True) == "learned"  # not measured
    assert c.next(True) == "greedy"


def test_a_probe_that_measures_cheaper_takes_over():
    c, costs = pymem._C.PlanChoice(), {"learned": 2.0, "cover": 3.0, "rebuild": 3.0, "belady": 4.0, "greedy": 1.0}
    for _ in range(len(TRIALS) + 5):
        how = c.next(True)
        c.measured(how, costs[how])
    for _ in range(2):  # the probe's two steps: the second measures the way
        probe = c.next(True)
        assert probe == "learned"
        c.measured(probe, 0.5)  # the program got cheaper to run the learned way
    assert c.next(True) == "learned"


def test_a_tie_within_five_percent_of_the_cheapest_goes_to_the_cheaper_cover():
    n = len(TRIALS)

    def settled(**costs):
        return _choices(dict({"learned": 2.0, "cover": 2.0, "rebuild": 2.0, "belady": 2.0, "greedy": 2.0}, **costs),
                        steps=n + 2)[n:]

    assert settled(learned=1.0, cover=1.05) == ["cover"] * 2
    assert settled(learned=1.0, cover=1.06) == ["learned"] * 2
    assert settled(greedy=1.0, cover=1.04) == ["cover"] * 2
    assert settled(learned=1.0, rebuild=1.05) == ["rebuild"] * 2
    assert settled(learned=1.0, cover=1.04, rebuild=1.02) == ["rebuild"] * 2
    assert settled(cover=1.0, rebuild=1.02) == ["cover"] * 2


def test_without_a_budget_to_cover_every_step_is_learned():
    assert _choices({"learned": 9.0, "cover": 1.0, "rebuild": 1.0, "belady": 1.0, "greedy": 1.0},
                    cover_allowed=False) == ["learned"] * (len(TRIALS) + 6)


def test_reset_starts_the_trials_over():
    c = pymem._C.PlanChoice()
    for _ in range(len(TRIALS) + 2):
        c.measured(c.next(True), 1.0)
    c.reset()
    assert [c.next(True) for _ in range(1)] == ["learned"]


def test_a_bad_way_is_a_clear_error():
    with pytest.raises(ValueError, match="'learned', 'cover', 'rebuild', 'belady' or 'greedy', got 'fastest'"):
        pymem._C.PlanChoice().measured("fastest", 1.0)


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


def test_every_way_trains_bitwise_in_budget_and_only_the_plans_release_early(managed):
    """A run through the trials and past them: each of the five ways plans some step; the learned
    plan and the covers release early, belady and greedy do not, and greedy leaves pressure to the
    policy alone (no release is chosen by the plan's next uses); training stays bitwise."""
    import runtime_models as rm
    from bitwise_harness import assert_bitwise_equal, budget_at, measure_peak, run_unmanaged, state_of
    from test_plan_cover import FIXED

    steps = pymem._C.PlanChoice.TRIAL_STEPS + 4
    ref_out, ref_state, _ = run_unmanaged(lambda: rm.trainer("gpt"), steps)
    budget = budget_at(measure_peak(lambda: rm.trainer("gpt"), steps), 0.5)
    rt = pymem.enable(budget=budget, device="cpu", cost=FIXED, plan="auto")
    step, outs, seen = rm.trainer("gpt"), [], {}
    for _ in range(steps):
        way = rt.trace.plan_releases
        assert rt.trace.covering == (way in ("cover", "rebuild"))  # evicted readers priced: released anyway
        before = pymem.memory_stats()
        outs.append(step())
        after = pymem.memory_stats()
        delta = {k: after[k] - before[k] for k in ("num_planned_releases", "plan_hits", "num_evictions")}
        seen.setdefault(way, []).append(delta)
    state = [t.clone() for t in state_of(step.model)]
    assert after["allocated_bytes.peak"] <= budget
    pymem.disable()
    assert_bitwise_equal("losses", ref_out, outs)
    assert_bitwise_equal("parameters", ref_state, state)
    assert set(WAYS) <= set(seen), seen
    assert any(d["num_planned_releases"] > 0 for w in ("learned", "cover", "rebuild") for d in seen[w]), seen
    for w in ("belady", "greedy"):
        assert all(d["num_planned_releases"] == 0 for d in seen[w]), seen
        assert all(d["num_evictions"] > 0 for d in seen[w]), seen  # under pressure all the same
    assert all(d["plan_hits"] == 0 for d in seen["greedy"]) and any(d["plan_hits"] > 0 for d in seen["belady"]), seen
