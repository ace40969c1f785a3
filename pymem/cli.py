"""The `pymem` command (also `python -m pymem`).

  pymem demo   train a small GPT-style model on CPU twice, unmanaged and with every tensor served
               from a pymem arena, and show the arena's figures and that the losses match bitwise
  pymem info   version, build, CUDA library, device memory
"""
import argparse
import os
import sys


def _fmt(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


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
    import torch

    import pymem
    from pymem.demo_models import gpt_trainer

    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    steps = args.steps
    print(f"pymem demo: TinyGPT (4 layers, d=128, batch {args.batch} x seq {args.seq}), {steps} Adam steps on CPU")

    step = gpt_trainer(batch=args.batch, seq=args.seq)
    ref = [step() for _ in range(steps)]
    ref_params = [p.detach().clone() for p in step.model.parameters()]
    del step

    # Size the arena from a measuring run: everything the run allocates, plus 10% headroom.
    probe = pymem.Arena(8 << 30, small_threshold=0)
    pymem.install_cpu_hook(probe)
    try:
        s = gpt_trainer(batch=args.batch, seq=args.seq)
        for _ in range(steps):
            s()
        del s
    finally:
        pymem.uninstall_cpu_hook()
    peak = probe.stats()["allocated_bytes.peak"]
    budget = (int(peak * 1.10) + 511) // 512 * 512

    arena = pymem.Arena(budget)
    pymem.install_cpu_hook(arena)
    try:
        step = gpt_trainer(batch=args.batch, seq=args.seq)
        got = [step() for _ in range(steps)]
        params = [p.detach().clone() for p in step.model.parameters()]
        del step
    finally:
        pymem.uninstall_cpu_hook()
    st = arena.stats()

    same = got == ref and all(torch.equal(a, b) for a, b in zip(params, ref_params))
    print(f"  losses (unmanaged): {', '.join(f'{x:.6f}' for x in ref)}")
    print(f"  losses (arena):     {', '.join(f'{x:.6f}' for x in got)}")
    print(f"  bitwise equal (losses and parameters): {'yes' if same else 'NO'}")
    print(f"  budget {_fmt(budget)}; arena peak {_fmt(st['allocated_bytes.peak'])} "
          f"({st['allocated_bytes.peak'] / budget:.1%} of the budget, never above it)")
    print(f"  {st['num_allocs']} allocations, {st['num_frees']} frees, "
          f"fragmentation now {st['fragmentation.largest_free']:.1%} (1 - largest free / free)")
    try:
        pymem.install_cpu_hook(pymem.Arena((budget // 4 + 511) // 512 * 512))
        gpt_trainer(batch=args.batch, seq=args.seq)()
        print("  a quarter of the budget: no error?!")
        same = False
    except pymem.OutOfBudgetError as e:
        print(f"  a quarter of the budget without eviction: {type(e).__name__}: {str(e)[:110]}...")
    finally:
        pymem.uninstall_cpu_hook()
    return 0 if same else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="pymem", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="train a small GPT on CPU through the pymem arena")
    d.add_argument("--steps", type=int, default=3)
    d.add_argument("--batch", type=int, default=8)
    d.add_argument("--seq", type=int, default=128)
    d.set_defaults(fn=cmd_demo)
    i = sub.add_parser("info", help="version, build, CUDA library, device memory")
    i.set_defaults(fn=cmd_info)
    args = ap.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
