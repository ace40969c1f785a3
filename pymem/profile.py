"""``pymem profile``: the budget-vs-slowdown curve of the user's own script, and its floor.

    pymem profile [--steps 6] [--budgets 1.0,0.7,0.5,0.3,0.2] [--policy P] [--offload D]
                  [--device cpu|cuda|meta] [--gpu h100] [--json F] [--plot F.png] -- script.py args...

The script runs unchanged for ``--steps`` training steps (pymem's step boundary: an optimizer's
``step()``, or ``pymem.step()``), each run in a fresh process (``pymem.profile_run``): first
unmanaged, to learn its peak (every tensor byte, counted as the arena counts it) and its step time,
then under each budget ratio of that peak, from the largest down; then the lowest feasible budget
by bisection, to 2% of the peak. Step time is the median of the steps after the first; evictions,
recompute seconds and offloaded bytes are per step over the same steps. Losses match when the lines
of the script's output that mention "loss" are the same as unmanaged; parameters when the bytes of
every parameter its optimizers hold are (a SHA-256 over them after the last step).

``--device meta`` runs nothing: it captures one step of the script on the meta device
(``pymem.sim.capture``) and replays it under each budget for the GPU named by ``--gpu``
(``pymem sim``'s cost model). Ctrl-C stops the run in flight and keeps the points measured so far.
"""
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional

from .budget import format_bytes
from .choices import DIRECTORS, POLICIES

_LAST_EVENTS = ("done", "oom", "ended", "error")  # what profile_run.py sends last
BISECT_TO = 0.02   # the floor is found to this share of the peak
DEFAULT_BUDGETS = (1.0, 0.7, 0.5, 0.3, 0.2)
EXIT_BAD_INPUT = 2


class ProfileError(Exception):
    """Bad input, or a script that cannot be profiled: the message, exit code 2."""


class ScriptFailed(Exception):
    """The unmanaged run of the script failed: its stderr and exit code pass through."""

    def __init__(self, code: int, stderr: str):
        super().__init__(f"exit code {code}")
        self.code, self.stderr = code, stderr


def parse_budgets(text: str) -> List[float]:
    try:
        ratios = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        ratios = []
    if not ratios or any(not 0 < r <= 1 for r in ratios):
        raise ProfileError(f"--budgets {text!r} is not accepted: a comma-separated list of shares of the "
                           "unmanaged peak, each in (0, 1], e.g. 1.0,0.7,0.5,0.3,0.2")
    return sorted(set(ratios), reverse=True)


def _ratio(r: float) -> str:
    return f"{r:.2f}" if round(r, 2) == r else f"{r:.4g}"


class _Progress:
    """One line per budget on stderr: redrawn with the current step on a terminal, then its result."""

    def __init__(self, stream=sys.stderr):
        self.stream, self.live = stream, stream.isatty()

    def update(self, label: str, text: str) -> None:
        if self.live:
            self.stream.write(f"\r\033[K  {label:<24} {text}")
            self.stream.flush()

    def done(self, label: str, text: str) -> None:
        self.stream.write(("\r\033[K" if self.live else "") + f"  {label:<24} {text}\n")
        self.stream.flush()


