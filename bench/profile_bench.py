"""How long ``pymem profile`` takes on the demo model with the five default budgets and the
bisection (issue 19's target: under 3 minutes on the development machine).

    python bench/profile_bench.py [--steps 6] [--json FILE]

Runs ``python -m pymem profile --steps N -- bench/demo_train.py`` as a user would, prints its table
and the wall time, and writes the profile's own JSON plus the time to FILE.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

TARGET_SECONDS = 180
HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "profile.json")
        env = dict(os.environ, PYTHONPATH=os.path.dirname(HERE) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        t0 = time.perf_counter()
        p = subprocess.run([sys.executable, "-m", "pymem", "profile", "--steps", str(args.steps), "--json", out,
                            "--", os.path.join(HERE, "demo_train.py")], env=env)
        seconds = time.perf_counter() - t0
        if p.returncode != 0:
            return p.returncode
        with open(out, encoding="utf-8") as f:
            data = json.load(f)
    runs = 1 + len(data["points"])
    met = seconds <= TARGET_SECONDS
    print(f"pymem profile on the demo model: {runs} runs (unmanaged, {len(data['points'])} budgets), "
          f"{seconds:.1f} s wall; target under {TARGET_SECONDS} s -> {'met' if met else 'NOT met'}")
    if args.json:
        data["wall_seconds"], data["target_seconds"], data["met"] = seconds, TARGET_SECONDS, met
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
