"""Hugging Face GPT-2 (random weights, built from a config: nothing is downloaded): pymem against the
model's own gradient checkpointing, on the CPU or a GPU.

    python bench/hf_checkpointing_bench.py [--device cpu|cuda] [--model test|gpt2-small]
        [--batch B] [--seq T] [--steps 10] [--warmup 3] [--json FILE] [--subprocess]
        [--limit SECONDS] [--only SUBSTRINGS] [--logs DIR] [--offload D] [--policy P]

On a GPU: --device cuda --model gpt2-small --steps 6 --warmup 3 --limit 120 (117 s on an H200 without the
pymem + hf-checkpointing rows, 2026-11-28: README, "On a GPU")

Models: "test" is the GPT-2 config of tests/test_models_hf.py (batch 16 x 64 tokens, 4 layers of
width 32); "gpt2-small" is GPT-2 124M (12 layers, width 768, 12 heads, vocabulary 50257) at batch
8 x 1024 tokens. --batch / --seq change the batch. Attention: transformers' default (SDPA) on the
CPU, "eager" on CUDA (plain matmul / softmax / dropout kernels, deterministic under
`torch.use_deterministic_algorithms`; SDPA's fused kernels are not); --attn chooses.

Configurations, each `--steps` AdamW steps of which the first `--warmup` are not timed (pymem plans
a step from the one before, from the third step on, and tries its five ways of planning in steps 3
to 12: `--steps 18 --warmup 12` times the way it settles on); model building is never timed:
  - plain: unmanaged, no checkpointing (the reference peak and step time);
  - hf-checkpointing non-reentrant / reentrant: `gradient_checkpointing_enable()`, unmanaged;
  - pymem at the checkpointed peak: the plain model under `pymem.enable(budget=the non-reentrant
    checkpointed peak)`;
  - pymem at 0.5 and at 0.33 of the plain peak: the plain model;
  - pymem + hf-checkpointing (each kind) at 0.8 and 0.6 of that kind's checkpointed peak.
Every loss and every parameter is compared bitwise with the unmanaged run of the same model (plain,
or checkpointed of the same kind; checkpointed runs with plain) through a sha256 digest of their
dtypes, shapes and bytes. Figures: peak as a share of the plain peak, median step time of the timed
steps as a multiple of plain's. A run that raises pymem.OutOfBudgetError is infeasible.

Peaks: on the CPU every CPU tensor byte of a separate run of the same steps under a counting arena
(tests/runtime_models.measure_run); on CUDA `torch.cuda.max_memory_allocated()` over the timed steps
(after `reset_peak_memory_stats()`); under pymem the arena's `allocated_bytes.peak` over the whole
run (every tensor of the run lives in it, cuBLAS's workspace included). pymem's options are its
defaults for the device (on CUDA: the arena through CUDAPluggableAllocator, offload "delta",
estimated op costs; on the CPU: offload "never", measured costs); --offload / --policy change them.

Processes: on CUDA every configuration runs in a fresh process (this file, with a hidden --one mode),
because pymem's arena must become PyTorch's CUDA allocator before CUDA initialises; each child sets
CUBLAS_WORKSPACE_CONFIG=:4096:8, `torch.use_deterministic_algorithms(True, warn_only=True)` and no
TF32, and returns its figures and digest as JSON through a file. On the CPU all configurations run
in this process (as before), or each in its own with --subprocess. Step timing on CUDA synchronises
the device before each clock read.
"""
import argparse
import gc
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before CUDA (cuBLAS) initialises

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))
if ROOT not in sys.path:
    sys.path.insert(1, ROOT)

import torch  # noqa: E402
import transformers  # noqa: E402

import pymem  # noqa: E402
from bitwise_harness import RunTooLong, budget_at, deadline, measure, state_of  # noqa: E402
import test_models_hf as models  # noqa: E402

transformers.utils.logging.set_verbosity_error()

# name -> GPT2Config fields and the default batch
MODELS = {
    "test": dict(vocab_size=models.V, n_embd=models.D, n_layer=models.L, n_head=2, n_positions=models.T,
                 bos_token_id=0, eos_token_id=0, batch=models.B, seq=models.T),
    "gpt2-small": dict(vocab_size=50257, n_embd=768, n_layer=12, n_head=12, n_positions=1024,
                       batch=8, seq=1024),
}
CKPT_KINDS = ("non-reentrant", "reentrant")
PLAIN_RATIOS = (0.5, 0.33)
CKPT_RATIOS = (0.8, 0.6)


# ------------------------------------------------------------------------------------ the workload

