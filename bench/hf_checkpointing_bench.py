"""Hugging Face GPT-2 (the config of tests/test_models_hf.py, random weights): pymem against the
model's own gradient checkpointing, in one process.

    python bench/hf_checkpointing_bench.py [--json FILE] [--steps 10] [--warmup 3]

Runs, each `--steps` AdamW steps (model building and the first `--warmup` steps not timed: pymem
plans a step from the one before, from the third step on), every loss and parameter compared
bitwise with the plain unmanaged run where the model is the same:
  - plain: unmanaged, no checkpointing (the reference peak and step time);
  - hf-checkpointing: `gradient_checkpointing_enable()` (non-reentrant and reentrant), unmanaged;
  - pymem at the checkpointed peak: the plain model under `pymem.enable(budget=that peak)`;
  - pymem + hf-checkpointing below the checkpointed peak (0.8, 0.6 of it).
Each figure: peak as a share of the plain peak, step time as a multiple of the plain step time.
A run that raises pymem.OutOfBudgetError is reported as infeasible.
"""
import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

import torch  # noqa: E402
import transformers  # noqa: E402

import pymem  # noqa: E402
from bitwise_harness import budget_at, measure, run_managed, run_unmanaged  # noqa: E402
import test_models_hf as models  # noqa: E402
from pymem.testing import all_bitwise_equal  # noqa: E402

transformers.utils.logging.set_verbosity_error()


def workload(checkpointing=None):
    def make():
        step = models.workload("gpt2")()
        if checkpointing is not None:
            step.model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": checkpointing == "reentrant"})
        return step
    return make


def timed_unmanaged(make, steps, warmup):
    run_unmanaged(make, 1)  # warm-up
    return run_unmanaged(make, steps, untimed=warmup)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3, help="steps run first and not timed")
    ap.add_argument("--json", help="write the figures here")
    a = ap.parse_args()
    out = {}
    plain_peak, _ = measure(workload(), a.steps)
    ref_losses, ref_state, plain_s = timed_unmanaged(workload(), a.steps, a.warmup)
    out["plain"] = {"peak": 1.0, "slowdown": 1.0}
    ckpt_peak = {}
    for kind in ("non-reentrant", "reentrant"):
        peak, _ = measure(workload(kind), a.steps)
        losses, state, s = timed_unmanaged(workload(kind), a.steps, a.warmup)
        ckpt_peak[kind] = peak
        out[f"hf-checkpointing {kind}"] = {"peak": peak / plain_peak, "slowdown": s / plain_s,
                                           "bitwise": all_bitwise_equal(losses + state, ref_losses + ref_state)}

    def managed(name, make, budget, ref):
        try:
            losses, state, stats, s, _ = run_managed(make, a.steps, budget, limit_s=600, untimed=a.warmup)
        except pymem.OutOfBudgetError:
            out[name] = {"peak": budget / plain_peak, "infeasible": True}
            return
        out[name] = {"peak": stats["allocated_bytes.peak"] / plain_peak, "slowdown": s / plain_s,
                     "budget": budget / plain_peak, "num_evictions": stats["num_evictions"],
                     "bitwise": all_bitwise_equal(losses + state, ref[0] + ref[1])}

    managed("pymem at the checkpointed peak", workload(), budget_at(ckpt_peak["non-reentrant"], 1.0),
            (ref_losses, ref_state))
    for kind in ("non-reentrant", "reentrant"):
        ref = run_unmanaged(workload(kind), a.steps)
        for ratio in (0.8, 0.6):
            managed(f"pymem + hf-checkpointing {kind} at {ratio} of its peak", workload(kind),
                    budget_at(ckpt_peak[kind], ratio), ref)
    for name, f in out.items():
        figs = "infeasible (OutOfBudgetError)" if f.get("infeasible") else \
            f"slowdown {f['slowdown']:.2f}x" + ("" if f.get("bitwise", True) else "  NOT BITWISE")
        print(f"{name:55s} peak {f['peak']:.2f} of plain  {figs}")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
