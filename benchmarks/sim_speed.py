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
- ``proposal``: what a search proposal costs with the load lower-bound screen of
  ``ff.search`` (``flexflow/bound.py``): the same chain, each proposal first bounded and
  only simulated when the bound cannot settle the Metropolis test (u drawn first);
  ``screened`` is the share it settled without a simulation.  The chain keeps a proposal
  by that test (temperature 1% of data parallelism's time, as in the search).

Times are CPU seconds of this process (``time.process_time``): the host is shared.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import flexflow as ff
from flexflow.cost.model import CostModel
from flexflow.hardware.machine import Machine
from flexflow.sim.simulate import Simulator
from flexflow.sim.bound import LoadBound
from flexflow.strategy.strategy import Strategy
from flexflow.strategy.candidates import candidate_configs
from flexflow.sim.taskkeys import PS

CASES = [("p100-cluster", 4), ("p100-cluster", 16), ("k80-cluster", 16), ("k80-cluster", 64)]
MODELS = ["inception_v3", "nmt"]


def chain(graph, machine, n, seed, temperature=0.01):
    """A search-like list of proposals, (strategy, group, u, keep it?), kept by the search's
    Metropolis test (u drawn before simulating) on a scratch simulator."""
    sim = Simulator(graph, machine, CostModel(machine))
    rng = random.Random(seed)
    reps = [m[0] for m in graph.groups.values()]
    cur = Strategy.data_parallel(graph, machine)
    now = sim.simulate(cur).iteration_time
    beta = math.log(2.0) / (temperature * now)
    out = []
    for _ in range(n):
        gi = rng.randrange(len(reps))
        op = reps[gi]
        new = cur.replace(op, rng.choice(candidate_configs(graph.op(op), machine)))
        u = rng.random()
        t = sim.simulate(new).iteration_time
        keep = t <= now or u < math.exp(-beta * (t - now))
        out.append((new, gi, u, keep, beta))
        if keep:
            cur, now = new, t
    return out


def run_chain(sim, start, props):
    times = []
    resim = 0
    sim.simulate(start)
    before = sim.stats["resimulated_tasks"]
    tasks = 0
    for s, *_ in props:
        t0 = time.process_time()
        r = sim.simulate(s)
        times.append(time.process_time() - t0)
        tasks += r.num_tasks
    resim = sim.stats["resimulated_tasks"] - before
    return times, resim / max(tasks, 1)


def run_screened(sim, start, props):
    """The chain as the search runs it: the load bound first; then the delta simulation,
    stopped as soon as it proves the proposal slower than anything the test accepts
    (``Simulator.simulate_within``: above max(now - ln(u) / beta, best so far)).  Returns
    per-proposal CPU seconds, how many were screened and how many were cut."""
    now = sim.simulate(start).iteration_time
    best = now
    bound = LoadBound(sim.ctx, start)
    times, screened, cut = [], 0, 0
    for s, gi, u, keep, beta in props:
        t0 = time.process_time()
        lb = bound.lower_bound(s, [gi]) / PS
        if lb > now and lb >= best and u >= math.exp(-beta * (lb - now)) * (1.0 + 1e-12):
            screened += 1
            assert not keep, "the bound rejected a proposal the chain kept"
        else:
            limit = max(now - math.log(u) / beta, best) * (1.0 + 1e-9) if u > 0 else math.inf
            r = sim.simulate_within(s, limit)
            if r is None:
                cut += 1
                assert not keep, "a stopped simulation rejected a proposal the chain kept"
            elif keep:
                bound.commit(s)
                now = r.iteration_time
                best = min(best, now)
            else:
                assert not (r.iteration_time <= now or u < math.exp(-beta * (r.iteration_time - now)))
        times.append(time.process_time() - t0)
    return times, screened, cut


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
        ssim = Simulator(graph, machine, dsim.cost_model)  # warm caches, its own task graph
        swarm, screened, cut = run_screened(ssim, dp, props)
        # full simulation of the chain's strategies, for the same mix of strategies
        fchain = []
        for s, *_ in props[:: max(1, len(props) // 20)]:
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
        "kept": sum(p[3] for p in props), "resim_fraction": resim,
        "speedup": ms(fchain) / ms(dwarm),
        "proposal_ms": ms(swarm), "screened_fraction": screened / len(props), "cut_fraction": cut / len(props),
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
                  f"(cold {row['delta_cold_ms']:.1f})  x{row['speedup']:.2f}  resim {row['resim_fraction']:.0%}  "
                  f"proposal {row['proposal_ms']:.1f} ms (screened {row['screened_fraction']:.0%}, "
                  f"cut {row['cut_fraction']:.0%})",
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
        "delta ms | delta cold ms | full/delta | resimulated | proposal ms | screened | cut |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(f"| {r['model']} | {r['machine']} | {r['devices']} | {r['tasks_dp']} | {r['full_cold_ms']:.0f} | "
                     f"{r['full_ms']:.1f} | {r['full_chain_ms']:.1f} | {r['delta_ms']:.1f} | {r['delta_cold_ms']:.1f} | "
                     f"{r['speedup']:.2f} | {r['resim_fraction']:.0%} | {r['proposal_ms']:.1f} | "
                     f"{r['screened_fraction']:.0%} | {r['cut_fraction']:.0%} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n" + aims(rows) + NOTES)
    print(f"wrote {out.with_suffix('.md')} and .json")


def aims(rows) -> str:
    """The aims, checked against this run's rows."""
    def met(ok):
        return "met" if ok else "**not met**"
    out = ["", "## Aims (checked against the table above)", ""]
    p16 = [r for r in rows if r["machine"] == "p100-cluster" and r["devices"] == 16 and r["model"] == "inception_v3"]
    if p16:
        out.append(f"- Full simulation of inception_v3 on 16 P100s under 100 ms: {p16[0]['full_ms']:.1f} ms, "
                   f"{met(p16[0]['full_ms'] < 100)}.")
    k64 = [r for r in rows if r["machine"] == "k80-cluster" and r["devices"] == 64]
    for r in k64:
        out.append(f"- {r['model']} on 64 K80s: a search proposal <= 10 ms: {r['proposal_ms']:.1f} ms as the search pays "
                   f"for it ({r['screened_fraction']:.0%} screened, {r['cut_fraction']:.0%} cut), "
                   f"{r['delta_ms']:.1f} ms per complete delta "
                   f"simulation -- {met(r['proposal_ms'] <= 10)}; full/delta >= 5x: {r['speedup']:.2f}x -- "
                   f"{met(r['speedup'] >= 5)}.")
    return "\n".join(out) + "\n"


NOTES = """
Columns: *tasks (DP)* = tasks of the data-parallel task graph (after fusing same-config
chains such as conv -> batch_norm -> relu); *full cold* = the very first simulation of a
fresh simulator (op times, transfer and parameter plans computed); *full ms (DP)* =
`simulate(s, incremental=False)` of data parallelism, caches warm; *full ms (chain)* = the
same for the strategies of the proposal chain (they carry extra transfers); *delta ms* =
one search proposal (random single-op change, `incremental=True`), caches warm; *delta cold*
= the same proposals the first time (new configs' op times and transfer plans computed);
*full/delta* = full ms (chain) / delta ms; *resimulated* = share of the tasks the delta
simulation schedules again; *proposal ms* = a proposal as `ff.search` pays for it: the load
lower bound first (`flexflow/bound.py`), then the delta simulation, stopped as soon as the
schedule proves the proposal slower than anything the Metropolis test or the best-so-far
would accept (`Simulator.simulate_within`); *screened* = share of the proposals the bound
rejected without a simulation; *cut* = share whose simulation stopped early.  The chain
keeps a proposal by the search's Metropolis test (temperature 1% of data parallelism's
time, u drawn before simulating), so neither shortcut changes a decision; the benchmark
asserts that no screened or cut proposal is one the chain kept.

## What limits the delta simulation

The delta result must equal the full one exactly (same iteration time, bytes, memory), and
the scheduler is FIFO list scheduling: a resource runs its tasks in order of readiness.
A proposal changes the time of one op somewhere in the forward pass; every later task on
every device the change reaches -- all of the backward pass, every all-reduce and update --
moves, each by its own amount, and FIFO order between tasks that become ready at nearby
times can flip.  So the exact re-simulation restarts where the change can first be seen
(the time the changed op's producers finish) and schedules everything after it again: the
*resimulated* column is that share.  What the delta simulation saves is the rest: it
patches the task graph in place instead of building it again and reuses the timeline
before the restart point.  The scheduling loop is compiled (`flexflow/schedcore.py`,
numba) around a bucket queue of ready times: about 30 ns per task where the devices run
identical programs (data parallelism: 73,000 tasks, under 700 distinct ready times) and
about 60 ns once a strategy breaks that symmetry (40,000 distinct times among 90,000
tasks).  A full simulation is dominated by building the task graph in Python, a delta by
the re-scheduled share plus 2-3 ms of Python for the patch of a 64-way group and its
mirror in the kernels' arrays (inception_v3's proposals patch two groups: the last
rejected change goes back, the new one goes in).  Memory locality matters as much as the
operation count: the kernel's successor walk touches one 64-byte task row per edge, and a
graph whose ids were handed out in patch order from an unsorted free list ran nmt's delta
kernel 1.5x slower than a freshly built one; ids are now reused lowest first in ascending
runs (7.0 against 6.0 ms fresh, same transitions).  The screen helps where
proposals pile work onto few devices or links (most random changes of a convolution
network at 64 devices); the cut helps where a proposal's extra work or waiting shows
before the end of the step.  CPU times on this shared 2-core host vary by +-30% between
runs.
"""

if __name__ == "__main__":
    sys.exit(main())
