"""PyTorch's own op database (OpInfo) under pymem: for every op with CPU samples, the outputs and
gradients of a run whose inputs and outputs were all evicted and recomputed are bitwise those of
the run without pymem.

Each sample (the first few per op, float32 and float64; the op's function, its in-place variant,
and its out= overload with out tensors of the right size or empty ones it must resize) runs unmanaged
twice (a sample whose two runs differ is nondeterministic, one that raises is rejected: both
skipped), then under pymem: every tensor argument is first made a recorded value (``leaf.clone()``
under grad mode, so it has a recipe), the op runs, every argument and output is evicted and read
back, all are evicted again, and backward runs against a fixed random cotangent (reading the op's
saved tensors, which are those evicted values). Outputs, the arguments' values after the op (an op
may write its arguments) and gradients are compared as raw bytes (NaN == NaN).

The small tests at the end pin what the sweep found, without the op database."""
import time
import warnings

import pytest
import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import pymem
from pymem import _C
from pymem.runtime.settings import check_intercept

_SAMPLES_PER_OP = 3
_BUDGET = 256 << 20  # OpInfo samples are small: nothing is evicted but what the test evicts
_SEED = 1234
_VARIANTS = ("function", "inplace", "out", "out_resize")
# Samples compared per variant and dtype at least (torch 2.13: about 1870, 370, 940, 940): a sweep
# that silently skips everything fails.
_MIN_COMPARED = {"function": 1500, "inplace": 300, "out": 800, "out_resize": 800}
# Uninitialized memory: no two runs need agree (their own OpInfo tests skip comparing values too).
_UNINITIALIZED = {"empty", "empty_like", "empty_strided", "empty_permuted", "new_empty", "new_empty_strided"}
# Results that any TorchDispatchMode changes by itself, pymem's included, evicting or not: ATen's
# isTensorSubclassLike() is true while a mode is active, and these take another path then (a known
# limit of a runtime built on a dispatch mode, not of eviction). Under the mode interception they are
# compared with a run under a pass-through mode instead, which still checks their eviction; the
# dispatcher interception is no mode, so they must equal the unmanaged run. (op, variants): why.
_MODE_CHANGES = {
    ("prod", ("function",)): "prod_backward takes prod_safe_zeros_backward (cumprod): other rounding",
    ("linalg.eig", ("function",)): "linalg_eig_backward skips its gauge check, which raises without a mode",
    ("masked_fill", ("function", "inplace")): "the value's grad sums where(mask, grad, 0): another order",
    ("linalg.cond", ("out", "out_resize")): "out= goes through _linalg_svd, div and copy_: other rounding",
    ("norm.nuc", ("out", "out_resize")): "out= goes through _linalg_svd, sum and copy_: other rounding",
    ("linalg.matrix_rank", ("out",)): "out= is never written under a mode: it keeps the zeros passed in",
    ("linalg.matrix_rank.hermitian", ("out",)): "as linalg.matrix_rank",
}
# Not compared at all under the mode interception: (op, variant): why.
_SKIP = {
    ("linalg.matrix_rank", "out_resize"): "out= is never written under a mode: resized, it holds garbage",
    ("linalg.matrix_rank.hermitian", "out_resize"): "as linalg.matrix_rank",
}


def _op_name(op) -> str:
    return op.name + ("." + op.variant_test_name if op.variant_test_name else "")


def _mode_changes(name: str, variant: str) -> bool:
    return check_intercept() == "mode" and any(op == name and variant in variants for op, variants in _MODE_CHANGES)


def _seed(n: int) -> None:
    torch.default_generator.manual_seed(n)  # torch.manual_seed also queues CUDA seeding, with a stack trace


def _bits(t):
    """A tensor's value as raw bytes (compared with torch.equal: NaN payloads included)."""
    t = t.detach()
    if t.layout != torch.strided:
        t = t.to_dense()
    if t.is_complex():
        t = torch.view_as_real(t)
    flat = torch.empty(t.numel(), dtype=t.dtype)  # fresh strides (contiguous() keeps odd ones of size-1 dims)
    flat.copy_(t.reshape(-1))
    return flat.view(torch.uint8) if t.dtype != torch.bool else flat


def _tensors(tree):
    return [x for x in pytree.tree_leaves(tree) if isinstance(x, torch.Tensor)]


