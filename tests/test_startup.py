"""No-code activation: PYMEM_BUDGET (and PYMEM_POLICY, PYMEM_DEVICE, PYMEM_LOG) enable pymem at
interpreter start through the .pth hook the package installs; run in subprocesses as a user runs
``PYMEM_BUDGET=20GB python train.py``."""
import os
import subprocess
import sys

import pytest

from pymem import _startup
from pymem.budget import parse_budget

TRAIN = """
import torch, pymem
print("enabled", pymem.is_enabled())
torch.manual_seed(0)
w = torch.randn(128, 128, requires_grad=True)
x = torch.randn(512, 128)
for _ in range(12):
    x = torch.tanh(x @ w)
x.sum().backward()
s = pymem.memory_stats()
print("budget", s["budget_bytes"], "policy", pymem.current().policy.name, "device", pymem.current().device,
      "allocator", s["allocator"])
print("peak within budget", s["allocated_bytes.peak"] <= s["budget_bytes"], "evicted", s["num_evictions"] > 0)
"""


def python(code: str, **env_vars):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYMEM_")}
    env.update(env_vars)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)


def test_the_budget_variable_imports_no_torch_until_the_program_does():
    """``PYMEM_BUDGET`` exported for every process: one that never touches a tensor pays for the
    check of the variables only; pymem is enabled by the program's own ``import torch``."""
    p = python("import sys; print('torch' in sys.modules, 'numpy' in sys.modules)", PYMEM_BUDGET="8GB")
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["False", "False"]
    p = python("import sys; import torch; print('pymem' in sys.modules and sys.modules['pymem'].is_enabled())\n"
               "import pymem; print(pymem.memory_stats()['budget_bytes'])", PYMEM_BUDGET="8GB", PYMEM_DEVICE="cpu")
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["True", str(8 * 10 ** 9)]


def test_a_percent_budget_is_taken_of_the_device_when_torch_is_imported():
    p = python("import torch, pymem; print(pymem.memory_stats()['budget_bytes'])", PYMEM_BUDGET="10%",
               PYMEM_DEVICE="cpu")
    assert p.returncode == 0, p.stderr
    assert int(p.stdout) == parse_budget("10%", "cpu")


def test_what_only_the_device_can_judge_stops_the_program_at_import_torch():
    """``PYMEM_DEVICE=cuda`` with no GPU: checked when torch is imported, before the next line."""
    p = python("print('first line', flush=True)\nimport torch\nprint('after import')", PYMEM_BUDGET="8GB",
               PYMEM_DEVICE="cuda")
    if p.returncode == 0:
        pytest.skip("a GPU is visible: PYMEM_DEVICE=cuda is accepted here")
    assert p.returncode == _startup.EXIT_BAD_SETTING and p.stdout == "first line\n"
    assert "pymem: cannot start from the environment: device 'cuda': CUDA is not available here" in p.stderr


def test_a_percent_of_a_gpu_with_no_gpu_names_the_device():
    p = python("import torch", PYMEM_BUDGET="80%", PYMEM_DEVICE="cuda")
    if p.returncode == 0:
        pytest.skip("a GPU is visible: PYMEM_DEVICE=cuda is accepted here")
    assert p.returncode == _startup.EXIT_BAD_SETTING
    assert "pymem: cannot start from the environment: device 'cuda': CUDA is not available here" in p.stderr


def test_torch_imported_before_the_hook_is_enabled_at_once():
    """Another .pth file (or sitecustomize) imported torch first: pymem is enabled on the spot."""
    code = ("import torch, os; from pymem import _startup\n"
            "_startup.activate({'PYMEM_BUDGET': '64MB', 'PYMEM_DEVICE': 'cpu'})\n"
            "import pymem; print(pymem.is_enabled(), pymem.memory_stats()['budget_bytes'])")
    p = python(code)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["True", str(64 * 10 ** 6)]


def test_a_probe_for_torch_is_not_its_import():
    """Libraries probe with importlib.util.find_spec("torch") (transformers does): the hook waits
    for the import itself."""
    p = python("import importlib.util\nassert importlib.util.find_spec('torch') is not None\n"
               "import torch, pymem; print(pymem.is_enabled())", PYMEM_BUDGET="64MB", PYMEM_DEVICE="cpu")
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["True"]


@pytest.mark.parametrize("first", ["from pymem import memory_stats", "import pymem.api", "import pymem.runtime",
                                   "import pymem; pymem.Arena"])
def test_pymem_imported_before_torch_is_still_enabled_at_import_torch(first):
    """A module of pymem that needs torch has torch imported before it runs: the hook enables pymem
    then, with every module whole, and no module of pymem runs twice."""
    code = (f"{first}\nimport sys, torch, pymem\n"
            "print(pymem.is_enabled(), sys.modules['pymem.api'].is_enabled(), pymem.memory_stats()['budget_bytes'])")
    p = python(code, PYMEM_BUDGET="64MB", PYMEM_DEVICE="cpu")
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["True", "True", str(64 * 10 ** 6)]


def test_two_callbacks_for_one_module_both_run_once(tmp_path):
    (tmp_path / "dummymod.py").write_text("X = 1\n")
    code = (f"import sys; sys.path.insert(0, {str(tmp_path)!r})\n"
            "from pymem.import_hook import when_imported\n"
            "when_imported('dummymod', lambda: print('A'))\nwhen_imported('dummymod', lambda: print('B'))\n"
            "import dummymod, importlib; importlib.reload(dummymod); print(dummymod.X)")
    p = python(code)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["A", "B", "1"]


