"""The overflow covers (csrc/plan_cover.h): from a step's trace and the budget, the cheapest values
to keep away where the step's live bytes overflow, each comeback priced with its lineage
(cover_releases) or with what its rerun rebuilds (rebuild_releases); and the step plan that tries
them against the other ways and keeps the cheapest (csrc/step_trace.h)."""
import pytest
import torch

import pymem
from pymem.cost_model import CostModel
from bitwise_harness import assert_bitwise_equal, budget_at, measure_peak, run_managed, run_unmanaged

torch.set_num_threads(2)

FIXED = CostModel(3e10, 7e9, 4e-6)
KB = 1024


def _step(ops, before=1, nbytes=KB):
    """A step's arrays: ``ops`` lists (cost, input values); op k makes one value, numbered after
    the ``before`` values made before the step (0 .. before-1). Every value is ``nbytes``."""
    s = {"op": [], "op_cost": [], "inputs_start": [0], "inputs": [], "outputs_start": [0], "outputs": [],
         "value_bytes": [nbytes] * before, "value_producer": [-1] * before, "value_recomputable": [0] * before}
    for k, (cost, ins) in enumerate(ops):
        s["op"].append(k)
        s["op_cost"].append(float(cost))
        s["inputs"] += ins
        s["inputs_start"].append(len(s["inputs"]))
        s["outputs"].append(before + k)
        s["outputs_start"].append(len(s["outputs"]))
        s["value_bytes"].append(nbytes)
        s["value_producer"].append(k)
        s["value_recomputable"].append(1)
    return s


COVERS = [pymem._C.cover_releases, pymem._C.rebuild_releases]


@pytest.mark.parametrize("cover", COVERS, ids=["lineage", "rebuild"])
def test_the_cover_keeps_the_cheapest_value_away_where_the_step_overflows(cover):
    # x (0) before the step; a = f(x) (1), b = g(a) (2), c = h(b) (3), d = k(c) (4), e = m(a, b, d) (5).
    # Live at op 3: x, a, b, c, d (5 KB); a budget of 4 KB needs a or b away across op 3.
    s = _step([(1, [0]), (10, [1]), (1, [2]), (1, [3]), (1, [1, 2, 4])])
    assert cover(s, 4 * KB) == [(1, 1)]  # a (cost 1), not b (10), after its read by op 1
    assert cover(s, 5 * KB) == []         # never over


@pytest.mark.parametrize("cover", COVERS, ids=["lineage", "rebuild"])
def test_the_cover_prices_the_inputs_a_recompute_must_redo(cover):
    # w = f(x) (1) is read once; a = g(w) (2); b = h(a) (3, cost 3); c = k(x) (4); r = m(a, b, c) (5).
    # Live at op 3: x, a, b, c (w is dead); under 3 KB, a or b is away from op 2 to op 4, and
    # recomputing a for op 4 redoes w too.
    def step(w_cost):
        return _step([(w_cost, [0]), (1, [1]), (3, [2]), (1, [0]), (1, [2, 3, 4])])

    assert cover(step(1), 3 * KB) == [(2, 2)]  # a: 1 + w's 1 < b's 3
    assert cover(step(5), 3 * KB) == [(2, 3)]  # b: 3 < a's 1 + w's 5


@pytest.mark.parametrize("cover", COVERS, ids=["lineage", "rebuild"])
def test_a_value_held_past_its_last_use_counts_until_it_dies_and_goes_after_that_use_for_free(cover):
    # x (0); a = f(x) (1, read once, by op 1); b = g(a) (2); c = h(b) (3); d = k(c) (4); e = m(b, d) (5).
    # By last uses the step peaks at 4 KB; the program holds a until op 3 (autograd frees a saved
    # tensor when its node ends, a user keeps a reference): then op 3 holds 5 KB.
    s = _step([(1, [0]), (1, [1]), (1, [2]), (1, [3]), (1, [2, 4])])
    assert cover(s, 4 * KB) == []
    held = dict(s, value_free_at=[-1, 3, 4, 3, 4, -1])
    # a goes right after its last read (op 1): nothing reads it again, so it costs no recompute.
    assert cover(held, 4 * KB) == [(1, 1)]
    assert cover(held, 5 * KB) == []