class Profiler:
    """Runs the script under each budget and keeps what each run measured (``points``)."""

    def __init__(self, script: List[str], steps: int, policy: str, offload: Optional[str], device: str,
                 gpu: str = "h100", progress: Optional[_Progress] = None):
        self.script, self.steps, self.policy, self.offload = script, steps, policy, offload
        self.device, self.gpu = device, gpu
        self.progress = progress or _Progress()
        self.unmanaged: Optional[Dict] = None
        self.points: Dict[float, Dict] = {}
        self.trace = None           # --device meta: the captured step
        self._timeout = None        # seconds a managed run may take: far beyond a thrashing one

    # --- runs ---
    def run_unmanaged(self) -> Dict:
        label = "unmanaged"
        if self.device == "meta":
            from .sim.capture import capture_script

            self.progress.update(label, "capturing one step on the meta device")
            try:
                self.trace = capture_script(self.script[0], self.script[1:])
            except Exception as e:  # noqa: BLE001 — the user's script: its error, named
                raise ProfileError(f"capturing {self.script[0]} on the meta device failed: {type(e).__name__}: {e}")
            peak = self.trace.peak_bytes()
            self.unmanaged = {"status": "ok", "peak_bytes": int(peak), "step_seconds": None}
            self.progress.done(label, f"peak {format_bytes(peak)}, {self.trace.num_ops} ops")
            return self.unmanaged
        t0 = time.perf_counter()
        event, out, err, code = self._child(None, label)
        if event.get("event") == "error" or code not in (0, None):
            code = event.get("code", code) or 1
            raise ScriptFailed(128 - code if code < 0 else code, err)  # killed by a signal: as a shell says it
        if event.get("event") != "done":
            raise ProfileError(
                f"{self.script[0]} ended after {event.get('steps', 0)} training step(s), fewer than --steps "
                f"{self.steps}: pymem sees a step end at an optimizer's step() or at pymem.step(); call "
                "pymem.step() at the end of each training step of a loop without an optimizer, or give fewer --steps")
        self.unmanaged = dict(event, status="ok", losses=_loss_lines(out))
        self._timeout = max(120.0, 20 * (time.perf_counter() - t0))
        self.progress.done(label, f"peak {format_bytes(event['peak_bytes'])}, step {event['step_seconds']:.3f} s")
        return self.unmanaged

    def run_budget(self, ratio: float) -> Dict:
        peak = self.unmanaged["peak_bytes"]
        budget = int(peak * ratio) // 512 * 512
        label = f"budget {_ratio(ratio)} ({format_bytes(budget)})"
        if budget <= 0:
            point = {"ratio": ratio, "budget_bytes": budget, "status": "oom", "message": "below 512 bytes"}
        elif self.device == "meta":
            point = self._simulated(ratio, budget)
        else:
            point = self._measured(ratio, budget, label)
        self.points[ratio] = point
        self.progress.done(label, _row_text(point))
        return point

    def _simulated(self, ratio: float, budget: int) -> Dict:
        from .sim.replay import simulate

        # the default by device, as a run on that GPU would have it: delta (see pymem.enable)
        r = simulate(self.trace, budget, policy=self.policy, offload=self.offload or "delta", plan="auto",
                     device=self.gpu)
        point = {"ratio": ratio, "budget_bytes": budget, "status": r["status"], "peak_bytes": r["peak_bytes"],
                 "evictions": r["evictions"], "recompute_seconds": r["recompute_seconds"],
                 "offloaded_bytes": r["offloaded_bytes"], "losses_match": None, "parameters_match": None}
        if r["status"] != "oom":
            point["step_seconds"] = r["step_seconds"] * r["overhead"]
            point["slowdown"] = r["overhead"]
            if self.unmanaged["step_seconds"] is None:
                self.unmanaged["step_seconds"] = r["step_seconds"]
        else:
            point["message"] = r.get("error", "")
        return point

    def _measured(self, ratio: float, budget: int, label: str) -> Dict:
        event, out, err, code = self._child(budget, label)
        point = {"ratio": ratio, "budget_bytes": budget}
        kind = event.get("event")
        if kind == "done":
            u = self.unmanaged
            point.update(status="ok", step_seconds=event["step_seconds"],
                         slowdown=event["step_seconds"] / u["step_seconds"], peak_bytes=event["peak_bytes"],
                         evictions=event["evictions"], recompute_seconds=event["recompute_seconds"],
                         offloaded_bytes=event["offloaded_bytes"],
                         losses_match=(_loss_lines(out) == u["losses"]) if u["losses"] else None,
                         parameters_match=(event["parameters_sha256"] == u["parameters_sha256"])
                         if u["parameters_sha256"] else None)
        elif kind == "oom":
            point.update(status="oom", message=event["message"])
        elif kind == "timeout":
            point.update(status="timeout", message=f"no result within {self._timeout:.0f} s (thrashing)")
        else:
            point.update(status="error", message=(err.strip().splitlines() or [f"exit code {code}"])[-1])
        return point

    def _child(self, budget: Optional[int], label: str):
        """One run in a fresh process, in its own process group (Ctrl-C reaches the parent, which
        then ends the whole group). Returns (last event, stdout, stderr, exit code)."""
        read_fd, write_fd = os.pipe()
        config = {"fd": write_fd, "steps": self.steps, "budget": budget, "device": self.device,
                  "policy": self.policy, "offload": self.offload}
        env = {k: v for k, v in os.environ.items() if not k.startswith("PYMEM_")}  # no startup hook
        env["PYMEM_PROFILE"] = json.dumps(config)
        with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
            proc = subprocess.Popen([sys.executable, "-m", "pymem.profile_run", *self.script], env=env,
                                    stdout=out, stderr=err, pass_fds=(write_fd,), start_new_session=True)
            os.close(write_fd)
            event, buf = {}, b""
            deadline = None if budget is None or self._timeout is None else time.monotonic() + self._timeout
            try:
                # Until the run's last event or its exit, not the pipe's end: whatever the script
                # forked (DataLoader workers) holds the pipe open after it.
                with os.fdopen(read_fd, "rb") as pipe:
                    while event.get("event") not in _LAST_EVENTS:
                        exited = proc.poll() is not None
                        ready, _, _ = select.select([pipe], [], [], 0 if exited else 0.5)
                        chunk = os.read(pipe.fileno(), 65536) if ready else b""
                        buf += chunk
                        *lines, buf = buf.split(b"\n")
                        for line in lines:
                            event = json.loads(line)
                            if event.get("event") == "step":
                                self.progress.update(label, f"step {event['step']}/{self.steps}")
                        if exited and not chunk:
                            break
                        if deadline is not None and time.monotonic() > deadline \
                                and event.get("event") not in _LAST_EVENTS:
                            event = {"event": "timeout"}
                            break
                if event.get("event") in _LAST_EVENTS:
                    try:
                        proc.wait(timeout=30)  # it ends on its own right after its last event
                    except subprocess.TimeoutExpired:
                        pass
                _kill(proc)  # the run itself (after a timeout) and what it left behind: its whole group
                code = proc.returncode
            except BaseException:  # Ctrl-C: nothing of it is left running
                _kill(proc)
                raise
            out.seek(0)
            err.seek(0)
            return event, out.read(), err.read(), code

    # --- the floor ---
    def floor(self) -> Optional[float]:
        ok = [r for r, p in self.points.items() if p["status"] not in ("oom", "timeout", "error")]
        return min(ok) if ok else None

    def bisect(self) -> None:
        """Between the lowest feasible ratio and the highest infeasible one below it (0 when none),
        until they are BISECT_TO apart."""
        while True:
            hi = self.floor()
            if hi is None:
                return
            below = [r for r, p in self.points.items() if r < hi and p["status"] in ("oom", "timeout", "error")]
            lo = max(below, default=0.0)
            if hi - lo <= BISECT_TO + 1e-9:
                return
            self.run_budget(round((lo + hi) / 2, 4))


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _loss_lines(stdout: str) -> List[str]:
    return [line for line in stdout.splitlines() if "loss" in line.lower()]


