"""Offloading on a GPU: the bandwidth pymem's copies achieve against the pinned PCIe rate, and how
much of their time compute hides (issue 15's last target).

    python3 bench/offload_gpu_bench.py [--json FILE] [--models transformer,cnn] [--ratios 0.5,0.3]
                                       [--offloads always,delta] [--warmup 3] [--steps 5]
    python3 bench/offload_gpu_bench.py --device cpu --smoke     # the machinery, on the CPU

Needs CUDA (exits 2 without it) unless --device cpu. Every measurement runs in a fresh process
(pymem's arena replaces PyTorch's CUDA allocator, so ``pymem.enable`` must come before CUDA starts:
one process per configuration), each with CUBLAS_WORKSPACE_CONFIG=:4096:8,
``torch.use_deterministic_algorithms(True, warn_only=True)`` and TF32 off:
  1. the pinned rate: a pinned host tensor (--pcie-mib, 512 MiB) copied to and from the device,
     each direction --pcie-reps times, timed with CUDA events: median GB/s (10^9 B/s); smaller
     sizes too, for reference (pymem copies one value at a time);
  2. per model (the transformer: TinyGPT; the CNN: bench/remat_bench.py's SmallResNet, both sized
     for an H100), unmanaged: peak = torch.cuda.max_memory_allocated() (model, Adam, data and
     training), median step time, losses, a hash of the trained parameters; trained twice in the
     process, so a nondeterministic kernel shows as "unmanaged repeat bitwise: False";
  3. per model, offload setting (--offloads: "always", "delta", the CUDA default) and ratio
     (--ratios): ``pymem.enable(ratio * peak, device="cuda", offload=...)`` first thing, then the
     same training: median step time, slowdown vs unmanaged, per step: bytes offloaded (values
     released to host) and copied out / back (a value released again reuses its host copy), the
     copies' own time (CUDA events around each copy: memory_stats' offload_copy_seconds,
     swap_in_copy_seconds), achieved bandwidth = copied bytes / copy seconds as a fraction of the
     pinned rate in that direction, exposed time = swap_seconds (the program's thread in copies and
     waits: the out copy is synchronous), hidden share = 1 - exposed / copy time, the stall
     (swap_stall_seconds: what the compute stream stood still for, from events on it) and its
     hidden share, evictions, rematerializations, peak within budget, losses and parameters
     bitwise equal to the unmanaged run.
Steps are timed with torch.cuda.synchronize() before and after each. Targets printed: achieved
bandwidth >= 0.8 of the pinned rate (each direction); the hidden share, reported.

--device cpu runs the same processes on the CPU (tiny models with --smoke; offload uses the CPU
copier, timed with perf_counter; the "pinned rate" is then a plain host memcpy's): it checks the
machinery end to end, its figures mean nothing for a GPU.
With --json FILE, everything above as JSON.
"""
import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GB = 1e9
MiB = 1 << 20
TARGET_BANDWIDTH = 0.8

# Sizes: a step of tens of ms on an H100 (fp32, TF32 off), activations of hundreds of MB to a few GB.
GPU_SIZES = {"gpt_vocab": 8192, "gpt_d": 512, "gpt_heads": 8, "gpt_layers": 6, "gpt_seq": 512, "gpt_batch": 8,
             "cnn_width": 32, "cnn_blocks": 2, "cnn_batch": 128, "cnn_size": 64}
SMOKE_SIZES = {"gpt_vocab": 128, "gpt_d": 32, "gpt_heads": 2, "gpt_layers": 2, "gpt_seq": 32, "gpt_batch": 4,
               "cnn_width": 8, "cnn_blocks": 1, "cnn_batch": 4, "cnn_size": 16}


# ------------------------------------------------------------------------------------ the workers
def _sync(torch, device):
    if device == "cuda":
        torch.cuda.synchronize()


