"""The `pymem` command (also `python -m pymem`).

  pymem demo   train a small GPT-style model twice (CPU, or --device cuda), unmanaged and under pymem
               with a budget of 40% of its peak, and show peak, budget, slowdown, evictions and that
               the losses and parameters match bitwise
  pymem run    pymem run --budget 2GB [--policy P] [--allocator native] [--offload D] [--no-prefetch] [--plan off] [--host-budget 64GB]
               -- script.py args...: the script under pymem,
               a memory summary at exit
  pymem trace  pymem trace MODEL_OR_SCRIPT --out step.npz [--batch N] [--dtype bf16]: one training step
               captured on the meta device (no memory): gpt2-xl, llama-7b, resnet152, hf:TYPE,
               hf:PATH/config.json, or a script.py (its second optimizer step)
  pymem sim    pymem sim --trace step.npz [--format pymem|simrd] --policy dtr [--offload D] [--plan auto|off]
               --budget 24GB | --budget-ratio 0.3 --device h100 [--json out.json]: replay the step
               under the budget at GPU scale
  pymem profile  pymem profile [--steps 6] [--budgets 1.0,0.7,0.5,0.3,0.2] [--policy P] [--offload D]
               [--device cpu|cuda|meta] [--gpu h100] [--json F] [--plot F.png] -- script.py args...:
               the script's slowdown under each budget, each run in a fresh process, and its lowest
               feasible budget (bisection to 2% of the peak)
  pymem info   version, build, CUDA library, device memory
"""
import argparse
import os
import sys

from .budget import format_bytes as _fmt
from .profile import DEFAULT_BUDGETS


def cmd_info(args) -> int:
    import torch

    import pymem
    from pymem import cuda_lib

    print(f"pymem {pymem.__version__} (torch {torch.__version__})")
    print(f"extension: {pymem._C.__file__}")
    path = cuda_lib.library_path()
    print(f"CUDA library: {path or 'not built (no CUDA toolkit at install time)'}")
    if torch.cuda.is_available():
        for d in range(torch.cuda.device_count()):
            free, total = torch.cuda.mem_get_info(d)
            print(f"cuda:{d} {torch.cuda.get_device_name(d)}: {_fmt(total)} total, {_fmt(free)} free")
    else:
        print("CUDA: not available")
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        print(f"cpu: {_fmt(total)} of memory, {os.cpu_count()} cores")
    except (ValueError, OSError):
        pass
    return 0


_DEMO_SIZES = {"cpu": (8, 128), "cuda": (64, 256)}  # batch, seq: a step of tens of ms on each


def cmd_demo(args) -> int:
    device = args.device or "cpu"
    if device not in _DEMO_SIZES:
        print(f"pymem demo: --device {device!r} is not a demo device; accepted: cpu, cuda", file=sys.stderr)
        return 2
    batch, seq = args.batch or _DEMO_SIZES[device][0], args.seq or _DEMO_SIZES[device][1]
    if device == "cuda":
        return _demo_cuda(args, batch, seq)

    import time

    import torch

    import pymem
    from pymem.demo_models import gpt_trainer

    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))  # also turns MKL's dynamic threads off
    steps = args.steps
    print(f"pymem demo: TinyGPT (4 layers, d=128, batch {batch} x seq {seq}), {steps} Adam steps on CPU")

    def unmanaged():
        """Losses, parameters, seconds and peak of the steps unmanaged, the allocations counted by
        a plain arena (no eviction) to learn the peak."""
        probe = pymem.Arena(8 << 30, small_threshold=0)
        pymem.install_cpu_hook(probe)
        try:
            step = gpt_trainer(batch=batch, seq=seq)
            losses, times = _timed_steps(step, steps, time)
            params = [p.detach().clone() for p in step.model.parameters()]
            del step
        finally:
            pymem.uninstall_cpu_hook()
        return losses, params, sum(times), probe.stats()["allocated_bytes.peak"]

    ref, ref_params, plain_s, peak = unmanaged()
    budget = int(peak * args.ratio)

    with pymem.budget(budget, device="cpu"):  # on a GPU machine too: the demo's tensors are the CPU's
        step = gpt_trainer(batch=batch, seq=seq)
        got, times = _timed_steps(step, steps, time)
        managed_s = sum(times)
        params = [p.detach().clone() for p in step.model.parameters()]
        del step
        st = pymem.memory_stats()
    again = None
    if not _same((got, params), (ref, ref_params)):
        # Is it pymem, or the unmanaged run itself? A second unmanaged run tells them apart.
        again = unmanaged()[:2]
    return _demo_report(args.ratio, peak, (ref, ref_params, plain_s), (got, params, managed_s), st, again)


