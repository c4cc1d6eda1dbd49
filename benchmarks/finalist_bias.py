"""Do the finalists time a plan as its training does?  One plan, two ways, in one launch.

    .venv/bin/python benchmarks/finalist_bias.py                 # wide_mlp, alexnet, rnnlm
    .venv/bin/python benchmarks/finalist_bias.py --only wide_mlp

``parallelize`` measures its finalists on fresh runtimes (``flexflow.finalists.measure``)
and fits the cost model's corrections to them; the benchmarks then time the module it
returns.  If the first timing were systematically slower than the second, the corrected
prediction would carry that bias.  Here, on 2 gloo processes (one thread each), for the plan
``parallelize`` chose:

- ``finalist``: a fresh finalist runtime of the plan (``measure._Run``), as ``measure``
  builds it: steps of zero_grad, forward, backward, optimizer step and a read of the loss;
- ``trained``: the ``ParallelModule`` that ``parallelize`` returned, stepped as
  ``real_speedup.py`` steps it (no read of the loss).

The two alternate in ``--trials`` pairs of ``--steps`` steps each; every step is timed alone
between barriers and counts at its slower rank (a step and the next cannot overlap, so
both ways time the same thing).  Reported per model: each trial's median step of either
way and their ratio (finalist / trained), and the median ratio.  Writes
``benchmarks/results/finalist_bias.md`` and ``.json``.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import flexflow as ff  # noqa: E402
from flexflow.finalists.measure import _barrier, _Run  # noqa: E402
from executor_overhead import _Trainer  # noqa: E402
from real_speedup import CASES, build  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "finalist_bias"


def _worker(rank: int, name: str, batch: int, trials: int, steps: int, budget: float) -> dict:
    torch.set_num_threads(1)
    module, inputs = build(name, batch)
    graph = ff.trace(module, inputs)
    machine = ff.Machine.detect().with_devices(2)
    chosen = ff.parallelize(module, example_inputs=inputs, budget=budget, machine=machine)
    f = next(f for f in chosen.plan.finalists if f.name == chosen.plan.chosen)
    trained = _Trainer(chosen, inputs)
    trained.steps(3)
    out = {"plan": f.name, "finalist": [], "trained": []}
    for _ in range(trials):
        run = _Run(f, graph, module, list(range(2)), torch.device("cpu"), 60.0, 25.0, "with_gradients", "sgd")
        run.steps(2, inputs, {})  # measure.WARMUP
        ts = []
        for _ in range(steps):
            _barrier()
            t0 = time.perf_counter()
            run.steps(1, inputs, {})
            ts.append(time.perf_counter() - t0)
        out["finalist"].append(ts)
        run.close()
        ts = []
        for _ in range(steps):
            _barrier()
            ts.append(trained.steps(1))
        out["trained"].append(ts)
    return out


def measure(name: str, batch: int, trials: int, steps: int, budget: float) -> dict:
    res = ff.launch(_worker, 2, name, batch, trials, steps, budget, timeout_s=900)
    row = {"model": name, "batch": batch, "plan": res[0]["plan"], "trials": []}
    for t in range(trials):
        fin = statistics.median(max(a, b) for a, b in zip(res[0]["finalist"][t], res[1]["finalist"][t]))
        tr = statistics.median(max(a, b) for a, b in zip(res[0]["trained"][t], res[1]["trained"][t]))
        row["trials"].append({"finalist_ms": fin * 1e3, "trained_ms": tr * 1e3, "ratio": fin / tr})
    row["median_ratio"] = statistics.median(t["ratio"] for t in row["trials"])
    return row


def write(rows: list[dict], command: str, seconds: float) -> None:
    L = ["# Finalist timing against training timing, the same plan", "",
         f"Command: `{command}` ({seconds:.0f} s; torch {torch.__version__}, {platform.machine()}, 2 processes, "
         "one thread each).", "",
         ("Each trial: a fresh finalist runtime of the plan `parallelize` chose (as `flexflow.finalists.measure` "
          "builds and steps it), then the module `parallelize` returned (as `real_speedup.py` steps it); every "
          "step timed alone between barriers, at its slower rank; medians per trial. Ratio: finalist / trained."),
         "", "| model | plan | trial | finalist ms | trained ms | ratio |", "|---|---|---:|---:|---:|---:|"]
    for r in rows:
        for i, t in enumerate(r["trials"]):
            L.append(f"| {r['model']} | {r['plan']} | {i + 1} | {t['finalist_ms']:.2f} | {t['trained_ms']:.2f} | "
                     f"{t['ratio']:.3f} |")
    L += ["", "| model | median ratio |", "|---|---:|"]
    L += [f"| {r['model']} | {r['median_ratio']:.3f} |" for r in rows]
    OUT.with_suffix(".md").write_text("\n".join(L) + "\n")
    OUT.with_suffix(".json").write_text(json.dumps({"command": command, "rows": rows}, indent=1))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", nargs="*", help="models (default: wide_mlp alexnet rnnlm)")
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--budget", type=float, default=5.0, help="parallelize's search budget, seconds")
    a = p.parse_args(argv)
    names = a.only or ["wide_mlp", "alexnet", "rnnlm"]
    t0 = time.perf_counter()
    rows = []
    for name, batch in CASES:
        if name in names:
            rows.append(measure(name, batch, a.trials, a.steps, a.budget))
            print(name, rows[-1]["plan"], [round(t["ratio"], 3) for t in rows[-1]["trials"]], flush=True)
    command = "python benchmarks/finalist_bias.py" + ("" if argv is None and len(sys.argv) == 1 else
                                                     " " + " ".join(argv if argv is not None else sys.argv[1:]))
    write(rows, command, time.perf_counter() - t0)


if __name__ == "__main__":
    main()
