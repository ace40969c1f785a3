"""What ``PYMEM_BUDGET`` exported for every process costs one that never touches a tensor (issue 19).

    python bench/startup_bench.py [--pairs 40] [--json FILE]

Times ``python -c pass`` as a whole process without the variable and with ``PYMEM_BUDGET=8GB``, in
turn (A B A B ..., so a drift of the machine's speed hits both), and prints the medians and the
median of the pairwise ratios. The same for ``import torch`` (where pymem is enabled, so its cost
there is what enabling costs). Target: the ``pass`` ratio at most 1.3x.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

TARGET = 1.3


def timed(code: str, env) -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], env=env, check=True)
    return time.perf_counter() - t0


def paired(code: str, pairs: int):
    plain = {k: v for k, v in os.environ.items() if not k.startswith("PYMEM_")}
    managed = dict(plain, PYMEM_BUDGET="8GB", PYMEM_DEVICE="cpu")
    timed(code, plain), timed(code, managed)  # warm the page cache
    a, b = [], []
    for _ in range(pairs):
        a.append(timed(code, plain))
        b.append(timed(code, managed))
    return {"plain_s": statistics.median(a), "with_budget_s": statistics.median(b),
            "ratio": statistics.median(y / x for x, y in zip(a, b))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=40)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    check = subprocess.run([sys.executable, "-c", "import sys; print('torch' in sys.modules)"],
                           env=dict(os.environ, PYMEM_BUDGET="8GB"), capture_output=True, text=True)
    if check.returncode != 0 or check.stdout.strip() != "False":
        sys.exit("the startup hook is not installed here, or imports torch: "
                 f"{check.stdout.strip()} {check.stderr.strip()} (pip install --no-build-isolation -e .)")
    out = {}
    for name, code, pairs in (("pass", "pass", args.pairs), ("import torch", "import torch", max(4, args.pairs // 8))):
        r = out[name] = paired(code, pairs)
        print(f"python -c {code!r:16} plain {r['plain_s'] * 1e3:7.1f} ms   PYMEM_BUDGET=8GB "
              f"{r['with_budget_s'] * 1e3:7.1f} ms   ratio {r['ratio']:.3f}x ({pairs} pairs)")
    met = out["pass"]["ratio"] <= TARGET
    print(f"target: PYMEM_BUDGET=8GB python -c pass at most {TARGET}x -> {'met' if met else 'NOT met'}")
    out["target"] = {"pass_ratio_at_most": TARGET, "met": met}
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
