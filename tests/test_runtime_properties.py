"""Random programs under the runtime compute bitwise what they compute without it.

Hypothesis draws short programs over a few tensors: functional ops, in-place ops (whole tensors
and through views), dropout, matmul, cat of views, a broadcast reduction, optimizer-style updates
of the leaves, explicit evictions, and dropping tensors; then a backward pass. Run once plainly and once under a budget that forces
evictions, every live tensor and every leaf gradient must be equal bit for bit, and the arena's
peak must stay within the budget.
"""
import gc

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, reject, settings
from hypothesis import strategies as st

import pymem

N = 72  # 72 x 72 float32 = 20.25 KiB per tensor: above the arena's small-region threshold
SLOTS = 6
TENSOR_BYTES = N * N * 4

slot = st.integers(0, SLOTS - 1)
step = st.one_of(
    st.tuples(st.just("binary"), st.sampled_from(["add", "mul", "sub"]), slot, slot, slot),
    st.tuples(st.just("unary"), st.sampled_from(["relu", "tanh", "sigmoid"]), slot, slot),
    st.tuples(st.just("inplace"), st.sampled_from(["add_", "mul_", "relu_"]), slot, slot),
    st.tuples(st.just("view_inplace"), slot, st.integers(1, N - 1)),
    st.tuples(st.just("transpose"), slot, slot),
    st.tuples(st.just("dropout"), slot, slot),
    st.tuples(st.just("matmul"), slot, slot, slot),
    st.tuples(st.just("cat"), slot, slot, slot),
    st.tuples(st.just("center"), slot, slot),
    st.tuples(st.just("leaf_update"), st.integers(0, 1)),
    st.tuples(st.just("evict"), slot),
    st.tuples(st.just("drop"), slot),
)


def run(program, managed: bool):
    """Returns (live tensors, leaf grads, leaf values) of ``program``; evictions only if managed."""
    torch.manual_seed(0)
    with torch.no_grad():
        leaves = [torch.randn(N, N) / 4, torch.randn(N, N) / 4]
    for w in leaves:
        w.requires_grad_(True)
    xs = [leaves[i % 2] * (i + 1) for i in range(SLOTS)]  # recomputable values
    for s in program:
        kind = s[0]
        if kind == "binary":
            _, op, d, i, j = s
            xs[d] = getattr(torch, op)(xs[i], xs[j])
        elif kind == "unary":
            _, op, d, i = s
            xs[d] = getattr(torch, op)(xs[i])
        elif kind == "inplace":
            _, op, d, i = s
            t = xs[d].clone()  # in place on a fresh value, never on one autograd saved
            getattr(t, op)(xs[i]) if op != "relu_" else t.relu_()
            xs[d] = t
        elif kind == "view_inplace":
            _, d, k = s
            t = xs[d].clone()
            t[:, :k].mul_(0.5)
            t.narrow(0, 0, k).add_(1.0)
            xs[d] = t
        elif kind == "transpose":
            _, d, i = s
            xs[d] = xs[i].t().contiguous()
        elif kind == "dropout":
            _, d, i = s
            xs[d] = F.dropout(xs[i], 0.5, training=True)
        elif kind == "matmul":
            _, d, i, j = s
            xs[d] = (xs[i] @ xs[j]) / N
        elif kind == "cat":  # views of two values, joined
            _, d, i, j = s
            xs[d] = torch.cat([xs[i][:, : N // 2], xs[j][:, N // 2:]], 1)
        elif kind == "center":  # a reduction broadcast back
            _, d, i = s
            xs[d] = xs[i] - xs[i].mean(0, keepdim=True)
        elif kind == "leaf_update":
            with torch.no_grad():
                leaves[s[1]].mul_(0.9).add_(0.01)  # what an optimizer does between steps
        elif kind == "evict":
            if managed:
                r = pymem.current().table.get(pymem._C.storage_key(xs[s[1]]))
                if r is not None and r.recipe is not None and not r.evicted and r.locks == 0:
                    pymem.evict(xs[s[1]])
        elif kind == "drop":
            xs[s[1]] = leaves[s[1] % 2] + 0.0
    loss = sum((x * (k + 1)).sum() for k, x in enumerate(xs))
    loss.backward()
    grads = [w.grad.clone() if w.grad is not None else torch.zeros(0) for w in leaves]  # unused leaf: none
    return [x.detach().clone() for x in xs], grads, [w.detach().clone() for w in leaves]


def unmanaged_peak(program) -> int:
    arena = pymem.Arena(256 << 20, small_threshold=0)  # counts every CPU allocation, evicts nothing
    pymem.install_cpu_hook(arena)
    try:
        run(program, managed=False)
        return arena.stats()["allocated_bytes.peak"]
    finally:
        pymem.uninstall_cpu_hook()
        gc.collect()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(program=st.lists(step, min_size=1, max_size=25), policy=st.sampled_from(["dtr", "lru", "coop"]),
       allocator=st.sampled_from(["arena", "native"]), sampling=st.booleans())
def test_random_programs_are_bitwise_equal_under_a_tight_budget(program, policy, allocator, sampling):
    want = run(program, managed=False)
    # 75% of the program's peak, plus the arena's small region: the pressure handler must release.
    budget = int(0.75 * unmanaged_peak(program)) // 512 * 512 + 64 * 1024
    pymem.enable(budget, policy=policy, allocator=allocator, sampling=sampling)
    try:
        got = run(program, managed=True)
        stats = pymem.memory_stats()
    except pymem.OutOfBudgetError:
        reject()  # what must stay (leaves, gradients, one op's working set) does not fit this budget
    finally:
        pymem.disable()
        gc.collect()
    for kind, a_list, b_list in zip(("value", "grad", "leaf"), want, got):
        for k, (a, b) in enumerate(zip(a_list, b_list)):
            assert torch.equal(a, b), f"{kind} {k} differs after {program}"
    assert stats["allocated_bytes.peak"] <= stats["budget_bytes"]
