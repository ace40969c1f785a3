"""Every thread under one runtime: a worker thread trains as the main thread does, two threads
train under one budget, a thread that existed before enable() gets an error that names it (and
works inside ``pymem.manage_thread()``), and heavy pressure from two threads corrupts nothing."""
import gc
import threading

import pytest
import torch

import pymem
import runtime_models as rm
from pymem.testing import all_bitwise_equal

STEPS = 3


def _in_thread(fn, name="trainer"):
    out, errors = [], []

    def body():
        try:
            out.append(fn())
        except BaseException as e:  # noqa: BLE001  (re-raised in the caller)
            errors.append(e)

    t = threading.Thread(target=body, name=name)
    t.start()
    t.join(120)
    assert not t.is_alive(), "the thread did not finish"
    if errors:
        raise errors[0]
    return out[0]


def _under_budget_in_threads(budget, make_targets):
    """Enables pymem, starts one thread per callable from ``make_targets()`` (called after enable,
    on this thread), joins them, disables; returns (their results, memory stats)."""
    targets_results, errors = {}, []

    def body(i, fn):
        try:
            targets_results[i] = fn()
        except BaseException as e:  # noqa: BLE001  (re-raised below)
            errors.append(e)

    pymem.enable(budget, device="cpu")
    try:
        threads = [threading.Thread(target=body, args=(i, fn)) for i, fn in enumerate(make_targets())]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
        st = pymem.memory_stats()
    finally:
        pymem.disable()
        gc.collect()
    if errors:
        raise errors[0]
    return [targets_results[i] for i in range(len(threads))], st


def _budget(name, ratio):
    return int(ratio * rm.unmanaged_peak(name, STEPS)) // 512 * 512


def test_a_worker_thread_trains_bitwise_with_evictions():
    want = rm.run("gpt", STEPS)  # main thread, unmanaged
    pymem.enable(_budget("gpt", 0.4), device="cpu")
    try:
        got = _in_thread(lambda: rm.run("gpt", STEPS))
        st = pymem.memory_stats()
    finally:
        pymem.disable()
        gc.collect()
    assert got[0] == want[0] and all_bitwise_equal(got[1], want[1])
    assert st["num_evictions"] > 0 and st["allocated_bytes.peak"] <= st["budget_bytes"]
    assert st["num_managed_threads"] >= 2


def test_two_threads_train_two_models_under_one_budget():
    """No dropout in either model: the default generator is shared by threads, so only RNG-free
    steps give the same values whatever the interleaving."""
    want = {name: rm.run(name, STEPS) for name in ("mlp", "views")}
    budget = (_budget("mlp", 0.6) + _budget("views", 0.6)) // 512 * 512
    names = list(want)
    barrier = threading.Barrier(2)

    def train(step):
        barrier.wait()
        losses = [step() for _ in range(STEPS)]
        return losses, [p.detach().clone() for p in step.model.parameters()]

    # Built one after the other: initialisation draws from the shared default generator.
    got, st = _under_budget_in_threads(budget, lambda: [
        (lambda step=rm.trainer(n): train(step)) for n in names])
    for name, (losses, params) in zip(names, got):
        assert losses == want[name][0], name
        assert all_bitwise_equal(params, want[name][1]), name
    assert st["num_evictions"] > 0 and st["allocated_bytes.peak"] <= st["budget_bytes"]


def _tanh_chain_grad():
    x = torch.randn(256, 1024, generator=torch.Generator().manual_seed(3), requires_grad=True)
    h = x
    for _ in range(16):
        h = torch.tanh(h) * 1.5
    h.sum().backward()
    return x.grad.clone()


def test_a_thread_started_before_enable_gets_an_error_naming_it_then_manage_thread_works():
    want = _tanh_chain_grad()
    go = threading.Event()
    results = []

    def old_thread():
        go.wait(30)
        try:
            keep = [torch.randn(256, 1024) for _ in range(16)]  # 16 MiB: twice the budget, untracked
            results.append(("ok", len(keep)))
        except pymem.OutOfBudgetError as e:
            results.append(("error", str(e)))
        with pymem.manage_thread():  # now its values are tracked, and releasable (16 MiB of them)
            results.append(("managed", _tanh_chain_grad(), pymem.memory_stats()["num_evictions"]))

    t = threading.Thread(target=old_thread, name="loader-7")
    t.start()
    pymem.enable(8 << 20, device="cpu")
    try:
        go.set()
        t.join(60)
    finally:
        pymem.disable()
        gc.collect()
    kind, msg = results[0]
    assert kind == "error" and "'loader-7'" in msg and "pymem.manage_thread()" in msg
    assert "released nothing" not in msg
    kind, grad, evictions = results[1]
    assert kind == "managed" and evictions > 0 and all_bitwise_equal([grad], [want])


