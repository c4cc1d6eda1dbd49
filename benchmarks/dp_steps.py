"""Data parallel step by step: DDP against flexflow, per-step medians and tails.

    .venv/bin/python benchmarks/dp_steps.py            # about a minute
    .venv/bin/python benchmarks/dp_steps.py --quick

On 2 gloo processes (one thread each), for each model: DDP on the plain
module (each rank its half of the batch), flexflow data parallel (the
global loss on every rank, riding on the gradient all-reduce: the default)
and flexflow data parallel with ``reduce_outputs="eager"`` (the loss
all-reduced on its own, one more collective).  Blocks of ``--steps`` steps alternate
between the three; every step is timed on its own (zero_grad, forward,
backward, SGD step, loss.item()), and the table gives the median, mean,
90th and 99th percentile per rank.  A median says what a step costs when
nothing goes wrong; the mean and the tail say how often a rank waits for a
peer woken late (what a round-based throughput figure also counts).
Writes ``benchmarks/results/dp_steps.md`` and ``.json``.
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import flexflow as ff  # noqa: E402
from flexflow.api import parallelize  # noqa: E402
from flexflow.launch import launch  # noqa: E402
from flexflow.hardware.machine import Machine  # noqa: E402
from flexflow.strategy.strategy import Strategy  # noqa: E402

CASES = [("alexnet", 64), ("transformer", 32), ("rnnlm", 32)]


def dp_setup(rank: int, name: str, batch: int):
    """In a rank of 2 (one thread): the zoo model (small), its global inputs, data
    parallelism on 2 cpu devices, and this rank's half of the inputs (what DDP takes)."""
    torch.set_num_threads(1)
    module, inputs = ff.models.get(name, batch_size=batch, size="small")
    graph = ff.trace(module, inputs)
    strategy = Strategy.data_parallel(graph, Machine.preset("cpu", devices=2))
    lo, hi = rank * batch // 2, (rank + 1) * batch // 2
    return module, inputs, strategy, tuple(x[lo:hi] for x in inputs)


def _worker(rank: int, name: str, batch: int, blocks: int, steps: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP
    module, inputs, strategy, half = dp_setup(rank, name, batch)
    runs = {"ddp": (DDP(copy.deepcopy(module)), half),
            "flexflow": (parallelize(module, example_inputs=inputs, strategy=strategy), inputs),
            "flexflow_eager": (parallelize(module, example_inputs=inputs, strategy=strategy,
                                           reduce_outputs="eager"), inputs)}
    return alternating_blocks(runs, blocks, steps)


def alternating_blocks(runs: dict, blocks: int, steps: int) -> dict:
    """In every rank of a running group: label -> seconds of each step of ``runs`` (label ->
    (model, its inputs)), SGD, in blocks of ``steps`` steps that alternate between the
    models between barriers; a first block warms up.  Each step: zero_grad, forward,
    backward, SGD step, loss.item()."""
    import torch.distributed as dist
    opts = {k: torch.optim.SGD(m.parameters(), lr=0.01) for k, (m, _) in runs.items()}
    times = {k: [] for k in runs}
    for block in range(blocks + 1):
        for k, (model, inp) in runs.items():
            dist.barrier()
            for _ in range(steps):
                t0 = time.perf_counter()
                opts[k].zero_grad()
                loss = model(*inp)
                loss.backward()
                opts[k].step()
                loss.item()
                if block:
                    times[k].append(time.perf_counter() - t0)
    return times


def _stats(v: list) -> dict:
    s = sorted(v)

    def q(p):
        return s[int(p * (len(s) - 1))] * 1e3
    return {"median_ms": q(0.5), "mean_ms": statistics.mean(v) * 1e3, "p90_ms": q(0.9), "p99_ms": q(0.99),
            "steps": len(v)}


def block_args(argv, doc: str, name: str, quick_help: str = "2 blocks of 5 steps"):
    """The command line of a benchmark that alternates blocks of steps: (args, blocks, steps)."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", type=int, default=12)
    p.add_argument("--steps", type=int, default=20, help="steps per block")
    p.add_argument("--quick", action="store_true", help=quick_help)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / name))
    a = p.parse_args(argv)
    return (a, 2, 5) if a.quick else (a, a.blocks, a.steps)


def main(argv=None) -> int:
    a, blocks, steps = block_args(argv, __doc__, "dp_steps")
    rows = []
    for name, batch in CASES:
        res = launch(_worker, 2, name, batch, blocks, steps, timeout_s=900)
        for rank, times in enumerate(res):
            for k, v in times.items():
                rows.append({"model": name, "batch": batch, "rank": rank, "contender": k, **_stats(v)})
        ddp = statistics.median(r["median_ms"] for r in rows if r["model"] == name and r["contender"] == "ddp")
        line = "  ".join(f"{r['contender']} r{r['rank']} {r['median_ms']:.2f}/{r['mean_ms']:.2f}"
                         for r in rows if r["model"] == name)
        print(f"{name:12s} median/mean ms: {line}  (DDP median {ddp:.2f})", flush=True)
    cmd = "python benchmarks/dp_steps.py" + (" --quick" if a.quick else "")
    lines = ["# Data parallel step by step: DDP against flexflow", "",
             f"Command: `{cmd}`. 2 gloo processes, one thread each; {blocks} blocks of {steps} steps per "
             "contender, blocks alternating; every step timed on its own (zero_grad, forward, backward, "
             "SGD step, loss.item()). flexflow: the global loss on every rank, riding on the gradient "
             "all-reduce (the default); flexflow_eager: the loss all-reduced on its own (one more collective).",
             "",
             "| model | batch | rank | contender | median ms | mean ms | p90 ms | p99 ms | median / DDP's |",
             "|---|---:|---:|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        ddp = next(x["median_ms"] for x in rows if x["model"] == r["model"] and x["rank"] == r["rank"]
                   and x["contender"] == "ddp")
        lines.append(f"| {r['model']} | {r['batch']} | {r['rank']} | {r['contender']} | {r['median_ms']:.2f} | "
                     f"{r['mean_ms']:.2f} | {r['p90_ms']:.2f} | {r['p99_ms']:.2f} | {r['median_ms'] / ddp:.2f} |")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    out.with_suffix(".json").write_text(json.dumps({"command": cmd, "rows": rows}, indent=1))
    print(f"wrote {out.with_suffix('.md')} and .json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
