"""Where a settled plan's recompute goes: one model and budget, fixed op costs, the last step taken apart.

    python bench/plan_gap.py [--model transformer|deep|cnn] [--ratio 0.3|ckpt] [--steps 16]
                             [--costs rates|measured] [--cost-tables DIR] [--json FILE]

bench/plan_ways.py says how much each way of planning recomputes; this says why, for the step the
choice settled on (the last of ``--steps``, run under ``plan="auto"`` at fixed op costs, so it
repeats run to run). From that step's trace (``pymem.step_trace()``) and the releases it made:

- each release, by who made it (the plan, or the pressure handler for an allocation the plan did
  not foresee), by whether the value had been brought back earlier in the step (a rerun's input
  rebuilt on the way, kept until pressure took it) or not, and whether the step reads it again;
- the pressure handler's calls: at which op, the request and the main region's free bytes then
  (free bytes above the request: the holes were too small, fragmentation);
- what came back: reruns by op (count and seconds at the fixed costs), and the values brought
  back more than once (a chain rebuilt from far back, its links taken again before their reads).

Issue 13's gaps measured with it are in README (Benchmarks, under vs_checkpoint.py).
"""
import argparse
import collections
import json
import os
import sys

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see remat_bench.py

import torch  # noqa: E402

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _ROOT)
sys.path.insert(0, os.path.join(_ROOT, "bench"))
import pymem  # noqa: E402
from op_costs import costs_for  # noqa: E402
from plan_ways import COST  # noqa: E402
from pymem.runtime import pressure, residency  # noqa: E402
from vs_checkpoint import make, peak_of  # noqa: E402

MiB = 2 ** 20


class _Watch:
    """The releases of the step being watched, each with whether the pressure handler made it, and
    the handler's calls (request, free bytes, how many releases before it). Wraps two methods for
    the run: a diagnostic's view from outside, nothing it decides changes."""

    def __init__(self):
        self.on = False
        self.in_handler = False
        self.releases = []  # (trace value, by the handler, bytes)
        self.calls = []     # (request, main free bytes, index of the first release after it)
        self._call, self._release = pressure.PressureHandler.__call__, residency.Residency.release
        watch = self

        def call(handler, request, window):
            if watch.on:
                watch.calls.append((request, handler.rt.arena.main_free_bytes, len(watch.releases)))
            watch.in_handler = True
            try:
                return watch._call(handler, request, window)
            finally:
                watch.in_handler = False

        def release(res, r, *args, **kwargs):
            if watch.on:
                watch.releases.append((r.trace_value, watch.in_handler, r.nbytes))
            return watch._release(res, r, *args, **kwargs)

        pressure.PressureHandler.__call__, residency.Residency.release = call, release

    def close(self):
        pressure.PressureHandler.__call__, residency.Residency.release = self._call, self._release


