"""Offloading on the CPU device: released values copied to host buffers outside the arena and
brought back on use (swap-in) or ahead of it (prefetch, on a worker thread), as the director
chooses. Training stays bitwise equal and within the budget whatever the mix."""
import gc
import threading

import pytest
import torch

import pymem
import runtime_models as rm
from pymem.policies import director_names, get_director
from test_runtime_training import budget_for, managed, trained_bitwise_equal  # noqa: F401

MiB = 1 << 20


@pytest.mark.parametrize("name,ratio", [(n, r) for n in rm.NAMES for r in (0.5, 0.3)])
def test_offloading_everything_trains_bitwise_equal_and_never_recomputes(managed, name, ratio):
    stats = trained_bitwise_equal(managed, name, ratio, offload="always")
    assert stats["num_offloads"] > 0 and stats["offload_copied_bytes"] > 0, stats
    assert stats["num_swap_ins"] + stats["num_prefetches"] > 0, stats
    # Every released value went to host memory, so nothing had to be recomputed.
    assert stats["num_evictions"] == 0 and stats["num_rematerializations"] == 0, stats
    assert stats["host_bytes.peak"] > 0


def test_prefetch_brings_values_back_ahead_of_use_without_running_ops(managed):
    on = trained_bitwise_equal(managed, "gpt", 0.5, offload="always")
    off = trained_bitwise_equal(managed, "gpt", 0.5, offload="always", prefetch=False)
    assert on["num_prefetches"] > 0 and on["prefetched_bytes"] > 0, on
    assert off["num_prefetches"] == 0 and off["num_swap_ins"] > 0, off
    # The worker thread's copies are not ops of the program (dispatch modes are per thread).
    assert on["num_ops"] == off["num_ops"]


def test_delta_mixes_offloads_and_evictions_by_cost(managed):
    """A link as slow as the cheap ops and faster than the costly ones: both kinds in one run."""
    # The real link of this machine: host copies are far cheaper than recomputes.
    fast = trained_bitwise_equal(managed, "gpt", 0.3, offload="delta")
    assert fast["num_offloads"] > 0, fast
    slow = _run_with_bandwidth(managed, "gpt", 0.3, 1e3, offload="delta")  # 1 kB/s: nothing is worth copying
    assert slow["num_offloads"] == 0 and slow["num_evictions"] > 0, slow
    mixed = _run_with_bandwidth(managed, "gpt", 0.3, _median_bandwidth("gpt"), offload="delta")
    assert mixed["num_offloads"] > 0 and mixed["num_evictions"] > 0, mixed


