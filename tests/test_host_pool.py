"""The host pool (csrc/host_pool.h): host copies of offloaded values come from large chunks, split
and coalesced without power-of-two rounding, under an optional cap; on CUDA (here: the fake CUDA
table) chunks are pinned and a block is reused only after the copies recorded on it completed."""
import ctypes
import gc

import pytest
import torch

from pymem import _C
from fake_cuda import FakeCuda

KiB, MiB = 1 << 10, 1 << 20


def test_blocks_come_from_one_chunk_exactly_sized_and_coalesce():
    pool = _C.HostPool(MiB)
    a, b, c = pool.empty(1000), pool.empty(100 * KiB), pool.empty(300 * KiB)
    for t, v in ((a, 1), (b, 2), (c, 3)):
        t.fill_(v)
    assert [int(t[0]) for t in (a, b, c)] == [1, 2, 3] and a.numel() == 1000
    s = pool.stats()
    assert s["num_host_chunks"] == 1 and s["host_reserved_bytes"] == MiB
    assert s["host_bytes"] == 1024 + 100 * KiB + 300 * KiB  # 512-byte units, no power-of-two rounding
    del a, b, c, t
    assert pool.stats()["host_bytes"] == 0
    whole = pool.empty(MiB)  # the three blocks coalesced back into the whole chunk
    assert pool.stats()["num_host_chunks"] == 1 and whole.numel() == MiB
    assert pool.stats()["host_bytes.peak"] == MiB


def test_a_request_larger_than_a_chunk_gets_a_chunk_of_its_own():
    pool = _C.HostPool(MiB)
    small, big = pool.empty(KiB), pool.empty(3 * MiB)
    s = pool.stats()
    assert s["num_host_chunks"] == 2 and s["host_reserved_bytes"] == 4 * MiB
    assert big.numel() == 3 * MiB and small.numel() == KiB


def test_the_cap_refuses_and_a_freed_block_is_taken_again():
    pool = _C.HostPool(256 * KiB, cap_bytes=MiB)
    held = [pool.empty(256 * KiB) for _ in range(3)]
    assert pool.empty(512 * KiB) is None  # 768 KiB taken of 1 MiB
    assert pool.stats()["num_host_refused"] == 1
    last = pool.empty(256 * KiB)  # the last chunk under the cap
    assert last is not None and pool.stats()["host_reserved_bytes"] == MiB
    del held[0]
    again = pool.empty(200 * KiB)
    assert again is not None and pool.stats()["host_reserved_bytes"] == MiB


def test_a_tensor_keeps_its_pool_alive():
    pool = _C.HostPool(MiB)
    t = pool.empty(KiB)
    del pool
    gc.collect()
    t.fill_(7)
    assert int(t.sum()) == 7 * KiB


def _fake_pool(fake, chunk, cap=0):
    return _C.HostPool(chunk, cap_bytes=cap, cuda_table=ctypes.addressof(fake.table))


def test_pinned_chunks_come_from_cuda_host_alloc_and_go_back_when_the_pool_closes():
    fake = FakeCuda()
    pool = _fake_pool(fake, MiB)
    assert pool.pinned
    t = pool.empty(10 * KiB)
    assert fake.host_allocs == [MiB] and t.data_ptr() in fake.host_buffers
    del t, pool
    gc.collect()
    assert len(fake.host_frees) == 1


def test_a_block_is_reused_only_after_the_copy_recorded_on_it_completed():
    fake = FakeCuda()
    pool = _fake_pool(fake, 64 * KiB, cap=64 * KiB)  # one chunk, one block of it at a time
    t = pool.empty(64 * KiB)
    addr = t.data_ptr()
    pool.record_use(t, 7)  # a copy on stream 7 reads it
    assert [st for _, st in fake.records()] == [7]
    del t
    assert pool.stats()["num_host_pending"] == 1 and pool.stats()["host_bytes"] == 64 * KiB
    assert pool.empty(64 * KiB) is None  # the copy may still read it: not handed out again
    fake.complete(7)
    again = pool.empty(64 * KiB)
    assert again is not None and again.data_ptr() == addr
    assert pool.stats()["num_host_pending"] == 0 and len(fake.host_allocs) == 1


def test_without_a_cap_a_pending_block_makes_the_pool_grow_instead_of_waiting():
    fake = FakeCuda()
    pool = _fake_pool(fake, 64 * KiB)
    t = pool.empty(64 * KiB)
    pool.record_use(t, 3)
    addr = t.data_ptr()
    del t
    other = pool.empty(64 * KiB)
    assert other.data_ptr() != addr and len(fake.host_allocs) == 2


def test_closing_the_pool_waits_for_copies_still_in_flight():
    fake = FakeCuda()
    pool = _fake_pool(fake, 64 * KiB)
    t = pool.empty(KiB)
    pool.record_use(t, 5)
    (event, _), = fake.records()
    del t, pool
    gc.collect()
    assert event in fake.syncs() and len(fake.host_frees) == 1


def test_bad_pool_arguments_are_clear_errors():
    with pytest.raises(ValueError, match="chunk_bytes must be positive"):
        _C.HostPool(0)
    pool = _C.HostPool(MiB)
    with pytest.raises(ValueError, match="did not hand out"):
        pool.record_use(torch.empty(4), 0)
