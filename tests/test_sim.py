"""The simulator (pymem.sim, issue 16): capture on meta, the trace format, replay through the
policies and the virtual arena, the simrd reader, the GPU cost model's arithmetic, and a step
recorded by the runtime replaying with the runtime's own release decisions."""
import json
import math
import os
import re

import numpy as np
import pytest
import torch

import pymem
from pymem import cli
from pymem.cost_model import CostModel
from pymem.gpus import LAUNCH_SECONDS, gpu_spec
from pymem.sim import Trace, TraceError, capture, from_step_arrays
from pymem.runtime.swap import latest_start
from pymem.sim.replay import EVICTED, RESIDENT, Simulator, _op_seconds, simulate
from pymem.sim.simrd import load_simrd, read_simrd

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "simrd_small.log")
MiB = 1 << 20


def _trace(ops, values, backward_at=-1):
    """A hand-written Trace. ops: [(name, cost, [inputs], [outputs])];
    values: [(bytes, producer, recomputable, free_at)]."""
    ins = [list(o[2]) for o in ops]
    outs = [list(o[3]) for o in ops]
    names = sorted({o[0] for o in ops})
    n, m = len(ops), len(values)
    starts = lambda xs: np.concatenate([[0], np.cumsum([len(x) for x in xs])]).astype(np.int64)  # noqa: E731
    t = Trace(op_names=names, op=np.array([names.index(o[0]) for o in ops], np.int32),
              op_flops=np.zeros(n, np.int64), op_bytes=np.zeros(n, np.int64), op_fp32=np.zeros(n, np.uint8),
              op_kernel=np.ones(n, np.uint8), op_cost=np.array([o[1] for o in ops], np.float64),
              inputs_start=starts(ins), inputs=np.array([v for x in ins for v in x], np.int32),
              outputs_start=starts(outs), outputs=np.array([v for x in outs for v in x], np.int32),
              value_bytes=np.array([v[0] for v in values], np.int64),
              value_producer=np.array([v[1] for v in values], np.int32),
              value_recomputable=np.array([v[2] for v in values], np.uint8),
              value_free_at=np.array([v[3] for v in values], np.int32),
              value_overwrites=np.full(m, -1, np.int32), backward_at=backward_at)
    t.check()
    return t


def _cheap_and_costly():
    """x (a leaf) -> A (cost 1) and B (cost 10); D (cost 1) is a temporary that needs a fourth
    block while x, A and B are resident; then E reads A and B. The only release that helps is A or
    B, and the right one is A: recomputing it costs 1, B 10."""
    ops = [("cheap", 1.0, [0], [1]), ("costly", 10.0, [0], [2]), ("temp", 1.0, [0], [3]),
           ("sum", 1.0, [1, 2], [4])]
    values = [(MiB, -1, 0, -1), (MiB, 0, 1, 3), (MiB, 1, 1, 3), (MiB, 2, 1, 2), (1024, 3, 1, -1)]
    return _trace(ops, values)


# --- replay ---------------------------------------------------------------------------------
def test_infinite_budget_gives_overhead_one():
    t = _cheap_and_costly()
    out = simulate(t, 1 << 30, device=None)
    assert out["status"] == "ok" and out["overhead"] == 1.0
    assert out["evictions"] == out["offloads"] == 0 and out["recompute_seconds"] == 0.0
    assert out["peak_bytes"] == t.peak_bytes() == 4 * MiB  # x, A, B and D while D is made, as unmanaged


@pytest.mark.parametrize("policy", ["dtr", "dtr-chain", "msps", "lru", "coop"])
def test_known_optimal_release(policy):
    # 4 MiB: the small region (budget/256) leaves room for three 1 MiB blocks in the main region, not four.
    out = simulate(_cheap_and_costly(), 4 * MiB, policy=policy, device=None)
    assert out["status"] == "ok"
    assert out["evictions"] == 1 and out["recompute_seconds"] == 1.0  # A went, and came back once
    assert out["overhead"] == pytest.approx(14.0 / 13.0)
    assert out["peak_bytes"] <= out["budget_bytes"] == 4 * MiB


def test_too_small_a_budget_is_oom_with_the_reason():
    out = simulate(_cheap_and_costly(), 2 * MiB, device=None)
    assert out["status"] == "oom" and out["overhead"] is None
    assert "out of budget" in out["error"]


def test_thrash_above_twice_the_step():
    # A chain of 12 read back from its end, one value at a time (as a backward pass reads its
    # forward): in four blocks each read recomputes the chain from the last value kept.
    k = 12
    ops = [("f", 1.0, [i], [i + 1]) for i in range(k)] + [("b", 1.0, [k - j], [k + 1 + j]) for j in range(k)]
    values = [(MiB, -1, 0, -1)] + [(MiB, i, 1, 2 * k - i - 1) for i in range(k)] + \
        [(1024, k + j, 1, -1) for j in range(k)]
    out = simulate(_trace(ops, values), 4 * MiB, policy="lru", device=None)
    assert out["status"] == "thrash" and out["recomputes"] == 30
    assert out["overhead"] == pytest.approx((24.0 + 30.0) / 24.0)


def test_reading_more_than_the_budget_at_once_is_oom():
    # The last op reads all twelve values at once: 12 MiB in a 4 MiB budget.
    k = 12
    ops = [("f", 1.0, [i], [i + 1]) for i in range(k)] + [("g", 1.0, list(range(1, k + 1)), [k + 1])]
    values = [(MiB, -1, 0, -1)] + [(MiB, i, 1, k) for i in range(k)] + [(1024, k, 1, -1)]
    out = simulate(_trace(ops, values), 4 * MiB, policy="lru", device=None)
    assert out["status"] == "oom" and out["ops_run"] == k and "out of budget" in out["error"]


def test_replay_is_deterministic():
    t = _cheap_and_costly()
    assert simulate(t, 4 * MiB, device=None) == simulate(t, 4 * MiB, device=None)


def test_offloading_a_leaf_copies_it_out_and_back():
    # x is a leaf: with offloading off nothing can make room for D; with it on, x goes to the host.
    ops = [("a", 1.0, [0], [1]), ("b", 1.0, [1], [2]), ("c", 1.0, [1, 2], [3]), ("d", 1.0, [0, 3], [4])]
    values = [(MiB, -1, 0, -1), (MiB, 0, 0, -1), (MiB, 1, 0, -1), (MiB, 2, 0, -1), (1024, 3, 1, -1)]
    t = _trace(ops, values)
    assert simulate(t, 4 * MiB, device=None)["status"] == "oom"
    out = simulate(t, 4 * MiB, device=None, offload="always", link_bytes_per_s=MiB)  # 1 s per copy
    assert out["status"] == "ok" and out["offloads"] >= 1
    assert out["copies_back"] >= 1 and 2.0 <= out["copy_seconds_exposed"] <= 2.0 * out["offloads"]
    assert out["overhead"] == pytest.approx((4.0 + out["copy_seconds_exposed"]) / 4.0)