def _build(torch, cfg):
    """step() -> loss (a float), all made now on cfg's device: model, Adam, a fixed random batch."""
    sys.path.insert(0, _ROOT)
    sys.path.insert(0, os.path.join(_ROOT, "bench"))
    nn = torch.nn
    s, device = cfg["sizes"], cfg["device"]
    torch.manual_seed(cfg["seed"])
    if cfg["model"] == "transformer":
        from pymem.demo_models import TinyGPT
        vocab = s["gpt_vocab"]
        model = TinyGPT(vocab=vocab, d=s["gpt_d"], heads=s["gpt_heads"], layers=s["gpt_layers"],
                        seq=s["gpt_seq"]).to(device)
        idx = torch.randint(0, vocab, (s["gpt_batch"], s["gpt_seq"] + 1)).to(device)

        def loss_of():
            logits = model(idx[:, :-1])
            return nn.functional.cross_entropy(logits.reshape(-1, vocab), idx[:, 1:].reshape(-1))
    else:
        from remat_bench import SmallResNet
        model = SmallResNet(width=s["cnn_width"], blocks=s["cnn_blocks"]).to(device)
        x = torch.randn(s["cnn_batch"], 3, s["cnn_size"], s["cnn_size"]).to(device)
        y = torch.randint(0, 10, (s["cnn_batch"],)).to(device)

        def loss_of():
            return nn.functional.cross_entropy(model(x), y)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    def step():
        opt.zero_grad(set_to_none=False)
        loss = loss_of()
        loss.backward()
        opt.step()
        return loss.item()

    step.model = model
    return step


def _train(torch, step, cfg):
    """(step seconds of the timed steps, every loss, memory_stats after warm-up and after the timed
    steps when ``stats``)."""
    device, times, losses = cfg["device"], [], []
    stats = None
    if cfg["budget"] is not None:
        import pymem
        stats = pymem.memory_stats
    s0 = None
    for i in range(cfg["warmup"] + cfg["steps"]):
        if i == cfg["warmup"] and stats is not None:
            _sync(torch, device)
            s0 = dict(stats())
        _sync(torch, device)
        t0 = time.perf_counter()
        losses.append(step())
        _sync(torch, device)
        if i >= cfg["warmup"]:
            times.append(time.perf_counter() - t0)
    s1 = dict(stats()) if stats is not None else None
    return times, losses, s0, s1


def _param_hash(step):
    h = hashlib.sha256()
    for p in step.model.parameters():
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def worker_pcie(cfg):
    import torch
    device = cfg["device"]
    out = {"device": device}
    sizes = sorted(set([cfg["pcie_mib"]] + [m for m in (4, 64) if m < cfg["pcie_mib"]]))
    if device == "cuda":
        out["gpu"] = torch.cuda.get_device_name()
        for mib in sizes:
            n = mib * MiB
            host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
            host.fill_(1)
            dev = torch.empty(n, dtype=torch.uint8, device="cuda")
            rates = {}
            for name, dst, src in (("h2d", dev, host), ("d2h", host, dev)):
                dst.copy_(src, non_blocking=True)  # warm
                torch.cuda.synchronize()
                samples = []
                for _ in range(cfg["pcie_reps"]):
                    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    a.record()
                    dst.copy_(src, non_blocking=True)
                    b.record()
                    b.synchronize()
                    samples.append(n / (a.elapsed_time(b) / 1e3) / GB)
                rates[name] = statistics.median(samples)
                rates[name + "_samples"] = [round(x, 3) for x in samples]
            out[f"{mib}MiB"] = rates
            del host, dev
            torch.cuda.empty_cache()
    else:  # the CPU smoke's stand-in: a plain host memcpy
        for mib in sizes:
            n = mib * MiB
            src, dst = torch.ones(n, dtype=torch.uint8), torch.empty(n, dtype=torch.uint8)
            dst.copy_(src)
            samples = []
            for _ in range(cfg["pcie_reps"]):
                t0 = time.perf_counter()
                dst.copy_(src)
                samples.append(n / (time.perf_counter() - t0) / GB)
            r = statistics.median(samples)
            out[f"{mib}MiB"] = {"h2d": r, "d2h": r, "h2d_samples": [round(x, 3) for x in samples]}
    out["h2d"] = out[f"{cfg['pcie_mib']}MiB"]["h2d"]
    out["d2h"] = out[f"{cfg['pcie_mib']}MiB"]["d2h"]
    return out


