"""One run of ``pymem profile``: the user's script, in this fresh process, for N training steps,
unmanaged or under one budget; what it measured goes to the parent as JSON lines on a pipe.

    PYMEM_PROFILE='{"fd": 5, "steps": 4, "budget": null, "device": "cpu", ...}' \\
        python -m pymem.profile_run script.py args...

A step ends at an optimizer's ``step()`` or at ``pymem.step()`` (once the script calls it, only
its marks count, so a loop that has both is not counted twice). Events, one JSON object a line:
``{"event": "step", "step": k}`` at each boundary; then one of ``done`` (N steps: the figures),
``oom`` (``pymem.OutOfBudgetError``), ``ended`` (the script returned before N steps) or ``error``
(it raised something else; its traceback is on stderr). At ``done`` the process ends at once
(``os._exit``): the rest of the script does not run.
"""
import hashlib
import json
import os
import runpy
import sys
import time
import traceback

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

import pymem
from pymem import api


class _Run:
    def __init__(self, config: dict):
        self.steps = int(config["steps"])
        self.budget = config.get("budget")
        self.device = config["device"]
        self.policy, self.offload = config.get("policy", "dtr"), config.get("offload")
        self.out = os.fdopen(int(config["fd"]), "w", buffering=1)
        self.times = []          # perf_counter at each boundary, the start first
        self.explicit = False    # the script calls pymem.step(): only those count
        self.optimizers = {}     # id -> optimizer, for the parameters' digest
        self.first = None        # the counters at the first boundary (the timed steps come after it)
        self.probe = None        # unmanaged on the CPU: an arena that counts bytes and releases nothing

    def start(self) -> None:
        if self.budget is None:
            if self.device.startswith("cuda"):
                torch.cuda.reset_peak_memory_stats()
            else:
                total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
                self.probe = pymem.Arena(total - total % 512, small_threshold=0)
                pymem.install_cpu_hook(self.probe)
        else:
            pymem.enable(self.budget, policy=self.policy, device=self.device, offload=self.offload)
        register_optimizer_step_post_hook(self._after_optimizer)
        api.step_observers.append(self._after_mark)
        self.times.append(time.perf_counter())

    def _after_optimizer(self, optimizer, args, kwargs) -> None:
        self.optimizers[id(optimizer)] = optimizer
        if not self.explicit:
            self._boundary()

    def _after_mark(self) -> None:
        if not self.explicit:  # from now on only the marks count: restart the count at this one
            self.explicit = True
            self.times = self.times[:1]
            self.first = None
        self._boundary()

    def _boundary(self) -> None:
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()  # a step ends when its kernels do, not when Python queued them
        self.times.append(time.perf_counter())
        k = len(self.times) - 1
        self.send(event="step", step=k)
        if k == 1:
            self.first = self.counters()
        if k >= self.steps:
            self.finish()

    def counters(self) -> dict:
        if self.budget is None:
            if self.probe is not None:
                peak = self.probe.stats()["allocated_bytes.peak"]
            else:
                peak = torch.cuda.max_memory_allocated()
            return {"peak_bytes": int(peak), "evictions": 0, "recompute_seconds": 0.0, "offloaded_bytes": 0}
        s = pymem.memory_stats()
        return {"peak_bytes": int(s["allocated_bytes.peak"]), "budget_bytes": int(s["budget_bytes"]),
                "evictions": int(s.get("num_evictions", 0)), "recompute_seconds": float(s.get("remat_seconds", 0.0)),
                "offloaded_bytes": int(s.get("offloaded_bytes", 0))}

    def parameters_digest(self):
        if not self.optimizers:
            return None
        h = hashlib.sha256()
        with torch.no_grad():
            for opt in self.optimizers.values():
                for group in opt.param_groups:
                    for p in group["params"]:
                        h.update(p.detach().reshape(-1).cpu().contiguous().view(torch.uint8).numpy().tobytes())
        return h.hexdigest()

    def finish(self) -> None:
        last = self.counters()
        timed = self.steps - 1
        per_step = [b - a for a, b in zip(self.times[1:], self.times[2:])]
        per_step.sort()
        figures = {"step_seconds": per_step[len(per_step) // 2],
                   "peak_bytes": last["peak_bytes"], "budget_bytes": last.get("budget_bytes"),
                   **{k: (last[k] - self.first[k]) / timed for k in ("evictions", "recompute_seconds", "offloaded_bytes")},
                   "parameters_sha256": self.parameters_digest()}
        sys.stdout.flush()
        sys.stderr.flush()
        self.send(event="done", **figures)
        os._exit(0)

    def send(self, **event) -> None:
        self.out.write(json.dumps(event) + "\n")
        self.out.flush()


def _is_out_of_budget(e: BaseException) -> bool:
    while e is not None:  # raised inside an op, it may come wrapped
        if isinstance(e, pymem.OutOfBudgetError):
            return True
        e = e.__cause__ or e.__context__
    return False


def main() -> int:
    config = json.loads(os.environ.pop("PYMEM_PROFILE"))
    run = _Run(config)
    script = sys.argv[1:]
    sys.argv = list(script)
    sys.path.insert(0, os.path.dirname(os.path.abspath(script[0])))
    run.start()
    try:
        runpy.run_path(script[0], run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if code != 0:
            run.send(event="error", code=code, steps=len(run.times) - 1)
            return code
    except BaseException as e:  # noqa: BLE001 — reported to the parent, traceback as the script's
        if _is_out_of_budget(e):
            run.send(event="oom", message=str(e).splitlines()[0], steps=len(run.times) - 1)
            return 0
        traceback.print_exc()
        run.send(event="error", code=1, steps=len(run.times) - 1)
        return 1
    run.send(event="ended", steps=len(run.times) - 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