def take_apart(step, watch):
    """The watched step's releases, pressure calls and comebacks, as printable rows and a summary."""
    names = [pymem._C.op_name(int(c)) for c in step["op"]]
    n = len(names)
    reads = collections.defaultdict(list)
    for k in range(n):
        for v in step["inputs"][step["inputs_start"][k]:step["inputs_start"][k + 1]]:
            reads[int(v)].append(k)
    backs = collections.defaultdict(list)
    for at, v in zip(step["back_at"], step["back_value"]):
        backs[int(v)].append(int(at))
    released_at = [int(a) for a in step["released_at"]]
    if len(released_at) != len(watch.releases):  # a release the trace did not book (an unplanned step)
        raise RuntimeError(f"the trace booked {len(released_at)} releases, the watch saw {len(watch.releases)}")
    kinds = collections.OrderedDict()
    rows = []
    for (v, by_handler, nbytes), at in zip(watch.releases, released_at):
        again = next((k for k in reads[v] if k > at), None)
        kind = ("pressure" if by_handler else "plan") + (", rebuilt" if any(b <= at for b in backs[v]) else "") + \
            (", read again" if again is not None else ", not read again")
        count, total = kinds.get(kind, (0, 0))
        kinds[kind] = (count + 1, total + nbytes)
        if by_handler:
            p = int(step["value_producer"][v])
            rows.append(f"  at {at:4d} {names[at][:30]:30s} v{v:<5d} {nbytes / MiB:7.2f} MiB of "
                        f"{names[p][:28] if p >= 0 else 'before the step':28s} read again at {again}")
    calls = []
    for request, free, first in watch.calls:
        at = released_at[first] if first < len(released_at) else None
        calls.append({"at": at, "request_bytes": request, "main_free_bytes": free})
    by_op = collections.Counter()
    seconds = collections.Counter()
    for v, ats in backs.items():
        p = int(step["value_producer"][v])
        op = names[p] if p >= 0 else "before the step (copied back)"
        by_op[op] += len(ats)
        seconds[op] += len(ats) * (float(step["op_cost"][p]) if p >= 0 else 0.0)
    repeated = {v: ats for v, ats in backs.items() if len(ats) > 1}
    return names, kinds, rows, calls, by_op, seconds, repeated


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="transformer", choices=("transformer", "deep", "cnn"))
    ap.add_argument("--ratio", default="0.3", help="a share of the unmanaged peak, or ckpt (the checkpointed peak)")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--costs", choices=("rates", "measured"), default="rates")
    ap.add_argument("--cost-tables", metavar="DIR", help="as bench/plan_ways.py's")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    settled_from = pymem._C.PlanChoice.TRIAL_STEPS + 2
    if a.steps <= settled_from:
        ap.error(f"--steps must be over {settled_from}: the choice settles from step {settled_from + 1}")
    if a.ratio != "ckpt":
        try:
            ratio = float(a.ratio)
        except ValueError:
            ap.error(f"--ratio must be a number in (0, 1] or ckpt, got {a.ratio!r}")
        if not 0 < ratio <= 1:
            ap.error(f"--ratio must be a number in (0, 1] or ckpt, got {a.ratio!r}")
    if a.cost_tables is not None:
        if a.costs != "measured":
            ap.error("--cost-tables needs --costs measured")
        os.makedirs(a.cost_tables, exist_ok=True)
    torch.set_num_threads(a.threads)
    peak = peak_of(a.model, "plain", False, 2)
    budget = peak_of(a.model, "checkpoint", False, 2) if a.ratio == "ckpt" else int(ratio * peak)
    budget -= budget % 512
    table = os.path.join(a.cost_tables, f"{a.model}.json") if a.cost_tables else None
    cost = COST if a.costs == "rates" else costs_for(make(a.model, "plain", False, []), COST, table)
    watch = _Watch()
    rt = pymem.enable(budget, device="cpu", plan="auto", cost=cost)
    ways = []
    try:
        step = make(a.model, "plain", False, [])
        before = pymem.memory_stats()
        for i in range(a.steps):
            ways.append(rt.trace.plan_releases or "-")
            watch.on = i == a.steps - 1
            step()
            after = pymem.memory_stats()
            if watch.on:
                remat = after["remat_seconds"] - before["remat_seconds"]
                moved = after["moved_bytes"] - before["moved_bytes"]
            before = after
        trace = pymem.step_trace()
    finally:
        watch.close()
        pymem.disable()
    names, kinds, rows, calls, by_op, seconds, repeated = take_apart(trace, watch)
    print(f"{a.model} at {budget / peak:.2f} of its {peak / MiB:.1f} MiB peak ({budget / MiB:.1f} MiB), "
          f"{a.costs} costs; ways {' '.join(w[:2] for w in ways)}")
    print(f"last step ({ways[-1]}): {len(names)} ops, recompute {remat:.4f} s, {moved / MiB:.1f} MiB moved, "
          f"{len(watch.releases)} releases, {len(trace['back_at'])} comebacks, {len(calls)} pressure calls")
    print("releases:")
    for kind, (count, nbytes) in kinds.items():
        print(f"  {kind:40s} {count:4d}  {nbytes / MiB:8.1f} MiB")
    print("releases the pressure handler made:")
    print("\n".join(rows) if rows else "  none")
    fragmented = sum(1 for c in calls if c["main_free_bytes"] >= c["request_bytes"])
    print(f"pressure calls with the free bytes above the request (holes too small): {fragmented} of {len(calls)}")
    print("comebacks by op (count, seconds at these costs):")
    for op, c in by_op.most_common():
        print(f"  {op[:44]:44s} {c:4d}  {seconds[op]:.4f}")
    print(f"values brought back more than once: {len(repeated)}"
          + (" (" + ", ".join(f"v{v} x{len(ats)}" for v, ats in sorted(repeated.items())[:12]) + ")" if repeated else ""))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"model": a.model, "budget_bytes": budget, "peak_bytes": peak, "costs": a.costs, "ways": ways,
                       "remat_seconds": remat, "moved_bytes": moved,
                       "releases": {k: {"count": c, "bytes": b} for k, (c, b) in kinds.items()},
                       "pressure_calls": calls,
                       "comebacks_by_op": {op: {"count": c, "seconds": seconds[op]} for op, c in by_op.items()},
                       "values_back_more_than_once": {str(v): ats for v, ats in repeated.items()}}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