def test_rebuild_keeps_what_a_rerun_rebuilds_where_it_fits_and_releases_it_again_where_not():
    # x (0); forward a1 = f(x) (1), a2 = f(a1) (2), a3 = f(a2) (3), l = f(a3) (4); backward
    # g3 = f(l, a3) (5), g2 = f(g3, a2) (6, 0 bytes), h = f(g2) (7), h2 = f(h) (8, 0 bytes),
    # g1 = f(h2, a1) (9, 0 bytes). Under 4 KB, a1 goes after op 1 (back for op 8) and a2 after op 2
    # (back for op 5); a2's rerun there rebuilds a1.
    def step(h_bytes):
        s = _step([(1, [0]), (1, [1]), (1, [2]), (1, [3]), (1, [4, 3]), (1, [5, 2]), (1, [6]), (1, [7]), (1, [8, 1])])
        s["value_bytes"][6:10] = [0, h_bytes, 0, 0]
        return s

    # h of 2 KB leaves room: a1 stays from op 5 until g1 reads it, one rerun each.
    assert pymem._C.rebuild_releases(step(2 * KB), 4 * KB) == [(1, 1), (2, 2)]
    # h of 3 KB does not: a1 goes again right after op 5 (which does not read it) and comes back for op 8.
    assert pymem._C.rebuild_releases(step(3 * KB), 4 * KB) == [(1, 1), (2, 2), (5, 1)]
    # The lineage cover counts a1 away from op 1 to op 8 either way, and leaves the rest to the runtime.
    assert pymem._C.cover_releases(step(3 * KB), 4 * KB) == [(1, 1), (2, 2)]


@pytest.mark.parametrize("cover", COVERS, ids=["lineage", "rebuild"])
def test_a_pick_that_later_picks_made_needless_is_dropped(cover):
    # x (0); a = f(x) (1, 1 KB, cost 1), b = g(x) (2, 3 KB, cost 3.5), u = h(a, b) (3), then f (4,
    # 2 KB, no recipe), three ops, k(f) (8), w = m(a, b) (9). Under 5 KB the step overflows by 2 KB
    # from op 3 to op 7 (after u, while f lives), where a and b wait for op 8. Greedy takes a first
    # (1 KB over five ops per second, against b's 2 KB per 3.5 seconds), still 1 KB short, then b,
    # which alone covers all of it with room to spare: a is dropped, its recompute saved.
    s = _step([(1, [0]), (3.5, [0]), (1, [1, 2]), (1, [0]), (1, [0]), (1, [0]), (1, [0]), (1, [4]), (1, [1, 2])])
    s["value_bytes"] = [KB, KB, 3 * KB, 0, 2 * KB, 0, 0, 0, 0, 0]
    s["value_recomputable"][4] = 0
    assert cover(s, 5 * KB) == [(2, 2)]
    # Under 4 KB, b alone would leave the step at the budget exactly, with none of the 3% slack a
    # drop must leave for placement: both stay.
    assert {(2, 1), (2, 2)} <= set(cover(s, 4 * KB))


@pytest.mark.parametrize("cover", COVERS, ids=["lineage", "rebuild"])
def test_bad_step_arrays_are_a_clear_error(cover):
    s = _step([(1, [0]), (1, [1])])
    s["inputs"][0] = 7
    with pytest.raises(ValueError, match=r"bad step arrays: inputs and outputs must be value indices"):
        cover(s, KB)
    s = _step([(1, [0])])
    s["op_cost"].append(1.0)
    with pytest.raises(ValueError, match=r"bad step arrays: op_cost needs one entry per op"):
        cover(s, KB)
    s = _step([(1, [0])])
    with pytest.raises(ValueError, match=r"value_free_at, when given, needs one entry per value"):
        cover(dict(s, value_free_at=[-1]), KB)
    with pytest.raises(ValueError, match=r"value_free_at must be an op position or -1"):
        cover(dict(s, value_free_at=[-1, 1]), KB)
    with pytest.raises(ValueError, match=r"op_transient, when given, needs one entry per op"):
        cover(dict(s, op_transient=[0, 0]), KB)
    with pytest.raises(ValueError, match=r"op_transient must be between 0 and 2\*\*48"):
        cover(dict(s, op_transient=[-1]), KB)


