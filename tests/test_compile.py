"""torch.compile under pymem: the compiled region runs eagerly through the runtime, and pymem says
so once (Dynamo itself falls back silently)."""
import warnings

import pytest
import torch

import pymem
from pymem.runtime import compile_warning

pytest.importorskip("torch._dynamo")


def test_a_compiled_function_runs_eagerly_under_pymem_with_one_warning(monkeypatch):
    monkeypatch.setattr(compile_warning, "_warned", False)
    torch._dynamo.reset()

    @torch.compile(backend="eager")  # Dynamo's skip does not depend on the backend; eager is fast
    def f(x):
        return torch.tanh(x) * 2 + 1

    x = torch.randn(64, 64)
    want = torch.tanh(x) * 2 + 1
    pymem.enable(budget="32MB", device="cpu")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ops_before = pymem.memory_stats()["num_ops"]
            got = [f(x) for _ in range(3)]
            ops = pymem.memory_stats()["num_ops"] - ops_before
    finally:
        pymem.disable()
    ours = [w for w in caught if "pymem: torch.compile" in str(w.message)]
    assert len(ours) == 1 and issubclass(ours[0].category, RuntimeWarning)
    assert ops >= 9  # tanh, mul, add per call: pymem saw (and manages) every op
    assert all(torch.equal(g, want) for g in got)


def test_compile_after_disable_compiles_again():
    torch._dynamo.reset()
    pymem.enable(budget="32MB", device="cpu")
    pymem.disable()
    calls = []

    def backend(gm, example_inputs):
        calls.append(gm)
        return gm.forward

    f = torch.compile(lambda x: x.sin() + 1, backend=backend)
    x = torch.randn(16)
    assert torch.equal(f(x), x.sin() + 1) and len(calls) == 1  # traced: pymem left nothing behind


def test_dynamo_never_traces_pymems_own_frames():
    """Inside its own dispatch the mode is off the stack: without pymem's guard, a compiled caller's
    frame callback compiled pymem's kernel calls into graphs (5 here). The guard costs far less than
    torch's _disable_dynamo wrapper, which pymem's mode opts out of."""
    torch._dynamo.reset()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def helper(x):
        return torch.tanh(x) * 2

    @torch.compile(backend=backend)
    def f(x):
        return helper(x).sum(), x.exp()

    x = torch.randn(64, 64, requires_grad=True)
    pymem.enable(budget="32MB", device="cpu")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for _ in range(3):
                s, e = f(x)
                (s + e.sum()).backward()
    finally:
        pymem.disable()
    assert graphs == []


def test_fullgraph_under_pymem_says_a_dispatch_mode_is_present():
    """The mode's own dispatch frame is on Dynamo's skip list: fullgraph=True fails with torch's
    reason, not with an unsupported call deep inside pymem's frame."""
    torch._dynamo.reset()
    f = torch.compile(lambda x: x.sin() + 1, backend="eager", fullgraph=True)
    pymem.enable(budget="32MB", device="cpu")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with pytest.raises(Exception) as caught:
                f(torch.randn(64))
    finally:
        pymem.disable()
    assert "dispatch mode present" in str(caught.value) and "pymem/runtime" not in str(caught.value)


def test_enable_does_not_import_dynamo_and_the_patch_comes_with_its_import():
    """Dynamo costs over a second to import: enable() leaves it alone; a program that compiles later
    (Dynamo imported after enable) still runs the region eagerly through pymem, with the warning."""
    import subprocess
    import sys

    code = """
import sys, warnings, torch, pymem
pymem.enable(budget="32MB", device="cpu")
print("dynamo after enable:", "torch._dynamo" in sys.modules)
f = torch.compile(lambda x: torch.tanh(x) * 2 + 1, backend="eager")
x = torch.randn(8, 8)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    before = pymem.memory_stats()["num_ops"]
    y = f(x)
    print("ops seen:", pymem.memory_stats()["num_ops"] - before >= 3)
print("equal:", torch.equal(y, torch.tanh(x) * 2 + 1))
print("warned:", sum("pymem: torch.compile" in str(w.message) for w in caught))
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={k: v for k, v in __import__("os").environ.items() if not k.startswith("PYMEM_")})
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines() == ["dynamo after enable: False", "ops seen: True", "equal: True", "warned: 1"]
