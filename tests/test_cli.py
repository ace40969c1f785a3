"""The README's demo command and `pymem info`, run as a user runs them."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(*args):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "pymem", *args], capture_output=True, text=True, env=env,
                          timeout=300)


def test_demo_trains_bitwise_identically_inside_the_budget():
    p = run("demo", "--steps", "2")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "bitwise equal (losses and parameters): yes" in p.stdout
    assert "never above the budget" in p.stdout and "(40% of it)" in p.stdout and "slowdown" in p.stdout
    evictions = int(p.stdout.split(" evictions,")[0].rsplit(" ", 1)[-1])
    assert evictions > 0


def _report(ref, got, again, peak_bytes=10):
    import torch

    from pymem.cli import _demo_report

    st = {"budget_bytes": 20, "allocated_bytes.peak": peak_bytes, "num_evictions": 1, "num_rematerializations": 1,
          "remat_seconds": 0.0, "num_compactions": 0}
    as_run = lambda losses: (losses, [torch.tensor(losses)])
    again = None if again is None else as_run(again)
    return _demo_report(0.4, 50, (*as_run(ref), 1.0), (*as_run(got), 1.0), st, again)


def test_a_demo_mismatch_is_told_apart_from_an_unmanaged_run_that_did_not_reproduce_itself(capsys):
    # pymem's run matches a second unmanaged run that differs from the first: PyTorch's rounding
    # varied, and pymem computed what an unmanaged run computes.
    assert _report([1.0, 2.0], [1.0, 2.5], again=[1.0, 2.5]) == 0
    out = capsys.readouterr().out
    assert "bitwise equal (losses and parameters): NO" in out
    assert "a second unmanaged run: other bits than the first; pymem's run matches it" in out
    assert "PyTorch itself did not reproduce its own run here" in out
    # The unmanaged run reproduces itself and pymem's differs: pymem's fault, and the demo fails.
    assert _report([1.0, 2.0], [1.0, 2.5], again=[1.0, 2.0]) == 1
    out = capsys.readouterr().out
    assert "a second unmanaged run: the same bits as the first; pymem's run matches neither" in out
    assert "did not reproduce" not in out
    # Bits that match still fail over the budget.
    assert _report([1.0], [1.0], again=None, peak_bytes=21) == 1

def test_demo_device_is_checked():
    p = run("demo", "--device", "tpu")
    assert p.returncode == 2 and "--device 'tpu' is not a demo device; accepted: cpu, cuda" in p.stderr, p.stderr
    import torch
    if not torch.cuda.is_available():
        p = run("demo", "--device", "cuda")
        assert p.returncode == 2 and "--device cuda, but CUDA is not available here" in p.stderr, p.stderr


SCRIPT = """
import sys, torch
w = torch.randn(128, 128, requires_grad=True)
x = torch.randn(512, 128)
for _ in range(12):
    x = torch.tanh(x @ w)