def test_bad_arguments_are_refused():
    t = _cheap_and_costly()
    with pytest.raises(ValueError, match="unknown policy 'nope'"):
        Simulator(t, 4 * MiB, policy="nope", device=None)
    with pytest.raises(ValueError, match="plan must be"):
        Simulator(t, 4 * MiB, plan="yes", device=None)
    with pytest.raises(ValueError, match="positive number of bytes"):
        Simulator(t, 0, device=None)
    captured = Trace(**{**t.__dict__, "op_cost": np.full(t.num_ops, np.nan)})
    with pytest.raises(ValueError, match="recorded no op costs"):
        Simulator(captured, 4 * MiB, device=None)


def test_a_compaction_is_priced_as_a_copy_on_the_device():
    # x, a, b, c in a row; a and c die; a 2 MiB value then fits only once b moves (all are leaves:
    # nothing can be released). On an H100 a move costs a launch plus its bytes read and written.
    ops = [("mk", 1.0, [0], [1]), ("mk", 1.0, [0], [2]), ("mk", 1.0, [0], [3]), ("big", 1.0, [2], [4])]
    values = [(MiB, -1, 0, -1), (MiB, 0, 0, 2), (MiB, 1, 0, -1), (MiB, 2, 0, 2), (2 * MiB, 3, 0, -1)]
    out = simulate(_trace(ops, values), 5 * MiB, device="h100")
    assert out["status"] == "ok" and out["compactions"] == 1 and out["moved_bytes"] == MiB
    assert out["compaction_seconds"] == pytest.approx(LAUNCH_SECONDS + MiB / (gpu_spec("h100").memory_bytes_per_s / 2))
    assert out["overhead"] == pytest.approx((4 * LAUNCH_SECONDS + out["compaction_seconds"]) / (4 * LAUNCH_SECONDS))