@pytest.mark.parametrize("cover", COVERS, ids=["lineage", "rebuild"])
def test_an_ops_temporaries_count_at_that_op(cover):
    # x (0); ops 0-3 make a = f(x) (1), b = g(a) (2), c = h(b) (3), d = k(a, c) (4). At most 4 KB
    # are live (at op 2: x, a, b, c): no overflow under 4 KB, until op 2's kernel takes 1 KB of
    # workspace beside them. Then a, read again by op 3, is away across op 2 (b and c are op 2's own).
    s = _step([(1, [0]), (5, [1]), (1, [2]), (1, [1, 3])])
    assert cover(s, 4 * KB) == []
    assert cover(dict(s, op_transient=[0, 0, KB, 0]), 4 * KB) == [(1, 1)]
    assert cover(dict(s, op_transient=[0, 0, KB // 2, 0]), 4 * KB + KB // 2) == []


def test_a_cover_plan_trains_bitwise_equal_in_budget_and_repeats(managed):
    """Through the trials of each way of planning (csrc/plan_choice.h), the cover's two among them:
    the cover's values are released at their last forward use (with evicted readers, which it priced) and recomputed
    in backward bitwise; with fixed costs two runs decide alike. The steps' large blocks take the
    offsets the step before planned for them (csrc/step_placement.h) and place alike too."""
    import runtime_models as rm

    steps = 8
    ref_out, ref_state, _ = run_unmanaged(lambda: rm.trainer("gpt"), steps)
    budget = budget_at(measure_peak(lambda: rm.trainer("gpt"), steps), 0.5)
    runs = [run_managed(lambda: rm.trainer("gpt"), steps, budget, cost=FIXED, plan="auto") for _ in range(2)]
    for out, state, stats, _, _ in runs:
        assert_bitwise_equal("losses", ref_out, out)
        assert_bitwise_equal("parameters", ref_state, state)
        assert stats["allocated_bytes.peak"] <= budget
        assert stats["plan_cover_steps"] >= 2 and stats["num_planned_releases"] > 0, stats
        assert stats["num_placed_as_planned"] > 0, stats
    keys = ("num_evictions", "num_rematerializations", "num_planned_releases", "plan_cover_steps", "moved_bytes",
            "num_placed_as_planned", "num_displaced_from_plan")
    assert [runs[0][2][k] for k in keys] == [runs[1][2][k] for k in keys]


def test_the_step_placement_is_on_with_the_plan_and_off_without(managed):
    rt = pymem.enable(budget="64MB", device="cpu", plan="auto")
    assert rt.arena.step_placement
    pymem.disable()
    rt = pymem.enable(budget="64MB", device="cpu", plan="off")
    assert not rt.arena.step_placement
    assert pymem.memory_stats()["num_placed_as_planned"] == 0


def test_a_step_planned_another_way_than_the_one_before_is_placed_by_best_fit(managed):
    """The step placement's offsets come from the step before only where it was planned the same
    way, or unplanned (csrc/step_placement.h): through the trials of the ways, each way's first
    step but the first planned one places no block at a planned offset, and its second places them
    from the first."""
    import runtime_models as rm

    budget = budget_at(measure_peak(lambda: rm.trainer("gpt"), 2), 0.5)
    rt = pymem.enable(budget=budget, device="cpu", cost=FIXED, plan="auto")
    step = rm.trainer("gpt")
    before, placed = None, []
    for _ in range(pymem._C.PlanChoice.TRIAL_STEPS + 2):
        way = rt.trace.plan_releases if rt.trace.following else None
        n = pymem.memory_stats()["num_placed_as_planned"]
        step()
        placed.append((before, way, pymem.memory_stats()["num_placed_as_planned"] - n))
        before = way
    switched = [p for b, w, p in placed if b is not None and w != b]
    carried = [p for b, w, p in placed if w is not None and (w == b or b is None)]
    assert len(switched) >= 4 and len(carried) >= 5, placed  # the trials: every way twice
    assert all(p == 0 for p in switched) and all(p > 0 for p in carried), placed


def test_offloading_keeps_the_learned_plan(managed):
    rt = pymem.enable(budget="64MB", device="cpu", cost=FIXED, plan="auto", offload="always")
    assert rt.trace.budget == 0  # the cover prices recomputes only
    pymem.disable()
    rt = pymem.enable(budget="64MB", device="cpu", cost=FIXED, plan="auto")
    assert rt.trace.budget == rt.budget - rt.arena.small_region_size > 0  # the main region's bytes


def test_a_cover_step_releases_the_covers_picks_where_it_planned_them(managed):
    """In a step that follows a cover plan (either cover), the values it picked leave memory right
    after the op it planned (the trace lists each release at the position after that op), where the
    step reads them again. (With observed deaths a cover also picks tails, values the program
    holds a few ops past their last read; one a rerun just brought back may stay until it dies.)"""
    import runtime_models as rm

    budget = budget_at(measure_peak(lambda: rm.trainer("gpt"), 2), 0.5)
    rt = pymem.enable(budget=budget, device="cpu", cost=FIXED, plan="auto")
    step = rm.trainer("gpt")
    checked = {}
    for _ in range(pymem._C.PlanChoice.TRIAL_STEPS + 2):
        way = rt.trace.plan_releases
        covering = way in ("cover", "rebuild")
        cover = pymem._C.cover_releases if way == "cover" else pymem._C.rebuild_releases
        picks = cover(rt.trace.last_step(), rt.trace.budget) if covering else []
        step()
        if covering:
            s = rt.trace.last_step()
            released = set(zip(s["released_at"].tolist(), s["released_value"].tolist()))
            read_at = {}
            for k in range(len(s["op"])):
                for v in s["inputs"][s["inputs_start"][k]:s["inputs_start"][k + 1]].tolist():
                    read_at.setdefault(v, []).append(k)
            needed = [(at, v) for at, v in picks if any(k > at for k in read_at.get(v, []))]
            assert needed and {(at + 1, v) for at, v in needed} <= released, (way, needed, released)
            checked[way] = checked.get(way, 0) + 1
    assert checked == {"cover": 2, "rebuild": 2}


def test_a_value_the_plan_releases_twice_leaves_memory_both_times(managed):
    """A cover may release a value, bring it back for a read, and release it again after that
    read (its tail, or a second gap). The step trace watches the value's record for every one of
    them: it once stopped at the first, so each second release was left to pressure."""
    import collections
    import runtime_models as rm

    budget = budget_at(measure_peak(lambda: rm.trainer("gpt"), 2), 0.5)
    rt = pymem.enable(budget=budget, device="cpu", cost=FIXED, plan="auto")
    step = rm.trainer("gpt")
    checked = 0
    for _ in range(pymem._C.PlanChoice.TRIAL_STEPS + 2):
        way = rt.trace.plan_releases
        cover = {"cover": pymem._C.cover_releases, "rebuild": pymem._C.rebuild_releases}.get(way)
        picks = cover(rt.trace.last_step(), rt.trace.budget) if cover else []
        step()
        if not cover:
            continue
        s = rt.trace.last_step()
        released = set(zip(s["released_at"].tolist(), s["released_value"].tolist()))
        back = collections.defaultdict(list)
        for at, v in zip(s["back_at"].tolist(), s["back_value"].tolist()):
            back[v].append(at)
        by_value = collections.defaultdict(list)
        for at, v in picks:
            by_value[v].append(at)
        # The second of two picks of a value that came back in between (resident then).
        again = [(ats[1], v) for v, ats in by_value.items() if len(ats) > 1 and any(ats[0] < b <= ats[1] for b in back[v])]
        assert again and {(at + 1, v) for at, v in again} <= released, (way, again)
        checked += 1
    assert checked == 4  # both covers' trial steps


def test_the_lineage_cover_keeps_the_cheapest_of_its_covers_of_slightly_less_memory():
    """bench/milp_optimum.py's 6-layer MLP at 0.6 of its peak: greedy at the budget itself releases
    layer 4's output, whose rerun replays the chain from the input (7 layer reruns in all); its
    cover of 0.98 of the budget keeps it and releases layer 5's, as the release-only optimum does
    (6 reruns). The lineage prices of the whole plans tell them apart."""
    from pymem.sim.capture import capture
    from pymem.sim.plan import step_arrays
    from pymem.sim.replay import _op_seconds

    with torch.device("meta"):
        net = torch.nn.Sequential(*[m for _ in range(6) for m in (torch.nn.Linear(1024, 1024), torch.nn.Tanh())])
        x = torch.randn(8192, 1024)

    def train_step():
        net.zero_grad(set_to_none=True)
        net(x).square().mean().backward()

    train_step()
    trace = capture(train_step)
    step = step_arrays(trace, _op_seconds(trace, "h100"))
    tanh = [int(trace.op_outputs(k)[0]) for k in range(trace.num_ops) if trace.op_name(k) == "aten.tanh.default"]
    released = {v for _, v in pymem._C.cover_releases(step, int(0.6 * trace.peak_bytes()))}
    assert tanh[4] in released and tanh[3] not in released  # layer 5's output away, layer 4's kept


def test_the_covers_plan_for_the_main_region_so_the_step_releases_only_what_they_planned():
    """A one-layer TinyGPT at 0.8 of its peak: planned for the whole budget, the cover counted the
    small region's bytes (budget / 256) as room for its large values, and the step ran short by
    less than that; the pressure handler then released 8 values unplanned, among them attention's
    softmax, whose rerun redid the scores and the causal mask (0.076 ms of recompute). Planned for
    the main region, every release is the plan's (0.043 ms)."""
    from pymem.demo_models import TinyGPT
    from pymem.sim.capture import capture
    from pymem.sim.replay import simulate

    with torch.device("meta"):
        model = TinyGPT(vocab=512, d=256, heads=4, layers=1, seq=256)
        idx = torch.randint(0, 512, (8, 256))
    model.eval()  # no dropout: the same step as bench/milp_optimum.py's transformer

    def train_step():
        model.zero_grad(set_to_none=True)
        logits = model(idx[:, :-1])
        torch.nn.functional.cross_entropy(logits.reshape(-1, 512), idx[:, 1:].reshape(-1)).backward()

    train_step()
    trace = capture(train_step)
    out = simulate(trace, int(0.8 * trace.peak_bytes()), policy="dtr", plan="auto", device="h100")
    assert out["status"] == "ok" and out["plan_releases"] in ("cover", "rebuild"), out
    assert out["evictions"] == out["planned_releases"] > 0, out


def _dropout_step(blank):
    """x (0) before the step; a = costly(x) (1, cost 10); m0 = empty_like(a) (2); m1 = bernoulli_(m0)
    (3: in place over m0, which it reads not when ``blank``); y = a * m1 (4; a dies here);
    z = other(x) (5, cost 5); big(x) (6) overflows a 4.5 KB budget by 512 B; then op 6 reads m1, z
    and y. One of m1, y or z is away across op 5, back for op 6, with a dead by then."""
    s = _step([(10, [0]), (0.001, [1]), (1, [2]), (0.1, [1, 3]), (5, [0]), (1, [0]), (1, [3, 5, 4])])
    s["value_bytes"][7] = 1  # op 6's output: 512 B aligned
    s["value_free_at"] = [-1, 3, 1, 6, 6, 6, 5, -1]
    s["value_overwrites"] = [-1, -1, -1, 2, -1, -1, -1, -1]
    s["value_blank_rerun"] = [0, 0, 0, int(blank), 0, 0, 0, 0]
    return s


@pytest.mark.parametrize("cover", COVERS, ids=["lineage", "rebuild"])
def test_a_mask_made_over_a_blank_buffer_comes_back_without_the_activation_it_was_shaped_from(cover):
    budget = 4 * KB + 512
    # Read, the overwritten m0 is dead at op 6, and so is a: m1's rerun would redo both (11.001);
    # z (5) is cheaper. Blank (bernoulli_ never reads it, as the runtime's recipe has it): 1.
    assert cover(_dropout_step(blank=False), budget) == [(4, 5)]
    assert cover(_dropout_step(blank=True), budget) == [(3, 3)]
    no_flags = {k: v for k, v in _dropout_step(blank=True).items() if k != "value_blank_rerun"}
    assert cover(no_flags, budget) == [(4, 5)]  # not known: every rerun reads what it overwrote


def test_a_blank_rerun_flag_is_only_taken_where_a_value_was_overwritten():
    s = _dropout_step(blank=True)
    with pytest.raises(ValueError, match="value_blank_rerun must be 0 or 1, and 1 only where value_overwrites"):
        pymem._C.cover_releases(dict(s, value_blank_rerun=[0, 0, 0, 0, 1, 0, 0, 0]), KB)
    with pytest.raises(ValueError, match="value_blank_rerun, when given, needs one entry per value"):
        pymem._C.rebuild_releases(dict(s, value_blank_rerun=[0, 1]), KB)