def worker_unmanaged(cfg):
    import torch
    from pymem.testing import deterministic_cuda
    deterministic_cuda()
    device, out = cfg["device"], {}
    arena = None
    if device == "cpu":  # the peak as the CPU runtime counts it: every tensor served from an arena
        import pymem
        arena = pymem.Arena(8 << 30, small_threshold=0)
        pymem.install_cpu_hook(arena)
    try:
        step = _build(torch, cfg)
        times, losses, _, _ = _train(torch, step, cfg)
        out["peak_bytes"] = (torch.cuda.max_memory_allocated() if device == "cuda"
                             else arena.stats()["allocated_bytes.peak"])
        out["params"] = _param_hash(step)
        del step
        again = _build(torch, cfg)  # the same run once more: are the kernels deterministic?
        _, losses2, _, _ = _train(torch, again, cfg)
        out["repeat_bitwise"] = losses2 == losses and _param_hash(again) == out["params"]
        del again
    finally:
        if arena is not None:
            pymem.uninstall_cpu_hook()
    out.update(median_step_s=statistics.median(times), step_s=times, losses=losses)
    if device == "cuda":
        out["gpu"] = torch.cuda.get_device_name()
    return out


_DIFFS = ("num_offloads", "offloaded_bytes", "offload_copied_bytes", "num_swap_ins", "swapped_in_bytes",
          "num_prefetches", "prefetched_bytes", "num_prefetches_cancelled", "num_late_uses", "num_evictions",
          "evicted_bytes", "num_rematerializations", "num_leaf_offloads", "swap_seconds",
          "offload_copy_seconds", "offload_copy_timed_bytes", "swap_in_copy_seconds",
          "swap_in_copy_timed_bytes", "swap_stall_seconds")


def worker_managed(cfg):
    import pymem  # before torch touches CUDA: the arena becomes PyTorch's CUDA allocator
    rt = pymem.enable(cfg["budget"], device=cfg["device"], offload=cfg["offload"])
    import torch
    from pymem.testing import deterministic_cuda
    deterministic_cuda()
    out = {"allocator": rt.allocator, "link_bandwidth_gbs": (rt.swap.bandwidth / GB if rt.swap is not None else None)}
    step = None
    try:
        step = _build(torch, cfg)
        times, losses, s0, s1 = _train(torch, step, cfg)
    except pymem.OutOfBudgetError as e:
        pymem.disable()
        return dict(out, infeasible=True, error=str(e)[:400])
    pymem.disable()  # restores every value: the parameters are whole again
    out["params"] = _param_hash(step)
    n = len(times)
    per_step = {k: (s1.get(k, 0) - s0.get(k, 0)) / n for k in _DIFFS}
    out.update(infeasible=False, median_step_s=statistics.median(times), step_s=times, losses=losses,
               per_step=per_step, peak_bytes=s1["allocated_bytes.peak"], budget_bytes=s1["budget_bytes"],
               host_bytes_peak=s1.get("host_bytes.peak", 0))
    return out


WORKERS = {"pcie": worker_pcie, "unmanaged": worker_unmanaged, "managed": worker_managed}


def worker_main(cfg_path, out_path):
    with open(cfg_path) as f:
        cfg = json.load(f)
    try:
        res = WORKERS[cfg["kind"]](cfg)
    except Exception as e:
        res = {"error": f"{type(e).__name__}: {e}"[:600], "traceback": traceback.format_exc()[-3000:]}
    with open(out_path, "w") as f:
        json.dump(res, f)