def _holes_between_small_blocks(small: int):
    """x (1 MiB, a leaf), then ``small`` leaves of 64 KiB, each after a value that dies (the holes
    hold 2.2 MiB together), then R (1.5 MiB, made from x by an op of 6 us on an H100: a launch
    and 2 us of FLOPs) beside the last hole, and 100 KiB free above it; then a 2 MiB value fits
    once the small leaves slide aside (the holes join) or once R goes (its bytes join the last
    hole). Returns the trace, R, and the budget whose main region is exactly that."""
    hole = (2 * MiB + 200 * 1024) // (small + 1) // 512 * 512
    ops, values = [("mk", 1.0, [], [0])], [[MiB, 0, 0, -1]]
    holes = []
    for i in range(small + 1):
        if i:
            ops.append(("mk", 1.0, [], [len(values)]))
            values.append([64 * 1024, len(ops) - 1, 0, -1])
        ops.append(("mk", 1.0, [], [len(values)]))
        holes.append(len(values))
        values.append([hole, len(ops) - 1, 0, -1])
    r = len(values)
    ops.append(("f", 1.0, [0], [r]))
    values.append([3 * MiB // 2, len(ops) - 1, 1, -1])
    for h in holes:
        values[h][3] = len(ops) - 1  # die once R is made
    ops.append(("big", 1.0, [], [r + 1]))
    values.append([2 * MiB, len(ops) - 1, 0, -1])
    ops.append(("use", 1.0, [r, r + 1], [r + 2]))
    values.append([1024, len(ops) - 1, 0, -1])
    t = _trace(ops, [tuple(v) for v in values])
    t.op_flops[values[r][1]] = int(2e-6 * gpu_spec("h100").tensor_flops)
    main = MiB + (small + 1) * hole + small * 64 * 1024 + 3 * MiB // 2 + 100 * 1024
    return t, r, main * 256 // 255 + 8192


@pytest.mark.parametrize("small", [1, 2])
def test_a_compaction_is_weighed_with_a_launch_for_every_block_it_moves(small):
    """Pressure weighs sliding the free bytes together against releasing (pressure.py): each block
    a compaction moves is a copy with its launch, as R's recompute (6 us) holds one. One small
    block moved (4 us and its bytes) costs less: it slides; two cost 8 us: R goes instead (priced
    by their bytes alone, they slid too, and the replay then charged 8 us for them)."""
    t, r, budget = _holes_between_small_blocks(small)
    sim = Simulator(t, budget, policy="dtr", device="h100")
    assert sim.main_end - sim.arena.base >= t.value_bytes[:r + 2].sum() - (small + 1) * t.value_bytes[1]
    out = sim.run()
    assert out["status"] == "ok" and out["peak_bytes"] <= out["budget_bytes"], out
    if small == 1:
        assert out["compactions"] == 1 and out["evictions"] == 0 and out["moved_bytes"] == 64 * 1024, out
    else:
        # R went for the 2 MiB value (its recompute for the last op then slides what it must).
        assert sim.released == [r] and sim.released_at == [r + 1] and out["recomputes"] == 1, out
        assert out["recompute_seconds"] == pytest.approx(6e-6)


def _inputs_apart(in_place=False):
    """A and B (leaves) with a dead spacer between them, then an op that reads both and makes 2 MiB:
    in 5 MiB, [A | free 1 | B | free 1.9] holds it only once an input moves, which no compaction may
    do while the kernel runs. ``in_place``: the op also overwrites A."""
    ops = [("mk", 1.0, [], [0]), ("mk", 1.0, [], [1]), ("mk", 1.0, [], [2]),
           ("big", 1.0, [0, 2], [3, 4] if in_place else [3])]
    values = [(MiB, 0, 0, -1), (MiB, 1, 0, 2), (MiB, 2, 0, -1), (2 * MiB, 3, 0, -1)]
    if in_place:
        values.append((MiB, 3, 0, -1))
    t = _trace(ops, values)
    if in_place:
        t.value_overwrites[4] = 0
        t.value_free_at[0] = 3
    return t


def test_a_refused_kernel_runs_again_once_its_inputs_slid_together():
    # runtime.run_again: the refused functional kernel left no trace; every block that may move,
    # its inputs included, slides up, and it runs once more.
    out = simulate(_inputs_apart(), 5 * MiB, device="h100")
    assert out["status"] == "ok" and out["retries"] == 1, out
    assert out["evictions"] == out["offloads"] == 0 and out["moved_bytes"] == 2 * MiB
    assert out["peak_bytes"] <= out["budget_bytes"]
    # An op that writes in place may have written before it ran out: never run again.
    out = simulate(_inputs_apart(in_place=True), 5 * MiB, device="h100")
    assert out["status"] == "oom" and out["retries"] == 0 and "out of budget" in out["error"]


def test_a_value_a_restore_waits_for_is_slid_aside_not_released():
    """pressure.py's rule, replayed: T = h(a, b) comes back by recomputing a, then b (2 MiB) beside
    x, which b's kernel reads (it cannot move). y goes first; then only a, which T's recompute still
    reads, is left, and the free bytes cover b in two holes: a is slid aside, not released (it
    would be recomputed again at once)."""
    ops = [("f", 1.0, [0], [1]), ("g", 1.0, [0], [2]), ("h", 1.0, [1, 2], [3]), ("k", 1.0, [0], [4]),
           ("mk", 1.0, [], [5]), ("use", 1.0, [3], [6])]
    values = [(MiB, -1, 0, -1), (MiB, 0, 1, -1), (2 * MiB, 1, 1, -1), (MiB // 2, 2, 1, -1),
              (7 * MiB // 2, 3, 1, 3), (MiB, 4, 1, -1), (1024, 5, 1, -1)]  # x, a, b, T, z (evicts a, b, T), y, out
    sim = Simulator(_trace(ops, values), 9 * MiB // 2 * 256 // 255 + 4096, policy="dtr", device=None)  # 4.5 MiB main
    out = sim.run()
    assert out["status"] == "ok" and out["peak_bytes"] <= out["budget_bytes"]
    assert list(zip(sim.events["back_at"], sim.events["back_value"])) == [(5, 1), (5, 2), (5, 3)]  # each once
    assert [v for v, at in zip(sim.released, sim.released_at) if at == 5] == [5]  # y alone
    assert out["compactions"] == 1 and out["moved_bytes"] == MiB  # a, slid aside


def test_pressure_releases_no_small_region_value_as_the_runtime_releases_none():
    """The runtime's records of the small region are never candidates (ArenaBackend.releasable):
    their bytes cannot serve a large request. The replay's pressure leaves them too, even to
    ``lru``, for which the oldest value, small or not, scores lowest."""
    ops = [("f", 1.0, [0], [1]), ("g", 1.0, [0], [2]), ("h", 1.0, [0], [3]), ("k", 1.0, [0], [4]),
           ("sum", 1.0, [1, 2, 3], [5])]
    values = [(MiB, -1, 0, -1), (8 * 1024, 0, 1, -1), (MiB, 1, 1, -1), (MiB, 2, 1, -1), (MiB, 3, 1, -1),
              (1024, 4, 1, -1)]
    for policy in ("lru", "dtr"):
        sim = Simulator(_trace(ops, values), 3 * MiB * 256 // 255 + 4096, policy=policy, device=None)
        out = sim.run()
        assert sim.values[1].addr >= sim.main_end  # in the small region
        assert out["status"] == "ok" and 1 not in sim.released, (policy, sim.released)
        assert out["recomputes"] == 1  # a, for the sum


def _forward_backward_chain(k=8, grad=64 * 1024):
    """x -> a1 .. ak (1 MiB each, a forward pass), then a backward pass that reads ak .. a1 in
    turn, each with the gradient before it, and frees it."""
    ops = [("f", 1.0, [i], [i + 1]) for i in range(k)]
    values = [(MiB, -1, 0, -1)] + [(MiB, i, 1, 2 * k - i - 1) for i in range(k)]
    for j in range(k):
        ops.append(("b", 2.0, [k - j] if j == 0 else [k - j, len(values) - 1], [len(values)]))
        values.append((grad, len(ops) - 1, 0, -1 if j == k - 1 else len(ops)))
    return _trace(ops, values)


def test_plan_auto_replays_the_steps_the_runtime_runs_until_its_plan_settles():
    t = _forward_backward_chain()
    out = simulate(t, 5 * MiB, policy="dtr", plan="auto", device=None)
    steps = out["plan_steps"]
    ways = ["learned", "cover", "rebuild", "belady", "greedy"]
    trials = 2 * len(ways)
    assert [s["plan"] for s in steps[:trials + 1]] == ["none"] + [w for w in ways for _ in range(2)]
    assert all(s["status"] == "ok" for s in steps) and out["peak_bytes"] <= out["budget_bytes"]
    # The settled step is the cheapest way by the runtime's measure (the cheaper cover on a tie within 5%),
    # and it is what the replay reports.
    work = {s["plan"]: s["comeback_seconds"] + s["compaction_seconds"] for s in steps[1:trials + 1]}
    cheapest = min(ways, key=lambda w: (work[w], ways.index(w)))
    near = [w for w in ("cover", "rebuild") if work[w] <= 1.05 * work[cheapest]]
    settled = min(near, key=lambda w: (work[w], ways.index(w))) if near else cheapest
    assert steps[-1]["plan"] == out["plan_releases"] == settled
    assert steps[trials - 1]["overhead"] == steps[0]["overhead"]  # the greedy way's step is the unplanned first step's
    assert out["overhead"] == steps[-1]["overhead"]
    assert out == simulate(t, 5 * MiB, policy="dtr", plan="auto", device=None)  # deterministic
    # Offloading: the runtime plans learned only.
    offloading = simulate(t, 5 * MiB, policy="dtr", plan="auto", offload="always", device=None)
    assert {s["plan"] for s in offloading["plan_steps"][1:]} == {"learned"}


def _fragmenting_step():
    """x, y, z of 1 MiB (made in the step, no recipe), x and z freed, then w of 2 MiB read with y:
    best fit leaves the two free MiB apart and w fits only once y moves."""
    ops = [("mk", 1.0, [], [0]), ("mk", 1.0, [], [1]), ("mk", 1.0, [], [2]), ("mk", 1.0, [], [3]),
           ("use", 1.0, [1, 3], [4])]
    values = [(MiB, 0, 0, 2), (MiB, 1, 0, 4), (MiB, 2, 0, 2), (2 * MiB, 3, 0, 4), (1024, 4, 0, -1)]
    return _trace(ops, values)


def test_a_replay_placed_by_the_plan_the_step_before_left_moves_nothing():
    """The runtime's step placement (csrc/step_placement.h), carried from one replay's arena to the
    next: the first step (nothing learned) moves y; the next takes the planned offsets and does not."""
    t = _fragmenting_step()
    first = Simulator(t, 4 * MiB, device=None, placement=([], []))
    assert first.run()["moved_bytes"] == MiB
    assert Simulator(t, 4 * MiB, device=None).run()["moved_bytes"] == MiB  # placement off: best fit
    second = Simulator(t, 4 * MiB, device=None, placement=first.next_placement).run()
    assert second["status"] == "ok" and second["moved_bytes"] == 0
    assert second["placed_as_planned"] == 4 and second["displaced_from_plan"] == 0
    with pytest.raises(ValueError, match=r"placement must be \(offsets, sizes\) of equal lengths"):
        Simulator(t, 4 * MiB, device=None, placement=([0], []))
    with pytest.raises(ValueError, match=r"a planned offset must be -1 \(none\) or a multiple of 512"):
        Simulator(t, 4 * MiB, device=None, placement=([4 * MiB], [MiB])).run()


def test_an_early_release_happens_right_after_its_op_and_comes_back_for_the_next_read():
    t = _forward_backward_chain()
    sim = Simulator(t, 1 << 30, policy="dtr", plan="auto", device=None, releases=[(2, 2)], releases_chains=True)
    out = sim.run()  # a2 released after op 2 although memory is plenty; backward recomputes it
    assert out["planned_releases"] == 1 and out["evictions"] == 1 and out["recomputes"] == 1
    assert (sim.events["released_at"], sim.events["released_value"]) == ([3], [2])  # noted at the next op
    assert (sim.events["back_at"], sim.events["back_value"]) == ([14], [2])  # for the backward op reading it (8 + 6)
    with pytest.raises(ValueError, match="early releases come from a step plan"):
        Simulator(t, 1 << 30, device=None, releases=[(2, 2)])
    with pytest.raises(ValueError, match=r"releases must be \(op position, value\) pairs of the trace"):
        Simulator(t, 1 << 30, plan="auto", device=None, releases=[(2, 999)])


def test_an_early_release_offloaded_comes_back_ahead_of_its_next_read_not_at_once():
    # Offloaded after op 2 (it read a2 last there): its copy back is queued for its next read
    # (op 14), so it starts a few copy times before that, and the prefetch is noted as a comeback
    # there, as the runtime notes an adopted prefetch.
    sim = Simulator(_forward_backward_chain(), 1 << 30, policy="dtr", plan="auto", offload="always", device=None,
                    link_bytes_per_s=MiB, releases=[(2, 2)], releases_chains=True)
    out = sim.run()
    assert out["offloads"] == out["prefetches"] == 1 and out["late_uses"] == 0
    assert (sim.events["back_at"], sim.events["back_value"]) == ([14], [2])


def _read_again_after_a_busy_middle():
    """x0..x3 (leaves, 1 MiB) read by op 0; 16 ops that each make a 3 MiB temporary, freed at once;
    then ops that read x0..x3 one at a time. 0.25 s per op; at 1 MiB/s a copy takes 1 s."""
    ops = [("a", 0.25, [0, 1, 2, 3], [4])]
    values = [(MiB, -1, 0, -1)] * 4 + [(1024, 0, 1, -1)]
    for _ in range(16):
        ops.append(("t", 0.25, [4], [len(values)]))
        values.append((3 * MiB, len(ops) - 1, 1, len(ops) - 1))
    for j in range(4):
        ops.append(("r", 0.25, [j], [len(values)]))
        values.append((1024, len(ops) - 1, 1, -1))
    return _trace(ops, values)


def test_a_copy_back_in_flight_is_given_up_for_room_and_not_started_again_into_it():
    # The x's go to the host for the temporaries; a copy back started between two of them is
    # given up when the next temporary needs its room (waited for, as swap.cancel_one waits),
    # and copies back then leave that room free: a handful of cancels, not one per temporary.
    out = simulate(_read_again_after_a_busy_middle(), 5 * MiB, policy="lru", offload="always", device=None,
                   link_bytes_per_s=MiB)
    assert out["status"] != "oom" and out["offloads"] >= 4
    assert 1 <= out["prefetches_cancelled"] <= 2


def test_a_late_copy_back_doubles_its_lead_for_the_steps_after():
    lead = {}
    late = []
    for _ in range(3):  # steps following a plan, as pymem/sim/plan.py replays them
        out = Simulator(_read_again_after_a_busy_middle(), 5 * MiB, policy="lru", plan="auto", offload="always",
                        device=None, link_bytes_per_s=MiB, lead=lead).run()
        late.append(out["late_uses"])
        if out["late_uses"]:
            assert max(lead.values()) == 2.0 ** len([n for n in late if n])  # doubled per late step
    assert late[0] >= 1 and lead


def test_copies_back_queued_behind_each_other_start_early_enough_for_the_last_read():
    # Eight leaves of 0.5 MiB go out for a 4.5 MiB temporary, then come back for eight reads in a
    # row after a calm stretch. Each copy takes two ops' time on one queue: started three copy
    # times before its own read (the head's trigger alone), the later ones come late; counting
    # the copies queued before each read (swap.latest_start), none does.
    nx = 8
    ops = [("a", 0.25, list(range(nx)), [nx]), ("t", 0.25, [nx], [nx + 1])]
    values = [(MiB // 2, -1, 0, -1)] * nx + [(1024, 0, 1, -1), (9 * MiB // 2, 1, 1, 1)]
    for name, reads in [("c", [nx])] * 40 + [("r", [j]) for j in range(nx)]:
        ops.append((name, 0.25, reads, [len(values)]))
        values.append((1024, len(ops) - 1, 1, -1))
    t = _trace(ops, values)
    sim = Simulator(t, 5 * MiB, policy="lru", plan="auto", offload="always", device=None, link_bytes_per_s=MiB)
    out = sim.run()
    assert out["status"] == "ok" and out["offloads"] == nx and out["prefetches"] == nx and out["late_uses"] == 0
    head_only = Simulator(t, 5 * MiB, policy="lru", plan="auto", offload="always", device=None, link_bytes_per_s=MiB)
    head_only._behind = lambda margin: False
    assert head_only.run()["late_uses"] > 0


def test_latest_start_counts_the_copies_queued_before_each_read():
    # Reads at 10, 10.5 and 11 s, copies of 1 s each: the third needs all three copies first.
    assert latest_start([(10.0, 1.0), (10.5, 1.0), (11.0, 1.0)]) == 8.0
    assert latest_start([(10.0, 1.0)]) == 9.0
    assert latest_start([]) == float("inf")


# --- the GPU cost model -----------------------------------------------------------------------
def test_op_seconds_on_a_gpu():
    t = _cheap_and_costly()
    t.op_flops[:] = [10**12, 0, 10**9, 0]
    t.op_bytes[:] = [10**6, 10**10, 10**6, 0]
    t.op_fp32[:] = [0, 0, 1, 0]
    t.op_kernel[:] = [1, 1, 1, 0]
    g = gpu_spec("h100")
    s = _op_seconds(t, "h100")
    assert s[0] == pytest.approx(LAUNCH_SECONDS + 10**12 / g.tensor_flops)   # compute-bound, tensor cores
    assert s[1] == pytest.approx(LAUNCH_SECONDS + 10**10 / g.memory_bytes_per_s)  # memory-bound
    assert s[2] == pytest.approx(LAUNCH_SECONDS + 10**9 / g.fp32_flops)      # fp32: no tensor cores
    assert s[3] == 0.0                                                       # a view: no kernel
    with pytest.raises(ValueError, match="unknown GPU 'x100'"):
        _op_seconds(t, "x100")


# --- the trace format -------------------------------------------------------------------------
def test_trace_round_trips_and_refuses_bad_files(tmp_path):
    t = _cheap_and_costly()
    path = str(tmp_path / "step.npz")
    t.save(path)
    u = Trace.load(path)
    for name in ("op", "op_cost", "inputs", "outputs", "value_bytes", "value_free_at"):
        assert np.array_equal(getattr(t, name), getattr(u, name))
    assert u.op_names == t.op_names
    np.savez(str(tmp_path / "bad.npz"), op=np.zeros(3))
    with pytest.raises(TraceError, match="missing"):
        Trace.load(str(tmp_path / "bad.npz"))
    (tmp_path / "text.npz").write_text("hello")
    with pytest.raises(TraceError, match="not a pymem trace"):
        Trace.load(str(tmp_path / "text.npz"))
    broken = Trace(**{**t.__dict__, "value_producer": np.array([-1, 1, 1, 2, 3], np.int32)})
    with pytest.raises(TraceError, match="producer does not list it"):
        broken.check()


def _dropout_trace(blank):
    """x (a leaf) -> a (cost 10) -> m0 = empty_like(a) -> m1 = bernoulli_(m0) in place (reading m0
    not when ``blank``) -> y = a * m1, where a dies; then an op reads m1 and y."""
    ops = [("costly", 10.0, [0], [1]), ("empty_like", 0.001, [1], [2]), ("bernoulli_", 1.0, [2], [3]),
           ("mul", 0.1, [1, 3], [4]), ("other", 1.0, [0], [5]), ("use", 1.0, [3, 4], [6])]
    values = [(MiB, -1, 0, -1), (MiB, 0, 1, 3), (MiB, 1, 1, 2), (MiB, 2, 1, 5), (MiB, 3, 1, 5), (MiB, 4, 1, 4),
              (MiB, 5, 1, -1)]
    t = _trace(ops, values)
    t.value_overwrites[3] = 2
    t.value_blank_rerun[3] = int(blank)
    t.check()
    return t


@pytest.mark.parametrize("blank", [False, True])
def test_a_rerun_over_a_blank_buffer_reads_not_what_it_overwrote(blank):
    # m1 released after op 3, back for op 5: blank, its rerun is bernoulli_ alone (as the runtime's
    # recipe, a blank buffer); read, it needs m0 again (dead), so empty_like, so a (dead): costly.
    sim = Simulator(_dropout_trace(blank), 1 << 30, policy="dtr", plan="auto", device=None, releases=[(3, 3)],
                    releases_chains=True)
    out = sim.run()
    assert out["status"] == "ok" and out["planned_releases"] == 1
    assert out["recompute_seconds"] == pytest.approx(1.0 if blank else 11.001)
    assert sorted(sim.events["back_value"]) == ([3] if blank else [1, 2, 3])


def test_trace_keeps_its_blank_reruns_and_reads_files_without_them(tmp_path):
    t = _dropout_trace(True)
    t.save(str(tmp_path / "step.npz"))
    assert Trace.load(str(tmp_path / "step.npz")).value_blank_rerun.tolist() == [0, 0, 0, 1, 0, 0, 0]
    with np.load(str(tmp_path / "step.npz")) as f:  # a file written before the field: all reruns read
        np.savez(str(tmp_path / "old.npz"), **{k: f[k] for k in f.files if k != "value_blank_rerun"})
    assert not Trace.load(str(tmp_path / "old.npz")).value_blank_rerun.any()
    t.value_blank_rerun[4] = 1  # y was made by no in-place op
    with pytest.raises(TraceError, match="1 only where value_overwrites names the value overwritten"):
        t.check()


# --- capture on meta --------------------------------------------------------------------------
class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(256, 512), torch.nn.Linear(512, 256)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _steps(device, optimizer=True):
    torch.manual_seed(0)
    with torch.device(device):
        net = _Net()
        x = torch.randn(64, 256)
    opt = torch.optim.Adam(net.parameters(), foreach=False)

    def step():
        opt.zero_grad(set_to_none=True)
        net(x).square().mean().backward()
        if optimizer:
            opt.step()
    return step


def test_capture_tells_a_blank_overwrite_from_one_that_reads():
    # Dropout's mask, as torch makes it off CUDA: bernoulli_ over empty_like (blank), div_ over that (read).
    x = torch.randn(32, 64, device="meta", requires_grad=True)

    def step():
        (x * torch.nn.functional.dropout(torch.ones_like(x), 0.5)).sum().backward()
    step()
    t = capture(step)
    written = {t.op_name(int(t.value_producer[v])): int(t.value_blank_rerun[v])
               for v in np.flatnonzero(t.value_overwrites >= 0)}
    div = next(n for n in written if n.startswith("aten.div_."))
    assert written["aten.bernoulli_.float"] == 1 and written[div] == 0


def test_capture_sees_ops_frees_mutations_and_backward():
    step = _steps("meta")
    step()
    t = capture(step)
    names = [t.op_name(k) for k in range(t.num_ops)]
    assert t.backward_at > 0 and "backward" not in " ".join(names[:t.backward_at])
    assert any("addmm" in n for n in names[:t.backward_at])
    # Adam rewrites each parameter in place: new values that take over the old ones' bytes
    rewritten = np.flatnonzero(t.value_overwrites >= 0)
    assert len(rewritten) >= 4 * 3  # 4 parameters, each with exp_avg, exp_avg_sq and the parameter
    assert not t.value_recomputable[rewritten].any()  # state rewritten in place: leaves
    backward = [v for k in range(t.backward_at, t.num_ops) if "backward" in names[k] for v in t.op_outputs(k)]
    assert backward and not t.value_recomputable[backward].any()  # no recipes in backward (as the runtime)
    fwd = [v for k in range(t.backward_at) for v in t.op_outputs(k)]
    assert t.value_recomputable[fwd].any()
    assert (t.value_free_at[fwd] >= 0).any()  # activations die in the backward pass
    # two matmuls forward, three backward (no gradient for the input): 2 * 64 * 256 * 512 FLOPs each
    assert t.op_flops.sum() == 5 * 2 * 64 * 256 * 512


def test_captured_peak_matches_the_cpu_peak():
    """The meta capture's unmanaged peak is the bytes the same forward and backward pass holds at
    its peak on the CPU (counted by a plain arena through the CPU allocator hook), to the byte.
    (Buffers a kernel allocates inside one op are no value of the trace: CPU Adam's showed up as
    0.9 MB more at its peak, outside what this compares.)"""
    step = _steps("meta", optimizer=False)
    step()
    traced = capture(step).peak_bytes()
    probe = pymem.Arena(1 << 30, small_threshold=0)
    pymem.install_cpu_hook(probe)
    try:
        cpu_step = _steps("cpu", optimizer=False)
        cpu_step()
        probe.reset_peak_memory_stats()
        cpu_step()
    finally:
        pymem.uninstall_cpu_hook()
    measured = probe.stats()["allocated_bytes.peak"]
    assert traced == measured


def test_trace_cli_captures_a_script_and_sim_replays_it(tmp_path, capsys):
    script = tmp_path / "train.py"
    script.write_text(
        "import torch\n"
        "net = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64))\n"
        "opt = torch.optim.SGD(net.parameters(), lr=0.1)\n"
        "x = torch.randn(32, 64)\n"
        "for i in range(10):\n"
        "    opt.zero_grad()\n"
        "    loss = net(x).square().mean()\n"
        "    loss.backward()\n"
        "    opt.step()\n"
        "    print('loss', loss.item())\n")
    out = str(tmp_path / "s.npz")
    assert cli.main(["trace", str(script), "--out", out]) == 0
    t = Trace.load(out)
    assert t.backward_at > 0 and t.num_ops > 10
    capsys.readouterr()
    res = str(tmp_path / "r.json")
    assert cli.main(["sim", "--trace", out, "--budget-ratio", "4", "--device", "l4", "--json", res]) == 0
    got = json.loads(open(res).read())
    assert got["status"] == "ok" and got["overhead"] == 1.0
    assert set(got) >= {"status", "overhead", "peak_bytes", "budget_bytes", "fragmentation", "evictions",
                        "offloads", "recompute_seconds", "copy_seconds_hidden"}
    assert cli.main(["sim", "--trace", out, "--device", "l4"]) == 2
    assert "give one of --budget" in capsys.readouterr().err


def test_capture_books_attention_as_the_fused_kernel_a_gpu_runs(tmp_path):
    """On meta, scaled_dot_product_attention would take the math path (a seq x seq score matrix);
    a GPU runs one fused kernel: memory-efficient attention for fp32. The function is restored."""
    import torch.nn.functional as F
    from pymem.sim.capture import capture_script
    before = F.scaled_dot_product_attention
    script = tmp_path / "attn.py"
    script.write_text(
        "import torch\n"
        "w = torch.nn.Parameter(torch.randn(64, 192))\n"
        "opt = torch.optim.SGD([w], lr=0.1)\n"
        "x = torch.randn(2, 128, 64)\n"
        "for i in range(3):\n"
        "    q, k, v = (x @ w).view(2, 128, 3, 4, 16).permute(2, 0, 3, 1, 4)\n"
        "    a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)\n"
        "    a.square().mean().backward()\n"
        "    opt.step()\n")
    modes = torch._C._len_torch_function_stack()
    t = capture_script(str(script))
    names = " ".join(t.op_names)
    assert "_scaled_dot_product_efficient_attention" in names and "_softmax" not in names, names
    assert F.scaled_dot_product_attention is before
    # The default device is restored as it was: unset, not a "cpu" device mode left on every call
    # (it made share_memory_() pin twice in the tests after it).
    assert torch._C._len_torch_function_stack() == modes and torch.get_default_device() == torch.device("cpu")


def test_capture_reads_item_as_one_so_bias_corrections_do_not_divide_by_zero(tmp_path):
    """Seen on a GPU machine's torch: Adam read its step counter with .item() on meta, and a 0 made
    its bias correction 1 - beta1 ** step divide by zero."""
    from pymem.sim.capture import capture_script
    script = tmp_path / "train.py"
    script.write_text(
        "import torch\n"
        "w = torch.nn.Parameter(torch.randn(64, 64))\n"
        "opt = torch.optim.SGD([w], lr=0.1)\n"
        "step = torch.zeros(())\n"
        "for i in range(4):\n"
        "    step += 1\n"
        "    scale = 0.1 / (1 - 0.9 ** step.item())  # Adam's step size, in Python floats\n"
        "    loss = (w @ w).square().mean() * scale\n"
        "    if torch.isnan(loss).any().item():\n"
        "        raise SystemExit('a flag must read False')\n"
        "    loss.backward()\n"
        "    opt.step()\n")
    t = capture_script(str(script))
    assert t.num_ops > 3 and t.backward_at > 0


def test_trace_cli_refuses_an_unknown_model(tmp_path, capsys):
    assert cli.main(["trace", "gpt5", "--out", str(tmp_path / "x.npz")]) == 2
    assert "unknown model 'gpt5'" in capsys.readouterr().err


def test_a_next_use_is_found_through_an_evicted_value_the_program_freed():
    """As the runtime's ``Record.next_use`` (records._next_use walks every evicted reader, freed by
    the program or not): p's next use is b's read, reached through a, which the program freed but
    b's recompute reads. Missing it scored p as unread for the rest of the step, so pressure
    released it mid-restore and reran it (the MILP's TinyGPT at 0.6: 0.1995 -> 0.1835 ms)."""
    ops = [("f", 1.0, [0], [1]), ("g", 1.0, [1], [2]), ("h", 1.0, [2], [3]), ("other", 2.0, [0], [4]),
           ("read", 1.0, [3], [5])]
    values = [(MiB, -1, 0, -1), (MiB, 0, 1, -1), (MiB, 1, 1, 2), (MiB, 2, 1, -1), (1024, 3, 1, -1),
              (1024, 4, 1, -1)]
    sim = Simulator(_trace(ops, values), 1 << 30, policy="dtr", plan="auto", device=None)
    a, b = sim.values[2], sim.values[3]
    a.state, a.dead, b.state = EVICTED, True, EVICTED
    sim.position = 3
    assert sim.seconds_to_next_use(1, 8) == pytest.approx(2.0)  # op 3 runs first, then op 4 reads b
    assert sim.seconds_to_next_use(1, 1) == math.inf  # one level of readers reaches a, not b
    b.state = RESIDENT  # b resident: nothing away reads p any more
    assert sim.seconds_to_next_use(1, 8) == math.inf


# --- simrd logs -------------------------------------------------------------------------------
def test_simrd_reader_on_the_fixture():
    t = load_simrd(FIXTURE)
    assert t.op_names == ["mul", "view", "relu", "add_", "mul_backward"]
    assert t.num_values == 6                                   # w, x, a, b, b after add_, c
    assert t.value_producer.tolist() == [-1, -1, 0, 2, 3, 4]   # the view made no value
    assert t.value_recomputable.tolist() == [0, 0, 1, 1, 1, 1]  # constants are leaves
    # a: its names (a, its view av, its copy a2) all released after op 4; b's old value once add_
    # rewrote it; b after add_ when COPY_FROM rebound b; c and the constants live on.
    assert t.value_free_at.tolist() == [-1, -1, 4, 3, 4, -1]
    assert t.backward_at == 4
    assert t.op_cost.tolist() == pytest.approx([100e-6, 1e-6, 10e-6, 10e-6, 200e-6])
    assert [list(t.op_inputs(k)) for k in range(5)] == [[1, 0], [2], [2], [3, 1], [4, 2]]
    out = simulate(t, 1 << 30, device=None)
    assert out["status"] == "ok" and out["overhead"] == 1.0


def test_simrd_reader_errors_name_the_line():
    with pytest.raises(TraceError, match="line 1: unknown INSTRUCTION 'JUMP'"):
        read_simrd(['{"INSTRUCTION": "JUMP"}'])
    with pytest.raises(TraceError, match="line 2: not JSON"):
        read_simrd(['{"INSTRUCTION": "RELEASE", "NAME": "x"}', "{oops"])
    with pytest.raises(TraceError, match="'y' is used before it is defined"):
        read_simrd(['{"INSTRUCTION": "CALL", "RESULT": [], "NAME": "f", "ARGS": ["y"], "TIME": 1}'])


# --- the runtime's trace replays with the runtime's decisions -------------------------------
def _residual_chain(x):
    hs = [x]
    for _ in range(10):
        hs.append(torch.tanh(hs[-1] * 1.01))
    total = hs.pop(0) * 1.0
    while hs:
        total = total + hs.pop(0)
    return total


def test_runtime_trace_replays_with_the_runtime_decisions(managed):
    """LRU: every decision the same. (With ``dtr`` the first ten of this program's releases are the
    same, then one recompute's inputs differ: the runtime's cache and the replay's dead values are
    not yet alike in every case.)"""
    budget = 6 * MiB
    fixed = CostModel(3e10, 7e9, 4e-6)  # the same costs in the runtime and in the replay
    rt = pymem.enable(budget=budget, device="cpu", cost=fixed, plan="auto", policy="lru")
    with pymem.no_recompute():
        x = torch.ones(1 << 18)  # a leaf in the arena
    _residual_chain(x)
    pymem.step()
    step = rt.trace.last_step()
    pymem.disable()
    sim = Simulator(from_step_arrays(step, pymem._C.op_name), budget, policy="lru", device=None)
    out = sim.run()
    assert out["status"] == "ok" and len(step["released_value"]) > 10
    assert sim.released == step["released_value"].tolist()
    assert sim.released_at == step["released_at"].tolist()


def test_sim_cli_replays_a_simrd_log(tmp_path, capsys):
    res = str(tmp_path / "r.json")
    assert cli.main(["sim", "--trace", FIXTURE, "--format", "simrd", "--device", "recorded", "--budget-ratio", "1.5",
                     "--json", res]) == 0
    got = json.loads(open(res).read())
    assert got["status"] == "ok" and got["overhead"] == 1.0 and got["step_seconds"] == pytest.approx(321e-6)
    assert got["lower_bound"]["overhead"] == 1.0  # nothing has to be away above the peak


def test_trace_of_a_transformers_config(tmp_path, capsys):
    pytest.importorskip("transformers")
    from pymem.sim.models import model_step

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 2, "vocab_size": 128,
                               "n_positions": 64}))
    step, meta = model_step(f"hf:{cfg}", batch=2)
    step()
    t = capture(step, meta)
    assert t.meta["seq"] == 64 and t.backward_at > 0 and t.op_flops.sum() > 0
    # The CLI's summary names the batch: a model's figures depend on it, and each has its default.
    assert cli.main(["trace", f"hf:{cfg}", "--batch", "3", "--out", str(tmp_path / "hf.npz")]) == 0
    assert re.search(r"^pymem trace: hf:\S+ \(batch 3\): \d+ ops", capsys.readouterr().out)
    with pytest.raises(ValueError, match="unknown transformers model type 'nonesuch'"):
        model_step("hf:nonesuch")


def _made_then_pushed_out():
    """x (a leaf) read by op 0, which makes y (1 MiB) and z (small); eight ops of 0.25 s read z;
    op 9 makes a 2.5 MiB temporary that leaves no room for both x and y (4 MiB); op 10 reads both."""
    ops = [("a", 0.25, [0], [1, 2])] + [("c", 0.25, [2], [3 + j]) for j in range(8)]
    ops += [("t", 0.25, [2], [11]), ("r", 0.25, [0, 1], [12])]
    values = [(MiB, -1, 0, -1), (MiB, 0, 1, -1), (1024, 0, 1, -1)] + [(1024, 1 + j, 1, 1 + j) for j in range(8)]
    values += [(5 * MiB // 2, 9, 1, 9), (1024, 10, 1, -1)]
    return _trace(ops, values)


@pytest.mark.parametrize("policy", ["lru", "dtr"])
def test_a_copy_out_started_ahead_hides_behind_compute_and_the_release_copies_nothing(policy):
    # At 1 MiB/s a copy takes 1 s: synchronous, the release at op 9 stalls for it; started ahead
    # (x at the step's start, y after op 0: 2 s on the queue to the host, done by op 9's 2.25 s),
    # the release finds the host copy made.
    kw = dict(policy=policy, offload="always", plan="auto", device=None, link_bytes_per_s=MiB)
    t = _made_then_pushed_out()
    plain = Simulator(t, 4 * MiB, **kw).run()
    ahead = Simulator(t, 4 * MiB, copy_ahead={0: -1, 1: 0}, **kw).run()
    assert plain["offloads"] == ahead["offloads"] == 1
    assert plain["copy_out_seconds_exposed"] == pytest.approx(1.0) and plain["copies_ahead"] == 0
    assert ahead["copy_out_seconds_exposed"] == 0.0 and ahead["copies_ahead"] == 2
    assert ahead["overhead"] == pytest.approx(plain["overhead"] - 1.0 / 2.75)


def test_a_release_waits_only_for_the_rest_of_a_copy_out_started_ahead():
    # DTR releases y (cheaper to bring back than the leaf x); its copy started after op 6 (at
    # 1.75 s) ends at 2.75 s, half a second after op 9 needs its room.
    sim = Simulator(_made_then_pushed_out(), 4 * MiB, policy="dtr", offload="always", plan="auto", device=None,
                    link_bytes_per_s=MiB, copy_ahead={1: 6})
    out = sim.run()
    assert sim.released == [1] and out["copies_ahead"] == 1
    assert out["copy_out_seconds_exposed"] == pytest.approx(0.5)


def test_plan_auto_with_offloading_copies_out_ahead_what_the_step_before_offloaded():
    t = _made_then_pushed_out()
    # LRU offloads x and y at op 9 (2 s of copies out, exposed, in the unplanned step). The plan's
    # steps copy both out ahead, and release y early once its copy is done: no copy out waited for.
    kw = dict(policy="lru", offload="always", device=None, link_bytes_per_s=MiB)
    plain = simulate(t, 4 * MiB, plan="off", **kw)
    assert plain["offloads"] == 2 and plain["copy_out_seconds_exposed"] == pytest.approx(2.0)
    out = simulate(t, 4 * MiB, plan="auto", **kw)
    assert out["status"] != "oom" and out["plan_releases"] == "learned" and out["planned_releases"] == 1
    assert out["copies_ahead"] == 2 and out["copy_out_seconds_exposed"] == 0.0
    assert out["overhead"] < plain["overhead"]
    first = Simulator(t, 4 * MiB, policy="lru", offload="always", device=None, link_bytes_per_s=MiB)
    first.run()
    from pymem.sim.plan import copy_ahead
    ahead = copy_ahead(t, first)
    # y from op 0, which makes it; x (made before the step) from op 0 too, its first read, where
    # the runtime's step trace first gives it an index (it went out after that read); both with
    # where they went out (op 9), the order their copies start in
    assert ahead == {0: (0, 9), 1: (0, 9)}


def test_bad_copy_ahead_is_refused():
    with pytest.raises(ValueError, match="copy_ahead must map values of the trace"):
        Simulator(_made_then_pushed_out(), 4 * MiB, device=None, copy_ahead={99: 0})
    with pytest.raises(ValueError, match="copy_ahead must map values of the trace"):
        Simulator(_made_then_pushed_out(), 4 * MiB, device=None, copy_ahead={1: 11})
    with pytest.raises(ValueError, match="copy_ahead must map values of the trace"):
        Simulator(_made_then_pushed_out(), 4 * MiB, device=None, copy_ahead={1: (-2, 3)})


def test_copies_out_ahead_start_by_expected_release_while_few_bytes_are_queued():
    # Two values made before the step, 300 MiB each (more than the queue holds): the one expected
    # to go out first is copied first, the other only once that copy is done.
    big = 300 * MiB
    t = _trace([("a", 1.0, [0, 1], [2]), ("b", 1.0, [2], [3])],
               [(big, -1, 0, -1), (big, -1, 0, -1), (1024, 0, 1, -1), (1024, 1, 1, -1)])
    sim = Simulator(t, 1 << 40, device=None, link_bytes_per_s=big, copy_ahead={0: (-1, 20), 1: (-1, 9)})
    sim.run()
    assert sim.values[1].host_at == 1.0 and sim.values[0].host_at == 2.0


def test_backlog_window_keeps_latest_start_as_heads_are_taken():
    """swap.BacklogWindow: after each head taken, what latest_start of the reads left gives; a copy
    queued inside the window has it built again, one queued after it (more queued) does not."""
    from pymem.runtime.swap import BacklogWindow

    reads = [(10.0, 1.0), (10.5, 1.0), (11.0, 1.0), (20.0, 4.0), (21.0, 0.5)]
    keys = [(k, k) for k in range(len(reads))]
    w = BacklogWindow()
    w.build(keys, reads, keys[-1], more=False)  # the whole queue (with more, half used up rebuilds)
    for j in range(len(reads)):
        assert w.valid and w.latest() == pytest.approx(latest_start(reads[j:]))
        w.took(keys[j])
    w.build(keys, reads, keys[-1], more=True)
    w.took((-1, -1))  # an entry the window left out (no read to place): nothing changes
    assert w.valid and w.latest() == latest_start(reads)
    w.queued((99, 0))  # after the window's last entry
    assert w.valid
    w.queued((2, 7))  # inside it
    assert not w.valid
    w.build(keys, reads, keys[-1], more=False)
    w.queued((99, 0))  # the window held the whole queue: a recompute would see this one
    assert not w.valid


def test_a_copy_out_waited_for_shares_the_link_with_the_copies_ahead_not_behind_them():
    # The runtime makes a release's copy on the compute stream and copies ahead on a stream of
    # their own: the two share the link (half its rate each while both run), neither waits.
    big = 300 * MiB  # 1 s at the link's rate
    t = _trace([("a", 1.0, [0, 1, 2], [3])],
               [(big, -1, 0, -1), (big // 4, -1, 0, -1), (big // 4, -1, 0, -1), (1024, 0, 1, -1)])
    sim = Simulator(t, 1 << 40, device=None, link_bytes_per_s=big, copy_ahead={0: (-1, 0)})
    for v in sim.values[:3]:
        sim._allocate(v)
    sim._copy_ahead(-1)
    ahead, first, second = sim.values[:3]
    assert ahead.host_at == 1.0 and sim.copies_ahead == 1
    sim._copy_out_now(first)  # 0.25 s alone, 1 s queued ahead: both at half rate until it is done
    assert first.host_at == pytest.approx(0.5) and ahead.host_at == pytest.approx(1.25)
    sim.clock = 1.1  # 0.15 s left ahead: shared until then, then the link is its own
    sim._copy_out_now(second)
    assert second.host_at == pytest.approx(1.1 + 0.15 + 0.25) and ahead.host_at == pytest.approx(1.1 + 2 * 0.15)
    assert sim.d2h_free == pytest.approx(ahead.host_at)
    sim.clock = 2.0  # nothing queued: the link's rate
    third = sim.values[3]
    sim._allocate(third)
    sim._copy_out_now(third)
    assert third.host_at == pytest.approx(2.0 + 1024 / big) and ahead.host_at == pytest.approx(1.4)


def test_a_leaf_rewritten_in_place_brings_back_what_its_old_value_made_first():
    # remat.invalidate_dependents, as the first step's AdamW does it: s = zeros_like(p) is evicted
    # for a 2 MiB temporary; then p is rewritten in place. s comes back from the old p before that
    # (one recompute) and is a leaf from then on: its read at op 3 finds it.
    ops = [("zeros_like", 1.0, [0], [1]), ("temp", 1.0, [0], [2]), ("mul_", 1.0, [0], [3]), ("read", 1.0, [1], [4])]
    values = [(MiB, -1, 0, -1), (MiB, 0, 1, 3), (2 * MiB, 1, 1, 1), (MiB, 2, 0, -1), (1024, 3, 1, -1)]
    t = _trace(ops, values)
    t.value_overwrites[3] = 0
    t.value_free_at[0] = 2
    sim = Simulator(t, 4 * MiB, policy="dtr", device=None)
    out = sim.run()
    assert out["status"] == "ok" and out["evictions"] == 1 and out["recomputes"] == 1, out
    assert not sim.values[1].recipe and out["overhead"] == pytest.approx(5.0 / 4.0)


def test_lower_bound_arithmetic_on_a_hand_written_trace():
    from pymem.sim.bound import lower_bound
    t = _cheap_and_costly()
    # At op 2 (D made while x is read) 3.5 MiB hold 1.5 MiB of A and B: 0.5 MiB must be away. With
    # a link too slow to matter, the cheapest release per byte is A's (1 s per MiB): half a second.
    b = lower_bound(t, 7 * MiB // 2, device=None, link_bytes_per_s=1e-6)
    assert b["at_op"] == 2 and b["excess_bytes"] == MiB // 2
    assert b["recompute_seconds"] == pytest.approx(0.5) and b["overhead"] == pytest.approx(13.5 / 13.0)
    # The 11 s before op 2 carry 0.5 MiB at 1 MiB/s: copying is free then.
    assert lower_bound(t, 7 * MiB // 2, device=None, link_bytes_per_s=MiB)["overhead"] == 1.0
    # A budget below op 2's own working set (x and D, 2 MiB) cannot run at all.
    assert lower_bound(t, 2 * MiB - 512, device=None)["overhead"] == float("inf")
    assert simulate(t, 2 * MiB - 512, device=None)["status"] == "oom"
    assert simulate(t, 7 * MiB // 2, device=None)["overhead"] >= 13.5 / 13.0
    with pytest.raises(ValueError, match="positive number of bytes"):
        lower_bound(t, 0, device=None)


def test_no_replay_beats_the_lower_bound():
    from pymem.sim.bound import lower_bound
    from pymem.sim.models import gpt2_xl_step
    step, meta = gpt2_xl_step(batch=8, seq=256, layers=4, d=256, heads=4, vocab=256)
    t = capture(step, meta)
    peak, link = t.peak_bytes(), 4e9
    bounds, seen = [], 0
    for ratio in (0.5, 0.4, 0.3):
        bound = lower_bound(t, int(peak * ratio), link_bytes_per_s=link)["overhead"]
        bounds.append(bound)
        for policy, offload in (("dtr", "never"), ("coop", "delta"), ("dtr", "delta")):
            out = simulate(t, int(peak * ratio), policy=policy, offload=offload, device="h100", link_bytes_per_s=link)
            if out["status"] != "oom":
                seen += 1
                assert out["overhead"] >= bound, (ratio, policy, offload, out["overhead"], bound)
    assert seen >= 6 and bounds == sorted(bounds) and bounds[-1] > 1.02  # a bound that says something