def _make_leaves(sample):
    """The sample's tensors as fresh leaves (same values, strides and requires_grad), made outside
    pymem; tensors the sample shares stay shared."""
    leaves = {}

    def leaf(t):
        if id(t) not in leaves:
            with torch.no_grad():
                if t.layout == torch.strided:
                    x = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
                    x.copy_(t.detach())
                else:
                    x = t.detach().clone()
            leaves[id(t)] = x.requires_grad_(t.requires_grad)
        return leaves[id(t)]

    tree = (sample.input, sample.args, sample.kwargs)
    return pytree.tree_map_only(torch.Tensor, leaf, tree), list(leaves.values())


class _PassThrough(TorchDispatchMode):
    """A dispatch mode that only runs each op: what any mode, pymem's included, changes by itself."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _run(fn, leaf_tree, leaves, cotangents, managed):
    """One run: (outputs, arguments after the op, grads), all tensors read back as plain copies.
    ``cotangents``: None (first run: made here, returned), else the list to use. ``managed``: under
    pymem (enabled by the caller), evicting everything; "plain": under a pass-through mode."""
    if managed == "plain":
        with _PassThrough():
            return _run(fn, leaf_tree, leaves, cotangents, False)
    _seed(_SEED)
    args_map = {}

    def arg(t):  # a recorded value: under pymem it has a recipe, so evicting it means something
        if id(t) not in args_map:
            args_map[id(t)] = t.clone()
        return args_map[id(t)]

    with torch.enable_grad():
        inp, args, kwargs = pytree.tree_map_only(torch.Tensor, arg, leaf_tree)
        out = fn(inp, *args, **kwargs)
    outs = _tensors(out)
    ins = list(args_map.values())
    if managed:
        _evict_all(ins + outs)
    with torch.no_grad():
        got = [o.clone() for o in outs]
        after = [a.clone() for a in ins]
    diff_outs = [o for o in outs if o.requires_grad and (o.is_floating_point() or o.is_complex())
                 and o.layout == torch.strided]
    wrt = [x for x in leaves if x.requires_grad]
    made = cotangents is None
    if made:
        g = torch.Generator().manual_seed(_SEED)
        cotangents = [torch.randn(o.shape, dtype=o.dtype, generator=g) for o in diff_outs]
    grads = None
    if diff_outs and wrt and len(cotangents) == len(diff_outs):
        if managed:
            _evict_all(ins + outs)
        try:
            grads = torch.autograd.grad(diff_outs, wrt, cotangents, allow_unused=True)
        except (RuntimeError, NotImplementedError) as e:
            grads = e
        else:
            with torch.no_grad():
                grads = [None if x is None else x.clone() for x in grads]
    non_tensors = [repr(x) for x in pytree.tree_leaves(out) if not isinstance(x, torch.Tensor)]
    return (got, after, grads, non_tensors), cotangents


def _evict_all(tensors):
    rt = pymem.current()
    for t in tensors:
        if t.layout != torch.strided:
            continue  # sparse: no storage of its own, pymem does not record it
        if t.untyped_storage().nbytes() == 0:
            continue  # nothing to evict (and pymem.evict raises on a 0-byte storage: fixed apart)
        r = rt.table.get(_C.storage_key(t))
        if r is not None and r.recipe is not None and not r.evicted and r.locks == 0:
            pymem.evict(t)


def _differences(ref, got):
    """Names of the results of ``got`` that are not bitwise those of ``ref``."""
    out = []
    for kind, a, b in zip(("output", "argument", "grad"), ref[:3], got[:3]):
        if isinstance(a, Exception) or isinstance(b, Exception) or a is None or b is None:
            if type(a) is not type(b):
                out.append(f"{kind}s: {a!r:.80} vs {b!r:.80}")
            continue
        if len(a) != len(b):
            out.append(f"{kind}s: {len(a)} vs {len(b)}")
            continue
        for i, (x, y) in enumerate(zip(a, b)):
            if (x is None) != (y is None):
                out.append(f"{kind} {i}: None vs tensor")
            elif x is not None and (x.shape != y.shape or x.dtype != y.dtype or
                                    not torch.equal(_bits(x), _bits(y))):
                out.append(f"{kind} {i}")
    if ref[3] != got[3]:
        out.append("non-tensor outputs")
    return out


def _out_placeholders(fn, leaf_tree, resize):
    """out= tensors for the function's outputs: same shapes (zeros), or empty ones the op resizes."""
    with torch.no_grad():
        out = fn(*leaf_tree[:1], *leaf_tree[1], **leaf_tree[2])
    make = (lambda o: torch.empty(0, dtype=o.dtype)) if resize else torch.zeros_like
    if isinstance(out, torch.Tensor):
        return make(out)
    if isinstance(out, (tuple, list)) and out and all(isinstance(o, torch.Tensor) for o in out):
        return tuple(make(o) for o in out)
    return None


