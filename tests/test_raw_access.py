"""Reads that reach a tensor's bytes without an aten op see its value, evicted (recomputed),
offloaded (copied back), or a leaf offloaded (offload_leaves), or resident."""
import copy
import io
import pickle

import numpy as np
import pytest
import torch

import pymem


@pytest.fixture(params=["evicted", "offloaded", "offloaded leaf"])
def evicted(request):
    """An activation (or a leaf), its value, and a helper that releases it again before each read:
    evicted, or offloaded to host memory."""
    pymem.enable(budget="64MB", device="cpu", offload="never" if request.param == "evicted" else "always")
    try:
        x = torch.randn(128, 96, requires_grad=True)
        if request.param == "offloaded leaf":
            with pymem.no_recompute():
                h = (x * 2).exp()
        else:
            h = (x * 2).exp()
        want = h.detach().clone()

        def again(t=h):
            pymem.evict(t)
            assert pymem.is_evicted(t)
            return t

        yield h, want, again
    finally:
        pymem.disable()


def _saved(obj, weights_only=True):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=weights_only)


def test_tolist_of_an_evicted_tensor(evicted):
    h, want, again = evicted
    assert again().tolist() == want.tolist()


def test_torch_save_of_an_evicted_tensor_and_of_a_dict_holding_it(evicted):
    h, want, again = evicted
    assert torch.equal(_saved(again()), want)
    assert torch.equal(_saved({"act": again(), "more": [h * 1]})["act"], want)


def test_pickle_and_deepcopy_of_an_evicted_tensor(evicted):
    h, want, again = evicted
    assert torch.equal(pickle.loads(pickle.dumps(again().detach())), want)
    y = torch.randn(64, 64) * 3  # grad mode: a recipe, though nothing requires grad (deepcopy-able)
    ref = y.clone()
    assert torch.equal(copy.deepcopy(again(y)), ref)


def test_numpy_array_interface_data_ptr_and_dlpack_of_an_evicted_tensor(evicted):
    _, _, again = evicted
    y = torch.randn(64, 64) * 3  # no grad needed: a direct .numpy() is allowed
    ref = y.clone()
    assert np.array_equal(again(y).numpy(), ref.numpy())
    assert np.array_equal(np.asarray(again(y)), ref.numpy())
    assert torch.equal(torch.from_dlpack(again(y).__dlpack__()), ref)
    y2 = torch.randn(64, 64) * 3
    ref2 = y2.clone()
    assert again(y2).data_ptr() != 0 and torch.equal(y2, ref2)  # brought back (and pinned)


def test_torch_save_holds_what_it_pickled_until_its_bytes_are_written(evicted):
    """torch.save pickles every tensor, then writes their bytes: bringing one back must not release
    another it already pickled."""
    h, want, again = evicted
    rt = pymem.current()
    record = rt.table[pymem._C.storage_key(h)]
    seen = []

    class Probe:
        def __reduce__(self):
            seen.append(record.locks)
            return (int, (0,))

    out = _saved({"act": again(), "probe": Probe()}, weights_only=False)
    assert seen == [1] and record.locks == 0
    assert torch.equal(out["act"], want)


def test_evict_of_a_tensor_with_no_bytes_does_nothing():
    pymem.enable(budget="16MB", device="cpu")
    try:
        x = torch.randn(0, requires_grad=True)
        y = x * 2
        pymem.evict(y)  # was: RuntimeError "the storage holds no bytes"
        assert not pymem.is_evicted(y)
        assert y.shape == (0,) and torch.equal(y.detach(), torch.empty(0))
    finally:
        pymem.disable()


def test_disable_gives_torch_its_methods_back():
    before = {n: torch.Tensor.__dict__.get(n) for n in ("tolist", "numpy", "__reduce_ex__")}
    save = torch.save
    pymem.enable(budget="16MB", device="cpu")
    assert torch.save is not save
    pymem.disable()
    assert torch.save is save and torch.serialization.save is save
    assert {n: torch.Tensor.__dict__.get(n) for n in before} == before