def make_step(cfg):
    """Seeds, builds the model (on the CPU, from the seed, then moved to the device), the batch and
    AdamW; returns step() -> the loss (a detached copy), with step.model. Under pymem it is called
    after pymem.enable, so that every tensor on the device (parameters, batch, AdamW state) lives in
    the arena."""
    spec = dict(MODELS[cfg["model"]])
    batch, seq = cfg["batch"] or spec.pop("batch"), cfg["seq"] or spec.pop("seq")
    spec.pop("batch", None)
    spec.pop("seq", None)
    spec["n_positions"] = max(spec["n_positions"], seq)
    if cfg["attn"] != "default":
        spec["attn_implementation"] = cfg["attn"]
    device = torch.device(cfg["device"])
    torch.manual_seed(0)  # as tests/test_models_hf.workload("gpt2"): model, then batch, then AdamW
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**spec))
    ids = torch.randint(0, spec["vocab_size"], (batch, seq))
    model.train()
    if device.type != "cpu":
        model.to(device)
        ids = ids.to(device)
    if cfg["checkpointing"] is not None:
        with warnings.catch_warnings():  # deprecated for activation_checkpointing_enable in transformers 5.2x
            warnings.simplefilter("ignore", FutureWarning)
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": cfg["checkpointing"] == "reentrant"})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step():
        opt.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        return loss.detach().clone()

    step.model = model
    return step


