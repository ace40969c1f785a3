"""Arena micro-benchmarks and fragmentation on a recorded training step.

    python bench/alloc_bench.py [--json FILE] [--quick]

Prints a table and, with --json, writes:
  pair_ns            {"100": ns, "1000": ns, "10000": ns}  allocate+free pair with N live blocks
  malloc_pair_ns     the same pattern against glibc malloc/free, in the same process
  window_search_us   {"1000": us, "10000": us}
  fragmentation      {"0.5": {"window": f, "one_at_a_time": f}, "0.3": {...}}: Coop's measure (free
                     bytes / budget at each allocation that needed eviction, averaged) when a
                     transformer training step's trace is replayed at that fraction of its peak
  replay             the full stats of each replay (evictions, rematerializations, ...)
  lowest_feasible_ratio  {"window": r, "one_at_a_time": r}: the smallest budget / peak at which the
                     replay completes (to 0.005)
Targets: pair <= 150 ns at 10000 live blocks; window search <= 50 us at 10000 blocks; fragmentation
<= 5% for `window` and clearly below `one_at_a_time`.
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pymem  # noqa: E402
from alloc_trace import record, replay  # noqa: E402
from pymem.demo_models import gpt_trainer  # noqa: E402


def lowest_feasible(trace, search, lo=0.05, hi=1.0, tol=0.005):
    """The smallest budget (as a fraction of the trace's peak) at which the replay completes."""
    while hi - lo > tol:
        mid = (lo + hi) / 2
        try:
            replay(trace, int(trace.peak * mid), search)
            hi = mid
        except pymem.OutOfBudgetError:
            lo = mid
    return round(hi, 3)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="write the figures to this file")
    ap.add_argument("--quick", action="store_true", help="fewer iterations (a smoke run)")
    args = ap.parse_args()
    pairs = 200_000 if args.quick else 3_000_000
    torch.set_num_threads(1)  # the replay is about layout, not speed; keep recording deterministic

    res = {"pair_ns": {}, "malloc_pair_ns": {}, "window_search_us": {}, "fragmentation": {}, "replay": {},
           "lowest_feasible_ratio": {}}
    for n in (100, 1000, 10000):
        res["pair_ns"][str(n)] = round(pymem._C._bench_arena_pairs(n, pairs), 1)
        res["malloc_pair_ns"][str(n)] = round(pymem._C._bench_malloc_pairs(n, pairs), 1)
    for n in (1000, 10000):
        res["window_search_us"][str(n)] = round(pymem._C._bench_window_search(n, 200 if args.quick else 2000), 2)

    trace = record(gpt_trainer(batch=16, seq=256))
    res["trace"] = {"ops": len(trace.ops), "peak_bytes": trace.peak,
                    "allocations": sum(len(a) for _, a, _ in trace.ops)}
    for ratio in (0.5, 0.3):
        res["fragmentation"][str(ratio)] = {}
        for search in ("window", "one_at_a_time"):
            try:
                s = replay(trace, int(trace.peak * ratio), search)
                frag = s["fragmentation.pressure"]
            except pymem.OutOfBudgetError as e:
                s, frag = {"error": str(e)}, None
            res["fragmentation"][str(ratio)][search] = None if frag is None else round(frag, 4)
            res["replay"][f"{ratio}/{search}"] = {k: s[k] for k in (
                "error", "budget_bytes", "allocated_bytes.peak", "num_pressure_events", "evictions",
                "rematerializations", "remat_cost", "search_seconds") if k in s}

    for search in ("window", "one_at_a_time"):
        res["lowest_feasible_ratio"][search] = lowest_feasible(trace, search)

    print(f"{'live blocks':>12} {'arena ns/pair':>14} {'malloc ns/pair':>15}")
    for n in res["pair_ns"]:
        print(f"{n:>12} {res['pair_ns'][n]:>14} {res['malloc_pair_ns'][n]:>15}")
    print(f"\n{'blocks':>12} {'window search us':>17}")
    for n, us in res["window_search_us"].items():
        print(f"{n:>12} {us:>17}")
    print(f"\ntrace: {res['trace']['ops']} ops, {res['trace']['allocations']} allocations, "
          f"peak {res['trace']['peak_bytes'] / 2**20:.1f} MiB")
    print(f"{'budget':>8} {'search':>14} {'frag (Coop)':>12} {'pressure':>9} {'evict':>7} {'remat':>7} {'remat MB':>9}")
    for key, s in res["replay"].items():
        ratio, search = key.split("/")
        f = res["fragmentation"][ratio][search]
        if f is None:
            print(f"{ratio:>8} {search:>14}   infeasible: {s['error'][:60]}")
            continue
        print(f"{ratio:>8} {search:>14} {f:>12.2%} {s['num_pressure_events']:>9} {s['evictions']:>7} "
              f"{s['rematerializations']:>7} {s['remat_cost'] / 2**20:>9.1f}")
    print("lowest feasible budget / peak: " +
          ", ".join(f"{k} {v:.3f}" for k, v in res["lowest_feasible_ratio"].items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
