"""Regenerate every table and plot in benchmarks/results/.

    python benchmarks/run.py            # everything (about an hour on 2 CPU cores)
    python benchmarks/run.py --quick    # smaller budgets and fewer cases
    python benchmarks/run.py --only sim_speed search_quality

Each benchmark is a script of its own that writes its results (markdown with
the command that made it, JSON with the raw figures, plots where there are
any); this runner runs them in turn and stops at the first failure.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")

# name -> (script, full args, quick args)
BENCHMARKS = {
    "profile_accuracy": ("benchmarks/profile_accuracy.py", [], ["--quick"]),
    "sim_speed": ("benchmarks/sim_speed.py", [], ["--quick"]),
    "memory_accuracy": ("benchmarks/memory_accuracy.py", [], ["--quick"]),
    "sim_accuracy": ("benchmarks/sim_accuracy.py", [], ["--quick"]),
    "executor_overhead": ("benchmarks/executor_overhead.py", [], ["--quick"]),
    "real_speedup": ("benchmarks/real_speedup.py", [], ["--quick"]),
    "dp_steps": ("benchmarks/dp_steps.py", [], ["--quick"]),
    "loss_split": ("benchmarks/loss_split.py", [], ["--blocks", "2", "--steps", "5"]),
    "soak": ("benchmarks/soak.py", ["--runs", "100"], ["--runs", "8"]),
    "search_quality": ("benchmarks/search_quality.py", [], ["--quick"]),
    "long_context": ("benchmarks/long_context.py", [], ["--budget", "20"]),
    "native": ("benchmarks/native.py", [], ["--quick"]),
    "inception_case_study": ("examples/inception_case_study.py",
                             ["--budget", "120", "--out", "benchmarks/results/inception_case_study.md"],
                             ["--budget", "20", "--out", "benchmarks/results/inception_case_study.md"]),
    "nmt_case_study": ("examples/nmt_case_study.py",
                       ["--budget", "180", "--out", "benchmarks/results/nmt_case_study.md"],
                       ["--budget", "20", "--out", "benchmarks/results/nmt_case_study.md"]),
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--only", nargs="+", choices=sorted(BENCHMARKS))
    a = p.parse_args(argv)
    os.makedirs(RESULTS, exist_ok=True)
    for name in a.only or BENCHMARKS:
        script, full, quick = BENCHMARKS[name]
        cmd = [sys.executable, script] + (quick if a.quick else full)
        print(f"== {name}: {' '.join(cmd[1:])}", flush=True)
        t = time.time()
        r = subprocess.run(cmd, cwd=ROOT)
        print(f"== {name}: exit {r.returncode} after {time.time() - t:.0f} s", flush=True)
        if r.returncode != 0:
            return r.returncode
    return 0


if __name__ == "__main__":
    sys.exit(main())
