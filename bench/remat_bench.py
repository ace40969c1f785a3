"""Training-step slowdown under a hard memory budget (eviction + rematerialization), and per-op cost.

    python bench/remat_bench.py [--json FILE] [--quick] [--threads 2] [--steps N] [--warmup N]

For each model ("transformer": TinyGPT; "cnn": a small ResNet-like net with BatchNorm; "tree": a
recursion over a data-dependent binary tree of 32 KiB activations, small ops; the last two defined
here), in one process:
  1. the unmanaged peak: model + Adam + fixed data built and trained (warmup + N steps) under a
     plain 8 GiB arena installed as the CPU allocator (`pymem.install_cpu_hook`, small_threshold=0);
     its median step time is reported too (arena_only_step_s, measured once, not bracketed: it
     separates the allocator's own effect from the runtime's, slowdown_vs_arena_only in details);
  2. the aten ops of one training step (a counting TorchDispatchMode);
  3. for each budget ratio (1.0, 0.7, 0.5, 0.3, 0.2): an unmanaged block (fresh model, warmup steps,
     N timed steps, no hook), then a managed block (`pymem.enable(ratio * peak)`, model + Adam + data
     built after enable so they live in the arena, warmup steps, N timed steps, `pymem.disable()`);
  4. the lowest feasible ratio: bisection (2-step runs) between the highest failing ratio below the
     lowest one that worked (at least 0.05) and that ratio, to --tol; then a timed block there;
  5. a closing unmanaged block.
slowdown = managed median step time / mean of the medians of the unmanaged blocks just before and
just after it (so slow drift of the machine cancels). A ratio whose run raises
pymem.OutOfBudgetError is infeasible (slowdown null, "infeasible": true in details). A managed block
(or search run) that takes longer than --max-slowdown (20) times the unmanaged time is stopped
(SIGALRM) and counts as failed too (slowdown null, "timed_out": true, "slowdown_at_least": x), so
thrashing cannot stall the bench; the lowest feasible ratio is thus the lowest that runs and is
within that bound.
OMP_WAIT_POLICY defaults to PASSIVE here (see below): keep the machine otherwise idle anyway.

Per-op bookkeeping overhead: --ops adds of 4-element tensors, unmanaged vs under pymem.enable with a
huge budget (no eviction), alternated --op-reps times; (managed - unmanaged) / ops in microseconds
(medians). Overhead share of a model = ops per step * per-op overhead / unmanaged step time.

With --json, writes:
  {"transformer": {"1.0": slowdown, "0.7": ..., "0.5": ..., "0.3": ..., "0.2": ...,
                   "lowest": {"ratio": r, "slowdown": s}},
   "cnn": {...}, "per_op_overhead_us": x,
   "details": {per model: peak, ops per step, unmanaged step time, per-ratio timings, evictions,
               rematerializations, remat seconds per step, peak vs budget, losses, search trials;
               "per_op": the raw loop timings; "config"; "targets"; "wall_seconds"}}
Targets (transformer): <= 1.05x at 1.0, <= 1.10x at 0.5, <= 1.25x at 0.3, <= 1.5x at 0.2; (tree)
<= 1.3x at 1.0.
"""
import argparse
import faulthandler
import gc
import json
import os
import signal
import statistics
import sys
import time
import traceback

# OpenMP's default (spin-then-sleep) wait makes 2 threads on a 2-core machine 10-20x slower as
# soon as any other process wants a core (every op's barrier waits for a descheduled spinner); a
# passive wait keeps the timings sane on a shared machine. Managed and unmanaged runs use the same
# setting; export OMP_WAIT_POLICY=ACTIVE (before running) to measure with spinning instead.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _ROOT)  # this checkout's pymem, whatever the editable install points at
import pymem  # noqa: E402
from pymem.demo_models import TinyGPT  # noqa: E402

RATIOS = (1.0, 0.7, 0.5, 0.3, 0.2)
QUICK_RATIOS = (1.0, 0.5)
TARGETS = {"transformer": {"1.0": 1.05, "0.5": 1.10, "0.3": 1.25, "0.2": 1.5}, "tree": {"1.0": 1.3}}
MiB = 2 ** 20


