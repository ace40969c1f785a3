"""What seeing every op costs, per op, before pymem does any bookkeeping (issue 14's first question:
keep the Python TorchDispatchMode, or intercept in C++ at the dispatcher).

    python bench/interception_bench.py [--ops N] [--reps R] [--json FILE]

One process, --ops adds of 4-element CPU tensors per loop, loops alternated --reps times, medians:
  plain        no mode: the op alone;
  empty mode   a TorchDispatchMode whose __torch_dispatch__ only calls the op (what any Python
               interception pays: torch's dispatch into Python, the mode stack, the call back);
  pymem        pymem.enable with a budget far above need (no pressure: entry plus bookkeeping).
Prints microseconds per op and the differences: entry = empty mode - plain, bookkeeping = pymem -
empty mode.
"""
import argparse
import json
import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import pymem


class _Empty(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _loop(n):
    a = torch.ones(4)
    b = torch.ones(4)
    t0 = time.perf_counter()
    for _ in range(n):
        a = a + b
    return (time.perf_counter() - t0) / n * 1e6


def _plain(n):
    return _loop(n)


def _empty(n):
    with _Empty():
        return _loop(n)


def _pymem(n):
    pymem.enable(budget=1 << 30, device="cpu")
    try:
        return _loop(n)
    finally:
        pymem.disable()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ops", type=int, default=20000)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json")
    a = ap.parse_args()
    runs = {"plain": _plain, "empty mode": _empty, "pymem": _pymem}
    for f in runs.values():  # warm-up: op caches, the mode's first-call paths
        f(1000)
    times = {k: [] for k in runs}
    for _ in range(a.reps):
        for k, f in runs.items():
            times[k].append(f(a.ops))
    med = {k: statistics.median(v) for k, v in times.items()}
    out = {"us_per_op": med, "entry_us": med["empty mode"] - med["plain"],
           "bookkeeping_us": med["pymem"] - med["empty mode"], "runs": times,
           "torch": torch.__version__}
    for k, v in med.items():
        print(f"{k:12s} {v:7.2f} us/op")
    print(f"entry (empty mode - plain): {out['entry_us']:.2f} us/op; "
          f"bookkeeping (pymem - empty mode): {out['bookkeeping_us']:.2f} us/op")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
