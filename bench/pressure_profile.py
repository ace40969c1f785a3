"""Where pymem's host time under pressure goes, on the CPU: the pressure handler's parts, per step,
from cProfile over the last two of ``--steps`` steps. On a GPU this host time is what the GPU waits
for (bench/gpu_overhead.py); the CPU shows it without a GPU, every part but the copies and moves
(which the GPU does asynchronously) costing about what it costs there.

    python bench/pressure_profile.py [--model gpt2-small|test|tinygpt] [--ratio 0.33] [--offload delta]
        [--batch B] [--seq T] [--steps 8] [--cost estimate|measure] [--json FILE]

gpt2-small: Hugging Face GPT-2 124M (random weights, eager attention) at batch 1 x 128 tokens by
default; test: the GPT-2 of bench/hf_checkpointing_bench.py's default (the tests' config, ~20 us
ops; its checkpointed peak is 0.34 of its plain one); tinygpt: pymem.demo_models' TinyGPT at batch
16 x 256. The budget is ``--ratio`` of the unmanaged peak (every CPU tensor byte, measured first).
Printed per step (ms, and calls): the handler in all; its compaction attempts without the moves
themselves (compact_for less the arena's moves); the moves (memmove on the CPU, queued copies on a
GPU); pricing the releases that compacting first is weighed against (the release path,
compaction_plan.release_path_seconds_in, asked first by pressure.py's _compact_first); releasing the lowest-scoring value; and swap.after_op, which runs after every op
while values are offloaded. Cumulative times under cProfile: its own overhead inflates Python, so
compare builds with this script, not with wall-clock figures.
"""
import argparse
import cProfile
import json
import os
import pstats
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [ROOT, HERE]

import torch  # noqa: E402

import pymem  # noqa: E402
from tests.runtime_models import measure_run  # noqa: E402

# name -> (file suffix, function) of the parts reported, as cProfile names them
PARTS = {
    "pressure handler": ("runtime/pressure.py", "__call__"),
    "compaction attempts": ("runtime/compaction.py", "compact_for"),
    "  of which moves (slide)": ("runtime/compaction.py", "_slide"),
    "  of which moves (one block)": ("~", "<built-in method pymem._C.move_block>"),
    "pricing the releases (compacting first?)": ("pymem/compaction_plan.py", "release_path_seconds_in"),
    "release lowest": ("runtime/pressure.py", "_release_lowest"),
    "swap.after_op": ("runtime/swap.py", "after_op"),
}


def make_trainer(a):
    if a.model == "tinygpt":
        from pymem.demo_models import gpt_trainer
        return lambda: gpt_trainer(batch=a.batch or 16, seq=a.seq or 256)
    import hf_checkpointing_bench as hb
    small = a.model == "gpt2-small"  # shorter than the bench's batch 8 x 1024; test: the bench's own
    cfg = dict(model=a.model, batch=a.batch or (1 if small else None), seq=a.seq or (128 if small else None),
               attn="eager", device="cpu", checkpointing=None)
    return lambda: hb.make_step(cfg)


def parts_of(stats: pstats.Stats, steps: int) -> dict:
    out = {}
    for name, (suffix, func) in PARTS.items():
        calls = seconds = 0.0
        for (fn, _, fname), (_, nc, _, ct, _) in stats.stats.items():
            if fname == func and (fn.endswith(suffix) or suffix == "~"):
                calls += nc
                seconds += ct
        out[name] = {"ms_per_step": seconds / steps * 1e3, "calls_per_step": calls / steps}
    moves = out["  of which moves (slide)"]["ms_per_step"] + out["  of which moves (one block)"]["ms_per_step"]
    out["compaction attempts, less moves"] = {
        "ms_per_step": out["compaction attempts"]["ms_per_step"] - moves,
        "calls_per_step": out["compaction attempts"]["calls_per_step"]}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt2-small", choices=("gpt2-small", "test", "tinygpt"))
    ap.add_argument("--ratio", type=float, default=0.33)
    ap.add_argument("--offload", default="delta")
    ap.add_argument("--batch", type=int)
    ap.add_argument("--seq", type=int)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--cost", default="estimate", help="pymem's cost option (estimate: as on a GPU)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    make = make_trainer(a)
    peak, _ = measure_run(make, 2)
    pymem.enable(int(peak * a.ratio) // 512 * 512, offload=a.offload, cost=a.cost)
    step = make()
    prof, times = cProfile.Profile(), []
    for i in range(a.steps):
        if i == a.steps - 2:
            prof.enable()
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    prof.disable()
    stats = pymem.memory_stats()
    pymem.disable()
    parts = parts_of(pstats.Stats(prof), 2)
    print(f"{a.model} at {a.ratio} of its {peak / 2**20:.0f} MiB peak, offload {a.offload}, cost {a.cost}; "
          f"steps (s) {[round(t, 2) for t in times]}")
    print(f"{'part (last two steps, under cProfile)':40s} {'ms/step':>9s} {'calls/step':>11s}")
    for name, p in parts.items():
        print(f"{name:40s} {p['ms_per_step']:9.1f} {p['calls_per_step']:11.0f}")
    counters = {k: stats.get(k) for k in ("num_evictions", "num_offloads", "num_compactions", "moved_bytes",
                                          "pressure_seconds", "num_ops")}
    print("whole run:", json.dumps(counters))
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump({"args": vars(a), "peak": peak, "step_seconds": times, "parts": parts, "stats": counters}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