def _yes_no(v) -> str:
    return "-" if v is None else ("yes" if v else "NO")


def _row_text(p: Dict) -> str:
    if p["status"] in ("oom", "timeout", "error"):
        return f"{p['status']}: {p.get('message', '')}"[:100]
    return (f"{p['slowdown']:.2f}x ({p['step_seconds']:.3f} s), {p['evictions']:.0f} evictions, "
            f"{p['recompute_seconds']:.3f} s recompute, {format_bytes(p['offloaded_bytes'])} offloaded per step")


def table(profiler: Profiler) -> str:
    u = profiler.unmanaged
    rows = [("budget", "status", "step s", "slowdown", "evictions", "recompute s", "offloaded", "peak/budget",
             "losses", "params")]
    if u.get("step_seconds") is not None:
        rows.append(("unmanaged", "ok", f"{u['step_seconds']:.3f}", "1.00x", "0", "0.000", "0 B",
                     format_bytes(u["peak_bytes"]), "", ""))
    for r in sorted(profiler.points, reverse=True):
        p = profiler.points[r]
        head = f"{_ratio(r)} ({format_bytes(p['budget_bytes'])})"
        if p["status"] in ("oom", "timeout", "error"):
            rows.append((head, p["status"], "", "", "", "", "", "", "", ""))
            continue
        rows.append((head, p["status"], f"{p['step_seconds']:.3f}", f"{p['slowdown']:.2f}x", f"{p['evictions']:.0f}",
                     f"{p['recompute_seconds']:.3f}", format_bytes(p["offloaded_bytes"]),
                     f"{p['peak_bytes'] / p['budget_bytes']:.0%}", _yes_no(p["losses_match"]),
                     _yes_no(p["parameters_match"])))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    floor = profiler.floor()
    lines.append(f"floor: {_ratio(floor)} of the peak ({format_bytes(profiler.points[floor]['budget_bytes'])})"
                 if floor is not None else "floor: no budget tried was feasible")
    return "\n".join(lines) + "\n"


