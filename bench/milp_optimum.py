"""The optimal recompute schedule of a small trace under a budget: Checkmate's MILP (Jain et al.,
"Checkmate: Breaking the Memory Wall with Optimal Tensor Rematerialization", MLSys 2020), solved
with HiGHS (``pip install highspy``; a bench-only dependency).

    python bench/milp_optimum.py [--json FILE] [--time-limit 120] [--traces mlp,gpt] [--ratios 0.8,0.6,0.5,0.4]
        [--optima milp,release_only,release_only_main_region] [--policies dtr,dtr-chain,msps,lru,coop]

The trace (pymem.sim) becomes Checkmate's graph: one node per op that makes fresh values (its
outputs' bytes together, its cost on the GPU's rates), an edge from each value's producer to each op
that reads it; values made before the step (parameters, the batch) are a constant that the budget
holds first. Stage t computes node t; R[t,i]: node i is (re)computed in stage t; S[t,i]: node i's
values are kept from stage t-1 into t; U[t,k]: memory after node k in stage t; FREE[t,i,k]: i's
values are freed after node k (Checkmate's linearized hazards). Values with no recipe (made by
backward ops, or alive at the step's end) are never recomputed: a node that is not recomputable is
kept until the program frees it (its end, if alive then). Minimise the total compute; the optimum's
recompute = that minus the step's own compute. Each policy's recompute in the simulator at the same
budget (plan off, and plan auto: the step the runtime's plan settles on) is then a multiple of it.

Checkmate may keep a value past the point where the program frees it (a pre-activation, kept so
that the activation made from it is recomputed cheaply); a runtime that only ever releases what
the program holds (DTR, Capuchin, pymem) cannot. ``milp_release_only`` is the optimum without
that: no value kept past its free. The gap between the two optima is what retention would buy.

``milp_release_only_main_region`` is the release-only optimum with the budget less the arena's
small region (budget / 256, at most 64 MiB: requests of up to 16 KiB go there, so large values have
the rest): what pymem's arena leaves its plans. The gap between the two release-only optima is what
that reserve costs.

Beside the optima, the two lower bounds that bench/plan_ways.py computes for runtime steps far too
long for this MILP (``recompute_lower_bound``, an LP, and ``recompute_lower_bound_lineage``), on the
same trace as step arrays (pymem.sim.plan.step_arrays): a bound above the release-only optimum
would be a wrong one (``recompute_lower_bounds``).

Two traces: a 6-layer MLP (1024 wide, batch 8192) and a one-layer TinyGPT (d 256, 4 heads, seq 256,
batch 8; in eval mode, as dropout writes in place), both on an H100's rates.

A model HiGHS does not solve within ``--time-limit`` gives the best schedule it found (an upper
bound of its optimum) and its proven lower bound (``recompute_proven_at_least``), both printed; a
policy's multiple of that optimum then lies between ``multiple_of_*`` and ``multiple_of_*_at_most``.

Views and in-place ops are left out (the traces here have none that make values); a trace with
in-place ops is refused.
"""
import argparse
import json
import math
import os
import sys
import time
import types

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def graph_of(trace, seconds):
    """(nodes' bytes, costs, deps, recomputable, alive at the end, constant bytes, freed) of a
    trace; freed[i]: the last node computed before the program frees node i's values (n - 1:
    never)."""
    if (trace.value_overwrites >= 0).any():
        raise ValueError("the MILP takes traces without in-place ops")
    align = 512
    size = -(-trace.value_bytes // align) * align
    node_of_value = {}
    mem, cost, deps, recomp, keep, op_of = [], [], [], [], [], []
    for k in range(trace.num_ops):
        outs = trace.op_outputs(k)
        if len(outs) == 0:
            continue
        n = len(mem)
        op_of.append(k)
        for v in outs:
            node_of_value[int(v)] = n
        mem.append(int(size[outs].sum()))
        cost.append(float(seconds[k]))
        deps.append(sorted({node_of_value[int(v)] for v in trace.op_inputs(k) if int(v) in node_of_value}))
        recomp.append(bool(trace.value_recomputable[outs].all()))
        keep.append(bool((trace.value_free_at[outs] < 0).any()))
    constant = int(size[trace.value_producer < 0].sum())
    freed = []
    for k in op_of:
        f = trace.value_free_at[trace.op_outputs(k)]
        last_op = trace.num_ops if (f < 0).any() else int(f.max())
        freed.append(sum(1 for o in op_of if o <= last_op) - 1)
    return mem, cost, deps, recomp, keep, constant, freed


def solve(mem, cost, deps, recomp, keep, budget, time_limit=120.0, freed=None, release_only=False):
    """Checkmate's MILP. Returns {"status", "total", "recompute", "seconds", "reruns"}; recompute None
    when infeasible or not solved in time; reruns: the schedule's (stage, node) pairs, node rerun in
    the stage that computes the other (graph_of's node numbers). ``freed`` (graph_of's): where the
    program frees each node's values; a value with no recipe is held until then. ``release_only``:
    no value is kept past that point either, as a runtime that only ever releases what the program
    holds (DTR, Capuchin, pymem) cannot; else Checkmate's own model, which may keep a recomputable
    value as long as it likes."""
    import highspy

    if release_only and freed is None:
        raise ValueError("release_only needs freed (graph_of's): where the program frees each node")
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
            # What has no recipe stays while the program holds it: autograd frees a backward
            # temporary when its node ends, not at its last read (a runtime cannot release it).
            must = keep[i] or (not recomp[i] and max(last_use[i], freed[i] if freed is not None else -1) >= t)
            gone = release_only and recomp[i] and not keep[i] and t > freed[i]
            S[t, i] = var(1 if must else 0, 0 if gone and not must else 1)
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
    x = h.getSolution().col_value if total is not None else None
    reruns = sorted((t, i) for (t, i), c in R.items() if i < t and x[c] > 0.5) if x is not None else None
    recomputed = sorted({i for _, i in reruns}) if reruns is not None else None
    # Stopped at the time limit, the schedule found is only an upper bound of the optimum; the
    # solver's dual bound is a lower one, so a policy's multiple of the optimum lies between.
    bound = info.mip_dual_bound if status in ("Optimal", "Time limit reached") else None
    return {"status": status, "total": total, "recompute": None if total is None else total - sum(cost),
            "recompute_proven_at_least": max(0.0, bound - sum(cost)) if bound is not None and math.isfinite(bound) else None,
            "seconds": time.perf_counter() - t0, "nodes": n, "recomputed_nodes": recomputed,
            "reruns": reruns}


def _step_profile(step, budget):
    """What both bounds start from: a step's arrays (``pymem.step_trace()``'s), each value's uses
    (each op once), its aligned bytes and death (its last use, or where the step recorded it freed;
    made before the step: the end), and the bytes over ``budget`` at each position, the op's
    temporaries (``op_transient``, where recorded) counted at it."""
    import numpy as np

    n, m = len(step["op"]), len(step["value_bytes"])
    p = types.SimpleNamespace(n=n, m=m, size=-(-np.asarray(step["value_bytes"], np.int64) // 512) * 512,
                              producer=np.asarray(step["value_producer"]),
                              recomputable=np.asarray(step["value_recomputable"]).astype(bool),
                              inputs_start=np.asarray(step["inputs_start"]), inputs=np.asarray(step["inputs"]),
                              cost=np.asarray(step["op_cost"], np.float64),
                              free_at=np.asarray(step.get("value_free_at", [])))
    p.uses = [[] for _ in range(m)]
    for k in range(n):
        for v in sorted({int(v) for v in p.inputs[p.inputs_start[k]:p.inputs_start[k + 1]]}):
            p.uses[v].append(k)
    p.death = np.empty(m, np.int64)
    delta = np.zeros(n + 1, np.int64)
    for v in range(m):
        last, made = (p.uses[v][-1] if p.uses[v] else -1), int(p.producer[v])
        died = last if len(p.free_at) == 0 else (n - 1 if p.free_at[v] < 0 else int(p.free_at[v]))
        p.death[v] = n - 1 if made < 0 else max(last, made, died)
        delta[max(made, 0)] += p.size[v]
        delta[p.death[v] + 1] -= p.size[v]
    transient = np.asarray(step.get("op_transient", np.zeros(n)), np.int64)  # an op's temporaries, at the op
    p.over = np.maximum(np.cumsum(delta)[:n] + transient - budget, 0)
    return p


def recompute_lower_bound(step, budget, time_limit=120.0):
    """A lower bound of the recompute any plan needs for a step under ``budget`` bytes, for traces
    far too long for the MILP (a runtime step of thousands of ops; ``step``: step arrays as
    ``pymem.step_trace()`` gives them, at fixed op costs). The covers' own problem
    (csrc/plan_cover.h), relaxed: the live bytes of the step that releases nothing (a value holds
    its aligned bytes from its producer to its death: its last use, or where it was freed when the
    step records that; made before the step: throughout) must come down to the budget at every
    position, by values away across gaps between their uses (or from their producer to their first
    use), each at its producer's cost shared among that op's outputs (a rerun brings them all
    back), or across the tail after their last use (free); each away stretch a variable in [0, 1],
    covering at most the overflow where it lies. Left out, each making the bound lower: a rerun's
    inputs must be there (lineage), what a rerun's kernel allocates, fragmentation. Returns
    (bound in seconds, or None when HiGHS did not solve it; the stretches it uses)."""
    import highspy
    import numpy as np

    prof = _step_profile(step, budget)
    n, m, size, producer, recomputable = prof.n, prof.m, prof.size, prof.producer, prof.recomputable
    cost, uses, death, over = prof.cost, prof.uses, prof.death, prof.over
    outputs_count = np.diff(np.asarray(step["outputs_start"]))
    rows = np.flatnonzero(over > 0)
    if len(rows) == 0:
        return 0.0, []
    row_of = np.full(n, -1, np.int64)
    row_of[rows] = np.arange(len(rows))
    stretches, col_cost, starts, index, coef = [], [], [], [], []
    for v in range(m):
        p = int(producer[v])
        if p < 0 or not recomputable[v]:
            continue
        share, prev, gaps = cost[p] / max(int(outputs_count[p]), 1), p, []
        for u in uses[v]:
            if u - prev >= 2:
                gaps.append((prev, u, share))
            prev = max(prev, u)
        if death[v] > prev:
            gaps.append((prev, int(death[v]) + 1, 0.0))
        for after, until, c in gaps:
            ks = rows[(rows > after) & (rows < until)]
            if len(ks):
                stretches.append((v, after, until))
                starts.append(len(index))
                col_cost.append(c)
                index.extend(row_of[ks].tolist())
                coef.extend(np.minimum(size[v], over[ks]).astype(float).tolist())
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("time_limit", float(time_limit))
    h.addRows(len(rows), over[rows].astype(float), np.full(len(rows), highspy.kHighsInf), 0,
              np.array([], np.int32), np.array([], np.int32), np.array([], float))
    h.addCols(len(col_cost), np.array(col_cost), np.zeros(len(col_cost)), np.ones(len(col_cost)), len(index),
              np.array(starts, np.int32), np.array(index, np.int32), np.array(coef, float))
    h.run()
    if h.modelStatusToString(h.getModelStatus()) != "Optimal":
        return None, []
    x = h.getSolution().col_value
    return h.getInfo().objective_function_value, [stretches[i] for i in range(len(stretches)) if x[i] > 1e-6]


def _unread_overwrites(step, overwrote):
    """By value: the value its producer wrote over without reading it, else -1. An op whose name this
    process does not know (a trace from another process) counts as not reading it: the bound may
    only get lower for it."""
    from pymem import _C
    from pymem.runtime.ops import overwrites_unread

    names = {}
    unread = []
    for v, w in enumerate(overwrote.tolist()):
        if w < 0:
            unread.append(-1)
            continue
        code = int(step["op"][int(step["value_producer"][v])])
        if code not in names:
            try:
                names[code] = overwrites_unread(_C.op_name(code))
            except IndexError:
                names[code] = True
        unread.append(w if names[code] else -1)
    return unread


def recompute_lower_bound_lineage(step, budget, depth=2, time_limit=120.0):
    """``recompute_lower_bound``'s problem with lineage, as an integer program: a tighter lower
    bound of any plan's recompute for ``step`` under ``budget`` bytes. Returns (the solver's proven
    bound in seconds, or None when it found none in ``time_limit``; its status).

    Each gap of a value (as there: between two of its uses, from its producer to its first use, or
    the tail after its last) is cut where its readers, up to ``depth`` levels down, are used inside
    it: a reader away until then is rerun there, and its producer reads the value. Each piece is
    away or not (binary). A value returns at the gap's end when the last piece is away (its own
    use), and at a cut when the piece before is away and either the one after is there or a reader
    is rerun at the cut (back for that rerun, then free to go again). A return is a rerun of its
    producer, at that op's cost: any of its reruns since the value left (one brings all its outputs
    back). Where the step records its
    deaths (``value_free_at``: the simulator's traces, and the runtime's steps that followed their
    plan; without them a value may outlive its last use), a rerun after the program freed a
    recomputable input needs that input
    rebuilt: once per value (it may be kept from one rerun to the next), in one of its producer's
    reruns or one more, and so the inputs of that one the program freed no later (dead by then
    too). An input without a recipe is there (the runtime holds what a recipe reads).

    Why it stays a bound: a plan that brings a value back between cuts, or releases it inside a
    piece, does no better than the piece away whole, back at its end (as many reruns, no more
    bytes). Left out, each lowering the bound as the LP's relaxations do: needs where no cut is
    (deeper than ``depth``), the bytes a rerun brings back, kernels' temporaries, fragmentation; a
    piece away after a cut counts as away at the cut too. On this file's traces it never exceeds
    the release-only optimum (the MLP at 0.8 of its peak: equal to it)."""
    import highspy
    import numpy as np

    prof = _step_profile(step, budget)
    n, m, size, producer, recomputable = prof.n, prof.m, prof.size, prof.producer, prof.recomputable
    inputs_start, inputs, cost, free_at = prof.inputs_start, prof.inputs, prof.cost, prof.free_at
    uses, death, over = prof.uses, prof.death, prof.over
    if not (over > 0).any():
        return 0.0, "Optimal"
    # What rerunning v's producer reads: not the value an op that overwrites without reading
    # (fill_, bernoulli_: a rerun writes a blank buffer) wrote over to make v. An in-place op that
    # reads it (div_ scaling a dropout mask) reads it again: the mask's rerun needs bernoulli_'s.
    overwrote = np.asarray(step.get("value_overwrites", np.full(m, -1)))
    unread = _unread_overwrites(step, overwrote)
    reads = [sorted({int(w) for w in inputs[inputs_start[p]:inputs_start[p + 1]]} - {v, unread[v]})
             if p >= 0 else [] for v, p in enumerate(producer.tolist())]
    readers = [[] for _ in range(m)]
    for u in range(m):
        for w in reads[u]:
            readers[w].append(u)
    col_cost, integral = [], []
    rows = []  # (lower, upper, [(column, coefficient)])
    cover = [[] for _ in range(n)]

    def column(c, integer):
        col_cost.append(c)
        integral.append(integer)
        return len(col_cost) - 1

    runs = {}  # (op, position) -> the column of its rerun there, at its cost: once for all its outputs
    returns = []  # (op, gap start, position, column): a return needs a rerun in (start, position]

    def rerun(v, after, t, r):  # return `r` of value v at t (away since `after` at the earliest)
        key = (int(producer[v]), t)
        if key not in runs:
            runs[key] = column(cost[key[0]], False)
        returns.append((key[0], after, t, r))
        return r

    rebuilds = {}  # op -> rebuild columns of its outputs (at some position: a rerun there, or one more)

    back = {}  # (value, its use t) -> the column of its return there
    back_at_cut = {}  # (value, cut t) -> (the piece before t, the return column at t)
    for v in range(m):
        if producer[v] < 0 or not recomputable[v]:
            continue
        below, cuts = {v}, set()  # readers up to `depth` levels down, and where they are used
        for _ in range(depth):
            below = {u for x in below for u in readers[x]}
            cuts.update(t for u in below for t in uses[u])
        cuts = sorted(cuts)
        prev, gaps = int(producer[v]), []
        for u in uses[v]:
            if u - prev >= 2:
                gaps.append((prev, u, False))
            prev = max(prev, u)
        if death[v] > prev:
            gaps.append((prev, int(death[v]) + 1, True))
        for after, until, tail in gaps:
            inner = [t for t in cuts if after < t < until]
            ends = [after] + inner + [until]
            pieces = []
            for j in range(len(ends) - 1):
                y = column(0.0, True)
                pieces.append(y)
                for k in range(ends[j] + 1 if j == 0 else ends[j], min(ends[j + 1], n)):
                    if over[k] > 0:
                        cover[k].append((y, min(size[v], over[k])))
            for j, t in enumerate(inner):
                r = rerun(v, after, t, column(0.0, False))
                rows.append((0.0, np.inf, [(r, 1.0), (pieces[j], -1.0), (pieces[j + 1], 1.0)]))
                back_at_cut[v, t] = (pieces[j], r)
            if not tail:
                r = rerun(v, after, until, column(0.0, False))
                rows.append((0.0, np.inf, [(r, 1.0), (pieces[-1], -1.0)]))
                back[v, until] = r
    rebuilt = {}

    def rebuild(w):  # w's column: rebuilt at least once; what it reads that died no later, too
        if w not in rebuilt:
            rebuilt[w] = column(0.0, False)
            rebuilds.setdefault(int(producer[w]), []).append(rebuilt[w])
            for x in reads[w]:
                if gone(x, death[w] + 1) and death[x] <= death[w]:
                    rows.append((0.0, np.inf, [(rebuild(x), 1.0), (rebuilt[w], -1.0)]))
        return rebuilt[w]

    # Gone at t: freed by the program before. Not a value without a recipe (the runtime holds what a
    # recipe reads), nor any where deaths were not observed (a value may outlive its last use, held
    # by the program).
    deaths_known = len(free_at) > 0

    def gone(w, t):  # one op of slack: the runtime notes a death one op early where it cannot tell
        return deaths_known and producer[w] >= 0 and recomputable[w] and t > death[w] + 1

    for (u, t), r_u in list(back.items()) + [(k, r) for k, (_, r) in back_at_cut.items()]:
        for w in reads[u]:
            if producer[w] < 0:
                continue
            if gone(w, t):  # rebuilt for the rerun
                rows.append((0.0, np.inf, [(rebuild(w), 1.0), (r_u, -1.0)]))
            elif (w, t) in back_at_cut:  # back at the cut if away before it
                before, r_w = back_at_cut[w, t]
                rows.append((-1.0, np.inf, [(r_w, 1.0), (before, -1.0), (r_u, -1.0)]))
    # One rerun brings all of an op's outputs back: a return is one of its op's reruns since the
    # value left (any there, not only one at its own position).
    at_positions = {}
    for (op, t), z in runs.items():
        at_positions.setdefault(op, []).append((t, z))
    for op, after, t, r in returns:
        rows.append((0.0, np.inf, [(r, -1.0)] + [(z, 1.0) for u, z in at_positions[op] if after < u <= t]))
    for op, cols in rebuilds.items():  # rebuilt: in one of the op's reruns, or one more of its own
        extra = column(cost[op], False)
        for r in cols:
            rows.append((0.0, np.inf, [(extra, 1.0), (r, -1.0)] + [(z, 1.0) for _, z in at_positions.get(op, [])]))
    for k in np.flatnonzero(over > 0):
        rows.append((float(over[k]), np.inf, [(c, float(x)) for c, x in cover[k]]))
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("time_limit", float(time_limit))
    nc = len(col_cost)
    h.addVars(nc, np.zeros(nc), np.ones(nc))
    h.changeColsCost(nc, np.arange(nc, dtype=np.int32), np.array(col_cost))
    ints = np.flatnonzero(integral).astype(np.int32)
    h.changeColsIntegrality(len(ints), ints, np.full(len(ints), highspy.HighsVarType.kInteger))
    starts, index, coef = [], [], []
    for _, _, terms in rows:
        starts.append(len(index))
        index.extend(c for c, _ in terms)
        coef.extend(x for _, x in terms)
    upper = np.array([highspy.kHighsInf if np.isinf(hi) else hi for _, hi, _ in rows])
    h.addRows(len(rows), np.array([lo for lo, _, _ in rows]), upper, len(index), np.array(starts, np.int32),
              np.array(index, np.int32), np.array(coef, float))
    h.run()
    status = h.modelStatusToString(h.getModelStatus())
    bound = h.getInfo().mip_dual_bound if status in ("Optimal", "Time limit reached") else None
    return (bound if bound is not None and np.isfinite(bound) else None), status


def _described(key, opt):
    """One solve() result in words: its recompute, and its proven lower bound where not solved."""
    if opt["recompute"] is None:
        return f"{key} {opt['status']}"
    bound = opt["recompute_proven_at_least"]
    proven = f" (proven at least {bound * 1e3:.3f})" if opt["status"] != "Optimal" and bound is not None else ""
    return f"{key} {opt['status']} recompute {opt['recompute'] * 1e3:.3f} ms{proven} ({opt['seconds']:.0f} s)"


# --optima's names -> the keys the output gives each optimum
OPTIMA = {"milp": "milp", "release_only": "milp_release_only",
          "release_only_main_region": "milp_release_only_main_region"}


def main(argv=None) -> int:
    import torch

    from pymem import _C
    from pymem.sim.capture import capture
    from pymem.sim.plan import step_arrays
    from pymem.sim.replay import _op_seconds, simulate

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default="bench/results/milp_optimum.json")
    ap.add_argument("--device", default="h100")
    ap.add_argument("--time-limit", type=float, default=120.0)
    ap.add_argument("--policies", default="dtr,dtr-chain,msps,lru,coop")
    ap.add_argument("--traces", default="mlp,gpt", help="which traces: mlp, gpt (comma-separated)")
    ap.add_argument("--ratios", default="0.8,0.6,0.5,0.4", help="budgets as shares of the trace's peak")
    ap.add_argument("--optima", default=",".join(OPTIMA),
                    help="which optima to solve (comma-separated): milp (Checkmate's), release_only (the whole budget), "
                         "release_only_main_region; one long solve need not wait for the others")
    args = ap.parse_args(argv)
    optima_asked = args.optima.split(",")
    if not optima_asked or any(o not in OPTIMA for o in optima_asked):
        ap.error(f"--optima takes {', '.join(OPTIMA)}, comma-separated; got {args.optima!r}")
    traces = args.traces.split(",")
    if not traces or any(t not in ("mlp", "gpt") for t in traces):
        ap.error(f"--traces takes mlp and/or gpt, comma-separated; got {args.traces!r}")
    try:
        ratios = [float(r) for r in args.ratios.split(",")]
    except ValueError:
        ratios = []
    if not ratios or any(not 0 < r <= 1 for r in ratios):
        ap.error(f"--ratios takes shares of the peak in (0, 1], comma-separated; got {args.ratios!r}")

    def mlp_step(layers=6, width=1024, batch=8192):
        with torch.device("meta"):
            net = torch.nn.Sequential(*[m for _ in range(layers) for m in (torch.nn.Linear(width, width), torch.nn.Tanh())])
            x = torch.randn(batch, width)

        def step():
            net.zero_grad(set_to_none=True)
            net(x).square().mean().backward()
        return step

    def gpt_step(layers=1, d=256, seq=256, batch=8, vocab=512):
        from pymem.demo_models import TinyGPT

        with torch.device("meta"):
            model = TinyGPT(vocab=vocab, d=d, heads=4, layers=layers, seq=seq)
            idx = torch.randint(0, vocab, (batch, seq))
        model.eval()  # dropout's bernoulli_ writes in place: the MILP takes none

        def step():
            model.zero_grad(set_to_none=True)
            logits = model(idx[:, :-1])
            torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), idx[:, 1:].reshape(-1)).backward()
        return step

    out = {"device": args.device, "traces": {}}
    chosen = {"mlp": ("mlp-6x1024-batch8192", mlp_step), "gpt": ("gpt-1x256-seq256-batch8", gpt_step)}
    for name, step in [(chosen[t][0], chosen[t][1]()) for t in traces]:
        step()
        trace = capture(step)
        seconds = _op_seconds(trace, args.device)
        mem, cost, deps, recomp, keep, constant, freed = graph_of(trace, seconds)
        peak = trace.peak_bytes()
        rows = {}
        for ratio in ratios:
            budget = int(peak * ratio)
            main_region = budget - _C.Arena(budget // _C.ALIGNMENT * _C.ALIGNMENT, "virtual").small_region_size
            solvers = {"milp": lambda: solve(mem, cost, deps, recomp, keep, budget - constant, args.time_limit, freed),
                       "release_only": lambda: solve(mem, cost, deps, recomp, keep, budget - constant, args.time_limit,
                                                     freed, release_only=True),
                       "release_only_main_region": lambda: solve(mem, cost, deps, recomp, keep, main_region - constant,
                                                                 args.time_limit, freed, release_only=True)}
            optima = {OPTIMA[o]: solvers[o]() for o in optima_asked}
            row = dict(optima)
            # The bounds for steps far too long for the MILP, checked here against its optimum: never above it.
            step_dict = step_arrays(trace, seconds)
            bounds = {"lp": recompute_lower_bound(step_dict, budget)[0],
                      "lineage": recompute_lower_bound_lineage(step_dict, budget, time_limit=args.time_limit)[0]}
            row["recompute_lower_bounds"] = bounds
            for p in args.policies.split(","):
                for plan in ("off", "auto"):
                    r = simulate(trace, budget, policy=p, plan=plan, device=args.device)
                    e = row[f"{p}/{plan}"] = {"status": r["status"], "recompute_seconds": r["recompute_seconds"],
                                              "plan_releases": r.get("plan_releases")}
                    for key, opt in optima.items():
                        if opt["recompute"] and r["status"] != "oom":
                            e[f"multiple_of_{key}"] = r["recompute_seconds"] / opt["recompute"]
                            if opt["recompute_proven_at_least"]:  # the multiple of the true optimum is at most this
                                e[f"multiple_of_{key}_at_most"] = r["recompute_seconds"] / opt["recompute_proven_at_least"]
            rows[ratio] = row
            print(f"{name} at {ratio}: " + "; ".join(_described(key, opt) for key, opt in optima.items()) + "; bounds "
                  + ", ".join(f"{k} {v * 1e3:.3f} ms" if v is not None else f"{k} none" for k, v in bounds.items()), flush=True)
            print("  " + ", ".join(f"{k} {v['recompute_seconds'] * 1e3:.3f} ms" if v["status"] != "oom" else f"{k} oom"
                                   for k, v in row.items() if "/" in k), flush=True)
        out["traces"][name] = {"ops": trace.num_ops, "nodes": len(mem), "peak_bytes": peak, "rows": rows}
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
