"""Bitwise tests under CPU contention: many copies at once of the tests that train below the
recompute floor with leaves offloaded, where copy completion decides what pymem does next (the rare
wrong result of session 39, 1 run in 10-60 there, not seen since). Not a test: a tool for the fault,
with restore verification on (``verify=True`` through ``PYMEM_VERIFY=1``, read by
tests/bitwise_harness.py), so a value that comes back wrong stops its run with RestoreMismatchError
naming it, where the run would otherwise end with weights a few ulps off.

    python bench/stress_bitwise.py [--copies 8] [--rounds 4] [--tests ID ...] [--no-verify]
                                   [--logs DIR] [--json FILE]

Each round starts ``--copies`` pytest processes at once and waits for them all. Printed: per round,
how many runs ended how (passed; wrong result: a bitwise comparison failed; mismatch: verification
caught a value; timeout: the harness's 60 s deadline, from the contention; out of budget: a run
whose copies completed in an order that left no room; other), and the logs of every run that did
not pass, kept in ``--logs``.
"""
import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_TESTS = ["tests/test_offload_leaves.py::test_a_transformer_trains_bitwise_below_the_recompute_floor",
                 "tests/test_offload_leaves.py::test_a_cnn_with_batchnorm_trains_bitwise_below_the_recompute_floor"]
# How a failed run ended, by what its log says (first match wins).
KINDS = [("mismatch", "RestoreMismatchError"), ("wrong result", "differs (max"), ("timeout", "RunTooLong"),
         ("out of budget", "OutOfBudgetError")]


def outcome(returncode: int, log: str) -> str:
    if returncode == 0:
        return "passed"
    for kind, marker in KINDS:
        if marker in log:
            return kind
    return "other"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--copies", type=int, default=8, help="pytest processes at once (default 8)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--tests", nargs="+", default=DEFAULT_TESTS, help="pytest node ids (default: the two "
                    "below-the-floor trainings of tests/test_offload_leaves.py)")
    ap.add_argument("--no-verify", action="store_true", help="leave restore verification off")
    ap.add_argument("--logs", default="stress_logs", help="where the logs of runs that did not pass go")
    ap.add_argument("--json", help="write the counts here")
    args = ap.parse_args()
    if args.copies < 1 or args.rounds < 1:
        ap.error("--copies and --rounds must be at least 1")
    os.makedirs(args.logs, exist_ok=True)
    env = dict(os.environ, PYMEM_VERIFY="0" if args.no_verify else "1")
    counts = dict.fromkeys(["passed", *(kind for kind, _ in KINDS), "other"], 0)
    kept = []
    t0 = time.time()
    for rnd in range(1, args.rounds + 1):
        procs = [subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args.tests],
                                  cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for _ in range(args.copies)]
        ended = {}
        for i, p in enumerate(procs):
            log, _ = p.communicate()
            kind = outcome(p.returncode, log)
            counts[kind] += 1
            ended[kind] = ended.get(kind, 0) + 1
            if kind != "passed":
                path = os.path.join(args.logs, f"round{rnd}_copy{i}_{kind.replace(' ', '_')}.log")
                with open(path, "w") as f:
                    f.write(log)
                kept.append(path)
        print(f"round {rnd}: " + ", ".join(f"{n} {k}" for k, n in sorted(ended.items())), flush=True)
    runs = args.copies * args.rounds
    print(f"{runs} runs of {len(args.tests)} test(s), {args.copies} at once, verify "
          f"{'off' if args.no_verify else 'on'}, {time.time() - t0:.0f} s: " +
          ", ".join(f"{n} {k}" for k, n in counts.items() if n))
    for path in kept:
        print("  log:", path)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"runs": runs, "copies": args.copies, "tests": args.tests, "verify": not args.no_verify,
                       "counts": counts, "logs": kept}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