def test_import_pymem_alone_loads_no_torch():
    p = python("import sys, pymem; print('torch' in sys.modules); pymem.enable; print('torch' in sys.modules)")
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["False", "True"]


def test_the_extension_brings_torch_in_and_raises_pymems_error():
    p = python("import pymem._C as C\ntry:\n    C.Arena(1 << 20).allocate(1 << 21)\n"
               "except Exception as e:\n    import pymem; print(isinstance(e, pymem.OutOfBudgetError))")
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["True"]


def test_the_names_the_hook_accepts_are_the_registered_ones():
    from pymem import choices
    from pymem.policies import director_names, policy_names

    assert list(choices.POLICIES) == policy_names() and list(choices.DIRECTORS) == director_names()


def test_unset_budget_imports_nothing():
    p = python("import sys; print('torch' in sys.modules, 'pymem' in sys.modules)")
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["False", "False"]


@pytest.mark.parametrize("allocator", ["arena", "native"])
def test_budget_variable_runs_an_unchanged_script_under_pymem(allocator):
    p = python(TRAIN, PYMEM_BUDGET="3MiB", PYMEM_POLICY="lru", PYMEM_DEVICE="cpu", PYMEM_ALLOCATOR=allocator)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "enabled True" in p.stdout
    assert f"budget {3 << 20} policy lru device cpu allocator {allocator}" in p.stdout
    assert "peak within budget True evicted True" in p.stdout
    assert p.stderr == ""  # silent by default


def test_log_variable_reports_enable_and_a_summary_at_exit():
    p = python("import torch; x = torch.ones(1000) * 2", PYMEM_BUDGET="64MB", PYMEM_LOG="info")
    assert p.returncode == 0, p.stderr
    assert "[pymem] pymem enabled: budget 64000000 B, policy dtr, device cpu" in p.stderr
    assert "[pymem] at exit: peak" in p.stderr and "budget, 0 evictions" in p.stderr


@pytest.mark.parametrize("var,value,expected", [
    ("PYMEM_BUDGET", "20 parsecs", "PYMEM_BUDGET: budget '20 parsecs' is not accepted"),
    ("PYMEM_BUDGET", "-5GB", "PYMEM_BUDGET: budget '-5GB' is not accepted"),
    ("PYMEM_POLICY", "fifo", "PYMEM_POLICY='fifo' is not a policy; accepted: coop, dtr"),
    ("PYMEM_DEVICE", "tpu", "PYMEM_DEVICE='tpu' is not a device; accepted: 'cpu', 'cuda', 'cuda:N'"),
    ("PYMEM_LOG", "loud", "PYMEM_LOG='loud' is not a log level; accepted: debug, info, warning, error"),
    ("PYMEM_ALLOCATOR", "slab", "PYMEM_ALLOCATOR='slab' is not an allocator; accepted: arena, native"),
    ("PYMEM_OFFLOAD", "sometimes", "PYMEM_OFFLOAD='sometimes' is not accepted; accepted: always, capuchin, delta, never"),
    ("PYMEM_PREFETCH", "yes", "PYMEM_PREFETCH='yes' is not accepted; accepted: 0, 1"),
    ("PYMEM_PLAN", "always", "PYMEM_PLAN='always' is not accepted; accepted: auto, off"),
    ("PYMEM_HOST_BUDGET", "lots", "PYMEM_HOST_BUDGET: host_budget 'lots' is not accepted"),
    ("PYMEM_OFFLOAD_LEAVES", "yes", "PYMEM_OFFLOAD_LEAVES='yes' is not accepted; accepted: 0, 1"),
    ("PYMEM_VERIFY", "on", "PYMEM_VERIFY='on' is not accepted; accepted: 0, 1"),
])
def test_malformed_variable_stops_the_program_before_it_starts(var, value, expected):
    env = {"PYMEM_BUDGET": "64MB", var: value}
    p = python("print('the script ran')", **env)
    assert p.returncode == _startup.EXIT_BAD_SETTING
    assert p.stdout == ""
    assert "pymem: cannot start from the environment: " + expected in p.stderr


def test_settings_from_env_accepts_every_budget_form_and_defaults():
    s = _startup.settings_from_env({"PYMEM_BUDGET": "1.5GiB"})
    assert s == {"budget": parse_budget("1.5GiB"), "policy": "dtr", "device": None, "allocator": None,
                 "offload": None, "prefetch": True, "plan": "auto", "host_budget": None, "offload_leaves": None,
                 "verify": False, "log": None}
    s = _startup.settings_from_env({"PYMEM_BUDGET": " 10% ", "PYMEM_DEVICE": "cpu", "PYMEM_POLICY": "coop",
                                    "PYMEM_ALLOCATOR": "native", "PYMEM_LOG": "DEBUG", "PYMEM_OFFLOAD": "always",
                                    "PYMEM_PREFETCH": "0", "PYMEM_PLAN": "off", "PYMEM_HOST_BUDGET": "50%",
                                    "PYMEM_OFFLOAD_LEAVES": "0", "PYMEM_VERIFY": "1"})
    assert s == {"budget": "10%", "policy": "coop", "device": "cpu", "allocator": "native",
                 "offload": "always", "prefetch": False, "plan": "off", "host_budget": parse_budget("50%", "cpu"),
                 "offload_leaves": False, "verify": True, "log": "debug"}
