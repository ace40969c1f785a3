"""The runtime's contract on small cases: Coop's in-place check, RNG replay, BatchNorm state never
re-run, shape queries never restore, the too-small-budget error, disable() restoring everything."""
import gc

import pytest
import torch

import pymem
from pymem.testing import bitwise_equal

MiB = 1 << 20


def test_coop_recomputable_in_place(managed):
    pymem.enable(64 * MiB)
    x1 = torch.ones(100_000)
    x2 = x1 * -2
    x3 = x2 - 2
    x2.relu_()
    pymem.evict(x3)
    assert pymem.is_evicted(x3)
    assert torch.equal(x3, torch.full((100_000,), -4.0))  # from x2's value before relu_
    pymem.evict(x2)
    assert torch.equal(x2, torch.zeros(100_000))  # relu_ of -2
    assert pymem.memory_stats()["num_rematerializations"] >= 2


def test_views_share_the_pool_and_shape_queries_never_restore(managed):
    pymem.enable(64 * MiB)
    a = torch.arange(60_000, dtype=torch.float32)
    b = (a * 3).view(300, 200)
    t = b.t()
    ref = t.clone()
    pymem.evict(b)
    assert pymem.is_evicted(t)  # a view of the same storage
    assert t.shape == (200, 300) and t.stride() == (1, 200) and t.dtype == torch.float32
    assert pymem.is_evicted(b)  # the queries above did not restore it
    assert torch.equal(t[5], ref[5])
    assert not pymem.is_evicted(b)


def test_dropout_recomputes_with_its_original_rng_state(managed):
    pymem.enable(64 * MiB)
    torch.manual_seed(0)
    x = torch.ones(50_000)
    y = torch.nn.functional.dropout(x, 0.5, training=True)
    ref = y.clone()
    torch.rand(1000)  # move the generator on
    pymem.evict(y)
    assert torch.equal(y, ref)


def test_batchnorm_recompute_does_not_touch_running_stats(managed):
    pymem.enable(64 * MiB)
    torch.manual_seed(0)
    bn = torch.nn.BatchNorm1d(8)
    x = torch.randn(512, 8) * 3 + 1
    h = x * 2
    y = bn(h)
    ref, mean, var = y.clone(), bn.running_mean.clone(), bn.running_var.clone()
    pymem.evict(y)
    assert torch.equal(y, ref)
    assert torch.equal(bn.running_mean, mean) and torch.equal(bn.running_var, var)


def test_backward_accepts_restored_saved_tensors(managed):
    pymem.enable(64 * MiB)
    torch.manual_seed(0)
    w = torch.randn(256, 256, requires_grad=True)
    x = torch.randn(64, 256)
    h = torch.tanh(x @ w)  # tanh saves its output
    pymem.evict(h)
    h.sum().backward()
    g = w.grad.clone()
    pymem.disable()
    w2 = w.detach().clone().requires_grad_()
    torch.tanh(x @ w2).sum().backward()
    assert torch.equal(g, w2.grad)


def test_budget_too_small_names_the_op_and_keeps_tensors_valid(managed):
    pymem.enable(4 * MiB)
    a = torch.ones(256, 1024)  # 1 MiB each
    b = a + 1
    c = b * 2
    pymem.evict(c)
    with pytest.raises(pymem.OutOfBudgetError, match=r"aten\.cat\.default needs 3145728 B more while its "
                                                    r"inputs \(2097152 B\) are held") as info:
        torch.cat([a, b, a])  # 3 MiB out + 2 MiB of inputs > 4 MiB
    assert info.value.op == "aten.cat.default" and info.value.requested == 3 * MiB
    assert isinstance(info.value, torch.OutOfMemoryError)
    assert "no owner" not in str(info.value)  # the runtime keeps no arena owners: no such count
    pymem.disable()  # restores c with PyTorch's own allocator
    assert torch.equal(c, torch.full((256, 1024), 4.0))
    assert torch.equal(b, torch.full((256, 1024), 2.0))