def _same(a, b) -> bool:
    """(losses, parameters) pairs equal bitwise."""
    from pymem.testing import all_bitwise_equal

    return a[0] == b[0] and all_bitwise_equal(a[1], b[1])


def _demo_report(ratio, peak, unmanaged, managed, st, again=None) -> int:
    """Prints the demo's figures; 0 when pymem's run is bitwise an unmanaged one inside the budget.
    ``again``: a second unmanaged run's (losses, parameters), taken when the first did not match."""
    (ref, ref_params, plain_s), (got, params, managed_s) = unmanaged, managed
    same = _same((got, params), (ref, ref_params))
    print(f"  losses (unmanaged): {', '.join(f'{x:.6f}' for x in ref)}")
    print(f"  losses (pymem):     {', '.join(f'{x:.6f}' for x in got)}")
    print(f"  bitwise equal (losses and parameters): {'yes' if same else 'NO'}")
    if again is not None:
        twice, matches = _same(again, (ref, ref_params)), _same((got, params), again)
        print(f"  a second unmanaged run: {'the same bits as the first' if twice else 'other bits than the first'}; "
              f"pymem's run {'matches it' if matches else 'matches neither'}")
        if not twice:
            print("  (PyTorch itself did not reproduce its own run here: on this machine an op's rounding "
                  "varies from run to run)")
        same = same or matches
    print(f"  unmanaged peak {_fmt(peak)}; budget {_fmt(st['budget_bytes'])} ({ratio:.0%} of it); "
          f"pymem peak {_fmt(st['allocated_bytes.peak'])} (never above the budget)")
    print(f"  {st['num_evictions']} evictions, {st['num_rematerializations']} rematerializations "
          f"({st['remat_seconds']:.2f} s), {st['num_compactions']} compactions, "
          f"{_fmt(st.get('offloaded_bytes', 0))} offloaded")
    print(f"  slowdown {managed_s / plain_s:.2f}x ({managed_s:.2f} s vs {plain_s:.2f} s unmanaged)")
    ok = same and st["allocated_bytes.peak"] <= st["budget_bytes"]
    return 0 if ok else 1


def _demo_cuda(args, batch: int, seq: int) -> int:
    """On CUDA pymem's arena must replace PyTorch's allocator before CUDA starts, so the unmanaged
    reference (its peak, losses and parameters) runs in a child process first."""
    import subprocess
    import tempfile
    import time

    # deterministic cuBLAS (PyTorch's reproducibility notes); read when CUDA starts, so set first
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    import torch

    import pymem
    from pymem.demo_models import gpt_trainer
    from pymem.testing import deterministic_cuda

    if not torch.cuda.is_available():
        print("pymem demo: --device cuda, but CUDA is not available here", file=sys.stderr)
        return 2
    steps = args.steps
    deterministic_cuda()
    if args.reference_out:  # the child: unmanaged, PyTorch's caching allocator
        torch.cuda.reset_peak_memory_stats()
        step = gpt_trainer(batch=batch, seq=seq, device="cuda")
        losses, times = _timed_steps(step, steps, time)
        torch.save({"losses": losses, "seconds": sum(times[1:]), "peak": torch.cuda.max_memory_allocated(),
                    "params": [p.detach().cpu() for p in step.model.parameters()]}, args.reference_out)
        return 0
    print(f"pymem demo: TinyGPT (4 layers, d=128, batch {batch} x seq {seq}), {steps} Adam steps on CUDA "
          f"(the first step not timed)")
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "reference.pt")
        r = subprocess.run([sys.executable, "-m", "pymem", "demo", "--device", "cuda", "--steps", str(steps),
                            "--batch", str(batch), "--seq", str(seq), "--reference-out", out])
        if r.returncode:
            print(f"pymem demo: the unmanaged reference run failed (exit {r.returncode})", file=sys.stderr)
            return r.returncode
        ref = torch.load(out)
    peak = ref["peak"]
    with pymem.budget(int(peak * args.ratio), device="cuda"):
        step = gpt_trainer(batch=batch, seq=seq, device="cuda")
        got, times = _timed_steps(step, steps, time)
        params = [p.detach().cpu() for p in step.model.parameters()]
        del step
        st = pymem.memory_stats()
    print(f"  device: {torch.cuda.get_device_name()}")
    return _demo_report(args.ratio, peak, (ref["losses"], ref["params"], ref["seconds"]),
                        (got, params, sum(times[1:])), st)


def _timed_steps(step, steps, time):
    """Each step's loss (``.item()`` waits for the device) and wall time."""
    losses, times = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        losses.append(step())
        times.append(time.perf_counter() - t0)
    return losses, times