x.sum().backward()
print("args", sys.argv[1:], "grad", float(w.grad.abs().sum()) > 0)
"""


def test_run_executes_the_script_under_pymem_and_prints_a_summary(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    p = run("run", "--budget", "3MiB", "--device", "cpu", "--", str(script), "--lr", "0.1")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "args ['--lr', '0.1'] grad True" in p.stdout
    assert "pymem memory summary" in p.stderr and "3.0 MiB" in p.stderr
    evictions = int(p.stderr.split("evictions (bytes)")[1].split()[0])
    assert evictions > 0


def test_run_verify_checks_every_value_that_comes_back(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT + "import pymem\nprint('verified', pymem.memory_stats()['num_verified_restores'])\n")
    p = run("run", "--budget", "3MiB", "--device", "cpu", "--verify", "--", str(script))
    assert p.returncode == 0, p.stdout + p.stderr
    assert "grad True" in p.stdout and int(p.stdout.split("verified")[1].split()[0]) > 0, p.stdout


def test_run_with_the_native_allocator(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    p = run("run", "--budget", "3MiB", "--allocator", "native", "--", str(script))
    assert p.returncode == 0, p.stdout + p.stderr
    assert "grad True" in p.stdout and "pymem memory summary" in p.stderr
    p = run("run", "--budget", "3MiB", "--allocator", "slab", "--", str(script))
    assert p.returncode == 2 and "pymem run: --allocator='slab' is not an allocator; accepted: arena, native" in p.stderr
    assert "grad" not in p.stdout


def test_run_rejects_a_bad_budget_and_a_missing_script_at_start(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('ran')")
    p = run("run", "--budget", "3 parsecs", "--", str(script))
    assert p.returncode == 2 and "budget '3 parsecs' is not accepted" in p.stderr and "ran" not in p.stdout
    p = run("run", "--budget", "3MiB", "--", str(tmp_path / "missing.py"))
    assert p.returncode == 2 and "cannot open script" in p.stderr and "missing.py" in p.stderr


def test_run_enables_pymem_only_when_the_script_imports_torch(tmp_path):
    script = tmp_path / "no_torch.py"
    script.write_text("import sys; print('torch loaded:', 'torch' in sys.modules)")
    p = run("run", "--budget", "3MiB", "--", str(script))
    assert p.returncode == 0, p.stderr
    assert p.stdout == "torch loaded: False\n"
    assert "pymem run: the script never imported torch; pymem was not enabled" in p.stderr
    script.write_text("import sys; print('before', 'torch' in sys.modules)\n"
                      "import torch, pymem; print('enabled at import', pymem.is_enabled())")
    p = run("run", "--budget", "3MiB", "--policy", "lru", "--", str(script))
    assert p.returncode == 0, p.stderr
    assert p.stdout == "before False\nenabled at import True\n" and "pymem memory summary" in p.stderr


@pytest.mark.parametrize("flags,expected", [
    (["--policy", "fifo"], "--policy='fifo' is not a policy; accepted: coop, dtr"),
    (["--plan", "always"], "--plan='always' is not accepted; accepted: auto, off"),
    (["--offload", "sometimes"], "--offload='sometimes' is not accepted; accepted: always, capuchin, delta, never"),
    (["--device", "tpu"], "--device='tpu' is not a device; accepted: 'cpu', 'cuda', 'cuda:N'"),
    (["--host-budget", "lots"], "--host-budget: host_budget 'lots' is not accepted"),
])
def test_run_checks_every_flag_before_the_script_starts(tmp_path, flags, expected):
    script = tmp_path / "train.py"
    script.write_text("print('ran')")
    p = run("run", "--budget", "3MiB", *flags, "--", str(script))
    assert p.returncode == 2 and p.stdout == ""
    assert "pymem run: " + expected in p.stderr


def test_run_stops_at_import_torch_on_what_only_the_device_can_judge(tmp_path):
    """``--device cuda`` here, with no GPU: judged when the script imports torch, exit 2 there."""
    script = tmp_path / "train.py"
    script.write_text("print('first line', flush=True)\nimport torch\nprint('after import')")
    p = run("run", "--budget", "3MiB", "--device", "cuda", "--", str(script))
    if p.returncode == 0:
        pytest.skip("a GPU is visible: --device cuda is accepted here")
    assert p.returncode == 2 and p.stdout == "first line\n"
    assert "pymem run: device 'cuda': CUDA is not available here" in p.stderr


def test_run_flags_win_over_the_environment(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("import torch, pymem; print(pymem.memory_stats()['budget_bytes'])")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), PYMEM_BUDGET="1GB")
    p = subprocess.run([sys.executable, "-m", "pymem", "run", "--budget", "3MiB", "--", str(script)],
                       capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == [str(3 << 20)]


def test_run_passes_the_script_exit_code(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text("import sys, torch; sys.exit(3)")
    p = run("run", "--budget", "3MiB", "--", str(script))
    assert p.returncode == 3 and "pymem memory summary" in p.stderr


def test_info():
    p = run("info")
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("pymem 0.1.0") and "CUDA library:" in p.stdout


def test_unknown_command_is_a_clear_error():
    p = run("dmeo")
    assert p.returncode == 2 and "invalid choice: 'dmeo'" in p.stderr
