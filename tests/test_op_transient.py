"""An op's temporaries: what its kernel holds beside its inputs and outputs while it runs (a
convolution's workspace), measured by the arena around each kernel (Arena.mark_op,
transient_since) and recorded in the step trace (op_transient), where the step plan counts them at
the op (csrc/plan_cover.h; the covers' own test: test_plan_cover.py)."""
import numpy as np
import pytest
import torch
from torch import nn

import pymem
from pymem import _C

torch.set_num_threads(2)

K = 4096


def test_the_transient_is_the_kernels_peak_above_what_it_started_and_ended_with():
    arena = _C.Arena(64 * K, backing="virtual", small_threshold=0)
    held = arena.allocate(8 * K)
    mark = arena.mark_op()
    out = arena.allocate(4 * K)    # an output: still there at the end
    tmp = arena.allocate(16 * K)   # a temporary: 8 + 4 + 16 at the peak
    arena.free(tmp)
    assert arena.transient_since(mark) == 16 * K
    mark = arena.mark_op()
    arena.free(out)                # an op that frees what it read holds nothing beyond its start
    assert arena.transient_since(mark) == 0
    arena.free(held)


def test_what_pressure_released_for_the_kernel_counts_as_held():
    # 16 KiB; a releasable 8 KiB value, then an op that makes a 4 KiB output and takes 8 KiB of
    # workspace: the workspace fits only once the value is released. Unreleased, the op would
    # have gone 8 -> 12 -> 20 -> 12 KiB: 8 KiB above what it started and ended with.
    arena = _C.Arena(16 * K, backing="virtual", small_threshold=0, search="handler")
    value = [arena.allocate(8 * K)]
    arena.set_pressure_handler(lambda request, window: arena.free(value.pop()) if value else None)
    mark = arena.mark_op()
    arena.allocate(4 * K)
    tmp = arena.allocate(8 * K)
    arena.free(tmp)
    assert arena.stats()["released_bytes"] == 8 * K
    assert arena.transient_since(mark) == 8 * K
    arena.set_pressure_handler(None)


def test_a_release_of_more_than_the_request_is_no_temporary():
    # v1 at 0, v2 at 4 KiB, 4 KiB free at the top: an 8 KiB output fits only once both are released
    # (v1 alone leaves two 4 KiB holes). The op held nothing beyond its output.
    arena = _C.Arena(16 * K, backing="virtual", small_threshold=0, search="handler")
    values = [arena.allocate(4 * K), arena.allocate(8 * K)]
    arena.set_pressure_handler(lambda request, window: arena.free(values.pop(0)) if values else None)
    mark = arena.mark_op()
    arena.allocate(8 * K)
    assert arena.stats()["released_bytes"] == 12 * K
    assert arena.transient_since(mark) == 0
    arena.set_pressure_handler(None)


class _Conv(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(8, 32, 3, padding=1)
        self.b = nn.Conv2d(32, 32, 3, padding=1)

    def forward(self, x):
        return self.b(torch.relu(self.a(x))).mean()


def _trace_of_a_conv_step(monkeypatch, intercept):
    monkeypatch.setenv("PYMEM_INTERCEPT", intercept)
    torch.manual_seed(0)
    model = _Conv()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(16, 8, 32, 32)
    rt = pymem.enable(budget="256MB", device="cpu", plan="auto")
    try:
        assert rt.interception.name == intercept
        for _ in range(2):
            opt.zero_grad()
            model(x).backward()
            opt.step()
        step = pymem.step_trace()
    finally:
        pymem.disable()
    names = [_C.op_name(int(c)) for c in step["op"]]
    return names, np.asarray(step["op_transient"])


@pytest.mark.parametrize("intercept", ["dispatcher", "mode"])
def test_the_step_trace_records_each_kernels_temporaries(monkeypatch, intercept):
    if intercept == "dispatcher" and _C.install_interception() != "":
        pytest.skip("this torch refuses pymem's dispatcher fallback")
    names, transient = _trace_of_a_conv_step(monkeypatch, intercept)
    assert len(transient) == len(names)
    backward = [t for n, t in zip(names, transient) if n == "aten.convolution_backward.default"]
    assert len(backward) == 2 and all(t >= 64 * 1024 for t in backward), backward  # oneDNN's workspace
    # Ops that allocate only their outputs hold nothing more (a grain at most: a scalar's tensor).
    plain = [t for n, t in zip(names, transient) if n in ("aten.relu.default", "aten.threshold_backward.default")]
    assert plain and max(plain) <= _C.ALIGNMENT
