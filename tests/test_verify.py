"""verify=True (PYMEM_VERIFY=1): every value pymem releases is checked as it comes back, recomputed or
copied back, against a checksum taken when it left; a value that comes back different raises
RestoreMismatchError naming it, and a correct run trains bitwise with every return checked."""
import ctypes
from unittest import mock

import pytest
import torch

import pymem
from pymem import cost_model
from pymem.demo_models import gpt_trainer
from bitwise_harness import assert_bitwise_equal, budget_at, measure_peak, run_managed, run_unmanaged

torch.set_num_threads(2)
MiB = 1 << 20


def _record(t):
    return pymem.current().table[pymem._C.storage_key(t)]


def test_a_host_copy_changed_while_away_is_caught_when_it_comes_back(managed):
    pymem.enable(8 * MiB, device="cpu", offload="always", verify=True)
    with pymem.no_recompute():
        leaf = torch.arange(float(1 << 16))  # no recipe: offloaded
    pymem.evict(leaf)
    host = _record(leaf).host
    ctypes.memset(host.data_ptr() + 100, 0x7F, 1)  # one byte of the host copy, behind pymem's back
    with pytest.raises(pymem.RestoreMismatchError, match=r"swap in of aten.arange.default \(262144 B\) gave other bytes") as e:
        leaf * 1
    assert (e.value.op, e.value.nbytes, e.value.how) == ("aten.arange.default", 1 << 18, "swap in")


def test_a_recompute_that_reads_a_changed_input_is_caught(managed):
    """An input overwritten where pymem cannot see it (the kind of write a missed alias would be):
    the recompute gives other bytes, and the read stops there instead of going on with them."""
    pymem.enable(8 * MiB, device="cpu", verify=True)
    x = torch.linspace(0, 1, 1 << 14)
    y = x.exp()
    pymem.evict(y)
    ctypes.memset(x.data_ptr(), 0, 4)  # x[0] = 0.0 behind pymem's back (it was 0.0: bytes unchanged)
    assert torch.equal(y * 1, torch.linspace(0, 1, 1 << 14).exp())  # same bytes: no error
    pymem.evict(y)
    ctypes.memset(x.data_ptr() + 4, 0, 4)  # x[1] changed
    with pytest.raises(pymem.RestoreMismatchError, match="rematerialize of aten.exp"):
        y * 1
    assert pymem.memory_stats()["num_verified_restores"] == 2


def test_training_below_the_recompute_floor_checks_every_return_and_stays_bitwise(managed):
    """TinyGPT at 0.18 of its peak with leaves offloaded (test_offload_leaves.py's case): every value
    released and brought back (copies back, prefetches, recomputes) is checked, and none differs."""
    make = lambda: gpt_trainer(batch=4, seq=128)  # noqa: E731
    ref_out, ref_state, _ = run_unmanaged(make, 3)
    budget = budget_at(measure_peak(make, 3), 0.18)
    with mock.patch.object(cost_model, "host_link_bandwidth", lambda device="cpu": 12e9):
        out, state, stats, _, _ = run_managed(make, 3, budget, offload="always", verify=True)
    assert_bitwise_equal("outputs", ref_out, out)
    assert_bitwise_equal("parameters", ref_state, state)
    assert stats["num_verified_restores"] > 100 and stats["num_leaf_offloads"] > 0, stats


def test_verify_must_be_a_bool_and_is_off_by_default(managed):
    with pytest.raises(ValueError, match="verify must be True or False, got 'yes'"):
        pymem.enable(8 * MiB, device="cpu", verify="yes")
    rt = pymem.enable(8 * MiB, device="cpu")
    assert rt.residency.verify is None and pymem.memory_stats()["num_verified_restores"] == 0