def _cases(op, dtype, variant, samples=_SAMPLES_PER_OP):
    """The samples of ``op``'s ``variant`` (one of _VARIANTS: "out" passes out= tensors of the right
    size, "out_resize" empty ones the op resizes) at ``dtype`` that run deterministically without
    pymem: [(name, fn, leaf_tree, leaves, reference results, cotangents)], and how many were skipped."""
    from torch.testing._internal.opinfo.core import SampleInput

    cases, skipped = [], 0
    out_kw = variant.startswith("out")
    fn = op.inplace_variant if variant == "inplace" else op
    op_name = _op_name(op)
    if op.name in _UNINITIALIZED or ((op_name, variant) in _SKIP and check_intercept() == "mode") or fn is None or (out_kw and not op.supports_out):
        return cases, skipped
    ref_mode = "plain" if _mode_changes(op_name, variant) else False
    requires_grad = op.supports_autograd and not out_kw  # out= refuses inputs that require grad
    _seed(0)
    try:  # the generator itself: op.sample_inputs's wrapper inspects the stack, for seconds per op
        sample_iter = iter(op.sample_inputs_func(op, "cpu", dtype, requires_grad))
    except Exception:
        return cases, skipped
    for n in range(samples):
        _seed(n)
        try:
            sample = next(sample_iter)
        except Exception:  # StopIteration, or a sample generator that fails on this build
            break
        leaf_tree, leaves = _make_leaves(sample)
        try:
            if out_kw:
                out = _out_placeholders(fn, leaf_tree, variant == "out_resize")
                if out is None:
                    skipped += 1  # no tensor outputs to pass as out=
                    continue
                leaf_tree, leaves = _make_leaves(SampleInput(sample.input, args=sample.args,
                                                             kwargs={**sample.kwargs, "out": out}))
            ref, cot = _run(fn, leaf_tree, leaves, None, ref_mode)
            ref2, _ = _run(fn, leaf_tree, leaves, cot, ref_mode)
        except Exception:
            skipped += 1  # the op itself rejects the sample
            continue
        if _differences(ref, ref2):
            skipped += 1  # nondeterministic without pymem
            continue
        cases.append((f"{op_name} ({variant}) {dtype} sample {n}", fn, leaf_tree, leaves, ref, cot))
    return cases, skipped


def check_ops(ops, dtype, variant="function"):
    """Failures (strings) of the ops' ``variant`` at ``dtype``; counts of samples compared and
    skipped. The references run first; then one runtime runs every sample (a process can install
    only so many arenas as the CPU allocator)."""
    cases, skipped = [], 0
    for op in ops:
        c, s = _cases(op, dtype, variant)
        cases += c
        skipped += s
    bad = []
    pymem.enable(_BUDGET, device="cpu")
    try:
        for case in cases:
            name, fn, leaf_tree, leaves, ref, cot = case
            try:
                got, _ = _run(fn, leaf_tree, leaves, cot, True)
            except Exception as e:
                bad.append((case, None, f"raised under pymem: {type(e).__name__}: {str(e)[:200]}"))
                continue
            diff = _differences(ref, got)
            if diff:
                bad.append((case, got, f"differs after eviction: {', '.join(diff)}"))
    finally:
        pymem.disable()
    failures = []
    for (name, fn, leaf_tree, leaves, ref, cot), got, what in bad:
        if got is not None:
            try:
                plain = _run(fn, leaf_tree, leaves, cot, "plain")[0]
                what += " (so does a pass-through dispatch mode)" if not _differences(plain, got) else ""
            except Exception:
                pass
        failures.append(f"{name}: {what}")
    return failures, len(cases), skipped


@pytest.fixture(scope="module")
def op_db():
    from torch.testing._internal.common_methods_invocations import op_db
    return op_db