# --------------------------------------------------------------------------------- the orchestrator
def spawn(cfg, timeout):
    """Runs one worker in a fresh process; its result (a dict, with "error" when it failed)."""
    env = dict(os.environ, CUBLAS_WORKSPACE_CONFIG=":4096:8",
               PYTHONPATH=os.pathsep.join(p for p in (_ROOT, os.environ.get("PYTHONPATH")) if p))
    if cfg["device"] == "cpu":
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        env.setdefault("OMP_NUM_THREADS", str(cfg["threads"]))
    with tempfile.TemporaryDirectory() as d:
        cfg_path, out_path = os.path.join(d, "cfg.json"), os.path.join(d, "out.json")
        with open(cfg_path, "w") as f:
            json.dump(cfg, f)
        t0 = time.perf_counter()
        try:
            r = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", cfg_path, out_path],
                               env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {timeout:.0f} s", "wall_s": time.perf_counter() - t0}
        wall = time.perf_counter() - t0
        if not os.path.exists(out_path):
            return {"error": f"worker exited {r.returncode} without a result", "stderr": r.stderr[-3000:],
                    "wall_s": wall}
        with open(out_path) as f:
            res = json.load(f)
    res["wall_s"] = wall
    return res


def log(msg):
    sys.stderr.write(msg + "\n")
    sys.stderr.flush()


def analyse(run, base, pcie):
    """Derived figures of one managed run against the unmanaged one and the pinned rate."""
    p = run["per_step"]
    out_s, in_s = p["offload_copy_seconds"], p["swap_in_copy_seconds"]
    copy_s = out_s + in_s
    d = {
        "slowdown": run["median_step_s"] / base["median_step_s"],
        "out_gbs": p["offload_copy_timed_bytes"] / out_s / GB if out_s > 0 else None,
        "in_gbs": p["swap_in_copy_timed_bytes"] / in_s / GB if in_s > 0 else None,
        "copy_s": copy_s,
        "exposed_s": p["swap_seconds"],
        "hidden_share": 1 - p["swap_seconds"] / copy_s if copy_s > 0 else None,
        "stall_hidden_share": 1 - p["swap_stall_seconds"] / copy_s if copy_s > 0 else None,
        "losses_bitwise": run["losses"] == base["losses"],
        "params_bitwise": run["params"] == base["params"],
        "within_budget": run["peak_bytes"] <= run["budget_bytes"],
    }
    d["out_share_of_pinned"] = d["out_gbs"] / pcie["d2h"] if d["out_gbs"] else None
    d["in_share_of_pinned"] = d["in_gbs"] / pcie["h2d"] if d["in_gbs"] else None
    shares = [s for s in (d["out_share_of_pinned"], d["in_share_of_pinned"]) if s is not None]
    d["bandwidth_target_met"] = (min(shares) >= TARGET_BANDWIDTH) if shares else None
    return d


def _f(x, fmt):
    return "-" if x is None else format(x, fmt)


def _bw(gbs, share):
    return "-" if gbs is None else f"{gbs:.1f} ({share:.2f})"


def _bitwise(a):
    return "yes" if a["losses_bitwise"] and a["params_bitwise"] else "NO"