def test_evicted_inputs_of_a_failed_op_stay_valid(managed):
    pymem.enable(4 * MiB)
    a = torch.ones(256, 1024)
    b = a * 3
    pymem.evict(b)
    with pytest.raises(pymem.OutOfBudgetError):
        torch.cat([b, b, b, b, b])
    assert torch.equal(b, torch.full((256, 1024), 3.0))


def test_an_input_that_cannot_be_recomputed_in_the_budget_names_the_op(managed):
    pymem.enable(4 * MiB)
    a = torch.ones(256, 1024)  # 1 MiB each
    b = a * 3
    pymem.evict(b)
    with pymem.no_recompute():  # leaves: never released, so b's recompute finds no room
        x, y = torch.zeros(256, 1024), torch.zeros(256, 1024)
    with pytest.raises(pymem.OutOfBudgetError, match=r"aten\.add\.Tensor needs 1 evicted input\(s\) back "
                                                    r"\(1048576 B\), and recomputing them does not fit") as info:
        b + 1
    assert info.value.op == "aten.add.Tensor"
    del x, y
    assert torch.equal(b, torch.full((256, 1024), 3.0))  # and now it fits


def test_enable_errors(managed):
    with pytest.raises(ValueError, match="unknown policy 'best'; accepted: coop, dtr"):
        pymem.enable(MiB, policy="best")
    with pytest.raises(ValueError, match="device 'xla' is not accepted; accepted: 'cpu', 'cuda', 'cuda:N'"):
        pymem.enable(MiB, device="xla")
    with pytest.raises(ValueError, match="budget '1 gigabyte' is not accepted: expected an int of bytes"):
        pymem.enable("1 gigabyte")
    with pytest.raises(ValueError, match=r"host_budget 'lots' is not accepted: expected .* \(None: no cap\)"):
        pymem.enable(MiB, host_budget="lots")
    rt = pymem.enable(MiB)
    assert pymem.enable("1MiB") is rt  # the same settings: a no-op
    with pytest.raises(RuntimeError, match=r"already enabled with budget=1048576 B, policy='dtr', device='cpu', "
                                           r"allocator='arena', sampling=False, cost=None, offload=None, prefetch=True, plan='auto', host_budget=None, offload_leaves=None, verify=False; call pymem.disable\(\) before "
                                           r"enabling it with budget=2097152 B"):
        pymem.enable(2 * MiB)
    assert pymem.is_enabled()
    pymem.disable()
    assert not pymem.is_enabled()


def test_an_optimizer_step_makes_leaves(managed):
    """A parameter made from a recomputable op (randn) is recomputable until an optimizer's step
    writes it: from then on it is state (a leaf), never evicted, though the step runs under no_grad
    like inference does."""
    pymem.enable(64 * MiB)
    p = torch.nn.Parameter(torch.randn(100, 100))
    pymem.evict(p)  # recomputable so far: the randn replays with its generator state
    want = p.detach().clone()
    opt = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    (p * p).sum().backward()
    opt.step()
    assert torch.equal(p.detach(), want - 0.1 * 2 * want)
    with pytest.raises(ValueError, match="has no recipe"):
        pymem.evict(p)
    with pytest.raises(ValueError, match="has no recipe"):
        pymem.evict(opt.state[p]["momentum_buffer"])  # made inside the step


def test_parameters_initialised_under_pymem_are_leaves(managed):
    """nn.init fills a fresh parameter in place under no_grad (uniform_): that is state being set,
    not a value computed, so the parameter is a leaf, as its later in-place updates keep it."""
    pymem.enable(64 * MiB)
    lin = torch.nn.Linear(64, 64)
    for p in (lin.weight, lin.bias):
        with pytest.raises(ValueError, match="has no recipe"):
            pymem.evict(p)


def test_no_recompute_makes_leaves(managed):
    pymem.enable(64 * MiB)
    a = torch.ones(1000)
    with pymem.no_recompute():
        b = a * 2
        with torch.no_grad():
            c = b + 1
    d = b * 3
    with pytest.raises(ValueError, match="has no recipe"):
        pymem.evict(b)
    with pytest.raises(ValueError, match="has no recipe"):
        pymem.evict(c)
    pymem.evict(d)  # outside the block: recomputable again
    assert torch.equal(d, torch.full((1000,), 6.0))
    pymem.disable()
    with pymem.no_recompute():  # not enabled: nothing to do
        pass