def _sync(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed_steps(step, cfg, before_timed=None):
    """(every step's loss, seconds of each step after the first --warmup)."""
    losses = [step() for _ in range(cfg["warmup"])]
    _sync(cfg["device"])
    if before_timed is not None:
        before_timed()
    seconds = []
    for _ in range(cfg["steps"] - cfg["warmup"]):
        t0 = time.perf_counter()
        losses.append(step())
        _sync(cfg["device"])
        seconds.append(time.perf_counter() - t0)
    return losses, seconds


def digest(tensors):
    """sha256 of the dtypes, shapes and bytes: equal digests, bitwise equal tensors."""
    h = hashlib.sha256()
    for t in tensors:
        t = t.detach().cpu().contiguous()
        h.update(f"{t.dtype}{tuple(t.shape)};".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _is_out_of_budget(e):
    while e is not None:  # raised inside an op (or a checkpoint's recompute), it may come wrapped
        if isinstance(e, pymem.OutOfBudgetError):
            return True
        e = e.__cause__ or e.__context__
    return False


STATS = ("budget_bytes", "allocated_bytes.peak", "num_evictions", "num_rematerializations", "num_offloads",
         "num_leaf_offloads", "offloaded_bytes", "num_swap_ins", "num_prefetches", "num_late_uses", "host_bytes.peak",
         "remat_seconds", "pressure_seconds", "swap_seconds", "plan_hits", "plan_divergences", "num_ops")


def one(cfg):
    """One configuration, in this process: a dict of its figures (see the module doc)."""
    device, budget = cfg["device"], cfg["budget"]
    res = {"name": cfg["name"], "budget_bytes": budget, "steps": cfg["steps"]}
    if device.startswith("cuda"):
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    step = None
    try:
        if budget is None:  # unmanaged
            if device.startswith("cuda"):
                step = make_step(cfg)
                losses, seconds = timed_steps(step, cfg, before_timed=torch.cuda.reset_peak_memory_stats)
                res["peak_bytes"] = int(torch.cuda.max_memory_allocated())
            else:
                res["peak_bytes"] = int(measure(lambda: make_step(cfg), cfg["steps"])[0])
                warm = make_step(cfg)  # one throwaway step first, as before: caches, thread pools
                warm()
                del warm
                gc.collect()
                step = make_step(cfg)
                losses, seconds = timed_steps(step, cfg)
            res["digest"] = digest(losses + state_of(step.model))
        else:
            options = {k: cfg[k] for k in ("offload", "policy") if cfg.get(k)}
            pymem.enable(budget=budget, device=device, **options)  # first: on CUDA, before CUDA initialises
            try:
                with deadline(cfg["limit_s"], f"{cfg['name']}: {cfg['steps']} steps under {budget} B"):
                    step = make_step(cfg)
                    losses, seconds = timed_steps(step, cfg)
                    res["digest"] = digest(losses + state_of(step.model))
                stats = dict(pymem.memory_stats())
            finally:
                pymem.disable()
            res["peak_bytes"] = int(stats["allocated_bytes.peak"])
            res["stats"] = {k: stats[k] for k in STATS if k in stats}
        res["losses"] = [float(x) for x in losses]
        res["step_seconds"] = statistics.median(seconds) if seconds else None
        res["step_seconds_all"] = seconds
        res["feasible"] = True
    except Exception as e:  # noqa: BLE001 — reported in the table
        if _is_out_of_budget(e):
            res.update(feasible=False, error="OutOfBudgetError: " + str(e).splitlines()[0][:300])
        elif isinstance(e, RunTooLong):
            res.update(feasible=False, error=str(e))
        else:
            traceback.print_exc()
            res.update(feasible=False, error=f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}",
                       crashed=True)
    finally:
        step = None
        gc.collect()
    return res


# --------------------------------------------------------------------------------------- the runs

def run_config(cfg, a, tmp):
    """One configuration: in this process, or in a fresh one (this file in --one mode)."""
    if not a.subprocess_mode:
        return one(cfg)
    index = len([f for f in os.listdir(tmp) if f.endswith(".json")])
    out = os.path.join(tmp, f"{index}.json")
    log = os.path.join(a.logs or tmp, f"{index:02d}-" + "".join(c if c.isalnum() or c in ".-" else "_" for c in cfg["name"]) + ".log")
    t0 = time.perf_counter()
    with open(log, "w") as err:
        try:
            r = subprocess.run([sys.executable, os.path.abspath(__file__), "--one", json.dumps(cfg), "--result", out],
                               stdout=err, stderr=subprocess.STDOUT, timeout=cfg["limit_s"] + 300)
            code = r.returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
    res = None
    if os.path.exists(out):
        with open(out) as fh:
            res = json.load(fh)
    if res is None or res.get("crashed") or a.verbose:
        with open(log) as fh:
            tail = fh.read()[-4000:]
        print(f"--- {cfg['name']}: exit {code}, its output (tail):\n{tail}", file=sys.stderr, flush=True)
    if res is None:
        res = {"name": cfg["name"], "budget_bytes": cfg["budget"], "feasible": False, "crashed": True,
               "error": f"the child process ended ({code}) without a result"}
    res["process_seconds"] = round(time.perf_counter() - t0, 1)
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda / cuda:N")
    ap.add_argument("--model", default="test", choices=sorted(MODELS))
    ap.add_argument("--batch", type=int, help="batch size (default: the model's)")
    ap.add_argument("--seq", type=int, help="tokens per sequence (default: the model's)")
    ap.add_argument("--attn", choices=("default", "eager", "sdpa"),
                    help="attention implementation (default: transformers' own on the CPU, eager on CUDA)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3, help="steps run first and not timed")
    ap.add_argument("--offload", help="pymem's offload director (default: pymem's for the device)")
    ap.add_argument("--policy", help="pymem's eviction policy (default: pymem's)")
    ap.add_argument("--limit", type=float, default=600, help="seconds one managed run may take")
    ap.add_argument("--subprocess", action="store_true", help="on the CPU too, each configuration in a fresh process")
    ap.add_argument("--only", help="comma-separated substrings: run only the pymem configurations whose name has one "
                                   "(plain and hf-checkpointing always run: the budgets and references come from them)")
    ap.add_argument("--verbose", action="store_true", help="print every child process's output (its tail)")
    ap.add_argument("--logs", help="keep each child process's output in this folder")
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    a = ap.parse_args()

    if a.one is not None:  # a child: one configuration, figures to --result
        res = one(json.loads(a.one))
        with open(a.result + ".tmp", "w") as fh:
            json.dump(res, fh)
        os.replace(a.result + ".tmp", a.result)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # no teardown (CUDA, pinned host memory): the figures are written

    if a.warmup >= a.steps:
        ap.error("--warmup must be less than --steps")
    on_cuda = a.device.startswith("cuda")
    if a.logs:
        os.makedirs(a.logs, exist_ok=True)
    if on_cuda and not torch.cuda.is_available():  # asks the driver only: CUDA stays uninitialised here
        ap.error(f"--device {a.device}: no CUDA GPU here")
    a.subprocess_mode = on_cuda or a.subprocess
    attn = a.attn or ("eager" if on_cuda else "default")
    base = dict(model=a.model, device=a.device, batch=a.batch, seq=a.seq, attn=attn, steps=a.steps,
                warmup=a.warmup, offload=a.offload, policy=a.policy, limit_s=a.limit)
    only = [s.strip() for s in a.only.split(",")] if a.only else None
    spec = MODELS[a.model]
    print(f"{a.model} (batch {a.batch or spec['batch']} x {a.seq or spec['seq']} tokens, attention {attn}) on "
          f"{a.device}: {a.steps} steps, {a.warmup} untimed; "
          f"{'each configuration in a fresh process' if a.subprocess_mode else 'all in this process'}", flush=True)

    results = {}
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="hf_ckpt_bench_") as tmp:
        def run(name, checkpointing=None, budget=None, ref=None):
            if only and budget is not None and not any(s in name for s in only):
                return None
            res = run_config(dict(base, name=name, checkpointing=checkpointing, budget=budget), a, tmp)
            res["reference"] = ref
            results[name] = res
            show(name, res, results)
            return res

        print(HEADER, flush=True)
        plain = run("plain")
        if not plain.get("feasible"):
            print(f"plain failed: {plain.get('error')}", file=sys.stderr)
            sys.exit(1)
        plain_peak = plain["peak_bytes"]
        ckpt = {}
        for kind in CKPT_KINDS:
            ckpt[kind] = run(f"hf-checkpointing {kind}", kind, ref="plain")
        if ckpt["non-reentrant"].get("feasible"):
            run("pymem at the checkpointed peak", budget=budget_at(ckpt["non-reentrant"]["peak_bytes"], 1.0), ref="plain")
        for ratio in PLAIN_RATIOS:
            run(f"pymem at {ratio} of plain", budget=budget_at(plain_peak, ratio), ref="plain")
        for kind in CKPT_KINDS:
            if not ckpt[kind].get("feasible"):
                continue
            for ratio in CKPT_RATIOS:
                run(f"pymem + hf-checkpointing {kind} at {ratio} of its peak", kind,
                    budget_at(ckpt[kind]["peak_bytes"], ratio), ref=f"hf-checkpointing {kind}")

    total = time.perf_counter() - t_start
    print(f"(peak, budget: shares of plain's peak, {plain_peak / 2**20:.1f} MiB; slowdown: median step over "
          f"plain's, {plain['step_seconds'] * 1e3:.1f} ms; bitwise: losses and parameters against the unmanaged "
          f"run of the same model; {total:.0f} s in all)")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"run": dict(base, attn=attn, batch=a.batch or spec["batch"], seq=a.seq or spec["seq"],
                                   subprocess=a.subprocess_mode, torch=torch.__version__,
                                   transformers=transformers.__version__, seconds=round(total, 1)),
                       "configs": summary(results)}, fh, indent=1)
    if any(r.get("crashed") for r in results.values()):
        sys.exit(1)


