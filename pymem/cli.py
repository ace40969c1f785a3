"""The `pymem` command (also `python -m pymem`).

  pymem demo   train a small GPT-style model on CPU twice, unmanaged and under pymem with a budget
               of 40% of its peak, and show peak, budget, slowdown, evictions and that the losses
               and parameters match bitwise
  pymem run    pymem run --budget 2GB [--policy P] [--allocator native] [--offload D] [--no-prefetch] [--plan off] [--host-budget 64GB]
               -- script.py args...: the script under pymem,
               a memory summary at exit
  pymem info   version, build, CUDA library, device memory
"""
import argparse
import os
import sys

from .api import format_bytes as _fmt


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


def cmd_demo(args) -> int:
    import time

    import torch

    import pymem
    from pymem.demo_models import gpt_trainer
    from pymem.testing import all_bitwise_equal

    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    steps = args.steps
    print(f"pymem demo: TinyGPT (4 layers, d=128, batch {args.batch} x seq {args.seq}), {steps} Adam steps on CPU")

    # Unmanaged, with the allocations counted by a plain arena (no eviction) to learn the peak.
    probe = pymem.Arena(8 << 30, small_threshold=0)
    pymem.install_cpu_hook(probe)
    try:
        step = gpt_trainer(batch=args.batch, seq=args.seq)
        t0 = time.perf_counter()
        ref = [step() for _ in range(steps)]
        plain_s = time.perf_counter() - t0
        ref_params = [p.detach().clone() for p in step.model.parameters()]
        del step
    finally:
        pymem.uninstall_cpu_hook()
    peak = probe.stats()["allocated_bytes.peak"]
    budget = int(peak * args.ratio)

    with pymem.budget(budget):
        step = gpt_trainer(batch=args.batch, seq=args.seq)
        t0 = time.perf_counter()
        got = [step() for _ in range(steps)]
        managed_s = time.perf_counter() - t0
        params = [p.detach().clone() for p in step.model.parameters()]
        del step
        st = pymem.memory_stats()

    same = got == ref and all_bitwise_equal(params, ref_params)
    print(f"  losses (unmanaged): {', '.join(f'{x:.6f}' for x in ref)}")
    print(f"  losses (pymem):     {', '.join(f'{x:.6f}' for x in got)}")
    print(f"  bitwise equal (losses and parameters): {'yes' if same else 'NO'}")
    print(f"  unmanaged peak {_fmt(peak)}; budget {_fmt(st['budget_bytes'])} ({args.ratio:.0%} of it); "
          f"pymem peak {_fmt(st['allocated_bytes.peak'])} (never above the budget)")
    print(f"  {st['num_evictions']} evictions, {st['num_rematerializations']} rematerializations "
          f"({st['remat_seconds']:.2f} s), {st['num_compactions']} compactions")
    print(f"  slowdown {managed_s / plain_s:.2f}x ({managed_s:.2f} s vs {plain_s:.2f} s unmanaged)")
    ok = same and st["allocated_bytes.peak"] <= st["budget_bytes"]
    return 0 if ok else 1


def cmd_run(args) -> int:
    import runpy

    import pymem

    script = args.script[1:] if args.script[:1] == ["--"] else args.script
    if not script:
        print("pymem run: no script given; usage: pymem run --budget 2GB [--policy P] -- script.py [args...]",
              file=sys.stderr)
        return 2
    if not os.path.isfile(script[0]):
        print(f"pymem run: cannot open script {script[0]!r}: no such file", file=sys.stderr)
        return 2
    try:
        pymem.enable(args.budget, policy=args.policy, device=args.device, allocator=args.allocator,
                     offload=args.offload, prefetch=not args.no_prefetch, plan=args.plan,
                     host_budget=args.host_budget, offload_leaves=False if args.no_offload_leaves else None)
    except (ValueError, RuntimeError) as e:
        print(f"pymem run: {e}", file=sys.stderr)
        return 2
    sys.argv = list(script)
    sys.path.insert(0, os.path.dirname(os.path.abspath(script[0])))
    code = 0
    try:
        runpy.run_path(script[0], run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        pymem.disable()
        print(pymem.memory_summary(), file=sys.stderr, end="")
    return code


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="pymem", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="train a small GPT on CPU through the pymem arena")
    d.add_argument("--steps", type=int, default=3)
    d.add_argument("--batch", type=int, default=8)
    d.add_argument("--seq", type=int, default=128)
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
    r.add_argument("--plan", default="auto", choices=("auto", "off"),
                   help="auto (the default): plan each training step from the one before; off: the policy alone (see pymem.enable)")
    r.add_argument("--no-offload-leaves", action="store_true",
                   help="never offload values with no recipe (gradients, optimizer state): see pymem.enable")
    r.add_argument("--host-budget", default=None,
                   help='cap on host memory for offloaded values, e.g. "64GB" or "50%%" of RAM (default: none)')
    r.add_argument("script", nargs=argparse.REMAINDER, help="the script and its arguments (after --)")
    r.set_defaults(fn=cmd_run)
    i = sub.add_parser("info", help="version, build, CUDA library, device memory")
    i.set_defaults(fn=cmd_info)
    args = ap.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
