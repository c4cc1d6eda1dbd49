"""How flexflow's runtime moves a tensor-parallel plan's transitions, measured three ways.

    .venv/bin/python benchmarks/tp_exchanges.py            # 4 gloo processes

``Strategy.megatron(tp=4)`` on ``benchmarks/sharded.py``'s decoder, AdamW, the same processes
and batch, alternating rounds (a round at its slowest rank):

- ``collectives + re-gather``: what the runtime does -- the sequence-parallel transitions as
  all-gathers and reduce-scatters on their group's process group, each gathered input of the
  linear layers gathered again for their backward instead of kept;
- ``collectives, kept``: the same with the gathered inputs kept for the backward;
- ``point to point``: every exchange as isend / irecv pairs (what the runtime did before).

The last two are ablations (the benchmark switches the runtime's choice off in its own
processes); each is predicted by the simulator only for the first.  Writes
``benchmarks/results/tp_exchanges.md``.
"""
from __future__ import annotations

import copy
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import sharded  # noqa: E402

import flexflow as ff  # noqa: E402
from flexflow.cost.model import CostModel  # noqa: E402

WORLD, STEPS, ROUNDS = 4, 5, 7


def _worker(rank: int):
    import flexflow.runtime.collex as collex
    import flexflow.runtime.execute as execute
    torch.set_num_threads(1)
    module, inputs = sharded.build()
    graph = ff.trace(module, inputs)
    machine = sharded.host_machine(WORLD)
    s = ff.Strategy.megatron(graph, machine, tp=WORLD)
    r = ff.Simulator(graph, machine, CostModel.for_machine(machine), optimizer="adam").simulate(s)
    made = {}

    def build(label):
        made[label] = ff.parallelize(copy.deepcopy(module), example_inputs=inputs, strategy=s, machine=machine)
    build("collectives + re-gather")
    planned = execute.plan_regathers
    execute.plan_regathers = lambda plan: set()
    build("collectives, kept")
    execute.plan_regathers = planned
    cliques = collex.clique_groups
    collex.clique_groups = lambda pairs: None
    build("point to point")
    collex.clique_groups = cliques
    runs = {k: sharded.Trainer(pm, inputs) for k, pm in made.items()}
    peaks, times = sharded.timed_rounds(runs, STEPS, ROUNDS, warm=1)
    kinds = {k: sorted({ex.coll.kind for ex in pm.runtime.exchanges if ex.coll is not None}) for k, pm in made.items()}
    for pm in made.values():
        pm.runtime.close()
    return {"times": times, "peaks": peaks, "kinds": kinds,
            "predicted": {"ms": r.iteration_time * 1e3, "peak": max(r.peak_memory)}}


def main() -> None:
    t0 = time.perf_counter()
    res = ff.launch(_worker, WORLD, timeout_s=1800)
    lines = ["# Tensor-parallel transitions: collectives, re-gathered inputs, point to point (4 gloo processes)", "",
             f"`python benchmarks/tp_exchanges.py` ({time.perf_counter() - t0:.0f} s). `Strategy.megatron(tp=4)` on "
             f"`flexflow.models.llama.Llama({sharded.CONFIG})`, batch {sharded.BATCH}, AdamW; step: median of "
             f"{ROUNDS} rounds, each at its slowest rank; peak: MemTracker, max over ranks.", "",
             "| how the runtime moves the transitions | collectives run | step ms | peak MiB | predicted |",
             "|---|---|---:|---:|---|"]
    pred = res[0]["predicted"]
    for k in res[0]["times"]:
        ms = statistics.median(max(r["times"][k][i] for r in res) for i in range(ROUNDS)) * 1e3
        peak = max(r["peaks"][k] for r in res)
        p = (f"{pred['ms']:.1f} ms ({pred['ms'] / ms - 1:+.0%}), {pred['peak'] / 2**20:.1f} MiB "
             f"({pred['peak'] / peak - 1:+.0%})") if k.startswith("collectives +") else ""
        lines.append(f"| {k} | {', '.join(res[0]['kinds'][k]) or 'none'} | {ms:.1f} | {peak / 2**20:.1f} | {p} |")
    out = HERE / "results" / "tp_exchanges.md"
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
