"""Issue 14's choice of interception, measured: a C++ boxed fallback on a dispatch key against the
Python TorchDispatchMode pymem uses today.

    python bench/dispatcher_bench.py [--ops N] [--reps R] [--json FILE]

Builds bench/dispatcher_probe.cpp (torch.utils.cpp_extension, about a minute the first time), then
in one process, round-robin over --reps rounds (the first one a warm-up), medians of microseconds
per op of --ops adds of 4-element CPU tensors, from a Python loop and from a C++ at::add loop:
  plain                  no interception;
  fallback               the probe's fallback on DispatchKey::Fake: redispatch only;
  fallback + table       it also looks up every input's storage and records every output in a
                         hash map under a mutex (the shape of the per-op work a C++ hot path does);
  empty mode             a Python TorchDispatchMode that only calls the op;
  pymem                  pymem.enable at a budget far above need (Python loop only).
Then whether the fallback sees backward ops on the autograd engine's worker thread (70 nested
reentrant checkpoints: the engine runs past depth 60 on a thread of its own) and on a Thread
started while the key is included (it should not: the key is per thread, like a mode).
"""
import argparse
import json
import os
import statistics
import tempfile
import threading
import time

import torch
from torch.utils.checkpoint import checkpoint

from interception_bench import _Empty  # the pass-through mode both benches measure

_HERE = os.path.dirname(os.path.abspath(__file__))


def build_probe():
    from torch.utils.cpp_extension import load
    os.environ.setdefault("MAX_JOBS", "2")
    build_dir = os.path.join(tempfile.gettempdir(), "pymem_dispatcher_probe")
    os.makedirs(build_dir, exist_ok=True)
    return load(name="pymem_dispatcher_probe", sources=[os.path.join(_HERE, "dispatcher_probe.cpp")],
                build_directory=build_dir, extra_cflags=["-O2"], verbose=False)


def _py_loop(a, b, n):
    t0 = time.perf_counter()
    for _ in range(n):
        a + b
    return (time.perf_counter() - t0) / n * 1e6


def per_op(probe, n, reps):
    import pymem
    a, b = torch.randn(4), torch.randn(4)
    rows = {k: ([], []) for k in ("plain", "fallback", "fallback + table", "empty mode", "pymem")}
    for rnd in range(reps + 1):
        for name in rows:
            if name in ("fallback", "fallback + table"):
                probe.set_bookkeeping(name != "fallback")
                probe.set_included(True)
                try:
                    p, c = _py_loop(a, b, n), probe.add_loop_us(a, b, n)
                finally:
                    probe.set_included(False)
            elif name == "empty mode":
                with _Empty():
                    p, c = _py_loop(a, b, n), probe.add_loop_us(a, b, n)
            elif name == "pymem":
                pymem.enable(budget=1 << 30, device="cpu")
                try:
                    p, c = _py_loop(a, b, n), None
                finally:
                    pymem.disable()
            else:
                p, c = _py_loop(a, b, n), probe.add_loop_us(a, b, n)
            if rnd:
                rows[name][0].append(p)
                if c is not None:
                    rows[name][1].append(c)
    return {k: {"python_loop_us": statistics.median(p), "cpp_loop_us": statistics.median(c) if c else None}
            for k, (p, c) in rows.items()}


def _nested(x, depth):
    if depth == 0:
        return x.sin()
    return checkpoint(lambda y: _nested(y, depth - 1) * 1.0001, x, use_reentrant=True)


def threads_seen(probe):
    probe.set_bookkeeping(True)
    probe.set_included(True)
    try:
        x = torch.randn(8, requires_grad=True)
        out = _nested(x, 70).sum()
        probe.reset()
        out.backward()
        backward = probe.num_threads_seen()
        probe.reset()
        t = threading.Thread(target=lambda: torch.ones(3) + 1)
        t.start()
        t.join()
        new_thread_ops = probe.ops()
    finally:
        probe.set_included(False)
        probe.set_bookkeeping(False)
    return {"threads_running_backward_ops_seen": backward, "ops_seen_on_a_new_thread": new_thread_ops}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ops", type=int, default=20000)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--json")
    a = ap.parse_args()
    torch.set_num_threads(1)
    probe = build_probe()
    status = probe.register_fallback()
    if status != "ok":
        raise SystemExit(f"DispatchKey::Fake cannot take a fallback in torch {torch.__version__}: {status}")
    rows = per_op(probe, a.ops, a.reps)
    seen = threads_seen(probe)
    plain = rows["plain"]["python_loop_us"]
    print(f"torch {torch.__version__}; {a.ops} adds of 4-element CPU tensors, medians of {a.reps} rounds")
    print(f"{'':18s} {'python loop':>12s} {'over plain':>11s} {'C++ loop':>9s}")
    for k, r in rows.items():
        cpp = f"{r['cpp_loop_us']:9.2f}" if r["cpp_loop_us"] is not None else f"{'-':>9s}"
        print(f"{k:18s} {r['python_loop_us']:9.2f} us {r['python_loop_us'] - plain:8.2f} us {cpp}")
    print(f"backward of 70 nested reentrant checkpoints: ops seen on {seen['threads_running_backward_ops_seen']} "
          f"thread(s) (the caller's and the engine's worker); ops seen on a new Thread: "
          f"{seen['ops_seen_on_a_new_thread']} (the key is per thread)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"per_op": rows, "threads": seen, "torch": torch.__version__}, f, indent=2)
        print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
