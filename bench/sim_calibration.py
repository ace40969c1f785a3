"""The simulator against a real device (issue 16, calibration): simulated vs measured step time of
the GPT and the CNN of bench/remat_bench.py (as bench/train_script.py) under the same budget ratios.

    python bench/sim_calibration.py [--device cuda] [--gpu h100] [--models gpt,cnn]
                                    [--budgets 1.0,0.7,0.5,0.3] [--steps 6] [--policy dtr]
                                    [--measure-timeout 150] [--json FILE] [train_script flags...]

Per model, two ``pymem profile`` runs of ``bench/train_script.py --model M [flags]``, each a
subprocess whose ``--json`` is read back:

  measured:  pymem profile --device D --budgets B --steps N -- train_script.py --model M --device D ...
             (one fresh process a budget, unmanaged first, then the bisection for the floor; stopped
             with SIGTERM after --measure-timeout seconds, which keeps the points measured so far)
  simulated: pymem profile --device meta --gpu G --budgets B' -- train_script.py --model M ...
             (one step captured on the meta device, replayed per budget; B' is B plus every ratio the
             measured run's bisection tried, so each measured point has a simulated one)

A ratio is a share of each side's own unmanaged peak: the measured side's is the device's (on CUDA
``torch.cuda.max_memory_allocated``, which counts cuBLAS workspaces and the caching allocator's
rounding), the simulated side's the trace's (its values, blocks rounded to 512 bytes). Both peaks are
reported; the same ratio is the same share, not the same bytes. Step time: the median of the steps
after the first (measured), the replay's clock (simulated). error = simulated / measured - 1; the
mean absolute error per model is over the rows (unmanaged and each ratio) where both sides ran.
Unknown flags (``--batch 2``, ``--seq 64``, ``--size 32`` ...) go to train_script.py on both sides.

On the CPU (``--device cpu``) this tests the plumbing only: the simulator prices a GPU.
"""
import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SCRIPT = os.path.join(HERE, "train_script.py")
_BAD = ("oom", "timeout", "error", "thrash")
MiB = 2 ** 20


def _env() -> dict:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS, before any CUDA starts
    return env


def profile(device: str, budgets, script_args, json_path: str, a, timeout=None) -> dict:
    """One ``python -m pymem profile`` run; its JSON (None when it wrote none) with "exit_code",
    "wall_seconds" and "stopped" (sent SIGTERM at ``timeout``) added."""
    cmd = [sys.executable, "-m", "pymem", "profile", "--device", device, "--steps", str(a.steps),
           "--policy", a.policy, "--budgets", ",".join(_fmt_ratio(r) for r in budgets), "--json", json_path]
    if device == "meta":
        cmd += ["--gpu", a.gpu]
    cmd += ["--", SCRIPT, *script_args]
    print("$ " + " ".join(cmd), file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=_env(), cwd=ROOT, stdout=subprocess.PIPE, text=True)
    stopped = False
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stopped = True  # as Ctrl-C: profile ends the run in flight and writes the points so far
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate()
    sys.stderr.write(out)
    data = None
    if os.path.exists(json_path):
        with open(json_path, encoding="utf-8") as f:
            data = json.load(f)
    return {"data": data, "exit_code": proc.returncode, "wall_seconds": time.perf_counter() - t0,
            "stopped": stopped, "command": cmd}


def _fmt_ratio(r: float) -> str:
    return repr(round(float(r), 6))


def _key(r) -> float:
    return round(float(r), 6)


def _ok(p) -> bool:
    return p is not None and p.get("status") not in _BAD and p.get("step_seconds") is not None


def compare(measured: dict, simulated: dict) -> dict:
    """Rows (unmanaged, then each ratio either side ran, largest first) of both sides' figures."""
    mu = (measured or {}).get("unmanaged") or {}
    su = (simulated or {}).get("unmanaged") or {}
    rows = [{"ratio": None, "label": "unmanaged",
             "measured": {"status": mu.get("status"), "step_seconds": mu.get("step_seconds"),
                          "peak_bytes": mu.get("peak_bytes"), "evictions": 0, "recompute_seconds": 0.0}
             if mu else None,
             "simulated": {"status": su.get("status"), "step_seconds": su.get("step_seconds"),
                           "peak_bytes": su.get("peak_bytes"), "evictions": 0, "recompute_seconds": 0.0}
             if su else None}]
    mp = {_key(p["ratio"]): p for p in (measured or {}).get("points", [])}
    sp = {_key(p["ratio"]): p for p in (simulated or {}).get("points", [])}
    for r in sorted(set(mp) | set(sp), reverse=True):
        label = f"{r:.2f}" if round(r, 2) == r else f"{r:.4g}"  # as pymem profile writes it
        rows.append({"ratio": r, "label": label, "measured": mp.get(r), "simulated": sp.get(r)})
    for row in rows:
        m, s = row["measured"], row["simulated"]
        row["error"] = (s["step_seconds"] / m["step_seconds"] - 1) if _ok(m) and _ok(s) else None
        if row["ratio"] is not None and _ok(m) and _ok(s):
            row["slowdown_error"] = s["slowdown"] / m["slowdown"] - 1
    errs = [abs(row["error"]) for row in rows if row["error"] is not None]
    budget_errs = [abs(row["error"]) for row in rows if row["error"] is not None and row["ratio"] is not None]
    slow_errs = [abs(row["slowdown_error"]) for row in rows if row.get("slowdown_error") is not None]
    mf, sf = (measured or {}).get("floor"), (simulated or {}).get("floor")
    return {"rows": rows,
            "mean_abs_error": sum(errs) / len(errs) if errs else None,
            "mean_abs_error_budgets": sum(budget_errs) / len(budget_errs) if budget_errs else None,
            "mean_abs_slowdown_error": sum(slow_errs) / len(slow_errs) if slow_errs else None,
            "compared_rows": len(errs),
            "measured_peak_bytes": mu.get("peak_bytes"), "simulated_peak_bytes": su.get("peak_bytes"),
            "measured_floor": mf["ratio"] if mf else None, "simulated_floor": sf["ratio"] if sf else None}