def result(profiler: Profiler, interrupted: bool, seconds: float) -> Dict:
    floor = profiler.floor()
    return {"script": profiler.script, "steps": profiler.steps, "device": profiler.device,
            "gpu": profiler.gpu if profiler.device == "meta" else None, "policy": profiler.policy,
            "offload": profiler.offload, "unmanaged": profiler.unmanaged,
            "points": [profiler.points[r] for r in sorted(profiler.points, reverse=True)],
            "floor": None if floor is None else {"ratio": floor, "budget_bytes": profiler.points[floor]["budget_bytes"]},
            "bisected_to": BISECT_TO, "interrupted": interrupted, "seconds": seconds}


def plot(data: Dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [p for p in data["points"] if p["status"] not in ("oom", "timeout", "error")]
    bad = [p for p in data["points"] if p["status"] in ("oom", "timeout", "error")]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([p["ratio"] for p in ok], [p["slowdown"] for p in ok], "o-", label="feasible")
    if bad:
        ax.plot([p["ratio"] for p in bad], [1.0] * len(bad), "x", color="tab:red", label="infeasible")
    if data["floor"] is not None:
        ax.axvline(data["floor"]["ratio"], color="gray", linestyle="--", label=f"floor {_ratio(data['floor']['ratio'])}")
    ax.set_xlabel("budget (share of the unmanaged peak)")
    ax.set_ylabel("step time / unmanaged")
    where = f"simulated on {data['gpu']}" if data["device"] == "meta" else data["device"]
    ax.set_title(f"{os.path.basename(data['script'][0])}: {data['policy']}, {where}")
    ax.invert_xaxis()
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(args) -> int:
    """The command: checks everything it can before the first run; exit 2 on bad input."""
    t0 = time.perf_counter()
    try:
        ratios = parse_budgets(args.budgets)
        script = args.script[1:] if args.script[:1] == ["--"] else list(args.script)
        if not script:
            raise ProfileError("no script given; usage: pymem profile [--budgets 1.0,0.5] -- script.py [args...]")
        if not os.path.isfile(script[0]):
            raise ProfileError(f"cannot open script {script[0]!r}: no such file")
        if args.steps < 2:
            raise ProfileError(f"--steps {args.steps} is not accepted: at least 2 (the first step is not timed)")
        if args.policy not in POLICIES:
            raise ProfileError(f"--policy {args.policy!r} is not a policy; accepted: {', '.join(POLICIES)}")
        if args.offload is not None and args.offload not in DIRECTORS:
            raise ProfileError(f"--offload {args.offload!r} is not accepted; accepted: {', '.join(DIRECTORS)}")
        device = args.device or _default_device()
        if device.split(":")[0] not in ("cpu", "cuda", "meta"):
            raise ProfileError(f"--device {device!r} is not accepted; accepted: cpu, cuda, cuda:N, meta")
        if device == "meta":
            from .gpus import gpu_names

            if args.gpu not in gpu_names():
                raise ProfileError(f"--gpu {args.gpu!r} is not a GPU pymem models; accepted: {', '.join(gpu_names())}")
        if args.plot:
            try:
                import matplotlib  # noqa: F401
            except ImportError:
                raise ProfileError("--plot needs matplotlib: pip install 'torch-pymem[bench]'") from None
    except ProfileError as e:
        print(f"pymem profile: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    profiler = Profiler(script, args.steps, args.policy, args.offload, device, gpu=args.gpu)
    print(f"pymem profile: {' '.join(script)}, {args.steps} steps a run, budgets {','.join(map(str, ratios))}"
          f" of the unmanaged peak, policy {args.policy}, "
          + (f"simulated on {args.gpu}" if device == "meta" else f"device {device}"), file=sys.stderr)
    interrupted = False
    # Ended from outside: as Ctrl-C, no run left behind. SIGINT too, explicitly: a shell starts a
    # background job with SIGINT ignored, and Python then installs no handler of its own (a terminal
    # sends Ctrl-C only to its foreground job, so this answers only a deliberate kill -INT).
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _interrupt)
    try:
        profiler.run_unmanaged()
        for r in ratios:
            profiler.run_budget(r)
        profiler.bisect()
    except ScriptFailed as e:
        sys.stderr.write(e.stderr)
        print(f"pymem profile: {script[0]} failed unmanaged (exit code {e.code}); nothing to profile", file=sys.stderr)
        return e.code
    except ProfileError as e:
        print(f"pymem profile: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        interrupted = True
        print("\npymem profile: interrupted; the points measured so far:", file=sys.stderr)
    if profiler.unmanaged is None:
        return 130
    data = result(profiler, interrupted, time.perf_counter() - t0)
    print(table(profiler), end="")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2)
    if args.plot and profiler.points:
        plot(data, args.plot)
    return 130 if interrupted else 0


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"