def _median_bandwidth(name):
    """Bytes per second at which half of the gpt's released values would be copied: each value's
    bytes over its compute cost, measured on a never-offloading run."""
    from pymem.runtime.runtime import Runtime

    rt = Runtime(budget_for(name, 0.3), offload="never")
    ratios = []
    release = rt.residency.release

    def spy(r):
        ratios.append(r.nbytes / max(r.compute_cost + r.evicted_ancestor_cost, 1e-9))
        release(r)
    rt.residency.release = spy
    rt.start()
    try:
        step = rm.trainer(name)
        step()
        step()
    finally:
        rt.stop()
    del step
    gc.collect()
    ratios.sort()
    return 2 * ratios[len(ratios) // 2]  # delta offloads when 2 * bytes / bw < cost


def _run_with_bandwidth(managed, name, ratio, bandwidth, **options):
    import pymem.cost_model as cm

    saved = dict(cm._bandwidth)
    cm._bandwidth["cpu"] = bandwidth
    try:
        return trained_bitwise_equal(managed, name, ratio, **options)
    finally:
        cm._bandwidth.clear()
        cm._bandwidth.update(saved)


@pytest.fixture
def rt():
    r = pymem.enable(8 * MiB, device="cpu", offload="always", prefetch=False)
    try:
        yield r
    finally:
        pymem.disable()


def _grad_input(n):
    with pymem.no_recompute():
        x = torch.arange(float(n))  # a leaf: no recipe
    return x.requires_grad_()


def test_a_value_released_again_reuses_its_host_copy(rt):
    x = _grad_input(1 << 18)  # 1 MiB
    y = x * 3  # recomputable: a forward op
    expected = torch.arange(float(1 << 18)) * 3
    records = len(rt.table)
    pymem.evict(y)
    assert len(rt.table) == records  # the host buffer is no tensor of the program: no record, no op
    s = pymem.memory_stats()
    assert s["num_offloads"] == 1 and s["offload_copied_bytes"] == MiB and s["host_bytes"] == MiB
    assert pymem.is_evicted(y) and repr(rt.table[pymem._C.storage_key(y)]).endswith("offloaded)")
    assert torch.equal(y.detach() + 0, expected)  # swapped in for the read
    pymem.evict(y)
    s = pymem.memory_stats()
    assert s["num_offloads"] == 2 and s["offload_copied_bytes"] == MiB  # released again: no copy
    assert s["num_swap_ins"] == 1 and s["num_rematerializations"] == 0
    assert torch.equal(y.detach() + 0, expected)
    del y
    gc.collect()
    rt.sweep()  # what each new pressure event does first
    assert pymem.memory_stats()["host_bytes"] == 0  # the copy went with its value


def test_an_offloaded_value_comes_back_without_its_evicted_ancestors(rt):
    x = _grad_input(1 << 16)
    a = x * 2
    b = a + 1
    c = b * b
    pymem.evict(c)  # offloaded
    rt.swap.director = get_director("never")
    pymem.evict(b)  # evicted: recomputing b would need a, which stays resident
    pymem.evict(a)
    before = pymem.memory_stats()
    assert torch.equal(c.detach() + 0, ((torch.arange(float(1 << 16)) * 2 + 1) ** 2))
    after = pymem.memory_stats()
    assert after["num_swap_ins"] == before["num_swap_ins"] + 1
    assert after["num_rematerializations"] == before["num_rematerializations"]  # a and b stay evicted
    assert pymem.is_evicted(a) and pymem.is_evicted(b)


class _Held(torch.Tensor):
    """A copy source whose bytes the worker reads only once ``go`` is set (``dst.copy_(src)`` calls
    ``__torch_function__`` first, on the worker thread)."""

    @staticmethod
    def __new__(cls, src, go):
        t = src.as_subclass(cls)
        t.go = go
        return t

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        for a in args:
            if isinstance(a, _Held):
                a.go.wait(30)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*[a.as_subclass(torch.Tensor) if isinstance(a, _Held) else a for a in args],
                        **(kwargs or {}))


