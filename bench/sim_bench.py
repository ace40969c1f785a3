"""GPU-scale allocator benchmarks on the simulator (issue 16, item 5): no GPU needed.

    python bench/sim_bench.py [--device h100] [--models gpt2-xl,llama-7b,resnet152] [--quick]
                              [--json bench/results/sim_bench.json] [--plots bench/results/sim_plots]

Every model's training step is captured on the meta device (``pymem trace``) and replayed by
``pymem.sim`` through the policy classes and the C++ arena the runtime uses, priced by the GPU's
published rates (pymem/gpus.py).

  (a) overhead against budget ratio (a share of the step's unmanaged peak): every policy with
      eviction only, with and without the step plan, and every offload director with the best of
      them and with coop; GPT-2 XL-sized (batch 16, seq 1024), Llama-style 7B (batch 4, seq 2048), ResNet-152
      (batch 64), bf16, AdamW.
  (b) the largest GPT-2 XL batch whose step fits the GPU's memory (80 GB on an H100): unmanaged
      (its peak fits) vs pymem (the replay under that budget is ok within 1.3x), with step times.
  (c) fragmentation at the moments memory ran short, by Coop's measure (free bytes / budget at each
      allocation that needed a release, averaged): the window search (coop) against one-at-a-time
      release with compaction (dtr-chain), with the plan off (the allocator's own: the target) and
      on (its early releases leave holes); and a caching allocator without defragmentation
      (PyTorch's CUDACachingAllocator's rounding and segment sizes, see third_party/README.md) on
      the unmanaged step, by GMLake's measure (1 - peak active / peak reserved).
  (d) published figures beside ours (third_party/README.md): the DTR prototype's transformer
      slowdowns on the overhead plot; the max-batch multiples of MegEngine, Capuchin and DELTA and
      GMLake's fragmentation beside (b) and (c).
  (e) the MILP optimum (Checkmate) of small traces: bench/milp_optimum.py; for every model and
      ratio, the lower bound no policy of pymem's kind can beat (pymem/sim/bound.py: what must be
      away at the op where the most must be, released at least at its producer's cost or copied
      at the link's rate), printed under (a) and beside the targets.

Plan "auto" replays the steps the runtime runs until its plan settles (pymem/sim/plan.py) and
reports the settled one; compaction's moves are priced as copies at the device's memory rate.

Targets printed: GPT-2 XL on H100, best policy: <= 1.10x at 0.3 of its peak, <= 1.3x at 0.2;
>= 3x the unmanaged max batch at <= 1.3x step time; window-search fragmentation <= 5%.
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from pymem.gpus import gpu_spec  # noqa: E402
from pymem.policies import director_names, policy_names  # noqa: E402
from pymem.sim.bound import lower_bound  # noqa: E402
from pymem.sim.capture import capture_model  # noqa: E402
from pymem.sim.replay import simulate  # noqa: E402

MODELS = {"gpt2-xl": 16, "llama-7b": 4, "resnet152": 64}  # batch sizes of (a) and (c)
RATIOS = (0.9, 0.7, 0.5, 0.4, 0.3, 0.2)
DTR_PROTOTYPE = {"transformer": [(0.81, 1.12), (0.41, 1.19), (0.20, 1.60)],
                 "resnet-1202": [(0.90, 1.28), (0.22, 1.47)]}  # third_party/README.md
MAX_BATCH_PUBLISHED = {"MegEngine DTR (ResNet-50)": 3.0, "DELTA (ResNet-50)": 2.04, "DELTA (ResNet-101)": 2.25,
                       "Capuchin (BERT, vs TensorFlow)": 7.0}
GMLAKE_FRAGMENTATION_CUT = 0.15


class Progress:
    def __init__(self, total: int, label: str) -> None:
        self.total, self.done, self.label, self.t0 = max(total, 1), 0, label, time.perf_counter()

    def step(self, what: str) -> None:
        self.done += 1
        bar = "#" * min(30, 30 * self.done // self.total)
        print(f"\r{self.label} [{bar:<30}] {self.done}/{self.total} {what[:40]:<40} "
              f"{time.perf_counter() - self.t0:6.0f}s", end="", file=sys.stderr, flush=True)
        if self.done >= self.total:
            print(file=sys.stderr)

    def finish(self) -> None:
        """Done, however many steps the estimate expected."""
        self.done = self.total - 1
        self.step("done")


def _short(r: dict) -> dict:
    keep = ("status", "overhead", "peak_bytes", "budget_bytes", "fragmentation", "evictions", "offloads",
            "recompute_seconds", "copy_seconds_hidden", "copy_seconds_exposed", "step_seconds", "compactions",
            "moved_bytes", "compaction_seconds", "prefetches", "planned_releases", "plan_releases",
            "copy_out_seconds_exposed", "copies_ahead", "late_uses")
    return {k: r.get(k) for k in keep}


def overhead_curves(trace, device, ratios, policies, directors, bar):
    """(a): {"policy/director/plan": {ratio: result}}."""
    peak = trace.peak_bytes()
    runs = {}
    for policy in policies:
        for plan in ("off", "auto"):
            key = f"{policy}/never/{plan}"
            runs[key] = {}
            for r in ratios:
                runs[key][r] = _short(simulate(trace, int(peak * r), policy=policy, plan=plan, device=device))
                bar.step(f"{key} {r}")
    # Offloading with the best eviction-only policy and with the window search (coop), which
    # frees contiguous room without moving blocks (a move competes with copies for the time).
    best = best_policy(runs, ratios).split("/")[0]
    for policy in dict.fromkeys((best, "coop")):
        if policy not in policies:
            continue
        for director in directors:
            key = f"{policy}/{director}/auto"
            runs[key] = {}
            for r in ratios:
                runs[key][r] = _short(simulate(trace, int(peak * r), policy=policy, offload=director,
                                               plan="auto", device=device))
                bar.step(f"{key} {r}")
    return runs


def best_policy(runs, ratios) -> str:
    """The run (policy/director/plan) with the lowest mean overhead over the ratios, infeasible
    ones counted as 10x."""
    def score(curve):
        return sum((curve[r]["overhead"] if curve[r]["status"] != "oom" else 10.0) for r in ratios) / len(ratios)
    return min(runs, key=lambda k: score(runs[k]))


def caching_allocator_fragmentation(trace) -> dict:
    """The unmanaged step through a model of PyTorch's CUDACachingAllocator (no defragmentation):
    512 B rounding; requests <= 1 MiB from 2 MiB segments, <= 10 MiB from 20 MiB segments, larger
    ones from a segment of their size rounded to 2 MiB; best fit among cached free blocks of the
    pool, split, merged with free neighbours on free; segments are never returned."""
    MiB = 1 << 20
    pools = {"small": [], "large": []}  # free blocks: [segment, offset, size]
    live = {}
    reserved = active = peak_reserved = peak_active = 0

    def pool_of(size):
        return "small" if size <= MiB else "large"

    def allocate(v, size):
        nonlocal reserved, active, peak_reserved, peak_active
        size = -(-size // 512) * 512
        pool = pools[pool_of(size)]
        fit = None
        for b in pool:
            if b[2] >= size and (fit is None or b[2] < fit[2]):
                fit = b
        if fit is None:
            seg = 2 * MiB if size <= MiB else 20 * MiB if size <= 10 * MiB else -(-size // (2 * MiB)) * 2 * MiB
            reserved += seg
            fit = [object(), 0, seg]
            pool.append(fit)
        pool.remove(fit)
        if fit[2] > size:
            pool.append([fit[0], fit[1] + size, fit[2] - size])
        live[v] = (fit[0], fit[1], size, pool_of(size))
        active += size
        peak_reserved, peak_active = max(peak_reserved, reserved), max(peak_active, active)

    def free(v):
        nonlocal active
        seg, off, size, name = live.pop(v)
        active -= size
        pool = pools[name]
        block = [seg, off, size]
        for b in [b for b in pool if b[0] is seg and (b[1] + b[2] == off or off + size == b[1])]:
            pool.remove(b)
            block = [seg, min(block[1], b[1]), block[2] + b[2]]
        pool.append(block)

    ends = {}
    for v, k in enumerate(trace.value_free_at):
        if k >= 0:
            ends.setdefault(int(k), []).append(v)
    for v in range(trace.num_values):
        if trace.value_producer[v] < 0 and trace.value_bytes[v] > 0:
            allocate(v, int(trace.value_bytes[v]))
    for k in range(trace.num_ops):
        for v in trace.op_outputs(k):
            if trace.value_bytes[v] > 0 and trace.value_overwrites[v] < 0:
                allocate(int(v), int(trace.value_bytes[v]))
            elif trace.value_overwrites[v] >= 0 and int(trace.value_overwrites[v]) in live:
                live[int(v)] = live.pop(int(trace.value_overwrites[v]))
        for v in ends.get(k, ()):
            if v in live:
                free(v)
    return {"peak_reserved_bytes": peak_reserved, "peak_active_bytes": peak_active,
            "fragmentation_gmlake": 1 - peak_active / peak_reserved if peak_reserved else 0.0}


def max_batch(device, budget, overhead_cap, policy, offload, bar, limit=256):
    """(b): the largest GPT-2 XL batch that fits ``budget`` unmanaged, and under pymem within
    ``overhead_cap``, with the replay of each."""
    cache = {}

    def trace_of(b):
        if b not in cache:
            cache[b] = capture_model("gpt2-xl", batch=b)
            bar.step(f"trace batch {b}")
        return cache[b]

    def largest(ok):
        lo, hi = 0, 1
        while hi <= limit and ok(hi):
            lo, hi = hi, hi * 2
        hi = min(hi, limit + 1)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if ok(mid) else (lo, mid)
        return lo

    def fits_unmanaged(b):
        return trace_of(b).peak_bytes() <= budget

    replays = {}

    def fits_managed(b):
        r = simulate(trace_of(b), budget, policy=policy, offload=offload, plan="auto", device=device)
        replays[b] = _short(r)
        bar.step(f"replay batch {b}: {r['status']} {r['overhead'] or 0:.2f}")
        return r["status"] == "ok" and r["overhead"] <= overhead_cap

    plain = largest(fits_unmanaged)
    managed = largest(fits_managed)
    base = simulate(trace_of(plain), 1 << 50, device=device)["step_seconds"] if plain else None
    step = replays[managed]["step_seconds"] * replays[managed]["overhead"] if managed else None
    return {"budget_bytes": budget, "policy": policy, "offload": offload, "overhead_cap": overhead_cap,
            "unmanaged_max_batch": plain, "unmanaged_step_seconds": base,
            "pymem_max_batch": managed, "pymem_step_seconds": step,
            "pymem_overhead": replays[managed]["overhead"] if managed else None,
            "multiple": managed / plain if plain else None,
            "throughput_multiple": (managed / step) / (plain / base) if plain and managed else None,
            "replays": replays}


def plot(results, path, ratios):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(results["overhead"])
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
    for ax, model in zip(axes[0], models):
        for key, curve in results["overhead"][model].items():
            xs = [r for r in ratios if curve[r]["status"] != "oom"]
            ax.plot(xs, [min(curve[r]["overhead"], 3.0) for r in xs], marker="o", ms=3, label=key)
        bound = results.get("lower_bound", {}).get(model)
        if bound:
            xs = [r for r in ratios if bound[r]["overhead"] < float("inf")]
            ax.plot(xs, [min(bound[r]["overhead"], 3.0) for r in xs], "k--", lw=1, label="lower bound (bound.py)")
        if model == "gpt2-xl":
            xs, ys = zip(*DTR_PROTOTYPE["transformer"])
            ax.plot(xs, ys, "k*", ms=10, label="DTR prototype (Titan V, transformer)")
        ax.set_title(f"{model} on {results['device']}")
        ax.set_xlabel("budget / unmanaged peak")
        ax.set_ylabel("step time / unmanaged (capped at 3)")
        ax.invert_xaxis()
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="h100")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--quick", action="store_true", help="fewer policies, directors and ratios")
    ap.add_argument("--json", default="bench/results/sim_bench.json")
    ap.add_argument("--plots", default="bench/results/sim_plots")
    args = ap.parse_args(argv)
    models = args.models.split(",")
    ratios = (0.7, 0.5, 0.3, 0.2) if args.quick else RATIOS
    policies = ["dtr", "dtr-chain", "msps", "coop"] if args.quick else policy_names()
    directors = ["delta", "capuchin"] if args.quick else [d for d in director_names() if d != "never"]
    t0 = time.perf_counter()
    out = {"device": args.device, "ratios": list(ratios), "overhead": {}, "best": {}, "lower_bound": {},
           "fragmentation": {}, "models": {}}
    runs = len(models) * (len(policies) * 2 + 2 * len(directors)) * len(ratios)  # at most
    bar = Progress(runs + len(models), "(a, c)")
    for model in models:
        trace = capture_model(model, batch=MODELS.get(model))
        bar.step(f"trace {model}")
        peak = trace.peak_bytes()
        out["models"][model] = {"batch": MODELS.get(model), "ops": trace.num_ops, "values": trace.num_values,
                                "unmanaged_peak_bytes": peak, **trace.meta}
        curves = overhead_curves(trace, args.device, ratios, policies, directors, bar)
        out["overhead"][model] = curves
        out["best"][model] = best_policy(curves, ratios)
        out["lower_bound"][model] = {r: lower_bound(trace, int(peak * r), args.device) for r in ratios}
        frag = {"caching_allocator": caching_allocator_fragmentation(trace)}
        # The allocator's own (plan off: releases only under pressure), and with the plan's early
        # releases (fewer pressure events, each with the plan's holes free).
        for key in ("coop/never/off", "dtr-chain/never/off", "coop/never/auto", "dtr-chain/never/auto"):
            if key in curves:
                frag[key] = {r: curves[key][r]["fragmentation"] for r in ratios if curves[key][r]["status"] != "oom"}
        out["fragmentation"][model] = frag
    # (b)
    # The best run with eviction only and the best of all (it may offload): the larger batch counts.
    budget = gpu_spec(args.device).memory_bytes
    curves = out["overhead"].get("gpt2-xl", {})
    evicting = {k: v for k, v in curves.items() if "/never/" in k}
    configs = {best_policy(c, ratios) for c in (evicting, curves) if c} or {"dtr-chain/never/auto"}
    bar_b = Progress(30 * len(configs), "(b)")
    tries = [max_batch(args.device, budget, 1.3, *key.split("/")[:2], bar_b) for key in sorted(configs)]
    out["max_batch"] = max(tries, key=lambda m: m["pymem_max_batch"] or 0)
    out["max_batch_tries"] = [{k: v for k, v in m.items() if k != "replays"} for m in tries]
    bar_b.finish()
    out["published"] = {"dtr_prototype": DTR_PROTOTYPE, "max_batch_multiple": MAX_BATCH_PUBLISHED,
                        "gmlake_fragmentation_cut": GMLAKE_FRAGMENTATION_CUT}
    out["wall_seconds"] = time.perf_counter() - t0
    report(out, ratios)
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1, default=str)
    os.makedirs(args.plots, exist_ok=True)
    plot(out, os.path.join(args.plots, f"overhead_{args.device}.png"), ratios)
    print(f"wrote {args.json} and {args.plots}/overhead_{args.device}.png")
    return 0


def report(out, ratios) -> None:
    for model, curves in out["overhead"].items():
        print(f"\n(a) {model} on {out['device']}: step time / unmanaged (oom: infeasible)")
        print(f"  {'policy/director/plan':28s}" + "".join(f"{r:>8}" for r in ratios))
        for key, curve in curves.items():
            cells = "".join(f"{(curve[r]['overhead'] or 0):8.3f}" if curve[r]["status"] != "oom" else f"{'oom':>8}"
                            for r in ratios)
            print(f"  {key:28s}{cells}")
        print(f"  best: {out['best'][model]}")
        bound = out["lower_bound"][model]
        print(f"  {'lower bound (no policy beats)':28s}" + "".join(f"{bound[r]['overhead']:8.3f}" for r in ratios))
        f = out["fragmentation"][model]
        ca = f["caching_allocator"]
        print(f"(c) {model}: caching allocator without defragmentation, unmanaged: "
              f"{ca['fragmentation_gmlake']:.1%} (1 - peak active / peak reserved); Coop's measure: "
              + "; ".join(f"{k}: " + ", ".join(f"{r}: {v:.1%}" for r, v in d.items())
                          for k, d in f.items() if k != "caching_allocator"))
    mb = out["max_batch"]
    print(f"\n(b) GPT-2 XL in {mb['budget_bytes'] / 1e9:.0f} GB on {out['device']}: unmanaged max batch "
          f"{mb['unmanaged_max_batch']}, pymem ({mb['policy']}, offload {mb['offload']}) {mb['pymem_max_batch']} "
          f"at {mb['pymem_overhead'] or 0:.2f}x step time: {mb['multiple'] or 0:.2f}x the batch, "
          f"{mb['throughput_multiple'] or 0:.2f}x the samples/s")
    print("(d) published max-batch multiples: " + ", ".join(f"{k} {v}x" for k, v in MAX_BATCH_PUBLISHED.items()))
    g = out["overhead"].get("gpt2-xl")
    if g:
        def at(r):  # the best run at ratio r: (overhead, its key), or (None, None) when all ran out
            ok = [(c[r]["overhead"], k) for k, c in g.items() if r in c and c[r]["status"] != "oom"]
            return min(ok) if ok else (None, None)
        print("\nTargets (GPT-2 XL on H100, best policy at each ratio):")
        for r, target in ((0.3, 1.10), (0.2, 1.3)):
            v, key = at(r)
            floor = out["lower_bound"]["gpt2-xl"][r]["overhead"]
            print(f"  at {r}: {'oom' if v is None else f'{v:.3f}x ({key})'} (target <= {target}x): "
                  f"{'met' if v is not None and v <= target else 'NOT met'}; no policy can go below "
                  f"{floor:.3f}x here (pymem/sim/bound.py){': the target is out of reach' if floor > target else ''}")
        m = mb["multiple"] or 0
        print(f"  max batch: {m:.2f}x at {mb['pymem_overhead'] or 0:.2f}x (target >= 3x at <= 1.3x): "
              f"{'met' if m >= 3 else 'NOT met'}")
        frag = out["fragmentation"]["gpt2-xl"].get("coop/never/off", {})
        worst = max(frag.values()) if frag else None
        print(f"  window-search fragmentation (plan off): {'-' if worst is None else f'{worst:.1%}'} worst over the ratios "
              f"(target <= 5%): {'met' if worst is not None and worst <= 0.05 else 'NOT met'}")


if __name__ == "__main__":
    sys.exit(main())