def test_no_grad_outputs_are_recomputable(managed):
    """Inference (no_grad, inference_mode) gets recipes like a forward pass: its values are evicted
    and recomputed bitwise, including those written in place."""
    pymem.enable(64 * MiB)
    w = torch.randn(64, 64)
    x = torch.randn(8, 64)
    for ctx in (torch.no_grad, torch.inference_mode):
        with ctx():
            h = (x @ w).relu_()
            y = torch.tanh(h) + h
            want = (h.clone(), y.clone())
            pymem.evict(h)
            pymem.evict(y)
            assert pymem.is_evicted(h) and pymem.is_evicted(y)
            assert torch.equal(y, want[1]) and torch.equal(h, want[0])


def test_an_input_no_tensor_holds_is_freed_with_the_recipes_that_read_it(managed):
    """An evaluation loop keeps each batch's (small) outputs: unmanaged, each (large) batch is freed
    once the loop moves on. The recipes of the kept outputs must not hold the batches: once only
    recipes hold a batch, the outputs become leaves and the batch is freed."""
    rt = pymem.enable(64 * MiB)
    w = torch.randn(4096, 4)
    kept = []
    with torch.no_grad():
        for i in range(64):
            with pymem.no_recompute():  # a leaf, as a batch copied in from host memory is
                batch = torch.full((256, 4096), float(i))  # 4 MiB each: 256 MiB if all were kept
            kept.append(batch @ w)  # 4 KiB
        del batch
    rt.sweep()
    assert pymem.memory_stats()["num_orphaned_leaves"] >= 63
    assert pymem.memory_stats()["allocated_bytes.current"] < 8 * MiB
    for i, k in enumerate(kept):
        assert torch.equal(k, torch.full((256, 4096), float(i)) @ w)
    with pytest.raises(ValueError, match="has no recipe"):
        pymem.evict(kept[0])  # a leaf now: its input is gone


def test_freeing_one_input_lets_the_sweep_free_the_next(managed):
    """Dropping A's readers' recipes (A's storage freed) makes Y a leaf, so B, read by Y and W, pins no
    more than it frees once only W (64 B) still reads it: the same sweep frees both, as it would
    one leaf at a time (the C++ filter decides on the graph before any drop)."""
    rt = pymem.enable(64 * MiB)
    with torch.no_grad():
        with pymem.no_recompute():
            a = torch.full((256, 1024), 1.0)   # 1 MiB leaf, older than b
            b = torch.full((16384,), 2.0)      # 64 KiB leaf
        y = a[:128] * b[:1024]                 # 512 KiB, reads a and b
        w = b[:16] * 3                         # 64 B, reads b only
        del a, b
    before = pymem.memory_stats()["num_orphaned_leaves"]
    rt.sweep()
    assert pymem.memory_stats()["num_orphaned_leaves"] - before == 2
    rt.sweep()
    assert pymem.memory_stats()["num_orphaned_leaves"] - before == 2
    assert torch.equal(y, torch.full((128, 1024), 2.0)) and torch.equal(w, torch.full((16,), 6.0))


def test_an_input_read_by_larger_kept_values_stays(managed):
    """The other way round: a small input whose kept outputs are larger stays held by their recipes
    (freeing it would make the outputs leaves, pinning more than it frees); they stay evictable."""
    rt = pymem.enable(64 * MiB)
    with torch.no_grad():
        with pymem.no_recompute():
            x = torch.randn(64)
        big = x.repeat(4096)  # 1 MiB from 256 B
        del x
    rt.sweep()
    assert pymem.memory_stats()["num_orphaned_leaves"] == 0
    want = big.clone()
    pymem.evict(big)
    assert torch.equal(big, want)


