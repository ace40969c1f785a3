"""pymem's step time on a GPU against the same model unmanaged, budget by budget: what the host's
work per op (and any wait for the GPU) adds where the GPU itself would be fast.

    python bench/gpu_overhead.py [--configs 20:never,1.0:delta,0.5:never,0.5:delta,0.5:always]
        [--steps 8] [--batch 64] [--seq 256] [--profile 0.5:delta] [--json FILE]

The model is pymem.demo_models' TinyGPT (4 layers, d 128) trained with Adam on a fixed batch,
fp32 without TF32, deterministic algorithms (pymem.testing.deterministic_cuda). A config is
RATIO:OFFLOAD, the budget being RATIO times the unmanaged run's peak (torch.cuda's
max_memory_allocated). Every run is a fresh process, since pymem's arena must become PyTorch's CUDA
allocator before CUDA initialises. Printed per config: the median step over the unmanaged median
(steps 3 on, and the last three alone, since pymem plans from the third step and tries its ways for
a few more), each step's milliseconds, and pymem's counters over the whole run. ``--profile C``
reruns config C with cProfile around its last three steps and prints the top functions.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
COUNTERS = ("allocated_bytes.peak", "num_evictions", "num_rematerializations", "remat_seconds", "offloaded_bytes",
            "swap_seconds", "pressure_seconds", "num_late_uses", "num_ops", "num_compactions", "num_swap_ins",
            "num_prefetches", "num_copies_ahead",
            # each cancelled prefetch synchronizes the compute stream (swap.cancel_one); moves are
            # priced per block with a cost model's launch: how often each happened on the GPU
            "num_prefetches_cancelled", "num_moved_blocks", "moved_bytes", "num_kernel_fallbacks")


def child(budget: int, offload: str, steps: int, batch: int, seq: int, profile: bool) -> dict:
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    import torch
    import pymem
    from pymem.demo_models import gpt_trainer
    from pymem.testing import deterministic_cuda

    if budget:
        pymem.enable(budget, device="cuda", offload=offload)
    deterministic_cuda()
    step = gpt_trainer(batch=batch, seq=seq, device="cuda")
    times, prof = [], None
    for i in range(steps):
        if profile and i == steps - 3:
            import cProfile
            prof = cProfile.Profile()
            prof.enable()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    if prof is not None:
        import pstats
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(30)
    out = {"times": times}
    if budget:
        st = pymem.memory_stats()
        out.update({k: st.get(k) for k in COUNTERS})
    else:
        out["peak"] = torch.cuda.max_memory_allocated()
    return out


def run_child(args, budget: int, offload: str, profile: bool = False):
    cmd = [sys.executable, __file__, "--child", str(budget), offload, "1" if profile else "0",
           "--steps", str(args.steps), "--batch", str(args.batch), "--seq", str(args.seq)]
    env = dict(os.environ, PYTHONPATH=os.path.dirname(HERE) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if profile:
        print(r.stdout[-7000:])
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    if r.returncode != 0 or not lines:
        print(r.stderr[-3000:], file=sys.stderr)
        return None
    return json.loads(lines[-1][len("RESULT "):])


def parse_configs(text: str):
    out = []
    for item in text.split(","):
        ratio, _, offload = item.strip().partition(":")
        out.append((float(ratio), offload or "delta"))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="20:never,1.0:delta,0.5:never,0.5:delta,0.5:always")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--profile", help="RATIO:OFFLOAD to rerun under cProfile")
    ap.add_argument("--json")
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        budget, offload, profile = int(a.child[0]), a.child[1], a.child[2] == "1"
        print("RESULT " + json.dumps(child(budget, offload, a.steps, a.batch, a.seq, profile)), flush=True)
        return 0
    ref = run_child(a, 0, "never")
    if ref is None:
        print("the unmanaged run failed")
        return 1
    base = statistics.median(ref["times"][2:])
    print(f"TinyGPT batch {a.batch} x {a.seq}: unmanaged peak {ref['peak'] / 2**20:.0f} MiB, "
          f"step {base * 1e3:.1f} ms", flush=True)
    results = {"unmanaged": ref}
    for ratio, offload in parse_configs(a.configs):
        budget = int(ref["peak"] * ratio) // 512 * 512
        r = run_child(a, budget, offload)
        name = f"{ratio}:{offload}"
        if r is None:
            print(f"{name}: FAILED", flush=True)
            results[name] = None
            continue
        m, last = statistics.median(r["times"][2:]), statistics.median(r["times"][-3:])
        r.update(slowdown=m / base, slowdown_last3=last / base)
        results[name] = r
        counters = {k: v for k, v in r.items() if k in COUNTERS}
        print(f"{name:12s} step {m * 1e3:6.1f} ms = {m / base:5.2f}x (last three {last / base:5.2f}x); "
              f"steps {[round(t * 1e3) for t in r['times']]}; {json.dumps(counters)}", flush=True)
    if a.profile:
        ratio, offload = parse_configs(a.profile)[0]
        run_child(a, int(ref["peak"] * ratio) // 512 * 512, offload, profile=True)
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump({"batch": a.batch, "seq": a.seq, "steps": a.steps, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
