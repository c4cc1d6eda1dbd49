"""A regression model trained on a loss written by hand, ``((net(x) - y) ** 2).mean()``,
data parallel on 2 gloo processes: DDP against flexflow, and against flexflow with that
mean computed whole on rank 0 (how it ran before sums and means split into partial sums:
the batch's predictions gathered to one rank every step, and the loss returned by an
all-reduce of its own).

    .venv/bin/python benchmarks/loss_split.py          # about 30 s

Blocks of 20 steps alternate between the contenders (10 timed blocks after one warm-up
block); every step is timed on its own (zero_grad, forward, backward, SGD step,
loss.item()); the table gives per-rank medians.  Writes ``benchmarks/results/loss_split.md``.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
from pathlib import Path

import torch
import torch.nn as nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import flexflow as ff  # noqa: E402
from flexflow.api import parallelize  # noqa: E402
from flexflow.launch import launch  # noqa: E402
from flexflow.hardware.machine import Machine  # noqa: E402
from flexflow.strategy.config import ParallelConfig
from flexflow.strategy.strategy import Strategy  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dp_steps import alternating_blocks  # noqa: E402


class Regression(nn.Module):
    def __init__(self, features: int = 64, hidden: int = 256, out: int = 32):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                                 nn.Linear(hidden, out))

    def forward(self, x, y):
        return ((self.net(x) - y) ** 2).mean()


def _worker(rank: int, batch: int, blocks: int, steps: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.set_num_threads(1)
    torch.manual_seed(0)
    module = Regression()
    x, y = torch.randn(batch, 64), torch.randn(batch, 32)
    graph = ff.trace(module, (x, y))
    machine = Machine.preset("cpu", devices=2)
    dp = Strategy.data_parallel(graph, machine)
    whole = dict(dp.items())
    for op in graph.compute_ops:
        if op.kind == "mean":
            whole[op.name] = ParallelConfig({}, (0,))
    lo, hi = rank * batch // 2, (rank + 1) * batch // 2
    runs = {"ddp": (DDP(copy.deepcopy(module)), (x[lo:hi], y[lo:hi])),
            "flexflow": (parallelize(module, example_inputs=(x, y), strategy=dp), (x, y)),
            "flexflow_mean_on_rank0": (parallelize(module, example_inputs=(x, y),
                                                   strategy=Strategy(graph, whole, machine, name="mean_on_rank0")),
                                       (x, y))}
    times = alternating_blocks(runs, blocks, steps)
    exchanges = {k: runs[k][0].runtime.num_exchanges for k in runs if k != "ddp"}
    return {"median_ms": {k: statistics.median(v) * 1e3 for k, v in times.items()}, "exchanges": exchanges}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--blocks", type=int, default=10)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "loss_split.md"))
    a = p.parse_args(argv)
    res = launch(_worker, 2, a.batch, a.blocks, a.steps, timeout_s=900)
    lines = ["# A hand-written loss, data parallel: DDP against flexflow", "",
             f"Command: `python benchmarks/loss_split.py`. 2 gloo processes, one thread each; a 3-layer MLP "
             f"(64 -> 256 -> 256 -> 32), global batch {a.batch}, loss `((net(x) - y) ** 2).mean()`; "
             f"{a.blocks} blocks of {a.steps} steps per contender, alternating; per-step medians. "
             "flexflow_mean_on_rank0: data parallelism with the mean computed whole on rank 0, as it ran before "
             "sums and means split into partial sums.", "",
             "| rank | contender | exchanges a step | median ms | / DDP's |", "|---:|---|---:|---:|---:|"]
    for rank, r in enumerate(res):
        ddp = r["median_ms"]["ddp"]
        for k, v in r["median_ms"].items():
            lines.append(f"| {rank} | {k} | {r['exchanges'].get(k, 0)} | {v:.2f} | {v / ddp:.2f} |")
        print(f"rank {rank}: " + "  ".join(f"{k} {v:.2f} ms" for k, v in r["median_ms"].items()), flush=True)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