def test_a_chain_that_keeps_growing_is_cut(managed, monkeypatch):
    """A loop that extends one value for ever (a generation loop's KV cache) would keep every op it
    ran reachable through the recipes: past the depth limit, an op's outputs are leaves."""
    import gc

    from pymem.runtime import records, runtime
    monkeypatch.setattr(runtime, "_DEPTH_LIMIT", 50)
    rt = pymem.enable(64 * MiB)
    cache = torch.zeros(16)
    with torch.no_grad():
        for i in range(500):
            cache = torch.cat([cache[1:], (cache[-1:] + i)])
    rt.sweep()  # dead storages' records leave the table
    gc.collect()
    assert sum(isinstance(o, records.Record) for o in gc.get_objects()) < 200  # 1000 without the limit
    assert torch.equal(cache, torch.cumsum(torch.arange(500.0), 0)[-16:])


@pytest.mark.parametrize("policy", ["dtr", "dtr-local", "lru", "size", "msps", "coop"])
def test_every_policy_keeps_a_chain_bitwise_equal_under_pressure(managed, policy):
    def chain():
        torch.manual_seed(0)
        w = torch.randn(128, 128, requires_grad=True)
        x = torch.randn(512, 128)
        for _ in range(12):
            x = torch.tanh(x @ w)
        x.sum().backward()
        return w.grad.clone()

    ref = chain()
    pymem.enable(3 * MiB, policy=policy)  # 12 saved 256 KiB activations and more do not fit
    got = chain()
    stats = pymem.memory_stats()
    pymem.disable()
    assert torch.equal(ref, got)
    assert stats["num_evictions"] > 0 and stats["num_rematerializations"] > 0
    assert stats["allocated_bytes.peak"] <= stats["budget_bytes"]


def test_overwriting_a_leaf_keeps_evicted_dependents_right(managed):
    w = torch.rand(1 << 16)  # made before enable: no recipe, like a parameter
    pymem.enable(64 * MiB)
    y = w * 2
    want = y.clone()
    pymem.evict(y)
    w.add_(1.0)  # what optimizer.step() does to a parameter
    assert torch.equal(y, want)
    z = w * 3
    pymem.evict(z)
    with torch.no_grad():
        w.mul_(2)
    assert torch.equal(z, (w / 2) * 3)


def test_a_leaf_larger_than_its_evicted_dependents_restores_them_instead_of_copying(managed):
    w = torch.rand(1 << 16)
    pymem.enable(64 * MiB)
    y = w[:1000] * 2  # 4 kB of dependents, 256 kB of leaf: restoring y is cheaper than a copy of w
    want = y.clone()
    pymem.evict(y)
    w.add_(1.0)
    assert not pymem.is_evicted(y) and torch.equal(y, want)  # restored before w changed
    assert pymem.memory_stats()["num_leaf_copies"] == 0


