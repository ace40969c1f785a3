"""How low the budget goes when values with no recipe are offloaded too (issue 15).

    python bench/offload_bench.py [--models transformer,cnn,wide] [--tol 0.01] [--steps 2] [--json FILE]

For each model, in one process, the lowest feasible budget (share of the unmanaged peak, every CPU
tensor byte counted as bench/vs_checkpoint.py counts it) found by bisection with --steps-step runs,
under three settings:
  recompute   offload="never": only activations are released (the CPU default; the floor before
              issue 15)
  activations offload="always", offload_leaves=False: activations offloaded, leaves stay
  leaves      offload="always" (offload_leaves by default): gradients, Adam state and parameters
              offloaded too
A run is feasible when it finishes within the budget (pymem.OutOfBudgetError otherwise). Then one
timed block per setting at the leaves' floor and at 0.4 (slowdown: median step / unmanaged median
step, measured just before). Models: the transformer and the CNN of bench/remat_bench.py, and
"wide", an MLP whose parameters, gradients and Adam state are most of its peak.

Targets (issue 15): the leaves' floor at most half the recompute floor for the transformer and the
CNN; "wide" feasible at 0.4 of its peak.
"""
import argparse
import gc
import json
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see remat_bench.py

import torch  # noqa: E402

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _ROOT)
sys.path.insert(0, os.path.join(_ROOT, "bench"))
import pymem  # noqa: E402
import vs_checkpoint as vc  # noqa: E402
from pymem.demo_models import wide_trainer  # noqa: E402

SETTINGS = {"recompute": dict(offload="never"),
            "activations": dict(offload="always", offload_leaves=False),
            "leaves": dict(offload="always")}


def make(name):
    return wide_trainer() if name == "wide" else vc.make(name, "plain", False, [])


def peak_of(name, steps=2):
    arena = pymem.Arena(8 << 30, small_threshold=0)
    pymem.install_cpu_hook(arena)
    try:
        step = make(name)
        for _ in range(steps):
            step()
        return arena.stats()["allocated_bytes.peak"]
    finally:
        pymem.uninstall_cpu_hook()
        gc.collect()


def run(name, budget, options, steps, timed=0):
    """(feasible, median seconds of `timed` steps after `steps`, stats or the error)."""
    budget -= budget % 512
    pymem.enable(budget, device="cpu", **options)
    step = None
    try:
        step = make(name)
        for _ in range(steps):
            step()
        seconds = _median_step(step, timed) if timed else None
        return True, seconds, dict(pymem.memory_stats())
    except pymem.OutOfBudgetError as e:
        return False, None, str(e)[:200]
    finally:
        pymem.disable()
        step = None
        gc.collect()


def floor(name, peak, options, a, log):
    lo, hi = 0.02, 1.0
    ok, _, _ = run(name, int(hi * peak), options, a.steps)
    if not ok:
        return None
    while hi - lo > a.tol:
        mid = (lo + hi) / 2
        ok, _, _ = run(name, int(mid * peak), options, a.steps)
        log(f"    {mid:.3f}: {'ok' if ok else 'infeasible'}")
        if ok:
            hi = mid
        else:
            lo = mid
    return hi


def _median_step(step, n):
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def unmanaged_step(name, n):
    step = make(name)
    step()
    seconds = _median_step(step, n)
    del step
    gc.collect()
    return seconds


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="transformer,cnn,wide")
    ap.add_argument("--tol", type=float, default=0.01)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--timed", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)

    def log(msg):
        sys.stderr.write(msg + "\n")
        sys.stderr.flush()

    results = {}
    for name in a.models.split(","):
        peak = peak_of(name)
        d = {"peak_bytes": peak, "floors": {}, "timed": {}}
        for label, options in SETTINGS.items():
            log(f"[{name}] {label}: bisecting the lowest feasible ratio")
            d["floors"][label] = floor(name, peak, options, a, log)
        base = unmanaged_step(name, a.timed)
        d["unmanaged_step_s"] = base
        points = sorted({0.4, d["floors"]["leaves"] or 0.4})
        for ratio in points:
            for label, options in SETTINGS.items():
                ok, t, s = run(name, int(ratio * peak), options, 1, a.timed)
                entry = {"feasible": ok}
                if ok:
                    entry.update(slowdown=t / base, leaf_offloads=s["num_leaf_offloads"],
                                 offloads=s["num_offloads"], host_bytes_peak=s["host_bytes.peak"],
                                 peak_share=s["allocated_bytes.peak"] / peak)
                d["timed"][f"{ratio:.3f} {label}"] = entry
        results[name] = d
        report(name, d)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
        print(f"wrote {a.json}")


def report(name, d):
    fl = d["floors"]
    show = {k: (f"{v:.3f}" if v is not None else "none up to 1.0") for k, v in fl.items()}
    print(f"\n{name}: unmanaged peak {d['peak_bytes'] / 2**20:.1f} MiB, step {d['unmanaged_step_s']:.3f} s")
    print(f"  lowest feasible ratio: recompute {show['recompute']}, activations offloaded {show['activations']}, "
          f"leaves offloaded too {show['leaves']}")
    if fl["recompute"] and fl["leaves"]:
        share = fl["leaves"] / fl["recompute"]
        print(f"  leaves' floor / recompute floor: {share:.2f} (target <= 0.5: {'met' if share <= 0.5 else 'missed'})")
    for key, e in d["timed"].items():
        if e["feasible"]:
            print(f"  {key:<20} slowdown {e['slowdown']:.2f}x, leaf offloads {e['leaf_offloads']}, "
                  f"host peak {e['host_bytes_peak'] / 2**20:.1f} MiB")
        else:
            print(f"  {key:<20} infeasible")
    if name == "wide":
        ok = d["timed"].get("0.400 leaves", {}).get("feasible")
        print(f"  wide at 0.4 with leaves offloaded: {'feasible (target met)' if ok else 'infeasible (target missed)'}")


if __name__ == "__main__":
    main()
