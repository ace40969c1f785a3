"""Two-rank training on loopback (gloo) for ``test_distributed.py``: a TinyGPT under DDP or FSDP2, each
rank comparing its runs under pymem with its own unmanaged run, bit for bit.

    python dist_worker.py OUT --wrap ddp|fsdp --ratio R [--bucket-mb B] [--steps N] [--reps K] [--skew S]
        spawns 2 ranks. Each rank runs the unmanaged reference first (every CPU tensor from an 8 GiB
        lazily mapped arena, to measure its peak), then K runs under ``pymem.enable(budget=R * peak)``.
    torchrun --nproc_per_node 2 dist_worker.py OUT --wrap ddp --from-env
        (with PYMEM_BUDGET set): each rank finds pymem enabled at start with its own budget, trains
        under it, then disables pymem and trains the reference.

Each rank writes OUT/rank<r>.json: its peak and budget, and per managed run the number of parameters
that differ from the reference (raw bytes: NaN != NaN), the arena's peak, and its stats.

``--skew`` makes rank 1 a straggler: it sleeps before each backward, so rank 0's collectives wait for
it in flight (their buffers held by gloo's thread) while rank 0's backward allocates, evicts and
compacts around them.
"""
import argparse
import datetime
import faulthandler
import json
import os
import sys
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F

VOCAB, D, LAYERS, SEQ, BATCH = 128, 32, 4, 64, 16
HANG_S = 100  # a rank stuck in a collective (its peer died) dumps its stack and exits


def train(rank: int, wrap: str, steps: int, bucket_mb: float, skew: float):
    """``steps`` Adam steps of a TinyGPT wrapped by ``wrap``; rank-local data, the same initial model
    on both ranks. Returns copies of this rank's parameters (FSDP: its shards)."""
    from pymem.demo_models import TinyGPT

    torch.manual_seed(0)
    model = TinyGPT(vocab=VOCAB, d=D, heads=4, layers=LAYERS, seq=SEQ)
    if wrap == "ddp":
        net = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_mb)
    else:
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        net = fully_shard(model)
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    idx = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(100 + rank))
    for _ in range(steps):
        opt.zero_grad(set_to_none=False)
        loss = F.cross_entropy(net(idx[:, :-1]).reshape(-1, VOCAB), idx[:, 1:].reshape(-1))
        if skew and rank == 1:
            time.sleep(skew)
        loss.backward()
        opt.step()
    params = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
    return [p.detach().clone() for p in params]


def differing(got, ref) -> int:
    """Parameters whose bytes differ. Compared as int32: as floats, NaN != NaN, and 0.0 == -0.0."""
    return sum(not torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(got, ref))


def run_rank(rank: int, world: int, args) -> None:
    faulthandler.dump_traceback_later(HANG_S, exit=True)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    import pymem

    at_start = pymem.is_enabled()  # PYMEM_BUDGET: enabled by the startup hook before this line
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    result = {"rank": rank, "pid": os.getpid(), "enabled_at_start": at_start, "runs": []}
    if args.from_env:
        budget = pymem.memory_stats()["budget_bytes"]
        got = train(rank, args.wrap, args.steps, args.bucket_mb, args.skew)
        stats = pymem.memory_stats()
        pymem.disable()
        ref = train(rank, args.wrap, args.steps, args.bucket_mb, args.skew)
        result["budget"] = budget
        result["runs"].append(_run_result(got, ref, stats))
    else:
        arena = pymem.Arena(8 << 30, small_threshold=0)
        pymem.install_cpu_hook(arena)
        try:
            ref = train(rank, args.wrap, args.steps, args.bucket_mb, args.skew)
            peak = arena.stats()["allocated_bytes.peak"]
        finally:
            pymem.uninstall_cpu_hook()
        budget = int(args.ratio * peak) // 512 * 512
        result.update(peak=peak, budget=budget)
        for _ in range(args.reps):
            pymem.enable(budget=budget)
            try:
                got = train(rank, args.wrap, args.steps, args.bucket_mb, args.skew)
                stats = pymem.memory_stats()
            finally:
                pymem.disable()
            result["runs"].append(_run_result(got, ref, stats))
    dist.destroy_process_group()
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    # The rank's results are written: end the process before the interpreter finalizes. A gloo
    # worker thread (ProcessGroupGloo::runLoop) that still releases a work's tensors then needs the
    # GIL, and Python 3.11 ends such a thread with pthread_exit, whose unwind through torch's
    # noexcept frames calls std::terminate: "terminate called without an active exception", SIGABRT,
    # at exit in 4 of 150 launches of the peak measurement here (pymem's arena as the CPU allocator,
    # no runtime; the backtrace has no pymem frame), 0 of 80 with this exit. The race is described
    # in pytorch/pytorch#179291.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _run_result(got, ref, stats) -> dict:
    keys = ("budget_bytes", "allocated_bytes.peak", "num_evictions", "num_compactions", "num_moved_blocks")
    return {"differ": differing(got, ref), "params": len(ref),
            "nan": sum(bool(torch.isnan(p).any()) for p in got), **{k: stats[k] for k in keys}}


def _spawned(rank: int, world: int, args) -> None:
    run_rank(rank, world, args)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--wrap", choices=("ddp", "fsdp"), default="ddp")
    ap.add_argument("--ratio", type=float, default=0.5)
    ap.add_argument("--bucket-mb", type=float, default=25.0)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--skew", type=float, default=0.0)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--from-env", action="store_true")
    args = ap.parse_args(argv)
    if "RANK" in os.environ:  # under torchrun: this process is one rank
        run_rank(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args)
        return
    import torch.multiprocessing as mp

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(args.port)
    mp.spawn(_spawned, args=(2, args), nprocs=2)


if __name__ == "__main__":
    sys.exit(main())
