"""`pymem profile`: a user's unchanged script under each budget, each run in a fresh process, its
floor by bisection; and each bad input a clear error with exit code 2, nothing left running."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from pymem.profile import BISECT_TO, Profiler

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# An MLP whose Adam state sets a floor well inside (0, 1) on the CPU (offload "never").
MLP = """
import os, sys, torch
if os.environ.get("PIDS"):
    open(os.environ["PIDS"], "a").write(f"{os.getpid()}\\n")
torch.manual_seed(0)
torch.set_num_threads(1)
layers = [torch.nn.Linear(256, 256) for _ in range(8)]
opt = torch.optim.Adam([p for l in layers for p in l.parameters()], lr=1e-3)
x = torch.randn(512, 256)
for step in range(int(sys.argv[1]) if len(sys.argv) > 1 else 10):
    h = x
    for l in layers:
        h = torch.tanh(l(h))
    loss = h.square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step {step} loss {loss.item():.8f}")
"""


def profile(*args, cwd, env=None, timeout=600):
    env = dict(env or os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "pymem", "profile", *args], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=timeout)


@pytest.fixture
def mlp(tmp_path):
    (tmp_path / "mlp.py").write_text(MLP)
    return tmp_path


def test_every_budget_a_row_the_floor_feasible_and_below_it_not(mlp):
    p = profile("--steps", "2", "--budgets", "1.0,0.85,0.7", "--json", "out.json", "--plot", "out.png",
                "--", "mlp.py", cwd=mlp)
    assert p.returncode == 0, p.stdout + p.stderr
    data = json.loads((mlp / "out.json").read_text())
    assert (mlp / "out.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    ratios = [pt["ratio"] for pt in data["points"]]
    assert {1.0, 0.85, 0.7} <= set(ratios) and ratios == sorted(ratios, reverse=True)
    lines = p.stdout.splitlines()
    assert lines[0].split()[:4] == ["budget", "status", "step", "s"] and lines[1].startswith("unmanaged")
    assert len(lines) == 2 + len(ratios) + 1 and lines[-1].startswith("floor: ")
    u = data["unmanaged"]
    assert u["peak_bytes"] > 0 and u["step_seconds"] > 0 and u["losses"] == ["step 0 loss 0.00198231"]
    for pt in data["points"]:
        if pt["status"] == "ok":  # bitwise: same printed losses, same parameter bytes; inside the budget
            assert pt["losses_match"] is True and pt["parameters_match"] is True
            assert pt["peak_bytes"] <= pt["budget_bytes"] and pt["slowdown"] > 0
    floor = data["floor"]["ratio"]
    point = {pt["ratio"]: pt for pt in data["points"]}
    assert point[floor]["status"] == "ok"
    highest_infeasible = max(r for r, pt in point.items() if pt["status"] == "oom" and r < floor)
    assert floor - highest_infeasible <= BISECT_TO + 1e-9
    # 5% of the peak below the floor, run again on its own: infeasible.
    again = Profiler([str(mlp / "mlp.py")], steps=2, policy="dtr", offload=None, device="cpu")
    again.unmanaged = u
    assert again.run_budget(round(floor - 0.05, 4))["status"] == "oom"


def test_a_step_marked_with_pymem_step_counts_without_an_optimizer(tmp_path):
    (tmp_path / "loop.py").write_text(
        "import torch, pymem\nw = torch.randn(64, 64, requires_grad=True)\n"
        "for i in range(5):\n    (w @ w).sum().backward()\n    pymem.step()\n    print('loss', i)\n")
    read_fd, write_fd = os.pipe()
    config = {"fd": write_fd, "steps": 3, "budget": None, "device": "cpu", "policy": "dtr", "offload": None}
    env = dict(os.environ, PYMEM_PROFILE=json.dumps(config),
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    child = subprocess.run([sys.executable, "-m", "pymem.profile_run", "loop.py"], cwd=tmp_path, env=env,
                           pass_fds=(write_fd,), capture_output=True, text=True, timeout=120)
    os.close(write_fd)
    with os.fdopen(read_fd) as f:
        events = [json.loads(line) for line in f]
    assert child.returncode == 0, child.stderr
    assert [e["event"] for e in events] == ["step", "step", "step", "done"]
    assert child.stdout == "loss 0\nloss 1\n"  # stopped right at the third mark, before its print
    assert events[-1]["parameters_sha256"] is None and events[-1]["peak_bytes"] > 0


def test_meta_device_replays_the_scripts_trace_on_a_gpu_model(mlp):
    p = profile("--device", "meta", "--gpu", "h100", "--budgets", "1.0,0.5", "--json", "meta.json",
                "--", "mlp.py", cwd=mlp)
    assert p.returncode == 0, p.stdout + p.stderr
    data = json.loads((mlp / "meta.json").read_text())
    assert data["device"] == "meta" and data["gpu"] == "h100"
    assert data["points"][0]["ratio"] == 1.0 and data["points"][0]["status"] == "ok"
    assert data["floor"] is not None and "simulated on h100" in p.stderr


@pytest.mark.parametrize("args,expected", [
    (["--budgets", "1.0,1.5"], "--budgets '1.0,1.5' is not accepted: a comma-separated list of shares"),
    (["--budgets", "0,0.5"], "--budgets '0,0.5' is not accepted"),
    (["--budgets", "half"], "--budgets 'half' is not accepted"),
    (["--steps", "1"], "--steps 1 is not accepted: at least 2"),
    (["--policy", "fifo"], "--policy 'fifo' is not a policy; accepted: coop, dtr"),
    (["--device", "tpu"], "--device 'tpu' is not accepted; accepted: cpu, cuda, cuda:N, meta"),
])
def test_bad_input_is_a_clear_error_before_any_run(mlp, args, expected):
    p = profile(*args, "--", "mlp.py", cwd=mlp)
    assert p.returncode == 2 and p.stdout == ""
    assert "pymem profile: " + expected in p.stderr


def test_unknown_flag_and_missing_script(mlp):
    p = profile("--budget", "0.5", "--", "mlp.py", cwd=mlp)
    assert p.returncode == 2 and "unrecognized arguments" in p.stderr
    p = profile("--", "missing.py", cwd=mlp)
    assert p.returncode == 2 and "pymem profile: cannot open script 'missing.py': no such file" in p.stderr


def test_a_script_that_raises_passes_its_traceback_and_exit_code(tmp_path):
    (tmp_path / "bad.py").write_text("import torch\ndef f():\n    raise ValueError('no data here')\nf()\n")
    p = profile("--", "bad.py", cwd=tmp_path)
    assert p.returncode == 1 and p.stdout == ""
    assert "Traceback" in p.stderr and "ValueError: no data here" in p.stderr and 'bad.py", line 3' in p.stderr
    (tmp_path / "exits.py").write_text("import sys, torch\nsys.exit(7)\n")
    p = profile("--", "exits.py", cwd=tmp_path)
    assert p.returncode == 7 and "exits.py failed unmanaged (exit code 7)" in p.stderr


def test_a_script_without_a_step_boundary_names_pymem_step(mlp):
    p = profile("--steps", "4", "--", "mlp.py", "2", cwd=mlp)  # two optimizer steps, then it ends
    assert p.returncode == 2
    assert "mlp.py ended after 2 training step(s), fewer than --steps 4" in p.stderr and "pymem.step()" in p.stderr


def test_what_a_run_forks_neither_holds_it_up_nor_outlives_it(tmp_path):
    """A helper process the script forks (a DataLoader worker, a logger) keeps the run's pipe open:
    the run still ends at its last event, and the helper with it."""
    (tmp_path / "forks.py").write_text(
        "import os, time, torch\n"
        "if os.fork() == 0:\n    open('helper.pid', 'w').write(str(os.getpid())); time.sleep(300); os._exit(0)\n"
        "torch.manual_seed(0)\nm = torch.nn.Linear(64, 64); opt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
        "x = torch.randn(32, 64)\n"
        "for i in range(10):\n    loss = m(x).square().mean(); loss.backward(); opt.step(); opt.zero_grad()\n")
    t0 = time.monotonic()
    p = profile("--steps", "2", "--budgets", "1.0", "--json", "out.json", "--", "forks.py", cwd=tmp_path, timeout=250)
    assert p.returncode == 0, p.stderr
    assert time.monotonic() - t0 < 200  # not the helper's 300 s
    point = json.loads((tmp_path / "out.json").read_text())["points"][0]
    assert point["status"] == "ok" and point["parameters_match"] is True
    time.sleep(0.2)
    assert not _running(int((tmp_path / "helper.pid").read_text()))


def _running(pid: int) -> bool:
    """Alive and not a zombie (killed, but its new parent has not reaped it yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_ctrl_c_keeps_the_points_so_far_and_leaves_nothing_running(mlp):
    pids = mlp / "pids"
    env = dict(os.environ, PIDS=str(pids), PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-m", "pymem", "profile", "--steps", "2", "--budgets", "1.0,0.9,0.85",
                             "--json", "out.json", "--", "mlp.py"], cwd=mlp, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            # started as a shell starts a background job (a CI runner's, say):
                            # SIGINT ignored, so Python installs no Ctrl-C handler of its own
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    # Each run writes its pid once its script starts: the third is the run at 0.9, in flight when
    # the signal comes (the unmanaged run and the one at 1.0 are measured by then).
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (pids.exists() and len(pids.read_text().split()) >= 3):
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "interrupted; the points measured so far" in err
    data = json.loads((mlp / "out.json").read_text())
    assert data["interrupted"] is True and data["unmanaged"]["peak_bytes"] > 0
    assert out.splitlines()[1].startswith("unmanaged") and len(data["points"]) >= 1
    time.sleep(0.2)
    assert not any(_running(pid) for pid in map(int, pids.read_text().split()))
