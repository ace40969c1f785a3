"""Which way the step plan settles on, and what each costs, with fixed op costs (no timer noise).

    python bench/plan_ways.py [--models transformer,deep,cnn] [--ratios ckpt,0.5,0.3] [--steps 18]
                              [--costs rates|measured] [--cost-tables DIR] [--bound] [--no-step-placement]
                              [--json FILE]

For each model of bench/vs_checkpoint.py and each budget (``ckpt``: the checkpoint-every-block
peak; a number: that share of the unmanaged peak), in one process: ``--steps`` training steps with
``plan="off"`` (the policy alone), then with ``plan="auto"``, both under
``cost=CostModel(1e11, 1e10, 5e-6)``, so every decision repeats run to run. Per step: the
recompute seconds (``remat_seconds``, at the fixed costs), the MiB compaction moved, and the way the
step was planned (csrc/plan_choice.h: learned, cover, rebuild, belady, greedy; "-" before the plan starts)
and the values ``rebuild`` held past the program's free of them (``plan_retained``, csrc/step_plan.h).
Printed: each step, and the means over the steps after the trials (``plan="auto"``: from the first
step the choice made; ``plan="off"``: the same steps), the recompute also as a share of the forward
pass at the same costs (issue 13's target at the checkpointed peak: at most half). ``--bound``: also
a lower bound of what any plan recomputes at that budget, two ways (bench/milp_optimum.py):
``recompute_lower_bound``, an LP on the settled step that leaves out lineage, and
``recompute_lower_bound_lineage``, the same problem as an integer program with a rerun's inputs two
levels deep and the chains of inputs the program freed (tighter; on the MILP's MLP at 0.8 of its
peak it is the optimum itself). ``--no-step-placement``: ``plan="auto"`` with its arena's step placement off
(csrc/step_placement.h; ``plan="off"`` never has it), to measure what the placement does.
``--costs measured``: instead of those rates, each op's cost measured on this CPU once per model
(the median of six unmanaged steps, per op and input shapes: bench/op_costs.py), then fixed, so
decisions still repeat run to run, at the costs ``cost="measured"`` would see (dropout's
``bernoulli_`` dearer than a matmul, which the rates miss). ``--cost-tables DIR``: each model's table
kept in ``DIR/MODEL.json`` (measured and saved when missing, else loaded), so two builds or two days
compare at the same costs.
"""
import argparse
import gc
import json
import os
import statistics
import sys

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see remat_bench.py

import torch  # noqa: E402

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _ROOT)
sys.path.insert(0, os.path.join(_ROOT, "bench"))
import pymem  # noqa: E402
from op_costs import costs_for  # noqa: E402
from pymem.cost_model import CostModel  # noqa: E402
from vs_checkpoint import make, peak_of  # noqa: E402

MiB = 2 ** 20
COST = CostModel(1e11, 1e10, 5e-6)


def run(name, budget, plan, steps, last_step=None, step_placement=True, cost=COST):
    """Per step: (way, recompute seconds, MiB moved); None when the budget is infeasible.
    ``last_step``: a list that gets the last step's trace (``pymem.step_trace()``)."""
    rt = pymem.enable(budget, device="cpu", plan=plan, cost=cost)
    if not step_placement:
        rt.arena.step_placement = False
    rows = []
    try:
        step = make(name, "plain", False, [])
        before = pymem.memory_stats()
        for _ in range(steps):
            way = rt.trace.plan_releases or "-"
            step()
            after = pymem.memory_stats()
            rows.append((way, after["remat_seconds"] - before["remat_seconds"],
                         (after["moved_bytes"] - before["moved_bytes"]) / MiB,
                         after["plan_retained"] - before["plan_retained"]))
            before = after
        if last_step is not None:
            last_step.append(pymem.step_trace())
    except pymem.OutOfBudgetError:
        return None
    finally:
        pymem.disable()
        step = None
        gc.collect()
    return rows


