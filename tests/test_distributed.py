"""Distributed training under pymem (issue 12): two ranks on loopback (gloo), each training under its
own budget, must end with parameters bitwise equal to the same run without pymem, every run.

What went wrong before: gloo runs a collective on its own thread, reading and writing the buffers it
was handed (DDP's gradient buckets) after the op returned, while compaction moved those blocks
under it (DDP: parameters wrong, ranks diverging, NaN); and FSDP2 frees and regrows its unsharded
parameters with ``UntypedStorage.resize_``, no op pymem saw, so recipes recomputed from freed or
uninitialised bytes (FSDP2: NaN in every run at 50%, crashes in recompute). The workers
(``dist_worker.py``) compare each managed run with the same rank's unmanaged run; rank 1 straggles
(``--skew``) so that rank 0's collectives stay in flight while its backward compacts around them.
Before the fix, 8 of the 15 DDP runs of three launches of this test were wrong (every launch failed),
and the FSDP2 test crashed in recompute every time.
"""
import json
import os
import socket
import subprocess
import sys

import pytest
import torch

import pymem

if not (torch.distributed.is_available() and torch.distributed.is_gloo_available()):
    pytest.skip("torch.distributed with the gloo backend is not available in this torch build",
                allow_module_level=True)

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "dist_worker.py")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(pymem.__file__)))  # the children import this pymem
LIMIT_S = 110  # hang guard; each launch takes 10-25 s on two cores
DDP = ["--wrap", "ddp", "--bucket-mb", "0.01", "--steps", "5"]  # small buckets: many collectives per step


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(out, args, torchrun=None, **env_vars):
    """Runs dist_worker.py with ``args`` for two ranks: spawned by the worker itself, or under
    torchrun, ``torchrun`` being what goes before the script ([], or ["-m", "pymem", "run", ...]).
    Returns each rank's result."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYMEM_")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")])))
    env.update(env_vars)
    port = str(_free_port())
    if torchrun is None:
        cmd = [sys.executable, WORKER, str(out), "--port", port, *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr",
               "127.0.0.1", "--master_port", port, *torchrun, WORKER, str(out), *args]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=LIMIT_S)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-8000:]
    results = []
    for rank in (0, 1):
        with open(os.path.join(out, f"rank{rank}.json")) as f:
            results.append(json.load(f))
    return results


def check_runs(results, budget=None):
    """Every managed run of every rank: bitwise equal to the reference, within its budget, and it
    really had to evict."""
    for res in results:
        assert res["runs"], res
        summary = [(r["differ"], r["nan"], r["allocated_bytes.peak"], r["num_evictions"], r["num_compactions"])
                   for r in res["runs"]]
        for r in res["runs"]:
            assert r["differ"] == 0 and r["nan"] == 0, \
                f"rank {res['rank']}: (differing params, NaN params, peak, evictions, compactions) per run: " \
                f"{summary}, of {r['params']} params"
            assert r["budget_bytes"] == (budget or res["budget"])
            assert r["allocated_bytes.peak"] <= r["budget_bytes"], (res["rank"], summary)
            assert r["num_evictions"] > 0, (res["rank"], summary)


@pytest.fixture
def one_rank_group():
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    yield
    torch.distributed.destroy_process_group()


def test_a_buffer_handed_to_a_collective_counts_as_written_and_never_moves(one_rank_group):
    """One rank in this process: the collective's bookkeeping, without a second process."""
    from pymem import _C
    from pymem.runtime import compaction

    pymem.enable(64 << 20)
    try:
        y = torch.ones(1 << 16) * 2  # recomputable
        torch.distributed.all_reduce(y, async_op=True).wait()
        rt = pymem.current()
        r = rt.table[_C.storage_key(y)]
        assert r.pins and r.recipe is None  # its value is the collective's now: a leaf
        pymem.evict(y)  # pinned: left in place
        assert not pymem.is_evicted(y) and torch.equal(y, torch.full((1 << 16,), 2.0))
        y.add_(1)  # written again by an aten op: still pinned
        assert rt.table[_C.storage_key(y)].pins
        assert y.untyped_storage().data_ptr() not in compaction.movable_blocks(rt)
        z = torch.ones(1 << 16) * 3
        torch.distributed.all_reduce(z)  # async_op=False: waited for before it returns
        r = rt.table[_C.storage_key(z)]
        assert r.recipe is None and not r.pins
        assert z.untyped_storage().data_ptr() in compaction.movable_blocks(rt)
    finally:
        pymem.disable()


def test_ddp_with_compaction_around_buckets_in_flight_is_bitwise(tmp_path):
    """DDP at 40% of the peak: 5 runs of 5 steps per rank, 14 bucket allreduces a step."""
    results = launch(tmp_path, [*DDP, "--ratio", "0.4", "--reps", "5", "--skew", "0.02"])
    check_runs(results)
    assert all(r["num_compactions"] > 0 for res in results for r in res["runs"])


def test_fsdp2_is_bitwise(tmp_path):
    """FSDP2 (fully_shard per block and at the root, resharding after forward) at 40% of the peak."""
    pytest.importorskip("torch.distributed.fsdp", reason="no torch.distributed.fsdp")
    from torch.distributed import fsdp

    if not hasattr(fsdp, "fully_shard"):
        pytest.skip("this torch has no FSDP2 (torch.distributed.fsdp.fully_shard)")
    results = launch(tmp_path, ["--wrap", "fsdp", "--ratio", "0.4", "--steps", "4", "--reps", "4",
                                "--skew", "0.02"])
    check_runs(results)


@pytest.fixture(scope="module")
def ddp_peak(tmp_path_factory):
    """The unmanaged peak of one DDP rank (the larger of the two)."""
    results = launch(tmp_path_factory.mktemp("peak"), [*DDP, "--reps", "0"])
    return max(res["peak"] for res in results)


@pytest.mark.parametrize("how", ["PYMEM_BUDGET", "pymem run"])
def test_each_rank_gets_its_own_budget_from_the_start(tmp_path, ddp_peak, how):
    """``PYMEM_BUDGET=... torchrun ...`` (the startup hook) or ``torchrun ... -m pymem run --budget``:
    each rank is a process of its own, with pymem enabled before its first line and a budget of its
    own, and trains bitwise equal to its unmanaged run."""
    budget = int(0.5 * ddp_peak) // 512 * 512
    if how == "PYMEM_BUDGET":
        results = launch(tmp_path, [*DDP, "--from-env"], torchrun=[], PYMEM_BUDGET=str(budget))
    else:
        results = launch(tmp_path, [*DDP, "--from-env"],
                         torchrun=["-m", "pymem", "run", "--budget", str(budget), "--"])
    assert all(res["enabled_at_start"] for res in results)
    assert results[0]["pid"] != results[1]["pid"]
    check_runs(results, budget)