def cmd_run(args) -> int:
    """The script under pymem, enabled as the startup hook enables it: the flags checked before the
    script's first line (no torch imported), pymem enabled when the script imports torch."""
    import runpy

    from . import _startup

    script = args.script[1:] if args.script[:1] == ["--"] else args.script
    if not script:
        print("pymem run: no script given; usage: pymem run --budget 2GB [--policy P] -- script.py [args...]",
              file=sys.stderr)
        return 2
    if not os.path.isfile(script[0]):
        print(f"pymem run: cannot open script {script[0]!r}: no such file", file=sys.stderr)
        return 2
    flags = {"budget": args.budget, "policy": args.policy, "device": args.device, "allocator": args.allocator,
             "offload": args.offload, "prefetch": "0" if args.no_prefetch else "1", "plan": args.plan,
             "host_budget": args.host_budget, "offload_leaves": "0" if args.no_offload_leaves else None,
             "verify": "1" if args.verify else None}
    try:
        settings = _startup.check_settings(flags, lambda key: "--" + key.replace("_", "-"))
    except ValueError as e:
        print(f"pymem run: {e}", file=sys.stderr)
        return 2
    settings.pop("log")
    _startup.cancel_environment()  # PYMEM_* exported too: the flags win
    _startup.when_torch_imported(settings, fail=lambda e: _startup.stop(f"pymem run: {e}"))
    sys.argv = list(script)
    sys.path.insert(0, os.path.dirname(os.path.abspath(script[0])))
    code = 0
    try:
        runpy.run_path(script[0], run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        if "torch" in sys.modules:
            import pymem

            pymem.disable()
            print(pymem.memory_summary(), file=sys.stderr, end="")
        else:
            print("pymem run: the script never imported torch; pymem was not enabled", file=sys.stderr)
    return code


def cmd_trace(args) -> int:
    import torch

    from .sim.capture import capture_model, capture_script

    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    try:
        if args.model.endswith(".py"):
            if not os.path.isfile(args.model):
                raise ValueError(f"cannot open script {args.model!r}: no such file")
            trace = capture_script(args.model, args.script_args)
        else:
            trace = capture_model(args.model, batch=args.batch, dtype=dtypes[args.dtype])
        trace.save(args.out)
    except (ValueError, OSError) as e:
        print(f"pymem trace: {e}", file=sys.stderr)
        return 2
    batch = f" (batch {trace.meta['batch']})" if "batch" in trace.meta else ""  # figures differ by batch: say which
    print(f"pymem trace: {trace.meta.get('model', args.model)}{batch}: {trace.num_ops} ops, {trace.num_values} values, "
          f"backward from op {trace.backward_at}, {trace.op_flops.sum() / 1e12:.1f} TFLOP, "
          f"peak {_fmt(trace.peak_bytes())} unmanaged -> {args.out}")
    return 0


def cmd_sim(args) -> int:
    import json

    from .budget import parse_budget
    from .sim.bound import lower_bound
    from .sim.replay import simulate
    from .sim.simrd import load_simrd
    from .sim.trace import Trace, TraceError

    try:
        trace = Trace.load(args.trace) if args.format == "pymem" else load_simrd(args.trace, args.time_unit)
        if (args.budget is None) == (args.budget_ratio is None):
            raise ValueError("give one of --budget (e.g. 24GB) or --budget-ratio (a share of the unmanaged peak, e.g. 0.3)")
        peak = trace.peak_bytes()
        if args.budget is not None:
            budget = parse_budget(args.budget, total=peak)
        elif not 0 < args.budget_ratio:
            raise ValueError(f"--budget-ratio must be positive, got {args.budget_ratio}")
        else:
            budget = int(peak * args.budget_ratio)
        device = None if args.device == "recorded" else args.device
        out = simulate(trace, budget, policy=args.policy, offload=args.offload, plan=args.plan, device=device)
        out["lower_bound"] = lower_bound(trace, budget, device)  # what no policy could beat here
    except (ValueError, OSError, TraceError) as e:
        print(f"pymem sim: {e}", file=sys.stderr)
        return 2
    out["unmanaged_peak_bytes"] = peak
    text = json.dumps(out, indent=2)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    print(text)
    return 0 if out["status"] == "ok" else 1


def cmd_profile(args) -> int:
    from .profile import run

    return run(args)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="pymem", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="train a small GPT through the pymem arena (CPU, or --device cuda)")
    d.add_argument("--steps", type=int, default=3)
    d.add_argument("--batch", type=int, default=None, help="default 8 on CPU, 64 on CUDA")
    d.add_argument("--seq", type=int, default=None, help="default 128 on CPU, 512 on CUDA")
    d.add_argument("--device", default="cpu", help="cpu (the default) or cuda")
    d.add_argument("--reference-out", default=None, help=argparse.SUPPRESS)  # the CUDA demo's unmanaged child
    d.add_argument("--ratio", type=float, default=0.4, help="budget as a share of the unmanaged peak")
    d.set_defaults(fn=cmd_demo)
    r = sub.add_parser("run", help="run a script under pymem: pymem run --budget 2GB -- script.py args...")
    r.add_argument("--budget", required=True, help='e.g. "20GB", "20GiB", "512MB", "80%%", or bytes')
    r.add_argument("--policy", default="dtr")
    r.add_argument("--device", default=None, help="cpu or cuda (default: CUDA when available)")
    r.add_argument("--allocator", default=None, help="arena (the default) or native: see pymem.enable")
    r.add_argument("--offload", default=None,
                   help="delta (the CUDA default), never (the CPU default) or always: see pymem.enable")
    r.add_argument("--no-prefetch", action="store_true", help="copy offloaded values back only when used")
    r.add_argument("--plan", default="auto",
                   help="auto (the default): plan each training step from the one before; off: the policy alone (see pymem.enable)")
    r.add_argument("--no-offload-leaves", action="store_true",
                   help="never offload values with no recipe (gradients, optimizer state): see pymem.enable")
    r.add_argument("--host-budget", default=None,
                   help='cap on host memory for offloaded values, e.g. "64GB" or "50%%" of RAM (default: none)')
    r.add_argument("--verify", action="store_true",
                   help="check each value pymem releases as it comes back: a mismatch stops the program (see pymem.enable)")
    r.add_argument("script", nargs=argparse.REMAINDER, help="the script and its arguments (after --)")
    r.set_defaults(fn=cmd_run)
    t = sub.add_parser("trace", help="capture one training step on the meta device: pymem trace gpt2-xl --out step.npz")
    t.add_argument("model", help="gpt2-xl, llama-7b, resnet152, hf:TYPE, hf:PATH/config.json, or script.py")
    t.add_argument("--out", required=True, help="the trace file to write (.npz)")
    t.add_argument("--batch", type=int, default=None, help="batch size (default: the model's)")
    t.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    t.add_argument("script_args", nargs="*", help="a script's arguments (after --)")
    t.set_defaults(fn=cmd_trace)
    s = sub.add_parser("sim", help="replay a trace under a budget at GPU scale")
    s.add_argument("--trace", required=True)
    s.add_argument("--format", default="pymem", choices=("pymem", "simrd"))
    s.add_argument("--policy", default="dtr")
    s.add_argument("--offload", default="never", help="never (the default), delta, capuchin or always")
    s.add_argument("--plan", default="off", choices=("auto", "off"))
    s.add_argument("--budget", default=None, help='bytes ("24GB") or a share of the unmanaged peak ("30%%")')
    s.add_argument("--budget-ratio", type=float, default=None, help="a share of the trace's unmanaged peak")
    s.add_argument("--device", default="h100",
                   help="a GPU of pymem.gpus (h100, h200, gh200, a100, l4) or 'recorded': the trace's own op costs")
    s.add_argument("--time-unit", type=float, default=1e-6, help="seconds per TIME unit of a simrd log")
    s.add_argument("--json", default=None, help="also write the result here")
    s.set_defaults(fn=cmd_sim)
    pr = sub.add_parser("profile", help="slowdown against budget for your script, and its lowest feasible budget",
                        allow_abbrev=False)  # "--budget 0.5" must not pass for --budgets
    pr.add_argument("--steps", type=int, default=6, help="training steps a run (the first is not timed)")
    pr.add_argument("--budgets", default=",".join(map(str, DEFAULT_BUDGETS)),
                    help="shares of the unmanaged peak, comma-separated, each in (0, 1]")
    pr.add_argument("--policy", default="dtr")
    pr.add_argument("--offload", default=None, help="delta, never, always or capuchin (default: by device)")
    pr.add_argument("--device", default=None,
                    help="cpu, cuda (default: CUDA when available) or meta: simulate the GPU named by --gpu")
    pr.add_argument("--gpu", default="h100", help="with --device meta: h100, h200, gh200, a100 or l4")
    pr.add_argument("--json", default=None, help="also write the points here")
    pr.add_argument("--plot", default=None, help="draw slowdown against budget here (.png; needs matplotlib)")
    pr.add_argument("script", nargs=argparse.REMAINDER, help="the script and its arguments (after --)")
    pr.set_defaults(fn=cmd_profile)
    i = sub.add_parser("info", help="version, build, CUDA library, device memory")
    i.set_defaults(fn=cmd_info)
    args = ap.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