def _cell(p, key, fmt):
    if p is None:
        return "-"
    if p.get("status") in _BAD:
        return p["status"] if key == "step_seconds" else ""
    v = p.get(key)
    return "-" if v is None else fmt.format(v)


def print_table(model: str, c: dict, device: str, gpu: str) -> None:
    mpk, spk = c["measured_peak_bytes"], c["simulated_peak_bytes"]

    def mib(x):
        return "-" if x is None else f"{x / MiB:.1f} MiB"

    print(f"\n{model}: measured on {device}, simulated on {gpu}; unmanaged peak measured {mib(mpk)}, "
          f"simulated {mib(spk)}" + (f" (sim/measured {spk / mpk:.3f})" if mpk and spk else ""))
    head = ("model", "ratio", "meas s", "sim s", "error", "meas slow", "sim slow", "meas evict", "sim evict",
            "meas recomp s", "sim recomp s")
    rows = [head]
    for row in c["rows"]:
        m, s = row["measured"], row["simulated"]
        rows.append((model, row["label"], _cell(m, "step_seconds", "{:.4f}"), _cell(s, "step_seconds", "{:.4f}"),
                     "-" if row["error"] is None else f"{row['error']:+.1%}",
                     "1.00x" if row["ratio"] is None and _ok(m) else _cell(m, "slowdown", "{:.2f}x"),
                     "1.00x" if row["ratio"] is None and _ok(s) else _cell(s, "slowdown", "{:.2f}x"),
                     _cell(m, "evictions", "{:.1f}"), _cell(s, "evictions", "{:.1f}"),
                     _cell(m, "recompute_seconds", "{:.4f}"), _cell(s, "recompute_seconds", "{:.4f}")))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    for r in rows:
        print("  ".join(x.ljust(w) for x, w in zip(r, widths)).rstrip())

    def pct(x):
        return "-" if x is None else f"{x:.1%}"

    print(f"{model}: mean |error| {pct(c['mean_abs_error'])} over {c['compared_rows']} rows "
          f"(budget rows only {pct(c['mean_abs_error_budgets'])}; slowdown {pct(c['mean_abs_slowdown_error'])}); "
          f"floor measured {c['measured_floor']}, simulated {c['simulated_floor']}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 allow_abbrev=False)  # "--d 256" is train_script's, not --device
    ap.add_argument("--device", default="cuda", help="the measured side: cuda, cuda:N or cpu")
    ap.add_argument("--gpu", default="h100", help="the GPU the simulator prices (pymem.gpus)")
    ap.add_argument("--models", default="gpt,cnn")
    ap.add_argument("--budgets", default="1.0,0.7,0.5,0.3", help="shares of each side's unmanaged peak")
    ap.add_argument("--steps", type=int, default=6, help="training steps a measured run (the first not timed)")
    ap.add_argument("--policy", default="dtr")
    ap.add_argument("--measure-timeout", type=float, default=120,
                    help="seconds a model's measured profile may take; then it is stopped (SIGTERM) and "
                         "keeps the points measured so far (the fixed budgets come before the bisection)")
    ap.add_argument("--json", default=None, help="write everything here")
    a, script_flags = ap.parse_known_args()
    models = [m.strip() for m in a.models.split(",") if m.strip()]
    for m in models:
        if m not in ("gpt", "cnn"):
            ap.error(f"--models: unknown model {m!r} (gpt, cnn)")
    budgets = sorted({float(x) for x in a.budgets.split(",") if x.strip()}, reverse=True)
    script_steps = ["--steps", str(max(20, a.steps + 2))]
    t_all = time.perf_counter()
    out = {"config": {**vars(a), "script_flags": script_flags, "budgets": budgets}, "models": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for m in models:
            args = ["--model", m, *script_steps, *script_flags]
            meas = profile(a.device, budgets, args + ["--device", a.device], os.path.join(tmp, f"{m}_measured.json"),
                           a, timeout=a.measure_timeout)
            tried = [p["ratio"] for p in (meas["data"] or {}).get("points", [])]
            sim_budgets = sorted({_key(r) for r in budgets + tried}, reverse=True)
            sim = profile("meta", sim_budgets, args, os.path.join(tmp, f"{m}_simulated.json"), a)
            c = compare(meas["data"], sim["data"])
            out["models"][m] = {"comparison": c, "measured": meas, "simulated": sim}
            print_table(m, c, a.device, a.gpu)
            if meas["stopped"]:
                print(f"{m}: the measured profile was stopped after {a.measure_timeout:g} s (--measure-timeout)")
            for side, r in (("measured", meas), ("simulated", sim)):
                if r["data"] is None:
                    print(f"{m}: the {side} profile wrote no result (exit code {r['exit_code']}); see its output above")
    out["wall_seconds"] = time.perf_counter() - t_all
    print(f"\nwall time {out['wall_seconds']:.0f} s")
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=2)
        print(f"wrote {a.json}")
    return 0 if all(v["measured"]["data"] and v["simulated"]["data"] for v in out["models"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
