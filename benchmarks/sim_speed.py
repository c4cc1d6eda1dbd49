"""Simulator speed: milliseconds per full simulation and per delta proposal.

    python benchmarks/sim_speed.py [--quick] [--out benchmarks/results/sim_speed]

For inception_v3 and nmt (paper size, 64 samples per device) on 4 and 16 devices of
p100-cluster and 16 and 64 devices of k80-cluster:

- full: ``simulate(strategy, incremental=False)`` of data parallelism, caches warm (op
  times, transfer plans and parameter plans are memoized per config across calls);
  ``full cold`` is the very first simulation (nothing memoized yet);
- delta: a search-like chain of proposals, each a random single-op change (random share
  group, random candidate config, ``Strategy.replace``) of the current strategy, simulated
  with ``incremental=True``; a proposal is kept when it is not slower (otherwise the next
  one starts again from the current strategy, so consecutive calls differ in up to two
  groups, as in an MCMC search).  ``delta`` replays the same chain on a second simulator
  with warm caches; ``delta cold`` is the first pass, which also computes the new configs'
  op times and transfer plans.
- ``resim``: share of the tasks the delta simulation re-schedules (the rest is reused).

Times are CPU seconds of this process (``time.process_time``): the host is shared.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import flexflow as ff
from flexflow.cost import CostModel
from flexflow.machine import Machine
from flexflow.simulate import Simulator
from flexflow.strategy import Strategy, candidate_configs

CASES = [("p100-cluster", 4), ("p100-cluster", 16), ("k80-cluster", 16), ("k80-cluster", 64)]
MODELS = ["inception_v3", "nmt"]


def chain(graph, machine, n, seed):
    """A search-like list of proposals: (strategy, keep it?) decided on a scratch simulator."""
    sim = Simulator(graph, machine, CostModel(machine))
    rng = random.Random(seed)
    reps = [m[0] for m in graph.groups.values()]
    cur = Strategy.data_parallel(graph, machine)
    best = sim.simulate(cur).iteration_time
    out = []
    for _ in range(n):
        op = rng.choice(reps)
        new = cur.replace(op, rng.choice(candidate_configs(graph.op(op), machine)))
        t = sim.simulate(new).iteration_time
        keep = t <= best
        out.append((new, keep))
        if keep:
            cur, best = new, t
    return out


def run_chain(sim, start, props):
    times = []
    resim = 0
    sim.simulate(start)
    before = sim.stats["resimulated_tasks"]
    tasks = 0
    for s, _ in props:
        t0 = time.process_time()
        r = sim.simulate(s)
        times.append(time.process_time() - t0)
        tasks += r.num_tasks
    resim = sim.stats["resimulated_tasks"] - before
    return times, resim / max(tasks, 1)


def bench(model, preset, devices, full_reps, proposals, seed=0):
    m, x = ff.models.get(model, batch_size=64 * devices, size="paper", device="meta")
    graph = ff.trace(m, x)
    machine = Machine.preset(preset, devices=devices)
    dp = Strategy.data_parallel(graph, machine)
    gc.disable()
    try:
        cm = CostModel(machine)
        sim = Simulator(graph, machine, cm)
        t0 = time.process_time()
        r = sim.simulate(dp, incremental=False)
        cold = time.process_time() - t0
        fulls = []
        for _ in range(full_reps):
            t0 = time.process_time()
            sim.simulate(dp, incremental=False)
            fulls.append(time.process_time() - t0)
        props = chain(graph, machine, proposals, seed)
        dsim = Simulator(graph, machine, CostModel(machine))  # its own, empty caches
        dcold, _ = run_chain(dsim, dp, props)
        dwarm, resim = run_chain(dsim, dp, props)  # same chain again: warm caches
        # full simulation of the chain's strategies, for the same mix of strategies
        fchain = []
        for s, _ in props[:: max(1, len(props) // 20)]:
            t0 = time.process_time()
            dsim.simulate(s, incremental=False)
            fchain.append(time.process_time() - t0)
    finally:
        gc.enable()
    ms = lambda xs: 1000 * statistics.mean(xs)
    return {
        "model": model, "machine": preset, "devices": devices, "ops": len(graph),
        "tasks_dp": r.num_tasks, "iteration_ms_dp": 1000 * r.iteration_time,
        "full_cold_ms": 1000 * cold, "full_ms": ms(fulls), "full_ms_median": 1000 * statistics.median(fulls),
        "full_chain_ms": ms(fchain), "delta_cold_ms": ms(dcold), "delta_ms": ms(dwarm),
        "delta_ms_median": 1000 * statistics.median(dwarm), "proposals": len(props),
        "kept": sum(k for _, k in props), "resim_fraction": resim,
        "speedup": ms(fchain) / ms(dwarm),
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer repeats and proposals")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "sim_speed"))
    ap.add_argument("--models", default=",".join(MODELS))
    args = ap.parse_args(argv)
    full_reps, proposals = (3, 40) if args.quick else (10, 150)
    rows = []
    t_start = time.time()
    for model in args.models.split(","):
        for preset, n in CASES:
            row = bench(model, preset, n, full_reps, proposals if n < 64 else proposals // 2)
            rows.append(row)
            print(f"{model:13s} {preset:13s} {n:3d}  full {row['full_ms']:8.1f} ms  "
                  f"chain full {row['full_chain_ms']:8.1f}  delta {row['delta_ms']:8.1f} ms  "
                  f"(cold {row['delta_cold_ms']:.1f})  x{row['speedup']:.2f}  resim {row['resim_fraction']:.0%}",
                  flush=True)
    elapsed = time.time() - t_start
    cmd = "python benchmarks/sim_speed.py" + (" --quick" if args.quick else "")
    note = (f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs (shared with other jobs), "
            f"Python {platform.python_version()}, CPU time of one process; {elapsed:.0f} s wall in all")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"command": cmd, "machine": note, "rows": rows}, indent=1))
    lines = [
        "# Simulator speed", "",
        f"Command: `{cmd}`  ", f"Machine: {note}", "",
        "| model | machine | devices | tasks (DP) | full cold ms | full ms (DP) | full ms (chain) | "
        "delta ms | delta cold ms | full/delta | resimulated |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(f"| {r['model']} | {r['machine']} | {r['devices']} | {r['tasks_dp']} | {r['full_cold_ms']:.0f} | "
                     f"{r['full_ms']:.1f} | {r['full_chain_ms']:.1f} | {r['delta_ms']:.1f} | {r['delta_cold_ms']:.1f} | "
                     f"{r['speedup']:.2f} | {r['resim_fraction']:.0%} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n" + NOTES)
    print(f"wrote {out.with_suffix('.md')} and .json")


NOTES = """
Columns: *tasks (DP)* = tasks of the data-parallel task graph (after fusing same-config
chains such as conv -> batch_norm -> relu); *full cold* = the very first simulation of a
fresh simulator (op times, transfer and parameter plans computed); *full ms (DP)* =
`simulate(s, incremental=False)` of data parallelism, caches warm; *full ms (chain)* = the
same for the strategies of the proposal chain (they carry extra transfers); *delta ms* =
one search proposal (random single-op change, `incremental=True`), caches warm; *delta cold*
= the same proposals the first time (new configs' op times and transfer plans computed);
*full/delta* = full ms (chain) / delta ms; *resimulated* = share of the tasks the delta
simulation schedules again.

## Aims

- Full simulation of inception_v3 (paper size, batch 64 x 16) on 16 P100s under 100 ms:
  met by a wide margin (see the p100-cluster 16 row).
- Delta simulation at least 3x faster than full at 16 devices, the gap growing with
  devices: **not met** -- 1.3-2.1x at 16 devices, 1.1-1.7x at 64; the gap does not grow
  (it is largest at 4 devices, where building a task graph is mostly per-op overhead).

## What limits the delta simulation

The delta result must equal the full one exactly (same iteration time, bytes, memory), and
the scheduler is FIFO list scheduling: a resource runs its tasks in order of readiness.
A proposal changes the time of one op somewhere in the forward pass; every later task on
every device the change reaches -- all of the backward pass, every all-reduce and update --
moves, each by its own amount, and FIFO order between tasks that become ready at nearby
times can flip.  So the exact re-simulation has to start where the change can first be
seen (the time the changed op's producers finish) and schedule everything after it
again: the *resimulated* column (80-93%) is that share.  Measured on the inception_v3 /
16-device chain, fewer than 1% of the re-scheduled tasks end in a tail shifted by one
common amount (which a lazy "shift the rest" could have skipped), and about 10% keep their
exact times (all an early-cutoff propagation could skip).

What the delta simulation saves is the rest: it patches the task graph in place (the
changed ops' tasks, the transfers on their edges, their neighbours' dependencies, their
parameters' all-reduce and update tasks) instead of building it again, and reuses the
timeline before the restart point (resources restored from the previous run's per-resource
histories).  Building a task graph is 50-65% of a full simulation; scheduling costs ~1-1.5 us
per task in CPython (a heap pop/push and the dependency counts of its successors).  The
delta pays for what the full simulation does not: the patch (2 ms at 16 devices, 9 ms at
64 on inception_v3) and the restart (a pass over the re-simulated tasks' dependencies to
re-count them: 2.5 ms at 16 devices, 10 ms at 64).  Both sides grow linearly with the
number of tasks (~devices), so their ratio does not grow with devices; at 64 devices a
random proposal also creates and removes thousands of transfer tasks (a 64-way
redistribution), which the patch pays for and which make up most of the task graph.
A search that keeps few proposals (most MCMC steps) also makes consecutive calls differ
in two ops (the dropped proposal and the new one), and the earlier of the two sets the
restart point.  CPU times on this shared 2-core host vary by +-30% between runs.

Ways to go further, not done: early termination for the search (stop once the partial
makespan exceeds the acceptance threshold, which MCMC can draw before simulating); keeping
a snapshot of the last kept strategy's state so that each proposal is one op away from it
instead of two; or a scheduler in compiled code (the loop is ~20 lines).
"""

if __name__ == "__main__":
    sys.exit(main())