def forward_seconds(name, peak, cost=COST):
    """The forward pass at the fixed costs: the ops of a step (the second, unmanaged in effect:
    twice the peak as budget) that made a value with a recipe (backward and optimizer ops make
    none). Issue 13's measure of recompute: at most half of it at the checkpointed peak."""
    pymem.enable(2 * peak, device="cpu", plan="off", cost=cost)
    try:
        step = make(name, "plain", False, [])
        step()
        step()
        s = pymem.step_trace()
    finally:
        pymem.disable()
        step = None
        gc.collect()
    total = 0.0
    for k in range(len(s["op"])):
        outs = s["outputs"][s["outputs_start"][k]:s["outputs_start"][k + 1]]
        if any(s["value_recomputable"][v] for v in outs):
            total += float(s["op_cost"][k])
    return total


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="transformer,deep,cnn")
    ap.add_argument("--ratios", default="ckpt,0.5,0.3")
    ap.add_argument("--steps", type=int, default=18)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--bound", action="store_true",
                    help="also lower bounds of recompute at each budget (milp_optimum.recompute_lower_bound and _lineage; "
                         "needs highspy)")
    ap.add_argument("--no-step-placement", action="store_true",
                    help='plan="auto" with the arena\'s step placement off (csrc/step_placement.h)')
    ap.add_argument("--costs", choices=("rates", "measured"), default="rates",
                    help="op costs: the fixed rates CostModel(1e11, 1e10, 5e-6), or each op's measured once (op_costs.py)")
    ap.add_argument("--cost-tables", metavar="DIR",
                    help="with --costs measured: each model's table is DIR/MODEL.json, measured and saved there "
                         "when missing, else loaded, so runs on other days or builds use the same costs")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    if a.cost_tables is not None:
        if a.costs != "measured":
            ap.error("--cost-tables needs --costs measured")
        os.makedirs(a.cost_tables, exist_ok=True)
    torch.set_num_threads(a.threads)
    settled_from = pymem._C.PlanChoice.TRIAL_STEPS + 2  # the plan starts at step 3, then the trials
    if a.steps <= settled_from:
        ap.error(f"--steps must be over {settled_from}: the choice settles from step {settled_from + 1}")
    out = {"cost": [COST.flop_rate, COST.byte_rate, COST.launch] if a.costs == "rates" else "measured",
           "settled_from_step": settled_from + 1,
           "step_placement": not a.no_step_placement, "models": {}}
    for name in a.models.split(","):
        peak = peak_of(name, "plain", False, 2)
        ckpt = peak_of(name, "checkpoint", False, 2)
        table = os.path.join(a.cost_tables, f"{name}.json") if a.cost_tables else None
        cost = COST if a.costs == "rates" else costs_for(make(name, "plain", False, []), COST, table)
        forward = forward_seconds(name, peak, cost)
        res = out["models"][name] = {"peak_bytes": peak, "checkpoint_peak_bytes": ckpt, "forward_seconds": forward,
                                     "budgets": {}}
        print(f"{name}: unmanaged peak {peak / MiB:.1f} MiB, checkpointed {ckpt / peak:.3f} of it; "
              f"forward pass {forward:.4f} s at these costs")
        for r in a.ratios.split(","):
            budget = ckpt if r == "ckpt" else int(float(r) * peak)
            budget -= budget % 512
            label = f"{budget / peak:.2f}" + (" (ckpt)" if r == "ckpt" else "")
            entry = res["budgets"][r] = {"budget_bytes": budget}
            for plan in ("off", "auto"):
                last_step = [] if plan == "auto" and a.bound else None
                rows = run(name, budget, plan, a.steps, last_step, not a.no_step_placement, cost)
                if rows is None:
                    entry[plan] = {"feasible": False}
                    print(f"  {label:<12} plan={plan:<4}  infeasible")
                    continue
                tail = rows[settled_from:]
                ways = sorted({w for w, *_ in tail})
                remat = statistics.mean(s for _, s, *_ in tail)
                entry[plan] = {"feasible": True, "steps": rows, "ways_settled": ways,
                               "remat_seconds_settled": remat, "remat_forwards_settled": remat / forward,
                               "moved_mib_settled": statistics.mean(m for _, _, m, _ in tail),
                               "held_settled": statistics.mean(h for *_, h in tail)}
                print(f"  {label:<12} plan={plan:<4}  settled: {remat:.4f} s recompute ({remat / forward:.2f} of a "
                      f"forward), {entry[plan]['moved_mib_settled']:5.1f} MiB moved, {entry[plan]['held_settled']:.1f} "
                      f"values held past their free per step, ways {'/'.join(ways)}")
                print("      " + " ".join(f"{w[:2]}:{s:.3f}" for w, s, *_ in rows))
                if last_step:
                    from milp_optimum import recompute_lower_bound, recompute_lower_bound_lineage
                    bound, _ = recompute_lower_bound(last_step[0], budget)
                    lineage, status = recompute_lower_bound_lineage(last_step[0], budget)
                    entry["recompute_lower_bound"] = bound
                    entry["recompute_lower_bound_lineage"] = lineage
                    if bound is not None:
                        print(f"  {label:<12} lower bound of any plan's recompute: {bound:.4f} s ({bound / forward:.2f} "
                              f"of a forward); with lineage: " + (f"{lineage:.4f} s ({lineage / forward:.2f})"
                                                                  if lineage is not None else status))
        if a.costs == "measured":  # ops the unmanaged steps never ran (a rerun's clone ...): priced by the rates
            res["calls_priced_by_rates"] = dict(cost.misses)
            print(f"  calls priced by the rates (ops and shapes the unmanaged steps did not run): "
                  f"{sum(cost.misses.values())}" + (f", mostly {cost.misses.most_common(1)[0][0]}" if cost.misses else ""))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
