"""Offloading values with no recipe (issue 15): gradients, optimizer state and parameters made under
pymem are released like any value when offloading is on (``offload_leaves``), copied back byte-exact
with ``_version`` unchanged, and a leaf-dominated model trains bitwise below the floor that
activations-only release allows."""
import pytest
import torch

import pymem
from pymem.demo_models import wide_trainer
from bitwise_harness import assert_bitwise_equal, budget_at, measure_peak, run_managed, run_unmanaged

torch.set_num_threads(2)
MiB = 1 << 20


def test_a_leaf_is_offloaded_and_comes_back_byte_exact_with_its_version(managed):
    pymem.enable(8 * MiB, device="cpu", offload="always")
    with pymem.no_recompute():
        leaf = torch.arange(float(1 << 16))  # no recipe: a leaf
    leaf.add_(1)  # a write in place: version 1
    version, want = leaf._version, torch.arange(float(1 << 16)) + 1
    pymem.evict(leaf)
    assert pymem._C.storage_is_evicted(leaf)
    s = pymem.memory_stats()
    assert s["num_leaf_offloads"] == 1 and s["num_evictions"] == 0 and s["host_bytes"] >= leaf.nbytes
    assert torch.equal(leaf * 1, want)  # read by an op: copied back first
    assert leaf._version == version and not pymem._C.storage_is_evicted(leaf)


def test_a_leaf_written_in_place_after_its_return_drops_its_stale_host_copy(managed):
    rt = pymem.enable(8 * MiB, device="cpu", offload="always")
    with pymem.no_recompute():
        leaf = torch.ones(1 << 16)
    pymem.evict(leaf)
    leaf.mul_(3)  # back, then overwritten: the host copy is stale now
    rec = rt.table[pymem._C.storage_key(leaf)]
    assert rec.host is None
    pymem.evict(leaf)  # a fresh copy
    assert torch.equal(leaf + 0, torch.full((1 << 16,), 3.0))


def test_without_offloading_a_leaf_still_cannot_be_released(managed):
    pymem.enable(8 * MiB, device="cpu")  # offload="never" on the CPU: leaves stay
    with pymem.no_recompute():
        leaf = torch.ones(16)
    with pytest.raises(ValueError, match="it cannot be evicted \\(a leaf can be offloaded: offload_leaves=True\\)"):
        pymem.evict(leaf)


def test_offload_leaves_settings_are_checked(managed):
    with pytest.raises(ValueError, match="offload_leaves=True needs offloading, but offload='never'"):
        pymem.enable(MiB, device="cpu", offload="never", offload_leaves=True)
    with pytest.raises(ValueError, match="offload_leaves must be None .*, True or False, got 'yes'"):
        pymem.enable(MiB, device="cpu", offload="always", offload_leaves="yes")
    rt = pymem.enable(MiB, device="cpu", offload="always", offload_leaves=False)
    assert not rt.residency.offload_leaves


def _wide_trainer():
    return wide_trainer(width=512, layers=4, batch=8)


def test_a_leaf_dominated_model_trains_bitwise_at_0_4_of_its_peak(managed):
    steps = 4
    ref_out, ref_state, _ = run_unmanaged(_wide_trainer, steps)
    peak = measure_peak(_wide_trainer, steps)
    budget = budget_at(peak, 0.4)
    with pytest.raises(pymem.OutOfBudgetError):  # activations alone cannot make room
        run_managed(_wide_trainer, steps, budget, offload="always", offload_leaves=False)
    out, state, stats, _, _ = run_managed(_wide_trainer, steps, budget, offload="always")
    assert_bitwise_equal("losses", ref_out, out)
    assert_bitwise_equal("parameters", ref_state, state)
    assert stats["allocated_bytes.peak"] <= budget
    assert stats["num_leaf_offloads"] > 0 and stats["num_swap_ins"] + stats["num_prefetches"] > 0, stats
