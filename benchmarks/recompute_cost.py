"""What recomputing whole blocks costs in time: the executor's step against the simulator's.

    python benchmarks/recompute_cost.py [--models llama gpt2] [--steps 10]

One CPU process, one thread, the zoo's small LLaMA and GPT-2 at batch 64 under data
parallelism on one device: the plain step, and the same with every op of every block
recomputed (``Strategy.recompute_blocks()``, block checkpointing).  Measured: the median of
``--steps`` AdamW steps after 3 untimed ones; predicted: the simulator's iteration time
(analytic costs, the ``cpu`` preset).  Writes ``benchmarks/results/recompute_cost.md`` and
``.json``.

The simulator charges a recomputed op one more forward in its backward; the executor runs
a forward twice there for an op whose output a later op needs (made again for the reader,
and in the op's own checkpoint).  The ratio of the two steps shows the difference.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

import flexflow as ff
from flexflow.hardware.machine import Machine
from flexflow.sim.simulate import Simulator
from flexflow.strategy.strategy import Strategy

OUT = Path(__file__).resolve().parent / "results" / "recompute_cost"


def measure(name: str, steps: int) -> dict:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    module, inputs = ff.models.get(name, size="small", batch_size=64)
    graph = ff.trace(module, inputs)
    m = Machine.preset("cpu", devices=1)
    row = {"model": name, "batch": 64}
    for label in ("plain", "blocks"):
        s = Strategy.data_parallel(graph, m)
        if label == "blocks":
            s = s.recompute_blocks()
        row[f"{label}_predicted_ms"] = Simulator(graph, m, optimizer="adam").simulate(s).iteration_time * 1e3
        par = ff.parallelize(module, example_inputs=inputs, strategy=s, machine=m, optimizer="adam")
        opt = torch.optim.AdamW(par.parameters(), lr=1e-4)

        def step():
            opt.zero_grad()
            par(*inputs).backward()
            opt.step()
        for _ in range(3):
            step()
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        row[f"{label}_measured_ms"] = statistics.median(times) * 1e3
    row["measured_ratio"] = row["blocks_measured_ms"] / row["plain_measured_ms"]
    row["predicted_ratio"] = row["blocks_predicted_ms"] / row["plain_predicted_ms"]
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["llama", "gpt2"])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--out", default=str(OUT))
    a = ap.parse_args(argv)
    rows = []
    for name in a.models:
        r = measure(name, a.steps)
        rows.append(r)
        print(f"{name}: plain {r['plain_measured_ms']:.1f} ms (pred {r['plain_predicted_ms']:.1f}), blocks "
              f"{r['blocks_measured_ms']:.1f} ms (pred {r['blocks_predicted_ms']:.1f}): x{r['measured_ratio']:.2f} "
              f"measured, x{r['predicted_ratio']:.2f} predicted", flush=True)
    command = "python benchmarks/recompute_cost.py " + " ".join(argv if argv is not None else sys.argv[1:])
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"command": command.strip(), "torch": torch.__version__,
                                                    "rows": rows}, indent=1))
    lines = ["# The time of recomputing whole blocks", "", f"`{command.strip()}` (torch {torch.__version__}, "
             "one CPU process, one thread)", "",
             "| model | batch | plain ms (predicted) | blocks recomputed ms (predicted) | x measured | x predicted |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['batch']} | {r['plain_measured_ms']:.1f} ({r['plain_predicted_ms']:.1f}) | "
                     f"{r['blocks_measured_ms']:.1f} ({r['blocks_predicted_ms']:.1f}) | {r['measured_ratio']:.2f} | "
                     f"{r['predicted_ratio']:.2f} |")
    lines += ["", "The simulator charges one forward more per recomputed op; the executor runs two for an op "
              "whose output a later op needs (made again for the reader, and again in the op's own "
              "checkpoint), where torch's block checkpointing runs one.", ""]
    out.with_suffix(".md").write_text("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