@pytest.mark.slow
@pytest.mark.parametrize("variant", _VARIANTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_op_db_bitwise_after_eviction(op_db, dtype, variant):
    t0 = time.perf_counter()
    ops = [op for op in op_db if dtype in op.supported_dtypes("cpu")]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecations by the hundred
        failures, ran, skipped = check_ops(ops, dtype, variant)
    print(f"{dtype} {variant}: {len(ops)} ops, {ran} samples compared, {skipped} skipped, "
          f"{time.perf_counter() - t0:.1f} s")
    assert not failures, f"{len(failures)} failing samples:\n" + "\n".join(failures)
    assert ran >= _MIN_COMPARED[variant], f"only {ran} samples compared"


# ---------------------------------------------------------------- what the sweep found, pinned

@pytest.fixture
def managed():
    pymem.enable(_BUDGET, device="cpu")
    yield pymem.current()
    pymem.disable()


def _record(t):
    return pymem.current().table.get(_C.storage_key(t))


def test_hfft2_after_eviction(managed):
    """hfft2 / hfftn clone a conj() view of their c2c result: the clone's recipe must read the
    argument through the conjugate bit, or its recompute gives the unconjugated value."""
    torch.manual_seed(0)
    x0 = torch.randn(5, 6, 7)
    pymem.disable()
    ref = torch.fft.hfft2(x0.clone(), s=(3, 10), dim=(1, 2), norm="ortho")
    pymem.enable(_BUDGET, device="cpu")
    with torch.enable_grad():
        x = x0.clone()
        y = torch.fft.hfft2(x, s=(3, 10), dim=(1, 2), norm="ortho")
    _evict_all([x, y])
    assert pymem.is_evicted(y)
    assert torch.equal(_bits(y), _bits(ref))


@pytest.mark.parametrize("view", ["conj", "neg"])
def test_math_bit_views_recompute(managed, view):
    """A conj() / _neg_view() argument keeps its bytes as they were; its lazy bit says how to read
    them. A recipe's argument views (a record's, a leaf's) carry the bits."""
    base = torch.randn(64, dtype=torch.complex64)
    with torch.enable_grad():
        for src in (base, base * 1):  # a leaf, a recorded value
            v = src.conj() if view == "conj" else torch._neg_view(src)
            y = v * 2
            ref = (src.resolve_conj().conj() if view == "conj" else -src) * 2
            _evict_all([src, y])
            assert torch.equal(_bits(y), _bits(ref))


def test_out_resized_becomes_a_leaf_of_its_new_size(managed):
    """An out= op that resizes its output (here from 0 bytes) changes the storage's size: its record
    is replaced by a leaf of the new size (a replay on the old, empty buffer gave 0 bytes, and reading
    them back crashed)."""
    a = torch.randn(40, 50)
    with torch.enable_grad():
        out = torch.empty(0).clone()  # recorded, with a recipe, 0 bytes
        torch.sum(a * 1, dim=0, out=out)
    r = _record(out)
    assert r.recipe is None and r.nbytes == out.untyped_storage().nbytes() == 200
    assert torch.equal(out, a.sum(0))


def test_in_place_op_that_grows_its_self(managed):
    """addbmm_ on a broadcast self of one element resizes it to the result's shape."""
    torch.manual_seed(0)
    b1, b2 = torch.randn(5, 5, 5), torch.randn(5, 5, 10)
    pymem.disable()
    ref = torch.ones(1).addbmm_(b1, b2)
    pymem.enable(_BUDGET, device="cpu")
    with torch.enable_grad():
        x = torch.ones(1) * 1
        x.addbmm_(b1 * 1, b2 * 1)
        y = x * 2
    assert _record(x).recipe is None and _record(x).nbytes == 200
    _evict_all([x, y])
    assert torch.equal(y, ref * 2) and torch.equal(x, ref)


def test_resize_grows_the_storage(managed):
    """resize_ (an inplace_view op: it writes no byte) may still give the storage a larger buffer."""
    with torch.enable_grad():
        x = torch.arange(4.0) * 1
        x.resize_(100)
    r = _record(x)
    assert r.recipe is None and r.nbytes == 400
    assert torch.equal(x[:4], torch.arange(4.0))


def test_native_batch_norm_out_updates_running_stats(managed):
    """native_batch_norm.out, like .default, updates running_mean / running_var in training mode
    though its schema marks them read-only: they are written values, not their old recipes."""
    torch.manual_seed(0)
    x0 = torch.randn(16, 4)
    pymem.disable()
    mean_ref, var_ref = torch.zeros(4), torch.ones(4)
    torch.ops.aten.native_batch_norm(x0, None, None, mean_ref, var_ref, True, 0.1, 1e-5)
    pymem.enable(_BUDGET, device="cpu")
    with torch.enable_grad():
        mean, var = torch.zeros(4) * 1, torch.ones(4) * 1
        outs = [torch.empty(0) * 1, torch.empty(0) * 1, torch.empty(0) * 1]
        torch.ops.aten.native_batch_norm.out(x0 * 1, None, None, mean, var, True, 0.1, 1e-5,
                                             out=outs[0], save_mean=outs[1], save_invstd=outs[2])
    _evict_all([mean, var])
    assert torch.equal(mean, mean_ref) and torch.equal(var, var_ref)