def summary(results):
    """name -> figures relative to plain (and the raw ones)."""
    plain = results["plain"]
    out = {}
    for name, r in results.items():
        f = {"feasible": bool(r.get("feasible")), "budget_bytes": r.get("budget_bytes")}
        if r.get("budget_bytes") is not None:
            f["budget"] = r["budget_bytes"] / plain["peak_bytes"]
        if r.get("feasible"):
            ref = results.get(r.get("reference")) if r.get("reference") else None
            f.update(peak=r["peak_bytes"] / plain["peak_bytes"], peak_bytes=r["peak_bytes"],
                     slowdown=r["step_seconds"] / plain["step_seconds"], step_seconds=r["step_seconds"],
                     step_seconds_all=r["step_seconds_all"],
                     bitwise=None if ref is None or not ref.get("feasible") else r["digest"] == ref["digest"],
                     bitwise_reference=r.get("reference"), digest=r["digest"], losses=r["losses"])
            if "stats" in r:
                f["stats"] = r["stats"]
                f["num_evictions"] = r["stats"].get("num_evictions")
                f["num_offloads"] = r["stats"].get("num_offloads")
                if r["stats"].get("pressure_seconds") is not None and r.get("steps"):
                    f["pressure_ms"] = r["stats"]["pressure_seconds"] / r["steps"] * 1e3  # every step, warm-up too
        else:
            f["error"] = r.get("error")
            f["crashed"] = bool(r.get("crashed"))  # an error other than OutOfBudgetError / the time limit
        if "process_seconds" in r:
            f["process_seconds"] = r["process_seconds"]
        out[name] = f
    return out


def _row(name, f):
    budget = f"{f['budget']:.2f}" if "budget" in f else "-"
    if not f["feasible"]:
        return f"{name:58s} {'-':>6s} {budget:>6s} {'-':>8s} {'-':>7s} {'ERROR' if f['crashed'] else 'no':>8s}  " \
            f"{(f.get('error') or '')[:70]}"
    bitwise = "ref" if f["bitwise_reference"] is None else {True: "yes", False: "NO", None: "?"}[f["bitwise"]]
    extra = "" if "stats" not in f else \
        f"  evictions {f['num_evictions']}, offloads {f['num_offloads']}" + \
        (f", pressure {f['pressure_ms']:.1f} ms a step" if f.get("pressure_ms") is not None else "")
    return f"{name:58s} {f['peak']:6.2f} {budget:>6s} {f['slowdown']:7.2f}x {bitwise:>7s} {'yes':>8s}{extra}"


HEADER = f"{'configuration':58s} {'peak':>6s} {'budget':>6s} {'slowdown':>8s} {'bitwise':>7s} {'feasible':>8s}"


def show(name, res, results):
    """The table's row of a configuration, as soon as it is done."""
    print(_row(name, summary(results)[name]), flush=True)


if __name__ == "__main__":
    main()