def report(results):
    pcie = results["pcie"]
    unit = "pinned PCIe rate" if results["device"] == "cuda" else "host memcpy rate (CPU smoke stand-in)"
    print(f"\n{unit} ({results['pcie_mib']} MiB, median of {results['pcie_reps']}): "
          f"host->device {pcie['h2d']:.2f} GB/s, device->host {pcie['d2h']:.2f} GB/s")
    others = [f"{k}: {v['h2d']:.2f} / {v['d2h']:.2f}" for k, v in pcie.items()
              if isinstance(v, dict) and k != f"{results['pcie_mib']}MiB"]
    if others:
        print("  smaller copies (h2d / d2h GB/s): " + ", ".join(others))
    print("\nPer step: MB offloaded (released to host), copied out, copied back; GB/s: copied bytes / the"
          "\ncopies' own time (share of the pinned rate); copy ms: that time, out + back; exposed ms:"
          "\nswap_seconds; hidden: 1 - exposed / copy ms; stall ms: swap_stall_seconds (the compute"
          "\nstream's time in copies and waits for them); dev hidden: 1 - stall / copy ms.")
    hdr = (f"{'setting':<11}{'step ms':>8}{'slow':>6}{'offl MB':>8}{'out MB':>7}{'in MB':>7}{'out GB/s':>13}"
           f"{'in GB/s':>13}{'copy ms':>8}{'expo ms':>8}{'hidden':>7}{'stall ms':>9}{'dev hid':>8}{'evict':>6}"
           f"{'remat':>6}{'peak/bud':>9}{'bitwise':>8}")
    met, total = 0, 0
    for name, m in results["models"].items():
        base = m["unmanaged"]
        print(f"\n{name}: {m['describe']}")
        if "error" in base:
            print(f"  unmanaged run failed: {base['error']}")
            continue
        print(f"  unmanaged: peak {base['peak_bytes'] / MiB:.0f} MiB, step {base['median_step_s'] * 1e3:.1f} ms, "
              f"same again in-process bitwise: {base['repeat_bitwise']}")
        print("  " + hdr)
        for key, run in m["runs"].items():
            if "analysis" not in run:
                why = "infeasible" if run.get("infeasible") else "failed"
                print(f"  {key:<11}{why}: {run.get('error', '')[:150]}")
                continue
            a, p = run["analysis"], run["per_step"]
            print(f"  {key:<11}{run['median_step_s'] * 1e3:>8.1f}{a['slowdown']:>6.2f}"
                  f"{p['offloaded_bytes'] / 1e6:>8.0f}{p['offload_copied_bytes'] / 1e6:>7.0f}"
                  f"{(p['swapped_in_bytes'] + p['prefetched_bytes']) / 1e6:>7.0f}"
                  f"{_bw(a['out_gbs'], a['out_share_of_pinned']):>13}{_bw(a['in_gbs'], a['in_share_of_pinned']):>13}"
                  f"{a['copy_s'] * 1e3:>8.1f}{a['exposed_s'] * 1e3:>8.1f}{_f(a['hidden_share'], '.2f'):>7}"
                  f"{p['swap_stall_seconds'] * 1e3:>9.1f}{_f(a['stall_hidden_share'], '.2f'):>8}"
                  f"{p['num_evictions']:>6.0f}{p['num_rematerializations']:>6.0f}"
                  f"{run['peak_bytes'] / run['budget_bytes']:>9.2f}{_bitwise(a):>8}")
            if a["bandwidth_target_met"] is not None:
                total += 1
                met += bool(a["bandwidth_target_met"])
    print("\nTargets (issue 15):")
    print(f"  achieved copy bandwidth >= {TARGET_BANDWIDTH} of the pinned rate, each direction: met in {met} of "
          f"{total} runs that copied")
    for name, m in results["models"].items():
        for key, run in m.get("runs", {}).items():
            a = run.get("analysis")
            if not a:
                continue
            verdict = {True: "met", False: "missed", None: "no copies"}[a["bandwidth_target_met"]]
            print(f"  {name} {key}: bandwidth out {_f(a['out_share_of_pinned'], '.2f')}, back "
                  f"{_f(a['in_share_of_pinned'], '.2f')} of pinned: {verdict}; copy time hidden behind compute: "
                  f"{_f(a['hidden_share'], '.0%')} of {a['copy_s'] * 1e3:.1f} ms/step by swap_seconds, "
                  f"{_f(a['stall_hidden_share'], '.0%')} by the compute stream's stall; bitwise {_bitwise(a)}")