def test_a_prefetch_in_flight_is_given_up_under_pressure():
    rt = pymem.enable(4 * MiB, device="cpu", offload="always", prefetch=True, offload_leaves=False)
    try:
        with pymem.no_recompute():
            leaf = torch.ones(MiB // 4)  # 1 MiB that can never be released
        x = leaf.clone().requires_grad_()
        a = x + 1  # 1 MiB, recomputable
        pymem.evict(a)  # offloaded: 2 MiB free
        rt.swap.headroom = 0
        # The worker's copy waits until the test lets it go: otherwise it may finish, and be adopted
        # by the next op, before the test looks (a race, not a fault).
        go, start = threading.Event(), rt.swap.copier.start
        rt.swap.copier.start = lambda dst, src, out=False: start(dst, _Held(src, go), out=out)
        s = leaf[:4] * 2  # any op: afterwards the prefetch of `a` starts (it fits)
        assert rt.swap.in_flight, "the prefetch did not start"
        go.set()  # in flight until an op adopts it, done or not: the next allocation comes first
        # 2.5 MiB: only giving up the prefetch's buffer makes room (x and the leaf stay).
        big = torch.empty(5 * MiB // 8, dtype=torch.float32)
        stats = pymem.memory_stats()
        assert stats["num_prefetches_cancelled"] == 1 and stats["allocated_bytes.peak"] <= 4 * MiB
        # The room `big` needed stays free of prefetches for the rest of the step: started into it
        # again, the copy would be given up (and waited for) at the next such allocation.
        del big
        leaf[:4] * 3
        assert not rt.swap.in_flight
        pymem.step()  # a new step: prefetches may use all free room again
        leaf[:4] * 3
        assert rt.swap.in_flight or not pymem.is_evicted(a)  # started (or already adopted) at once
        assert torch.equal(a.detach() + 0, torch.full((MiB // 4,), 2.0))  # back from its host copy
        assert torch.equal(s, torch.full((4,), 2.0))
    finally:
        pymem.disable()


def test_disable_lands_copies_in_flight_and_restores_offloaded_values():
    rt = pymem.enable(8 * MiB, device="cpu", offload="always", prefetch=True)
    try:
        x = _grad_input(1 << 18)
        a, b = x * 2, x * 5
        pymem.evict(a)
        pymem.evict(b)
        rt.swap.headroom = 0
        _ = x[:1] + 0  # starts prefetches
    finally:
        pymem.disable()
    assert not pymem._C.storage_is_evicted(a) and not pymem._C.storage_is_evicted(b)
    assert torch.equal(a.detach(), torch.arange(float(1 << 18)) * 2)
    assert torch.equal(b.detach(), torch.arange(float(1 << 18)) * 5)


def test_offload_and_bring_back_are_labelled_in_the_snapshot(rt):
    pymem.record_memory_history(True)
    try:
        x = _grad_input(1 << 16)
        y = x.sin()
        pymem.evict(y)
        _ = y + 1
        names = [e["frames"][0]["name"] for e in pymem.memory_snapshot()["device_traces"][0]]
    finally:
        pymem.record_memory_history(False)
    assert "pymem offload aten.sin.default" in names
    assert "pymem swap in aten.sin.default" in names


def test_offload_settings_are_checked(rt):
    pymem.disable()
    with pytest.raises(ValueError, match="offload 'sometimes' is not accepted; accepted: None \\(by device\\), "
                                         "'always', 'capuchin', 'delta', 'never'"):
        pymem.enable(MiB, offload="sometimes")
    with pytest.raises(ValueError, match="prefetch must be True or False, got 'yes'"):
        pymem.enable(MiB, prefetch="yes")
    assert not pymem.is_enabled()
    assert director_names() == ["always", "capuchin", "delta", "never"]


def test_without_offloading_the_swap_stats_are_there_and_zero():
    with pymem.budget(MiB, device="cpu") as r:  # the CPU default: never
        assert r.swap is None
        _ = torch.ones(100) + 1
    s = pymem.memory_stats()
    for k in ("num_offloads", "offloaded_bytes", "num_swap_ins", "num_prefetches", "host_bytes.peak"):
        assert s[k] == 0, k
    assert "offloads (bytes)" in pymem.memory_summary()


def test_offloaded_list_stays_bounded_under_steady_pressure(rt):
    """Prefetch looks only at the newest offloaded values; old entries are pruned, not kept for
    every step of a long run."""
    rt.swap.prefetch_enabled = True
    rt.swap._prune_at = 8
    x = _grad_input(1 << 14)
    for i in range(40):
        y = x * float(i)
        pymem.evict(y)
        del y  # its storage dies: no prefetch will ever want it
    assert len(rt.swap.offloaded) <= 16


def test_the_swap_stats_have_the_same_keys_with_or_without_offloading(rt):
    from pymem.runtime.swap import NO_SWAP_STATS

    assert set(rt.swap.stats()) == set(NO_SWAP_STATS)


def test_host_copies_come_from_the_pool_in_chunks(managed):
    stats = trained_bitwise_equal(managed, "gpt", 0.3, offload="always")
    assert stats["num_host_chunks"] >= 1 and stats["host_reserved_bytes"] >= stats["host_bytes.peak"] > 0
    # Chunks are large: far fewer than the copies made from them.
    assert stats["num_host_chunks"] * 8 <= stats["num_host_allocs"], stats
    assert stats["host_budget"] == 0 and stats["num_host_refused"] == 0


def test_the_host_cap_turns_offloads_into_evictions(managed):
    cap = budget_for("gpt", 0.3) // 4
    stats = trained_bitwise_equal(managed, "gpt", 0.3, offload="always", host_budget=cap)
    assert stats["host_budget"] == cap and stats["host_reserved_bytes"] <= cap
    assert stats["num_host_refused"] > 0, stats
    # What did not fit the cap was evicted (and recomputed) instead: both kinds in one run.
    assert stats["num_offloads"] > 0 and stats["num_evictions"] > 0 and stats["num_rematerializations"] > 0


@pytest.mark.parametrize("name", ["gpt", "cnn"])
def test_capuchin_director_trains_bitwise_equal(managed, name):
    """offload="capuchin": from the step plan, each released value is swapped where its copy hides
    behind compute before its next use, recomputed where that costs less, evicted where the step
    does not read it again. On a link as slow as the median value's recompute, both kinds."""
    stats = _run_with_bandwidth(managed, name, 0.3, _median_bandwidth(name), offload="capuchin")
    assert stats["num_offloads"] > 0 and stats["num_evictions"] > 0, stats
    assert stats["plan_hits"] > 0


def test_copy_times_count_every_copy_made():
    """The copies' own time (stats offload_copy_* / swap_in_copy_*; CPU: each copy timed where it
    runs): once every copy landed (disable), the bytes timed are the bytes copied, each way, and
    the seconds are there exactly when copies were made; the stall is the calling thread's part."""
    budget = budget_for("gpt", 0.3)
    pymem.enable(budget, device="cpu", offload="always")
    try:
        step = rm.trainer("gpt")
        for _ in range(3):
            step()
        live = pymem.memory_stats()
    finally:
        pymem.disable()
        step = None
        gc.collect()
    s = pymem.memory_stats()
    assert s["num_offloads"] > 0 and s["num_prefetches"] > 0, s
    assert s["offload_copy_timed_bytes"] == s["offload_copied_bytes"] > 0
    assert s["offload_copy_seconds"] > 0
    copied_in = s["swapped_in_bytes"] + s["prefetched_bytes"]
    if s["num_prefetches_cancelled"] == 0:
        assert s["swap_in_copy_timed_bytes"] == copied_in > 0
    else:  # a cancelled prefetch's copy was made too, and is copied again later
        assert s["swap_in_copy_timed_bytes"] > copied_in > 0
    assert s["swap_in_copy_seconds"] > 0
    # Out and on demand run in the calling thread: stalls, inside its time in copies and waits. Out
    # ahead (the plan's: steps after the first) runs on a worker: no stall but its waits.
    assert s["num_copies_ahead"] > 0 and s["copy_ahead_seconds"] > 0, s
    assert s["offload_copy_seconds"] - s["copy_ahead_seconds"] <= s["swap_stall_seconds"] <= s["swap_seconds"]
    # While running, only what completed is counted: never more than what was copied.
    assert live["offload_copy_timed_bytes"] == live["offload_copied_bytes"]
    assert live["swap_in_copy_timed_bytes"] <= s["swap_in_copy_timed_bytes"]


def test_copy_times_are_zero_without_copies():
    with pymem.budget(64 * MiB, device="cpu", offload="always") as r:  # room for everything
        assert r.swap is not None
        _ = (torch.ones(100) + 1).sum()
    s = pymem.memory_stats()
    for k in ("offload_copy_seconds", "offload_copy_timed_bytes", "swap_in_copy_seconds",
              "swap_in_copy_timed_bytes", "swap_stall_seconds"):
        assert s[k] == 0, k
    with pymem.budget(MiB, device="cpu"):  # offload="never": the same keys
        pass
    s = pymem.memory_stats()
    assert s["offload_copy_seconds"] == s["swap_in_copy_timed_bytes"] == s["swap_stall_seconds"] == 0


class _FakeEvent:
    """A CUDA timing event stand-in: completes when the test says; elapsed_time only then."""

    def __init__(self, at_ms):
        self.at_ms, self.complete, self.waited = at_ms, False, False

    def query(self):
        return self.complete

    def synchronize(self):
        self.waited = self.complete = True

    def elapsed_time(self, end):
        assert end.complete, "elapsed_time before the end event completed"  # (so did its start)
        return end.at_ms - self.at_ms


def test_cuda_copy_times_are_read_only_once_complete_and_in_stream_order():
    """_CudaCopier's booking without a GPU: a copy's events are asked (query, never a wait) only
    from each stream's oldest pending copy on; close() waits for the rest."""
    from pymem.runtime.swap import _IN, _OUT, _PREFETCH, _WAIT, _CudaCopier

    c = _CudaCopier(torch.device("cpu"), None)
    side = [(_FakeEvent(0.0), _FakeEvent(2.0)), (_FakeEvent(2.0), _FakeEvent(5.0))]
    compute = [(_FakeEvent(1.0), _FakeEvent(1.5)), (_FakeEvent(3.0), _FakeEvent(3.25))]
    c._track("side", side[0], MiB, _PREFETCH)
    c._track("side", side[1], 2 * MiB, _PREFETCH)
    c._track("compute", compute[0], MiB, _IN)
    c._track("compute", compute[1], 0, _WAIT)
    c._book(_OUT, 4 * MiB, 0.004)  # an out copy: waited for by the copy itself
    side[1][0].complete = side[1][1].complete = True  # not the oldest: not booked before it
    compute[0][0].complete = compute[0][1].complete = True
    t = c.time_stats()
    assert t["swap_in_copy_timed_bytes"] == MiB and t["swap_in_copy_seconds"] == pytest.approx(0.0005)
    assert t["offload_copy_timed_bytes"] == 4 * MiB and t["offload_copy_seconds"] == pytest.approx(0.004)
    assert t["swap_stall_seconds"] == pytest.approx(0.0045)
    side[0][0].complete = side[0][1].complete = True
    t = c.time_stats()
    assert t["swap_in_copy_timed_bytes"] == 4 * MiB and t["swap_in_copy_seconds"] == pytest.approx(0.0055)
    assert not any(e.waited for pair in side + compute for e in pair)
    c.close()  # the wait left: the compute stream's last interval
    assert compute[1][1].waited
    t = c.time_stats()
    assert t["swap_stall_seconds"] == pytest.approx(0.00475)
    assert not any(c.pending.values())


class _StandInCuda:
    """torch.cuda's streams and events, logged (the copies themselves run on CPU tensors): each
    new stream gets the next number (the compute stream is 1)."""

    def __init__(self, monkeypatch):
        log = self.log = []
        streams = iter(range(2, 100))

        class Stream:
            def __init__(self, n):
                self.cuda_stream = n

            def wait_stream(self, other):
                log.append(("wait_stream", self.cuda_stream, other.cuda_stream))

            def wait_event(self, ev):
                log.append(("wait_event", self.cuda_stream, ev.name))

            def synchronize(self):
                log.append(("stream sync", self.cuda_stream))

        class Event:
            made = 0

            def __init__(self, enable_timing=False):
                assert enable_timing
                Event.made += 1
                self.name, self.at, self.complete = f"e{Event.made}", None, False

            def record(self, stream):
                self.at = 2.0 * Event.made + len(log)  # later records, later times
                log.append(("record", self.name, stream.cuda_stream))

            def query(self):
                log.append(("query", self.name))
                return self.complete

            def synchronize(self):
                log.append(("event sync", self.name))
                self.complete = True

            def elapsed_time(self, end):
                assert end.complete
                return end.at - self.at

        class Host:
            def used_by_copy(self, buf, stream):
                log.append(("used_by_copy", stream.cuda_stream))

        self.compute, self.host = Stream(1), Host()
        monkeypatch.setattr(torch.cuda, "Event", Event)
        monkeypatch.setattr(torch.cuda, "Stream", lambda device: Stream(next(streams)))
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: self.compute)
        monkeypatch.setattr(torch.cuda, "stream", lambda s: __import__("contextlib").nullcontext())


def test_cuda_copier_puts_timing_events_around_each_copy(monkeypatch):
    """_CudaCopier on a stand-in torch.cuda (events, streams; the copies themselves run on CPU
    tensors): each copy between a start and an end event on its stream; nothing is waited for by
    the host, the out copy included (the compute stream orders every later use of its device
    block, and the host pool is told of its host block); copies out and back and a late use's wait
    are booked once their end event completes, asked with a query only."""
    from pymem.runtime.swap import _CudaCopier

    cuda = _StandInCuda(monkeypatch)
    log, Host = cuda.log, lambda: cuda.host
    c = _CudaCopier(torch.device("cpu"), Host())
    src = torch.arange(64, dtype=torch.uint8)
    host = torch.empty(64, dtype=torch.uint8)
    c.copy(host, src, out=True)
    assert torch.equal(host, src)
    assert log == [("record", "e1", 1), ("record", "e2", 1), ("used_by_copy", 1), ("query", "e2")]
    assert c.time_stats()["offload_copy_timed_bytes"] == 0  # still running: not booked, not waited for
    c.pending[1][0][0][1].complete = True
    assert c.time_stats()["offload_copy_timed_bytes"] == 64 and c.time_stats()["offload_copy_seconds"] > 0
    del log[:]
    back = torch.empty(64, dtype=torch.uint8)
    c.copy(back, host)  # on demand, on the compute stream
    handle = c.start(torch.empty(64, dtype=torch.uint8), host)  # prefetch, on the side stream
    c.wait(handle, timed=True)  # a use that came before the prefetch was done
    assert [e for e in log if e[0] in ("record", "wait_stream", "wait_event", "used_by_copy")] == [
        ("record", "e3", 1), ("record", "e4", 1), ("used_by_copy", 1),
        ("wait_stream", 2, 1), ("record", "e5", 2), ("record", "e6", 2), ("used_by_copy", 2),
        ("record", "e7", 1), ("wait_event", 1, "e6"), ("record", "e8", 1)]
    assert not any(e[0].endswith("sync") for e in log)  # nothing waited for
    assert c.time_stats()["swap_in_copy_timed_bytes"] == 0  # none complete yet
    handle.complete = True  # the prefetch completed; the compute stream's copy not yet
    t = c.time_stats()
    assert t["swap_in_copy_timed_bytes"] == 64 and t["swap_stall_seconds"] == t["offload_copy_seconds"]
    c.close()
    assert ("stream sync", 2) in log
    t = c.time_stats()
    assert t["swap_in_copy_timed_bytes"] == 128 and t["swap_stall_seconds"] > t["offload_copy_seconds"]
    assert not any(c.pending.values())


def _gate_copies_out(rt, go):
    """Copies out ahead read their source only once ``go`` is set (copies back run as usual)."""
    start = rt.swap.copier.start
    rt.swap.copier.start = lambda dst, src, out=False: start(dst, _Held(src, go) if out else src, out=out)


@pytest.mark.parametrize("recipe", [True, False])
def test_a_write_in_place_waits_for_the_copy_out_ahead_of_its_value(recipe):
    """A value being copied out ahead (beside compute) and then written in place: the write waits
    for the copy, so the host copy holds the value before the write (a recomputable value's old
    record keeps it), or none is kept (a leaf: its record now holds the new value)."""
    rt = pymem.enable(64 * MiB, device="cpu", offload="always", prefetch=False)
    try:
        x = torch.ones(MiB // 4)
        if recipe:
            y = x.requires_grad_() * 2
        else:
            with pymem.no_recompute():
                y = x * 2
        r = rt.table[pymem._C.storage_key(y)]
        assert (r.recipe is not None) == recipe
        go = threading.Event()
        _gate_copies_out(rt, go)
        rt.swap.copy_ahead(r, 0)
        assert r in rt.swap.out_flight and r.host is None
        threading.Timer(0.2, go.set).start()  # the write below must wait for it
        with torch.no_grad():
            y.add_(1)
        assert not rt.swap.out_flight
        if recipe:
            assert torch.equal(r.host.view(torch.float32), torch.full((MiB // 4,), 2.0))
        else:
            assert r.host is None  # it would be stale
        assert torch.equal(y, torch.full((MiB // 4,), 3.0))
    finally:
        pymem.disable()


def _copy_out_ahead_held(rt):
    """A 1 MiB value whose copy out ahead is started but reads its source only 0.2 s from now (on
    the CPU a copy may not have begun when the value is released): (tensor, record)."""
    x = torch.arange(MiB // 4, dtype=torch.float32).requires_grad_()
    y = x * 3
    r = rt.table[pymem._C.storage_key(y)]
    go = threading.Event()
    _gate_copies_out(rt, go)
    rt.swap.copy_ahead(r, 0)
    threading.Timer(0.2, go.set).start()
    return y, r


@pytest.mark.parametrize("director_offloads", [True, False])
def test_a_release_waits_for_the_copy_out_ahead_and_copies_nothing_more(director_offloads):
    """Released while its copy out ahead runs, or has not begun: the release waits for that copy
    (no second one), and the value comes back byte-exact from it. Where the director would evict
    it, the copy must still be waited for (it was not: the worker then copied from the freed
    storage, a segfault); with the host copy made, the release is an offload."""
    rt = pymem.enable(64 * MiB, device="cpu", offload="always", prefetch=False)
    try:
        copied = pymem.memory_stats()["offload_copied_bytes"]
        y, r = _copy_out_ahead_held(rt)
        if not director_offloads:
            rt.swap.wants_offload = lambda rec: False
        pymem.evict(y)
        assert r not in rt.swap.out_flight and r.host is not None
        s = pymem.memory_stats()
        assert s["num_offloads"] == 1 and s["num_evictions"] == 0
        assert s["num_copies_ahead"] == 1 and s["copied_ahead_bytes"] == MiB
        assert s["offload_copied_bytes"] - copied == MiB  # the copy ahead's bytes, once
        assert s["offload_copy_timed_bytes"] == MiB  # no copy in the calling thread
        assert torch.equal(y, torch.arange(MiB // 4, dtype=torch.float32) * 3)
        assert pymem.memory_stats()["num_rematerializations"] == 0  # back by its host copy
    finally:
        pymem.disable()


def test_a_storage_resize_waits_for_the_copy_out_ahead_reading_its_bytes():
    """``UntypedStorage.resize_`` frees the bytes a copy out ahead may not have read yet: the
    resize waits for the copy, so the host copy holds the value the recipes that read it knew."""
    rt = pymem.enable(64 * MiB, device="cpu", offload="always", prefetch=False)
    try:
        y, r = _copy_out_ahead_held(rt)
        y.untyped_storage().resize_(0)
        assert r not in rt.swap.out_flight and r.host is not None
        assert torch.equal(r.host.view(torch.float32), torch.arange(MiB // 4, dtype=torch.float32) * 3)
    finally:
        pymem.disable()


def test_a_block_being_copied_out_ahead_is_not_moved():
    """Compaction slides blocks; one a copy out ahead still reads stays where it is."""
    rt = pymem.enable(64 * MiB, device="cpu", offload="always", prefetch=False)
    try:
        x = torch.ones(MiB // 4).requires_grad_()
        y = x * 2
        r = rt.table[pymem._C.storage_key(y)]
        go = threading.Event()
        _gate_copies_out(rt, go)
        rt.swap.copy_ahead(r, 0)
        from pymem.runtime.compaction import movable_blocks
        assert y.untyped_storage().data_ptr() not in movable_blocks(rt)
        go.set()
        rt.swap.finish_out(r)
        assert y.untyped_storage().data_ptr() in movable_blocks(rt)
    finally:
        pymem.disable()


@pytest.mark.parametrize("name", ["gpt", "cnn"])
def test_copies_out_ahead_train_bitwise_equal_and_spare_the_copies_at_release(managed, name):
    """Offloading with the step plan: from the second step, the values the step before offloaded
    are copied out ahead, beside compute; training stays bitwise equal under the budget, and a
    good part of the bytes copied out (over half, measured, in the four steps of five with a
    plan) were copied ahead, not in the calling thread at release."""
    stats = trained_bitwise_equal(managed, name, 0.3, "dtr", offload="always", plan="auto")
    assert stats["num_copies_ahead"] > 0, stats
    assert stats["copied_ahead_bytes"] > stats["offload_copied_bytes"] / 4, stats


def test_copies_out_ahead_wait_their_turn_by_expected_release(monkeypatch):
    """Copies out ahead start while few bytes are queued (one here), the one whose release the
    step before made first going first: not in the order the values were made."""
    import pymem.runtime.swap as swap_module

    monkeypatch.setattr(swap_module, "_OUT_QUEUE_BYTES", 1)
    rt = pymem.enable(64 * MiB, device="cpu", offload="always", prefetch=False)
    try:
        x = torch.ones(MiB // 4).requires_grad_()
        a, b, c = x * 2, x * 3, x * 5
        recs = {rt.table[pymem._C.storage_key(t)]: n for t, n in ((a, "a"), (b, "b"), (c, "c"))}
        order, start = [], rt.swap.copier.start
        go = threading.Event()

        def spy(dst, src, out=False):
            order.append(float(src.view(torch.float32)[0]))
            return start(dst, _Held(src, go), out=out)

        rt.swap.copier.start = spy
        by_name = {n: r for r, n in recs.items()}
        rt.swap.copy_ahead(by_name["a"], 5)  # the queue is empty: it starts now
        rt.swap.copy_ahead(by_name["b"], 9)
        rt.swap.copy_ahead(by_name["c"], 1)  # expected first of the two waiting
        assert order == [2.0] and len(rt.swap.ahead_waiting) == 2
        go.set()
        rt.swap.finish_out(by_name["a"])
        rt.swap.after_op()
        rt.swap.finish_out(by_name["c"])
        rt.swap.after_op()
        assert order == [2.0, 5.0, 3.0]
    finally:
        pymem.disable()


def test_cuda_copies_out_ahead_run_on_a_stream_of_their_own(monkeypatch):
    """On a stand-in torch.cuda: a copy out ahead goes on a second side stream (not the prefetches'),
    after the compute stream's work so far (its source was made there); the host block it writes is
    marked used by that stream; a wait for it is the compute stream's wait on its end event (no
    host sync); the copy is booked as a copy out, ahead, once complete (the copy itself is no
    stall; a wait for it is)."""
    from pymem.runtime.swap import _CudaCopier

    cuda = _StandInCuda(monkeypatch)
    c = _CudaCopier(torch.device("cpu"), cuda.host)
    src = torch.arange(64, dtype=torch.uint8)
    host = torch.empty(64, dtype=torch.uint8)
    prefetch = c.start(torch.empty(64, dtype=torch.uint8), host)  # the prefetches' stream: 2
    out = c.start(host, src, out=True)
    assert torch.equal(host, src)
    log = cuda.log
    i = log.index(("wait_stream", 3, 1))
    assert log[i:i + 4] == [("wait_stream", 3, 1), ("record", "e3", 3), ("record", "e4", 3), ("used_by_copy", 3)]
    c.wait(out, timed=True)  # a release before the copy was done
    assert ("wait_event", 1, out.name) in log and not any(e[0].endswith("sync") for e in log)
    assert c.time_stats()["copy_ahead_seconds"] == 0  # not complete yet
    out.complete = prefetch.complete = True
    t = c.time_stats()
    assert t["copy_ahead_seconds"] > 0 and t["offload_copy_timed_bytes"] == 64
    assert t["offload_copy_seconds"] == t["copy_ahead_seconds"]
    c.close()
    assert ("stream sync", 2) in log and ("stream sync", 3) in log


@pytest.mark.parametrize("name", ["gpt", "cnn"])
def test_the_in_trigger_remembered_answers_as_the_whole_test_would(managed, name, monkeypatch):
    """swap.after_op answers "hold the planned head back" from what the last such test read
    (_still_quiet) until that test could pass: every time it does, the whole test (the head's next
    read and the backlog behind it, over the copies in flight now) holds it back too, and training
    stays bitwise equal under the budget."""
    from pymem.runtime import swap as swap_mod

    remembered = swap_mod.Swapper._still_quiet
    answered = []

    def checked(self, plan, head):
        quiet = remembered(self, plan, head)
        if quiet:
            r = head[2]()
            d = plan.seconds_to_next_use(r)
            margin = swap_mod._LEAD * self.lead.get(r.trace_value, 1.0) * r.swap_cost
            assert d is not None and d > margin and not self._behind(plan, margin - r.swap_cost)
            answered.append(d)
        return quiet

    monkeypatch.setattr(swap_mod.Swapper, "_still_quiet", checked)
    stats = trained_bitwise_equal(managed, name, 0.3, "dtr", offload="always", plan="auto")
    assert stats["num_prefetches"] > 0, stats
    assert answered, "the remembered answer was never used"
