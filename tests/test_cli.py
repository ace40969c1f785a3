"""The README's demo command and `pymem info`, run as a user runs them."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(*args):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "pymem", *args], capture_output=True, text=True, env=env,
                          timeout=300)


def test_demo_trains_bitwise_identically_inside_the_budget():
    p = run("demo", "--steps", "2", "--batch", "2", "--seq", "32")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "bitwise equal (losses and parameters): yes" in p.stdout
    assert "never above it" in p.stdout and "OutOfBudgetError" in p.stdout


def test_info():
    p = run("info")
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("pymem 0.1.0") and "CUDA library:" in p.stdout


def test_unknown_command_is_a_clear_error():
    p = run("dmeo")
    assert p.returncode == 2 and "invalid choice: 'dmeo'" in p.stderr