# ----------------------------------------------------------------------------------------- models
class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout)
        self.c2, self.b2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout)
        self.short = None
        if stride != 1 or cin != cout:
            self.short = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        y = self.b2(self.c2(torch.relu(self.b1(self.c1(x)))))
        return torch.relu(y + (x if self.short is None else self.short(x)))


class SmallResNet(nn.Module):
    """A ResNet-18-like net: a 3x3 stem, three stages (width, 2x, 4x; stride 2 between stages) of
    `blocks` basic blocks each, global average pooling, a linear classifier."""

    def __init__(self, width=24, blocks=2, classes=10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        layers, cin = [], width
        for i, cout in enumerate((width, 2 * width, 4 * width)):
            for j in range(blocks):
                layers.append(BasicBlock(cin, cout, 2 if (i > 0 and j == 0) else 1))
                cin = cout
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x):
        return self.fc(self.layers(self.stem(x)).mean((2, 3)))


def make_transformer(a):
    """step() -> loss: one Adam step of TinyGPT on a fixed random batch (all built now)."""
    torch.manual_seed(a.seed)
    model = TinyGPT(vocab=a.gpt_vocab, d=a.gpt_d, heads=a.gpt_heads, layers=a.gpt_layers, seq=a.gpt_seq)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    idx = torch.randint(0, a.gpt_vocab, (a.gpt_batch, a.gpt_seq + 1))
    vocab = a.gpt_vocab

    def step():
        opt.zero_grad(set_to_none=False)
        logits = model(idx[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, vocab), idx[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        return loss.item()

    return step


def make_cnn(a):
    """step() -> loss: one Adam step of SmallResNet on a fixed random batch (all built now)."""
    torch.manual_seed(a.seed)
    model = SmallResNet(width=a.cnn_width, blocks=a.cnn_blocks)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(a.cnn_batch, 3, a.cnn_size, a.cnn_size)
    y = torch.randint(0, 10, (a.cnn_batch,))

    def step():
        opt.zero_grad(set_to_none=False)
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss.item()

    return step


class TreeCell(nn.Module):
    """Combines two children of a binary tree (TreeLSTM-like gating, without the memory cell)."""

    def __init__(self, d):
        super().__init__()
        self.combine = nn.Linear(2 * d, d)
        self.gate = nn.Linear(2 * d, d)

    def forward(self, left, right):
        x = torch.cat([left, right], 1)
        return torch.tanh(self.combine(x)) * torch.sigmoid(self.gate(x))


def make_tree(a):
    """step() -> loss: one Adam step of a recursion over a binary tree of small activations whose
    shape follows the data (each node reads .item() of its children to order them): many tiny ops,
    where bookkeeping per op, not compute, sets the step time."""
    torch.manual_seed(a.seed)
    embed = nn.Embedding(a.tree_vocab, a.tree_d)
    cell = TreeCell(a.tree_d)
    head = nn.Linear(a.tree_d, 1)
    params = [*embed.parameters(), *cell.parameters(), *head.parameters()]
    opt = torch.optim.Adam(params, lr=1e-3)
    tokens = torch.randint(0, a.tree_vocab, (a.tree_leaves, a.tree_rows))

    def node(lo, hi):
        if hi - lo == 1:
            return embed(tokens[lo])
        mid = (lo + hi) // 2
        left, right = node(lo, mid), node(mid, hi)
        if left.mean().item() > right.mean().item():  # the data decides the order
            left, right = right, left
        return cell(left, right)

    def step():
        opt.zero_grad(set_to_none=False)
        loss = head(node(0, a.tree_leaves)).pow(2).mean()
        loss.backward()
        opt.step()
        return loss.item()

    return step


MODELS = {"transformer": make_transformer, "cnn": make_cnn, "tree": make_tree}


def describe(name, a):
    if name == "transformer":
        return (f"TinyGPT(vocab {a.gpt_vocab}, d {a.gpt_d}, heads {a.gpt_heads}, layers {a.gpt_layers}, "
                f"seq {a.gpt_seq}) batch {a.gpt_batch}")
    if name == "tree":
        return (f"binary-tree recursion over {a.tree_leaves} leaves of {a.tree_rows}x{a.tree_d} "
                f"({a.tree_rows * a.tree_d * 4 // 1024} KiB activations), .item() per node")
    return f"SmallResNet(width {a.cnn_width}, blocks/stage {a.cnn_blocks}) batch {a.cnn_batch} of 3x{a.cnn_size}x{a.cnn_size}"


# ---------------------------------------------------------------------------------------- helpers
class OpCounter(TorchDispatchMode):
    """Counts the aten ops that reach the dispatcher's Python mode (what the runtime's mode sees)."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def cpu_snapshot():
    """(load average over 1 min, [user+nice+system, steal, total] jiffies) for noise reporting."""
    try:
        load = os.getloadavg()[0]
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return load, (v[0] + v[1] + v[2], v[7] if len(v) > 7 else 0, sum(v))
    except OSError:
        return None, None


def noise_since(snap):
    """Other processes' share of the machine since `snap`: load average now, steal fraction."""
    load, (busy0, steal0, tot0) = snap if snap[1] else (snap[0], (0, 0, 0))
    load1, cur = cpu_snapshot()
    if cur is None:
        return {"loadavg_1m": load1}
    dt = max(cur[2] - tot0, 1)
    return {"loadavg_1m_start": load, "loadavg_1m_end": load1, "steal_fraction": (cur[1] - steal0) / dt}


class BlockTimeout(Exception):
    """A managed block ran past its time limit (raised from SIGALRM between bytecodes)."""


def _alarm(signum, frame):
    raise BlockTimeout()


def run_steps(step, warmup, steps, progress=None):
    """Runs warmup + steps steps; returns (timed step times, all losses). `progress` (a list), if
    given, gets (loss, seconds) per finished step as it goes, so a timed-out run can still say how far
    it got."""
    times, losses = [], []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        losses.append(step())
        dt = time.perf_counter() - t0
        if progress is not None:
            progress.append((losses[-1], dt))
        if i >= warmup:
            times.append(dt)
    return times, losses


def unmanaged_block(name, a, warmup, steps):
    gc.collect()
    step = MODELS[name](a)
    times, losses = run_steps(step, warmup, steps)
    del step
    gc.collect()
    return {"median_s": statistics.median(times), "times_s": [round(t, 5) for t in times], "losses": losses}


def unmanaged_peak(name, a, warmup, steps):
    """Peak bytes of building + training the model with every tensor served from a plain arena
    (no runtime), and the median step time of that run (the allocator's share of any slowdown)."""
    gc.collect()
    arena = pymem.Arena(8 << 30, small_threshold=0)
    pymem.install_cpu_hook(arena)
    try:
        step = MODELS[name](a)
        times, _ = run_steps(step, warmup, steps)
        peak = arena.stats()["allocated_bytes.peak"]
        del step
        gc.collect()
    finally:
        pymem.uninstall_cpu_hook()
    return int(peak), statistics.median(times)


def ops_per_step(name, a):
    step = MODELS[name](a)
    step()  # Adam state exists from here on: count a steady-state step
    with OpCounter() as c:
        step()
    del step
    gc.collect()
    return c.n


def _stat(s, key, default=0):
    v = s.get(key, default)
    return default if v is None else v


def block_timeout(a, ref_step_s, nsteps):
    """Seconds a managed block of `nsteps` steps may take: --max-slowdown times the unmanaged time
    (at least --min-timeout), at most --block-timeout."""
    t = max(a.min_timeout, a.max_slowdown * ref_step_s * nsteps)
    return min(t, a.block_timeout) if a.block_timeout > 0 else t


def managed_block(name, a, budget, warmup, steps, ref_step_s):
    """Build + train under pymem.enable(budget). Returns a dict; "infeasible" on OutOfBudgetError,
    "timed_out" (too slow: see block_timeout), "error" (with the traceback) on anything else.
    pymem.disable() always runs."""
    gc.collect()
    timeout = block_timeout(a, ref_step_s, warmup + steps)
    res = {"budget_bytes": budget, "requested_budget_bytes": budget, "infeasible": False}
    progress = []
    t_start = time.perf_counter()
    pymem.enable(budget, policy=a.policy, device="cpu", offload=a.offload, prefetch=not a.no_prefetch)
    try:
        step = None
        try:
            if timeout > 0:
                signal.signal(signal.SIGALRM, _alarm)
                signal.setitimer(signal.ITIMER_REAL, timeout)
            step = MODELS[name](a)
            _, wl = run_steps(step, warmup, 0, progress)
            s0 = pymem.memory_stats()
            warm_peak = _stat(s0, "allocated_bytes.peak")
            pymem.reset_peak_memory_stats()
            times, losses = run_steps(step, 0, steps, progress)
            s1 = pymem.memory_stats()
            n = max(len(times), 1)
            res.update({
                "median_s": statistics.median(times), "times_s": [round(t, 5) for t in times],
                "losses": wl + losses,
                "budget_bytes": _stat(s1, "budget_bytes", budget),
                "peak_bytes_build_warmup": warm_peak,
                "peak_bytes_timed": _stat(s1, "allocated_bytes.peak"),
                "evictions_per_step": (_stat(s1, "num_evictions") - _stat(s0, "num_evictions")) / n,
                "remats_per_step": (_stat(s1, "num_rematerializations") - _stat(s0, "num_rematerializations")) / n,
                "remat_s_per_step": (_stat(s1, "remat_seconds") - _stat(s0, "remat_seconds")) / n,
                "offloads_per_step": (_stat(s1, "num_offloads") - _stat(s0, "num_offloads")) / n,
                "swap_ins_per_step": (_stat(s1, "num_swap_ins") - _stat(s0, "num_swap_ins")) / n,
                "prefetches_per_step": (_stat(s1, "num_prefetches") - _stat(s0, "num_prefetches")) / n,
                "host_bytes_peak": _stat(s1, "host_bytes.peak"),
                "evictions_total": _stat(s1, "num_evictions"),
                "remats_total": _stat(s1, "num_rematerializations"),
            })
            res["peak_bytes"] = max(res["peak_bytes_build_warmup"], res["peak_bytes_timed"])
            res["within_budget"] = res["peak_bytes"] <= res["budget_bytes"]
        except BlockTimeout:
            st = pymem.memory_stats()
            res.update(timed_out=True, error=f"too slow: stopped after {timeout:.0f} s with {len(progress)} of "
                       f"{warmup} warmup + {steps} steps done (see --max-slowdown)",
                       slowdown_at_least=timeout / (ref_step_s * (warmup + steps)),
                       steps_done=len(progress), step_times_done_s=[round(t, 3) for _, t in progress],
                       stats_at_timeout={k: _stat(st, k) for k in (
                           "allocated_bytes.peak", "num_evictions", "num_rematerializations",
                           "remat_seconds", "num_ops")})
        except pymem.OutOfBudgetError as e:
            res.update(infeasible=True, error=f"OutOfBudgetError: {e}"[:400])
        except Exception as e:  # a runtime bug, not a too-small budget: keep going, but say so
            res.update(error=f"{type(e).__name__}: {e}"[:400], traceback=traceback.format_exc())
            print(f"  !! {name} budget {budget}: {type(e).__name__}: {e}", file=sys.stderr)
            traceback.print_exc()
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        step = None
        gc.collect()
    finally:
        pymem.disable()
    res["wall_s"] = round(time.perf_counter() - t_start, 3)
    return res


def budget_for(peak, ratio):
    """ratio * peak, rounded up to the arena's 512-byte granule."""
    return -(-int(peak * ratio) // 512) * 512


def rkey(r):
    return "1.0" if r == 1.0 else f"{r:g}"


def ok(r):
    return not r["infeasible"] and "error" not in r


def loss_diff(managed, unmanaged):
    lm, lu = managed.get("losses"), unmanaged.get("losses")
    if not lm or not lu or len(lm) != len(lu):
        return None
    return max(abs(x - y) for x, y in zip(lm, lu))


# ------------------------------------------------------------------------------------- per-op cost
def _add_loop(n):
    a, b = torch.ones(4), torch.ones(4)
    t0 = time.perf_counter()
    for _ in range(n):
        c = torch.add(a, b)
    dt = time.perf_counter() - t0
    del c
    return dt


def per_op_overhead(n, reps, budget, policy):
    _add_loop(min(n, 2000))  # warm the interpreter / dispatcher
    pymem.enable(budget, policy=policy, device="cpu")
    try:
        _add_loop(min(n, 2000))  # one-time costs of the managed path
    finally:
        pymem.disable()
    un, man = [], []
    for _ in range(reps):
        gc.collect()
        un.append(_add_loop(n))
        pymem.enable(budget, policy=policy, device="cpu")
        try:
            man.append(_add_loop(n))
        finally:
            pymem.disable()
    um, mm = statistics.median(un), statistics.median(man)
    return {"ops": n, "reps": reps, "unmanaged_s": [round(t, 5) for t in un], "managed_s": [round(t, 5) for t in man],
            "unmanaged_us_per_op": um / n * 1e6, "managed_us_per_op": mm / n * 1e6,
            "overhead_us_per_op": (mm - um) / n * 1e6}


# ------------------------------------------------------------------------------------------ driver
def bench_model(name, a, ratios, log):
    d = {"model": describe(name, a)}
    snap = cpu_snapshot()
    log(f"[{name}] {d['model']}")
    peak, d["arena_only_step_s"] = unmanaged_peak(name, a, a.warmup, max(a.steps, 2))
    d["unmanaged_peak_bytes"] = peak
    d["ops_per_step"] = ops_per_step(name, a)
    unmanaged_block(name, a, 1, 1)  # settle the process's own heap before the first timed block
    log(f"[{name}] unmanaged peak {peak / MiB:.1f} MiB, {d['ops_per_step']} ops/step")

    blocks = []   # [("unmanaged", res) | ("managed", key, res)], in time order
    rows = {}
    for r in ratios:
        blocks.append(("unmanaged", unmanaged_block(name, a, a.warmup, a.steps)))
        res = managed_block(name, a, budget_for(peak, r), a.warmup, a.steps, blocks[-1][1]["median_s"])
        res["ratio"] = r
        rows[rkey(r)] = res
        blocks.append(("managed", rkey(r), res))
        log(f"[{name}] ratio {r:g}: " + (f"{res['median_s']:.3f} s/step" if ok(res) else
                                          ("infeasible" if res["infeasible"] else res["error"][:120])))

    # lowest feasible ratio: bisection with 2-step runs
    worked = [r for r in ratios if ok(rows[rkey(r)])]
    search = []
    lowest = None
    if worked:
        hi = min(worked)
        failed_below = [r for r in ratios if r < hi and not ok(rows[rkey(r)])]
        lo = max([a.search_floor] + failed_below)
        ref = statistics.median(b[1]["median_s"] for b in blocks if b[0] == "unmanaged")
        while hi - lo > a.tol + 1e-9:
            mid = round((lo + hi) / 2, 4)
            t = managed_block(name, a, budget_for(peak, mid), 0, 2, ref)
            search.append({"ratio": mid, "feasible": ok(t), "wall_s": t["wall_s"],
                           **({"error": t["error"][:200]} if "error" in t else {})})
            log(f"[{name}] search {mid:.4f}: {'ok' if ok(t) else ('infeasible' if t['infeasible'] else t['error'][:80])}"
                f" ({t['wall_s']:.1f} s)")
            if ok(t):
                hi = mid
            else:
                lo = mid
        d["lowest_2step_ratio"] = hi
        # time it; where the longer timed run fails although 2 steps did not, step up by tol, 2 tol,
        # 4 tol, ... below the lowest fixed ratio that worked, which is the fallback (already timed)
        attempts, k = [], 0
        while True:
            r = round(hi + (a.tol * (2 ** (k - 1)) if k else 0), 4)
            k += 1
            if r >= min(worked):
                lowest = min(worked)
                rows["lowest"] = rows[rkey(lowest)]
                log(f"[{name}] lowest: the fixed ratio {lowest:g}")
                break
            blocks.append(("unmanaged", unmanaged_block(name, a, a.warmup, a.steps)))
            res = managed_block(name, a, budget_for(peak, r), a.warmup, a.steps, blocks[-1][1]["median_s"])
            res["ratio"] = r
            if ok(res):
                blocks.append(("managed", "lowest", res))
                lowest = r
                rows["lowest"] = res
                log(f"[{name}] lowest {r:.4f}: {res['median_s']:.3f} s/step")
                break
            attempts.append({"ratio": r, "error": res.get("error", "")[:200]})
            log(f"[{name}] lowest {r:.4f} failed in the timed run ({res.get('error', '')[:80]}); stepping up")
        d["lowest_timed_attempts"] = attempts
    blocks.append(("unmanaged", unmanaged_block(name, a, a.warmup, a.steps)))

    # slowdown = managed median / mean(unmanaged medians right before and after)
    unm_all = []
    for i, b in enumerate(blocks):
        if b[0] != "managed":
            unm_all.append(b[1]["median_s"])
            continue
        _, key, res = b
        before, after = blocks[i - 1][1], blocks[i + 1][1]
        ref = (before["median_s"] + after["median_s"]) / 2
        res["unmanaged_median_s"] = ref
        res["unmanaged_before_s"], res["unmanaged_after_s"] = before["median_s"], after["median_s"]
        res["slowdown"] = res["median_s"] / ref if ok(res) else None
        res["slowdown_vs_arena_only"] = res["median_s"] / d["arena_only_step_s"] if ok(res) else None
        res["loss_max_abs_diff"] = loss_diff(res, before) if ok(res) else None
    d["unmanaged_step_s"] = statistics.median(unm_all)
    d["unmanaged_block_medians_s"] = unm_all
    d["unmanaged_spread"] = (max(unm_all) - min(unm_all)) / d["unmanaged_step_s"] if unm_all else None
    d["ratios"] = rows
    d["search"] = search
    d["lowest_ratio"] = lowest
    d["machine"] = noise_since(snap)
    return d


def fmt_row(key, res, targets):
    tgt = targets.get(key) if key != "lowest" else None
    r = res.get("ratio")
    label = f"{r:g}" if key != "lowest" else f"{r:.3g}*"
    if not ok(res):
        what = ("infeasible" if res["infeasible"]
                else f"too slow: >= {res['slowdown_at_least']:.1f}x, {res['steps_done']} steps done"
                if res.get("timed_out") else "ERROR: " + res.get("error", "")[:70])
        return f"{label:>7} {res['budget_bytes'] / MiB:>9.1f}   {what}" + (f"   (target <= {tgt:.2f}x)" if tgt else "")
    s = res["slowdown"]
    verdict = ""
    if tgt:
        verdict = f"<= {tgt:.2f}x {'ok' if s <= tgt else 'MISS'}"
    ld = res.get("loss_max_abs_diff")
    return (f"{label:>7} {res['budget_bytes'] / MiB:>9.1f} {res['peak_bytes'] / MiB:>9.1f} "
            f"{res['unmanaged_median_s']:>8.3f} {res['median_s']:>8.3f} {s:>8.3f}x "
            f"{res['evictions_per_step']:>8.1f} {res['remats_per_step']:>8.1f} {res['remat_s_per_step']:>8.3f} "
            f"{res.get('offloads_per_step', 0):>8.1f} {res.get('prefetches_per_step', 0):>8.1f} "
            f"{'-' if ld is None else f'{ld:.1e}':>8}  {verdict}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="write the figures to this file")
    ap.add_argument("--quick", action="store_true", help="small models, 2 steps, ratios 1.0 and 0.5 (a smoke run)")
    ap.add_argument("--models", default="transformer,cnn,tree", help="comma-separated: transformer, cnn, tree")
    ap.add_argument("--ratios", help="comma-separated budget / unmanaged peak ratios (default 1.0,0.7,0.5,0.3,0.2)")
    ap.add_argument("--policy", default="dtr")
    ap.add_argument("--offload", default="never",
                    help="director: never (the CPU default), delta or always. On the CPU device host copies "
                         "sit in the same RAM: this measures the machinery and its decisions, not a saving")
    ap.add_argument("--no-prefetch", action="store_true", help="offloaded values come back only when used")
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per block")
    ap.add_argument("--steps", type=int, default=8, help="timed steps per block")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-slowdown", type=float, default=20,
                    help="a managed block (or a 2-step search run) taking longer than this many times the "
                         "unmanaged time is stopped and counts as failed (too slow), with a lower bound")
    ap.add_argument("--min-timeout", type=float, default=30, help="seconds any managed block may take at least")
    ap.add_argument("--block-timeout", type=float, default=600, help="seconds any managed block may take at most")
    ap.add_argument("--tol", type=float, default=0.01, help="resolution of the lowest-ratio search")
    ap.add_argument("--search-floor", type=float, default=0.05, help="the lowest ratio the search tries")
    ap.add_argument("--ops", type=int, default=20000, help="adds per per-op overhead loop")
    ap.add_argument("--op-reps", type=int, default=5, help="alternated unmanaged/managed loops")
    ap.add_argument("--op-budget", type=int, default=1 << 30, help="budget (bytes) for the per-op loop")
    g = ap.add_argument_group("transformer")
    g.add_argument("--gpt-vocab", type=int, default=512)
    g.add_argument("--gpt-d", type=int, default=128)
    g.add_argument("--gpt-heads", type=int, default=4)
    g.add_argument("--gpt-layers", type=int, default=4)
    g.add_argument("--gpt-seq", type=int, default=256)
    g.add_argument("--gpt-batch", type=int, default=16)
    g = ap.add_argument_group("cnn")
    g.add_argument("--cnn-width", type=int, default=24)
    g.add_argument("--cnn-blocks", type=int, default=2, help="basic blocks per stage")
    g.add_argument("--cnn-batch", type=int, default=32)
    g.add_argument("--cnn-size", type=int, default=64, help="image side")
    g = ap.add_argument_group("tree")
    g.add_argument("--tree-leaves", type=int, default=128)
    g.add_argument("--tree-rows", type=int, default=128, help="rows of each node's activation")
    g.add_argument("--tree-d", type=int, default=64)
    g.add_argument("--tree-vocab", type=int, default=256)
    if ap.parse_known_args()[0].quick:  # smaller defaults; options given explicitly still win
        # activation-dominated shapes (leaves + the largest op well under 30% of the peak), ~10-50 ms/step
        ap.set_defaults(gpt_vocab=128, gpt_d=32, gpt_heads=4, gpt_layers=4, gpt_seq=64, gpt_batch=32,
                        cnn_width=8, cnn_blocks=1, cnn_batch=16, cnn_size=32,
                        warmup=1, steps=2, ops=2000, op_reps=2, tol=0.05, min_timeout=15)
    a = ap.parse_args()
    ratios = tuple(float(x) for x in a.ratios.split(",")) if a.ratios else (QUICK_RATIOS if a.quick else RATIOS)
    ratios = tuple(sorted(set(ratios), reverse=True))
    models = [m.strip() for m in a.models.split(",") if m.strip()]
    for m in models:
        if m not in MODELS:
            ap.error(f"unknown model {m!r} (transformer, cnn, tree)")
    if not hasattr(pymem, "enable"):
        sys.exit("pymem.enable is missing: the runtime (pymem/runtime) is not there yet")
    torch.set_num_threads(a.threads)
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1)  # kill -USR1 <pid>: dump the stack (a run that seems stuck)

    t_all = time.perf_counter()

    def log(msg):
        print(f"  {time.perf_counter() - t_all:7.1f}s {msg}", file=sys.stderr, flush=True)

    details = {"config": {k: v for k, v in vars(a).items() if k != "json"}, "targets": TARGETS}
    details["config"].update(ratios=list(ratios), torch=torch.__version__, torch_threads=torch.get_num_threads(),
                             omp_wait_policy=os.environ.get("OMP_WAIT_POLICY"))
    log(f"per-op overhead: {a.ops} adds x {a.op_reps}")
    details["per_op"] = per_op = per_op_overhead(a.ops, a.op_reps, a.op_budget, a.policy)
    out = {}
    for m in models:
        d = bench_model(m, a, ratios, log)
        d["overhead_share"] = d["ops_per_step"] * per_op["overhead_us_per_op"] * 1e-6 / d["unmanaged_step_s"]
        details[m] = d
        fig = {}
        for key, res in d["ratios"].items():
            if key == "lowest":
                continue
            fig[key] = None if res.get("slowdown") is None else round(res["slowdown"], 4)
        low = d["ratios"].get("lowest")
        fig["lowest"] = {"ratio": d["lowest_ratio"],
                         "slowdown": None if low is None or low.get("slowdown") is None else round(low["slowdown"], 4),
                         "two_step_ratio": d.get("lowest_2step_ratio")}
        out[m] = fig
    out["per_op_overhead_us"] = round(per_op["overhead_us_per_op"], 3)
    details["wall_seconds"] = round(time.perf_counter() - t_all, 1)
    out["details"] = details

    # ------------------------------------------------------------------------------------ table
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads "
          f"(OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}), policy {a.policy}, "
          f"{a.warmup} warmup + {a.steps} timed steps per block")
    print(f"per-op overhead: {per_op['overhead_us_per_op']:.2f} us/op "
          f"(unmanaged {per_op['unmanaged_us_per_op']:.2f} us/op, managed {per_op['managed_us_per_op']:.2f} us/op, "
          f"{a.ops} adds of 4-element tensors)")
    for m in models:
        d = details[m]
        tg = TARGETS.get(m, {})
        print(f"\n{m}: {d['model']}")
        print(f"  unmanaged peak {d['unmanaged_peak_bytes'] / MiB:.1f} MiB, step {d['unmanaged_step_s']:.3f} s "
              f"(blocks spread {d['unmanaged_spread']:.1%}; {d['arena_only_step_s']:.3f} s with the plain arena as "
              f"allocator, no runtime), {d['ops_per_step']} ops/step, bookkeeping share {d['overhead_share']:.1%}")
        mc = d["machine"]
        if "steal_fraction" in mc:
            print(f"  machine: load average {mc['loadavg_1m_start']:.2f} -> {mc['loadavg_1m_end']:.2f}, "
                  f"steal {mc['steal_fraction']:.1%}" + ("  (busy machine: timings are noisy)"
                                                        if max(mc['loadavg_1m_start'], mc['loadavg_1m_end'])
                                                        > a.threads + 0.5 else ""))
        print(f"{'ratio':>7} {'budgetMiB':>9} {'peakMiB':>9} {'unman s':>8} {'man s':>8} {'slowdown':>9} "
              f"{'evict/st':>8} {'remat/st':>8} {'remat s':>8} {'offl/st':>8} {'pref/st':>8} {'loss d':>8}  target")
        for key, res in d["ratios"].items():
            if key != "lowest":
                print(fmt_row(key, res, tg))
        if "lowest" in d["ratios"]:
            print(fmt_row("lowest", dict(d["ratios"]["lowest"], ratio=d["lowest_ratio"]), tg))
            print(f"  * lowest feasible ratio: {d['lowest_ratio']:.3f} ({a.warmup} + {a.steps} steps); 2-step "
                  f"runs (bisection to {a.tol:g}, floor {a.search_floor:g}) succeed down to {d['lowest_2step_ratio']:.3f}"
                  + (f"; timed runs failed at {', '.join(str(x['ratio']) for x in d['lowest_timed_attempts'])}"
                     if d.get("lowest_timed_attempts") else ""))
        else:
            print("  no feasible ratio")
        bad = [k for k, r in d["ratios"].items() if ok(r) and not r["within_budget"]]
        if bad:
            print(f"  !! peak above budget at {', '.join(bad)}")
    print(f"\nwall time {details['wall_seconds']:.0f} s")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2)
        print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