def test_two_threads_under_heavy_pressure_compute_the_right_values():
    def chain(seed):
        g = torch.Generator().manual_seed(seed)
        w = torch.randn(128, 128, generator=g, requires_grad=True)
        h = torch.randn(128, 128, generator=g)
        for _ in range(60):
            h = torch.tanh(h @ w / 12)
        h.sum().backward()
        return h.detach().clone(), w.grad.clone()

    want = [chain(s) for s in (1, 2)]

    def repeat(seed):
        for _ in range(2):
            chain(seed)
        return chain(seed)

    # about a quarter of what the two chains hold
    got, st = _under_budget_in_threads(5 << 20, lambda: [lambda: repeat(1), lambda: repeat(2)])
    for (h, g), (wh, wg) in zip(got, want):
        assert all_bitwise_equal([h, g], [wh, wg])
    assert st["num_evictions"] > 0 and st["allocated_bytes.peak"] <= st["budget_bytes"]


class _ScaleBy(torch.autograd.Function):
    """Multiplies the gradient by ``h`` in backward, and notes the thread that runs it."""

    @staticmethod
    def forward(ctx, x, h, seen):
        ctx.h, ctx.seen = h, seen
        return x * 1

    @staticmethod
    def backward(ctx, g):
        ctx.seen.append(threading.get_ident())
        return g * ctx.h, None, None


def _nested_checkpoints(x, h, seen, depth):
    if depth == 0:
        return _ScaleBy.apply(x, h, seen).tanh()
    return torch.utils.checkpoint.checkpoint(_nested_checkpoints, x, h, seen, depth - 1, use_reentrant=True)


def test_a_backward_op_on_an_autograd_worker_thread_is_seen():
    """Reentrant backward passes nested past the engine's depth limit (60) run on a worker thread of
    the engine. Its ops must go through pymem: there ``g * h`` reads ``h``, evicted, which only the
    runtime can bring back (unseen, the op would read a released buffer)."""
    def run(managed: bool):
        torch.manual_seed(0)
        x0 = torch.randn(256, 256, requires_grad=True)
        x = torch.randn(256, 256, requires_grad=True)
        h = (x0 * 2).exp()  # a recipe: evictable
        seen = []
        out = _nested_checkpoints(x, h, seen, 70)
        if managed:
            pymem.evict(h)
            assert pymem.is_evicted(h)
        out.sum().backward()
        return x.grad, seen

    want, _ = run(False)
    rt = pymem.enable("64MB", device="cpu")
    try:
        got, seen = run(True)
        st = pymem.memory_stats()
        managed_threads = set(rt.threads.managed)
    finally:
        pymem.disable()
        gc.collect()
    assert seen and seen[0] != threading.get_ident(), "the engine ran this backward on the calling thread"
    assert seen[0] in managed_threads and st["num_rematerializations"] >= 1
    assert all_bitwise_equal([got], [want])


def test_pressure_handled_on_another_thread_is_not_this_threads_op_cost():
    """An op's cost is its kernel's time less the pressure handling inside its own allocations.
    Handling on another thread while this op's kernel ran is not part of it: counted as this op's,
    it made costs negative (DTR's neighbourhood then refused the evicted value)."""
    rt = pymem.enable(64 << 20, device="cpu")
    try:
        before = rt.pressure.spent.seconds
        _in_thread(lambda: rt.pressure(1 << 30, None))  # a handler run for a request nothing fits
        assert rt.pressure.spent.seconds == before
    finally:
        pymem.disable()


def test_the_runtime_lock_keeps_threading_rlocks_contract():
    """Runtime.lock (C, taken by the fast path without a call) is re-entrant, released by its owner
    only, and a thread waiting for it lets the holder run Python meanwhile (no GIL held while waiting)."""
    lock = pymem._C.RuntimeLock()
    with lock:
        with lock:  # re-entrant
            assert lock._is_owned()
        assert lock._is_owned()
        assert _in_thread(lambda: lock.acquire(blocking=False)) is False  # another thread cannot take it
        with pytest.raises(RuntimeError, match="un-acquired"):
            _in_thread(lock.release)
    assert not lock._is_owned()
    with pytest.raises(RuntimeError, match="un-acquired"):
        lock.release()

    order = []
    lock.acquire()
    t = threading.Thread(target=lambda: (lock.acquire(), order.append("waiter"), lock.release()))
    t.start()
    for _ in range(1000):  # the waiter blocks without the GIL: this thread keeps running Python
        order.append("holder")
    lock.release()
    t.join(10)
    assert not t.is_alive() and order[-1] == "waiter" and order.count("holder") == 1000
