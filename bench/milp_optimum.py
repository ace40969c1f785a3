"""The optimal recompute schedule of a small trace under a budget: Checkmate's MILP (Jain et al.,
"Checkmate: Breaking the Memory Wall with Optimal Tensor Rematerialization", MLSys 2020), solved
with HiGHS (``pip install highspy``; a bench-only dependency).

    python bench/milp_optimum.py [--json FILE] [--time-limit 120]

The trace (pymem.sim) becomes Checkmate's graph: one node per op that makes fresh values (its
outputs' bytes together, its cost on the GPU's rates), an edge from each value's producer to each op
that reads it; values made before the step (parameters, the batch) are a constant that the budget
holds first. Stage t computes node t; R[t,i]: node i is (re)computed in stage t; S[t,i]: node i's
values are kept from stage t-1 into t; U[t,k]: memory after node k in stage t; FREE[t,i,k]: i's
values are freed after node k (Checkmate's linearized hazards). Values with no recipe (made by
backward ops, or alive at the step's end) are never recomputed: a node that is not recomputable is
kept until its last reader (its end, if alive then). Minimise the total compute; the optimum's
recompute = that minus the step's own compute. Each policy's recompute in the simulator at the same
budget is then a multiple of it.

Views and in-place ops are left out (the traces here have none that make values); a trace with
in-place ops is refused.
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def graph_of(trace, seconds):
    """(nodes' bytes, costs, deps, recomputable, alive at the end, constant bytes) of a trace."""
    if (trace.value_overwrites >= 0).any():
        raise ValueError("the MILP takes traces without in-place ops")
    align = 512
    size = -(-trace.value_bytes // align) * align
    node_of_value = {}
    mem, cost, deps, recomp, keep = [], [], [], [], []
    for k in range(trace.num_ops):
        outs = trace.op_outputs(k)
        if len(outs) == 0:
            continue
        n = len(mem)
        for v in outs:
            node_of_value[int(v)] = n
        mem.append(int(size[outs].sum()))
        cost.append(float(seconds[k]))
        deps.append(sorted({node_of_value[int(v)] for v in trace.op_inputs(k) if int(v) in node_of_value}))
        recomp.append(bool(trace.value_recomputable[outs].all()))
        keep.append(bool((trace.value_free_at[outs] < 0).any()))
    constant = int(size[trace.value_producer < 0].sum())
    return mem, cost, deps, recomp, keep, constant


def solve(mem, cost, deps, recomp, keep, budget, time_limit=120.0):
    """Checkmate's MILP. Returns {"status", "total", "recompute", "seconds"}; recompute None when
    infeasible or not solved in time."""
    import highspy

    n = len(mem)
    users = [[] for _ in range(n)]
    for j, ds in enumerate(deps):
        for i in ds:
            users[i].append(j)
    last_use = [max(users[i]) if users[i] else i for i in range(n)]
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("time_limit", float(time_limit))
    inf = highspy.kHighsInf
    col = [0]

    def var(lo, hi, c=0.0, integer=True):
        h.addCol(c, lo, hi, 0, [], [])
        if integer:
            h.changeColIntegrality(col[0], highspy.HighsVarType.kInteger)
        col[0] += 1
        return col[0] - 1

    def row(lo, hi, terms):
        idx = [i for i, _ in terms]
        val = [float(v) for _, v in terms]
        h.addRow(lo, hi, len(idx), idx, val)

    R, S = {}, {}
    for t in range(n):
        for i in range(t + 1):
            fixed = 1 if i == t else (0 if not recomp[i] else None)
            R[t, i] = var(fixed if fixed is not None else 0, fixed if fixed is not None else 1, cost[i])
        for i in range(t):
            must = (keep[i] or not recomp[i]) and (keep[i] or last_use[i] >= t)
            S[t, i] = var(1 if must else 0, 1)
    for t in range(1, n):  # kept only what was there in the stage before
        for i in range(t):
            terms = [(S[t, i], 1), (R[t - 1, i], -1)]
            if i < t - 1:
                terms.append((S[t - 1, i], -1))
            row(-inf, 0, terms)
    for t in range(n):  # an input is computed or kept in the stage that reads it
        for j in range(t + 1):
            for i in deps[j]:
                row(-inf, 0, [(R[t, j], 1), (R[t, i], -1)] + ([(S[t, i], -1)] if i < t else []))
    for t in range(n):  # memory, node by node through the stage
        prev, frees = None, {}
        for k in range(t + 1):
            u = var(0, budget, 0.0, integer=False)
            terms = [(u, 1), (R[t, k], -mem[k])]
            if prev is None:
                terms += [(S[t, i], -mem[i]) for i in range(t)]
            else:
                terms.append((prev, -1))
                for i, f in frees[k - 1]:
                    terms.append((f, mem[i]))
            row(0, 0, terms)
            prev = u
            # FREE[t, i, k]: i's values leave after k (k reads i, or i is k): no later reader in the
            # stage, not kept into the next stage, and k ran
            frees[k] = []
            for i in set(deps[k]) | {k}:
                later = [j for j in users[i] if k < j <= t]
                f = var(0, 1)
                hazards = [(R[t, k], -1)] + [(R[t, j], 1) for j in later]
                const = 1.0
                if t + 1 < n:
                    hazards.append((S[t + 1, i], 1))
                    max_h = 2 + len(later)
                else:
                    const += 1.0 if keep[i] else 0.0
                    max_h = 2 + len(later)
                # 1 - f <= hazards  ->  hazards + f >= 1      (hazards = const + sum)
                row(1 - const, inf, hazards + [(f, 1)])
                # max_h (1 - f) >= hazards  ->  sum + max_h f <= max_h - const
                row(-inf, max_h - const, hazards + [(f, max_h)])
                frees[k].append((i, f))
    t0 = time.perf_counter()
    h.run()
    status = h.modelStatusToString(h.getModelStatus())
    info = h.getInfo()
    total = info.objective_function_value if status in ("Optimal", "Time limit reached") and info.primal_solution_status == 2 else None
    return {"status": status, "total": total, "recompute": None if total is None else total - sum(cost),
            "seconds": time.perf_counter() - t0, "nodes": n}


def main(argv=None) -> int:
    import torch

    from pymem.sim.capture import capture
    from pymem.sim.replay import _op_seconds, simulate

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default="bench/results/milp_optimum.json")
    ap.add_argument("--device", default="h100")
    ap.add_argument("--time-limit", type=float, default=120.0)
    ap.add_argument("--policies", default="dtr,dtr-chain,msps,lru,coop")
    args = ap.parse_args(argv)

    def mlp_step(layers=6, width=1024, batch=8192):
        with torch.device("meta"):
            net = torch.nn.Sequential(*[m for _ in range(layers) for m in (torch.nn.Linear(width, width), torch.nn.Tanh())])
            x = torch.randn(batch, width)

        def step():
            net.zero_grad(set_to_none=True)
            net(x).square().mean().backward()
        return step

    out = {"device": args.device, "traces": {}}
    for name, step in (("mlp-6x1024-batch8192", mlp_step()),):
        step()
        trace = capture(step)
        seconds = _op_seconds(trace, args.device)
        mem, cost, deps, recomp, keep, constant = graph_of(trace, seconds)
        peak = trace.peak_bytes()
        rows = {}
        for ratio in (0.8, 0.6, 0.5, 0.4):
            budget = int(peak * ratio)
            opt = solve(mem, cost, deps, recomp, keep, budget - constant, args.time_limit)
            row = {"milp": opt}
            for p in args.policies.split(","):
                r = simulate(trace, budget, policy=p, device=args.device)
                row[p] = {"status": r["status"], "recompute_seconds": r["recompute_seconds"]}
                if opt["recompute"] and r["status"] != "oom":
                    row[p]["multiple_of_optimum"] = r["recompute_seconds"] / opt["recompute"]
            rows[ratio] = row
            print(f"{name} at {ratio}: MILP {opt['status']} recompute {opt['recompute']} "
                  f"({opt['seconds']:.1f} s, {opt['nodes']} nodes); "
                  + ", ".join(f"{p} {row[p]['recompute_seconds'] * 1e3:.3f} ms" if row[p]["status"] != "oom" else f"{p} oom"
                              for p in args.policies.split(",")), flush=True)
        out["traces"][name] = {"ops": trace.num_ops, "nodes": len(mem), "peak_bytes": peak, "rows": rows}
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
