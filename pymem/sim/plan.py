"""The step plan in a replay: the steps the runtime runs before its plan settles.

The runtime plans each step from the one before it (csrc/step_trace.h). Its first step runs
unplanned (the policy alone). Every later step follows a plan made one of five ways, which
csrc/plan_choice.h chooses by what the steps that followed each way brought back:
``learned`` (the releases of the step before, made right after their last use: csrc/step_plan.h),
``cover`` and ``rebuild`` (the cheapest cover of where the step overflows its budget, each
comeback priced with its lineage, or with what its rerun rebuilds: csrc/plan_cover.h; ``rebuild``
also holds small values the program freed that a rerun of the step before rebuilt: csrc/step_plan.h),
``belady`` (no early release; pressure scored by the plan's next uses) or ``greedy`` (the
policy alone, as the first step).

A replay is one step, so ``replay_planned`` replays the runtime's sequence of steps with the same
C++ (``_C.learned_releases``, ``_C.cover_releases``, ``_C.rebuild_releases``, ``_C.PlanChoice``; the
runtime's measure: the op costs of what came back plus the compactions' moves): the unplanned step, each
way's trial steps, then the step the choice settles on, twice, as the runtime repeats it. It
reports that last step (the runtime's steady state: a step that follows one run the same way).
Every step replayed must fit: the runtime raises at the first that does not, so the first replay
that runs out of budget is the result.

Every step is replayed, each in a fresh arena: what a step leaves the next besides its trace is
carried over, as the runtime's arena and swapper carry it: the step placement's plan of offsets
(csrc/step_placement.h, on with the plan: ``Simulator(placement=...)``) between steps planned the
same way or from the unplanned first step (a step planned another way than the one before is
placed by best fit), and swap.py's prefetch feedback.
"""
from typing import Dict, List, Tuple

import numpy as np

from .. import _C
from .replay import Simulator
from .trace import Trace


COVERS = {"cover": _C.cover_releases, "rebuild": _C.rebuild_releases}  # the ways that cover, by name


def step_arrays(trace: Trace, seconds: np.ndarray) -> Dict[str, np.ndarray]:
    """The trace as the runtime's step arrays (csrc/step_trace.h), priced by ``seconds``; with its
    values' deaths and in-place writes where they were observed (a capture's; a runtime step's that
    followed its plan)."""
    step = {"op": trace.op.astype(np.int32), "op_cost": np.asarray(seconds, dtype=np.float64),
            "inputs_start": trace.inputs_start, "inputs": trace.inputs,
            "outputs_start": trace.outputs_start, "outputs": trace.outputs,
            "value_bytes": trace.value_bytes, "value_producer": trace.value_producer,
            "value_recomputable": trace.value_recomputable}
    if trace.meta.get("deaths") != "last read":
        step["value_free_at"] = trace.value_free_at
        step["value_overwrites"] = trace.value_overwrites
        step["value_blank_rerun"] = trace.value_blank_rerun
    return step


def copy_ahead(trace: Trace, sim: Simulator) -> Dict[int, Tuple[int, int]]:
    """What the runtime copies out ahead in the step after ``sim``'s (swap.copy_ahead): each value
    it offloaded, from the op that makes it (the step trace gives it its index there), or for a
    value made before the step, from its first read in the step; or from the step's start (the
    previous step made it) when it was offloaded before that read, as the runtime then knows it by
    the index it was made with. With each, where ``sim`` offloaded it (the copies go in that order)."""
    out = {}
    for v, at in sim.offloaded_at.items():
        producer = int(trace.value_producer[v])
        if producer < 0:
            first = sim.readers[v][0] if sim.readers[v] else trace.num_ops
            producer = -1 if at <= first else first
        out[v] = (producer, at)
    return out


def replay_planned(trace: Trace, budget: int, **kw) -> Dict:
    """The step the runtime settles on with ``plan="auto"`` (``Simulator``'s keywords), with
    ``plan_releases`` ("learned", "cover", "rebuild", "belady" or "greedy": how it was planned) and
    ``plan_steps`` (each step replayed on the way: its plan, status, overhead, and the seconds it
    brought values back and moved blocks for: the choice's measure, as the runtime's)."""
    kw.pop("plan", None)
    lead: Dict[int, float] = {}  # swap.py's prefetch feedback, carried from step to step
    kw["lead"] = lead
    kw["placement"] = ([], [])  # the runtime's first step: nothing placed yet
    first = Simulator(trace, budget, plan="off", **kw)  # the runtime's first step: no plan yet
    step = step_arrays(trace, first.seconds)
    covered = first.budget - first.arena.small_region_size  # what the runtime's covers plan for
    cover_allowed = kw.get("offload", "never") == "never"  # offloading: the runtime plans learned only
    choice = _C.PlanChoice()
    steps: List[Dict] = []

    # csrc/step_plan.h's retention (kRebuild's holds): value -> the op after which it is let go,
    # from each step that ran a plan (the runtime watches no deaths in its unplanned first step).
    holds: Dict[int, int] = {}
    retain_limit = first.budget // _C.RETAIN_SHARE

    def run(sim: Simulator, how: str) -> Tuple[Dict, Dict, Dict]:
        nonlocal holds
        out = sim.run()
        if how != "none":
            before = [(v, int(trace.value_free_at[v]), until) for v, until in sim.retain.items()]
            holds = {v: until for v, _, until in _C.retained_values(dict(step, **sim.events), retain_limit, before)}
        kw["copy_ahead"] = copy_ahead(trace, sim)
        kw["placement"] = sim.next_placement
        cost = _C.comeback_cost(dict(step, back_at=sim.events["back_at"], back_value=sim.events["back_value"]))
        return out, sim.events, {"plan": how, "status": out["status"], "overhead": out["overhead"],
                                 "comeback_seconds": cost, "compaction_seconds": out["compaction_seconds"]}

    out, learned_from, summary = run(first, "none")
    steps.append(summary)
    if trace.num_ops == 0:  # nothing to plan: the runtime follows no empty plan
        return dict(out, plan_releases=None, plan_steps=steps)
    covers = {how: COVERS[how](step, covered) for how in COVERS}  # the program's and budget's alone

    def simulator(how: str) -> Simulator:
        if how in COVERS:
            return Simulator(trace, budget, plan="auto", releases=covers[how], releases_chains=True,
                             retain=holds if how == "rebuild" else None, **kw)
        if how == "greedy":  # the policy alone, as the unplanned first step
            return Simulator(trace, budget, plan="off", **kw)
        return Simulator(trace, budget, plan="auto", **kw)  # belady: next uses, no early release

    # The ways' trials, then the settled step twice: the runtime repeats it, and the second starts
    # from a step run the same way (the step placement's plan, the learned plan's releases).
    for _ in range(_C.PlanChoice.TRIAL_STEPS + 2):
        if out["status"] == "oom":
            break
        how = choice.next(cover_allowed)
        before = steps[-1]["plan"]
        if before != "none" and how != before:  # as the runtime's end_step: planned another way, placed by best fit
            kw["placement"] = ([], [])
        if how != "learned":
            out, _, summary = run(simulator(how), how)
        else:
            releases = _C.learned_releases(step, learned_from)
            out, learned_from, summary = run(Simulator(trace, budget, plan="auto", releases=releases, **kw), how)
        steps.append(dict(summary))
        choice.measured(how, summary["comeback_seconds"], summary["compaction_seconds"])
    return dict(out, plan_releases=steps[-1]["plan"], plan_steps=steps)