def test_logits_kept_across_the_optimizer_step_come_back_with_the_old_weights(managed):
    """A training step keeps its logits in a local while the optimizer updates the weights: the
    weights' old values are kept aside for the logits' recipe instead of recomputing the forward
    pass before the update; reading the logits afterwards gives the values computed before it."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(512, 64)
    pymem.enable(64 * MiB)
    logits = model(x)
    want = logits.detach().clone()
    logits.square().mean().backward()
    pymem.evict(logits)
    rematerialized = pymem.memory_stats()["num_rematerializations"]
    opt.step()
    s = pymem.memory_stats()
    assert s["num_leaf_copies"] > 0
    assert s["num_rematerializations"] == rematerialized  # nothing recomputed for the update
    assert pymem.is_evicted(logits)
    assert torch.equal(logits, want)  # recomputed from the old weights
    assert not torch.equal(model(x), want)  # the model itself did change


def test_a_leaf_storage_resized_outside_any_op_keeps_its_dependents_right(managed):
    """FSDP frees a parameter's storage after forward (UntypedStorage.resize_(0), no aten op) and
    regrows it before backward, uninitialised until its all-gather fills it. Recipes that read the
    parameter must not recompute from the freed or regrown bytes: the value they read is kept."""
    w = torch.rand(1 << 16)  # a parameter: made before enable, no recipe
    pymem.enable(64 * MiB)
    evicted = w * 2
    resident = w + 1
    want = (evicted.clone(), resident.clone())
    pymem.evict(evicted)
    storage = w.untyped_storage()
    nbytes = storage.nbytes()
    storage.resize_(0)
    storage.resize_(nbytes)  # garbage, as FSDP's alloc_storage leaves it
    with torch.no_grad():
        w.fill_(float("nan"))  # not the old value
    pymem.evict(resident)
    assert torch.equal(evicted, want[0]) and torch.equal(resident, want[1])
    assert pymem.memory_stats()["num_leaf_copies"] == 1
    assert torch.UntypedStorage.resize_ is not torch._C.StorageBase.resize_
    pymem.disable()
    assert torch.UntypedStorage.resize_ is torch._C.StorageBase.resize_  # unwrapped


def test_free_bytes_that_cover_a_request_are_slid_together_not_released_for(managed):
    """A request that the free bytes cover, only not in one block (the program freed every other
    tensor), is placed by moving blocks: releasing a value would cost a recompute where a move
    costs one copy. Fixed costs (a matmul's recompute far dearer than a copy of its output):
    measured ones put a cheap op's rerun and a copy of its bytes within each other's noise (under
    ASan the choice went either way)."""
    from pymem.cost_model import CostModel
    n = 65_536  # 256 KiB per tensor: above the small-region threshold
    nbytes = 4 * n
    x = torch.randn(n)  # made before enable: outside the budget
    ws = [torch.randn(256, 256) for _ in range(8)]
    pymem.enable(8 * nbytes + 40 * 1024, policy="dtr", cost=CostModel(1e9, 1e10, 1e-6))  # + the small region
    ts = [x.view(256, 256).mm(ws[i]) for i in range(8)]  # the budget full of recomputable values
    assert pymem.memory_stats()["num_evictions"] == 0
    for i in (1, 3, 5):
        ts[i] = None
    arena = pymem.current().arena
    assert arena.main_free_bytes >= 2 * nbytes > arena.largest_free_block  # scattered
    big = torch.cat([x, x])
    st = pymem.memory_stats()
    assert st["num_evictions"] == 0 and st["num_compactions"] == 1 and st["moved_bytes"] > 0
    assert st["allocated_bytes.peak"] <= st["budget_bytes"]
    assert torch.equal(big, torch.cat([x, x]))
    for i in (0, 2, 4, 6, 7):
        assert torch.equal(ts[i], x.view(256, 256).mm(ws[i]))


@pytest.mark.parametrize("small", [1, 2])
def test_a_compaction_is_weighed_with_the_cost_models_launch_for_every_block_it_moves(managed, small):
    """Free bytes in holes between small leaves: sliding the leaves aside or releasing R (beside the
    last hole) both make room for a 2 MiB tensor. With a cost model each block moved is a copy with
    the launch that R's recompute estimate holds too: one block slides, two cost more than R's
    recompute and R is released (priced by bytes alone, two blocks slid as well)."""
    from pymem.cost_model import CostModel
    hole = (2 * MiB + 200 * 1024) // (small + 1) // 512 * 512
    source = torch.randn(3 * MiB // 8)  # 1.5 MiB, made before enable: outside the budget
    main = (small + 1) * hole + small * 64 * 1024 + 3 * MiB // 2 + 100 * 1024
    pymem.enable(main * 256 // 255 + 8192, policy="dtr", plan="off", cost=CostModel(1e12, 1e12, 1e-3))
    holes, leaves = [], []
    for i in range(small + 1):
        if i:
            with pymem.no_recompute():
                leaves.append(torch.full((16 * 1024,), float(i)))  # 64 KiB, never released
        holes.append(source.new_empty(hole // 4).fill_(1.0))
    r = source * 2
    del holes
    before = pymem.memory_stats()
    big = torch.zeros(MiB // 2)  # 2 MiB
    st = pymem.memory_stats()
    if small == 1:
        assert st["num_compactions"] - before["num_compactions"] == 1 and st["num_evictions"] == 0, st
    else:
        assert st["num_evictions"] - before["num_evictions"] == 1 and pymem.is_evicted(r), st
    assert st["allocated_bytes.peak"] <= st["budget_bytes"]
    del big
    assert torch.equal(r, source * 2)
    for i, leaf in enumerate(leaves):
        assert torch.equal(leaf, torch.full((16 * 1024,), float(i + 1)))


def test_an_input_a_pending_recompute_waits_for_is_moved_aside_not_released(managed):
    """Bringing t = a + b[:n] back recomputes a, then b. For b only a, which t's recompute still
    reads, is left to release, and the free bytes cover b in two holes: a is slid aside, since
    releasing it would recompute it once more right away."""
    n = 65_536  # 256 KiB per unit: above the small-region threshold
    unit = 4 * n
    pymem.enable(5 * unit * 256 // 255 + 4096, policy="dtr")  # 5 units in the main region
    with pymem.no_recompute():
        x = torch.randn(n)  # a leaf: stays, and is read (cannot move) while b is recomputed
    a = x * 2
    b = torch.cat([x, x])  # 2 units
    t = a + b[:n]
    z = torch.cat([x, x, x, x])  # 4 units: a, b and t go
    assert all(pymem.is_evicted(v) for v in (a, b, t))
    del z
    y = torch.cat([x, x[: n // 2]])  # 1.5 units beside x: after a comes back, 1.5 units are free
    before = pymem.memory_stats()
    total = t.sum()
    st = pymem.memory_stats()
    assert st["num_rematerializations"] - before["num_rematerializations"] == 3  # a, b and t, once each
    assert st["num_compactions"] - before["num_compactions"] == 1 and st["moved_bytes"] > 0
    assert st["allocated_bytes.peak"] <= st["budget_bytes"]
    assert pymem.is_evicted(y)
    del y
    assert torch.equal(t, x * 2 + x) and torch.equal(total, t.sum())


def test_scattered_leaves_are_moved_to_fit_a_large_request(managed):
    """Leaves (state made under pymem.no_recompute) between evictable values split the free bytes; the request
    fits only if the leaves move. Their values, and the recomputed ones, must survive the move."""
    n = 65_536  # 256 KiB per tensor: above the small-region threshold
    nbytes = 4 * n
    pymem.enable(10 * nbytes + 16 * 1024 + 512, policy="dtr")  # + the small region (budget / 256)
    x = torch.randn(n)
    leaves, acts = [], []
    for i in range(4):
        with pymem.no_recompute():
            leaves.append(torch.full((n,), float(i)))  # state: never evicted
        acts.append(x * (i + 2))                       # recomputable
    big = torch.cat([x, x, x])                         # 3 tensors' worth in one block
    assert all(torch.equal(big[k * n:(k + 1) * n], x) for k in range(3))
    st = pymem.memory_stats()
    assert st["num_evictions"] >= 2 and st["num_compactions"] >= 1 and st["moved_bytes"] > 0
    # Only the run of blocks that gathers the free bytes slides (2 tensors), not everything below
    # the topmost hole (5).
    assert st["moved_bytes"] <= 2 * nbytes, st["moved_bytes"] / nbytes
    assert st["allocated_bytes.peak"] <= st["budget_bytes"]
    del big  # (its bytes are checked below against x, slice by slice)
    for i in range(4):
        assert torch.equal(leaves[i], torch.full((n,), float(i)))
        assert torch.equal(acts[i], x * (i + 2))


def test_bookkeeping_stays_bounded_over_many_steps(managed):
    """Values that die are forgotten: the table and DTR's evicted neighbourhood do not grow with the
    number of training steps (a long run must not leak host memory). Both are swept periodically,
    so their sizes are sawtooth: compare the peaks of two windows of 150 steps."""
    torch.manual_seed(0)
    rt = pymem.enable(768 << 10)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(6)])
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(512, 64)
    early, late = [0, 0], [0, 0]
    for step in range(400):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        if step >= 100:
            w = early if step < 250 else late
            w[0], w[1] = max(w[0], len(rt.table)), max(w[1], len(rt.residency.neighbourhood))
    assert rt.residency.num_evictions > 400, "the budget must force evictions every step"
    assert late[0] <= early[0] + 64, (early, late)
    assert late[1] <= 1.25 * early[1] + 64, (early, late)


def test_candidate_sampling_scores_about_sqrt_n_candidates(managed):
    from pymem.policies.heuristics import DTRLocal

    class Counting(DTRLocal):
        calls = 0

        def evaluate(self, t, now):
            Counting.calls += 1
            return super().evaluate(t, now)

    def run(sampling):
        Counting.calls = 0
        rt = pymem.enable(4 * MiB, policy=Counting(), sampling=sampling)
        x = torch.ones(16_384, requires_grad=True)  # 64 KiB values
        keep = [x * i for i in range(100)]          # 6.4 MiB of recomputable values in 4 MiB
        evictions = rt.residency.num_evictions
        assert all(torch.equal(k, torch.full((16_384,), float(i))) for i, k in enumerate(keep))
        pymem.disable()
        return Counting.calls / evictions

    full, sampled = run(False), run(True)  # scores per eviction (compaction plans score too)
    assert sampled < full / 4, (full, sampled)


def test_the_heap_is_frozen_for_the_collector_while_enabled_and_thawed_after():
    """pymem's per-op objects make the cyclic collector run; frozen, the objects from before enable
    (torch's modules) are not walked by each full collection. A program's own freeze is left alone."""
    assert gc.get_freeze_count() == 0
    pymem.enable("64MB", device="cpu")
    try:
        assert gc.get_freeze_count() > 0
    finally:
        pymem.disable()
    assert gc.get_freeze_count() == 0
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        pymem.enable("64MB", device="cpu")
        pymem.disable()
        assert gc.get_freeze_count() == frozen
    finally:
        gc.unfreeze()
    pymem.enable("64MB", device="cpu")  # the program freezes too while pymem runs (before a fork)
    try:
        gc.freeze()
    finally:
        pymem.disable()
    try:
        assert gc.get_freeze_count() > 0  # its freeze stays
    finally:
        gc.unfreeze()


def test_a_model_of_small_tensors_trains_bitwise_below_its_peak():
    """4 KiB activations are below the arena's small-block threshold; once the small region is full
    they lie in the main region, and must be releasable there, or such a model can release nothing
    (before: OutOfBudgetError even at its own peak)."""
    def run():
        torch.manual_seed(0)
        w = torch.randn(16, 16, requires_grad=True)
        h = torch.randn(64, 16)
        for _ in range(64):
            h = torch.tanh(h @ w)  # 64x16 float32: 4 KiB
        h.sum().backward()
        return w.grad

    want = run()
    from pymem import _C
    arena = _C.Arena(1 << 26, backing="host", small_threshold=0)  # the unmanaged peak, one region
    _C.install_cpu_hook(arena)
    try:
        run()
        peak = arena.stats()["allocated_bytes.peak"]
    finally:
        _C.uninstall_cpu_hook()
    pymem.enable(int(peak * 0.6), device="cpu")
    try:
        got = run()
        st = pymem.memory_stats()
    finally:
        pymem.disable()
    assert st["num_evictions"] > 0 and st["allocated_bytes.peak"] <= st["budget_bytes"]
    assert bitwise_equal(got, want)


def test_the_blocks_that_may_move_are_the_values_in_memory_nothing_holds_in_place(managed):
    """compaction.movable_blocks (csrc/movable.h): a value in memory may move, and be released when
    it has a recipe and no op holds it; a leaf may move but not be released (offloading off); a
    value pinned outside torch, an evicted one and a running kernel's input do not move."""
    from pymem.runtime.compaction import movable_blocks

    rt = pymem.enable(64 * MiB, device="cpu", offload="never")
    with pymem.no_recompute():
        x = torch.ones(MiB // 4).requires_grad_()  # a leaf: no recipe
    y, pinned, locked, evicted, running = (x * k for k in (2, 3, 4, 5, 6))

    def record(t):
        return rt.table[pymem._C.storage_key(t)]

    addr = {name: t.untyped_storage().data_ptr() for name, t in
            [("x", x), ("y", y), ("pinned", pinned), ("locked", locked), ("running", running)]}
    gone = record(evicted)
    record(pinned).pins += 1
    record(locked).locks += 1
    rt.running.append((record(running),))
    rt.residency.release(gone)
    try:
        m = movable_blocks(rt)
        assert m[addr["y"]][0] is record(y) and m[addr["y"]][1] is record(y).sref and m[addr["y"]][2] is True
        assert m[addr["x"]][0] is record(x) and m[addr["x"]][2] is False  # a leaf, and leaves stay
        assert m[addr["locked"]][2] is False  # moves, is not released
        assert addr["pinned"] not in m and addr["running"] not in m
        assert all(entry[0] is not gone for entry in m.values())
        # What the moves-only question reads (compact_for with `worth`): the same blocks' addresses.
        addrs = pymem._C.movable_addresses(rt.table, rt.cache, rt.lo, rt.main_hi, [addr["running"]])
        assert sorted(addrs) == sorted(m)
    finally:
        rt.running.pop()
        record(pinned).pins -= 1
        record(locked).locks -= 1


def _holed_region():
    """pymem at 24 MiB with its main region filled by 1 MiB tensors, every other one then freed:
    1 MiB holes between live blocks. The tensors (None where freed) hold their index."""
    rt = pymem.enable(24 * MiB, device="cpu", offload="never")
    with pymem.no_recompute():
        ts = []
        while rt.arena.main_free_bytes >= MiB:
            ts.append(torch.full((MiB // 4,), float(len(ts))))
    for i in range(0, len(ts), 2):
        ts[i] = None
    return rt, ts


def _assert_intact(ts):
    for i, t in enumerate(ts):
        assert t is None or torch.equal(t, torch.full((MiB // 4,), float(i)))


def test_a_value_that_dies_between_the_compaction_plan_and_its_moves_leaves_it_to_be_planned_again(managed):
    """The moves-only compaction (compact_for with `worth`) lists the blocks that may move after
    planning over their addresses. A value collected in between (a garbage collection while the plan
    is priced, or while the blocks are listed) is missing from the list: the plan is stale and is
    made again, where CI's FSDP run raised KeyError from inside an op's allocation."""
    from pymem.runtime.compaction import MovableAddresses, compact_for

    rt, ts = _holed_region()
    request = 4 * MiB  # fits in the free bytes, in no one hole (nor in one the victim leaves)
    picture = MovableAddresses(rt)
    planned = rt.arena.plan_moves(request, picture.addresses)
    assert planned is not None and planned[3] > 0  # the same plan compact_for makes
    victim = next(i for i, t in enumerate(ts) if t is not None and t.untyped_storage().data_ptr() in planned[0])

    def worth(moved, blocks):
        ts[victim] = None  # collected between the plan and the moves
        return True

    assert compact_for(rt, request, worth, picture)  # the arena asks again
    assert compact_for(rt, request, lambda moved, blocks: True)  # a fresh picture moves
    assert rt.arena.stats()["largest_free_block"] >= request
    _assert_intact(ts)


def test_the_slide_after_a_kernels_failure_skips_a_value_collected_since_the_blocks_were_listed(managed, monkeypatch):
    """defragment_after_failure slides every block that may move; one collected between the listing
    and the slide (its block already free) is left out, not held (before: RuntimeError, the storage
    is dead, raised from inside the failed kernel's retry)."""
    from pymem.runtime import compaction

    rt, ts = _holed_region()
    listed = compaction.movable_blocks

    def listed_then_collected(rt_):
        blocks = listed(rt_)
        ts[3] = None  # a collection right after the listing
        return blocks

    monkeypatch.setattr(compaction, "movable_blocks", listed_then_collected)
    assert compaction.defragment_after_failure(rt)
    st = rt.arena.stats()
    assert st["largest_free_block"] >= rt.arena.main_free_bytes  # the main region's free bytes in one block
    _assert_intact(ts)