def describe(name, s):
    if name == "transformer":
        return (f"TinyGPT(vocab {s['gpt_vocab']}, d {s['gpt_d']}, heads {s['gpt_heads']}, layers {s['gpt_layers']}, "
                f"seq {s['gpt_seq']}) batch {s['gpt_batch']}, Adam")
    return (f"SmallResNet(width {s['cnn_width']}, blocks/stage {s['cnn_blocks']}) batch {s['cnn_batch']} of "
            f"3x{s['cnn_size']}x{s['cnn_size']}, Adam")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--smoke", action="store_true", help="tiny models (for --device cpu)")
    ap.add_argument("--models", default="transformer,cnn")
    ap.add_argument("--ratios", default="0.5,0.3", help="budget / unmanaged peak")
    ap.add_argument("--offloads", default="always,delta")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pcie-mib", type=int, default=512)
    ap.add_argument("--pcie-reps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2, help="CPU threads (--device cpu)")
    ap.add_argument("--timeout", type=float, default=180, help="seconds a process may take")
    ap.add_argument("--json")
    for k, v in GPU_SIZES.items():
        ap.add_argument("--" + k.replace("_", "-"), type=int, default=None, help=f"default {v} (smoke "
                        f"{SMOKE_SIZES[k]})")
    a = ap.parse_args()
    if a.worker:
        worker_main(*a.worker)
        return 0

    import torch
    if a.device == "cuda" and not torch.cuda.is_available():
        print("offload_gpu_bench: CUDA is not available here (this bench measures a GPU's copies); "
              "run it on a machine with an NVIDIA GPU, or use --device cpu --smoke for a check of the "
              "machinery.", file=sys.stderr)
        return 2
    sizes = dict(SMOKE_SIZES if a.smoke else GPU_SIZES)
    for k in sizes:
        v = getattr(a, k)
        if v is not None:
            sizes[k] = v
    t_start = time.perf_counter()
    common = dict(device=a.device, seed=a.seed, warmup=a.warmup, steps=a.steps, sizes=sizes, threads=a.threads,
                  pcie_mib=a.pcie_mib, pcie_reps=a.pcie_reps, budget=None)
    results = {"device": a.device, "pcie_mib": a.pcie_mib, "pcie_reps": a.pcie_reps, "sizes": sizes,
               "warmup": a.warmup, "steps": a.steps, "models": {}}
    log(f"[pcie] {a.pcie_mib} MiB pinned copies, {a.pcie_reps} each way")
    pcie = spawn(dict(common, kind="pcie"), a.timeout)
    if "error" in pcie:
        print(f"the pinned-rate process failed: {pcie['error']}\n{pcie.get('traceback', pcie.get('stderr', ''))}",
              file=sys.stderr)
        return 1
    results["pcie"] = pcie
    ratios = [float(r) for r in a.ratios.split(",") if r]
    offloads = [o for o in a.offloads.split(",") if o]
    for name in a.models.split(","):
        m = {"describe": describe(name, sizes), "runs": {}}
        results["models"][name] = m
        log(f"[{name}] unmanaged")
        base = spawn(dict(common, kind="unmanaged", model=name), a.timeout)
        m["unmanaged"] = base
        if "error" in base:
            log(f"  failed: {base['error']}\n{base.get('traceback', base.get('stderr', ''))}")
            continue
        for offload in offloads:
            for ratio in ratios:
                budget = int(ratio * base["peak_bytes"]) // 512 * 512
                key = f"{offload}@{ratio:g}"
                log(f"[{name}] {key}: budget {budget / MiB:.1f} MiB")
                run = spawn(dict(common, kind="managed", model=name, offload=offload, budget=budget), a.timeout)
                run["ratio"], run["offload"] = ratio, offload
                if "error" in run and "traceback" in run:
                    log(f"  failed: {run['error']}\n{run['traceback']}")
                elif "error" in run:
                    log(f"  failed: {run['error']}\n{run.get('stderr', '')}")
                if "per_step" in run:
                    run["analysis"] = analyse(run, base, pcie)
                m["runs"][key] = run
    results["wall_s"] = time.perf_counter() - t_start
    report(results)
    print(f"\nwall time {results['wall_s']:.0f} s")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
        print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
