"""Measured speed of a training step on 2 local processes: DDP, flexflow data
parallel and flexflow searched, side by side, with the simulator's predictions.

    .venv/bin/python benchmarks/real_speedup.py            # a few minutes
    .venv/bin/python benchmarks/real_speedup.py --quick    # smoke run
    .venv/bin/python benchmarks/real_speedup.py --only wide_mlp

For each model, one launch of 2 gloo processes (one thread each) builds three
contenders on the same processes and the same global batch:

- ``ddp``: ``torch.nn.parallel.DistributedDataParallel`` on the plain module,
  each rank running its half of the batch (what a user writes by hand);
- ``flexflow_dp``: ``flexflow.parallelize`` with ``Strategy.data_parallel``
  (the global loss rides on the gradient all-reduce, the default: no
  collective beyond DDP's, which returns each rank's local loss);
- ``flexflow_searched``: ``flexflow.parallelize`` with no strategy: rank 0
  searches (``--budget`` seconds, on the detected host), the search's finalists
  run a few steps each on both ranks and the fastest measured is kept (the
  *measured choice*).  ``parallelize`` is called twice: the first call's
  finalists correct the cost model (``flexflow.cost.corrections``), the second
  searches with the corrections and is the contender;
- ``flexflow_simulator``: the strategy the simulator chose in that second call
  (the *simulator's choice*, before the finalists were measured), run as a
  strategy of its own;
- ``flexflow_dp_eager``: data parallel with ``reduce_outputs="eager"`` (the
  global loss all-reduced on its own, started at the end of the forward);
- ``ddp_batched``: DDP as ``ddp``, on a process group of its own whose gloo
  event-loop threads run under ``SCHED_BATCH``, as flexflow's groups do
  (``flexflow.runtime.gloo.batch_gloo_loops``): how much of a ratio to ``ddp`` is that
  thread policy, not the strategy.  The ratios (×DDP) are to plain ``ddp``.

Rounds alternate between the contenders so that load from other jobs hits
them alike; each round is ``--steps`` SGD steps, timed on every rank, and a
round counts at the slower rank.  Reported: median step time, the spread
(min-max over rounds), steps/s, the ratio to DDP, and the prediction
(``Simulator(graph, machine, CostModel.for_machine(machine))``: the machine and
the op profile the search used; ``parallelize()`` profiles the ops on this host
before it searches, within a third of ``--budget``, and caches them).  Writes ``benchmarks/results/real_speedup.md`` and
``.json``.  For the two searched contenders the table also gives the plan's own
prediction (the corrected cost model's), so the chosen plan's error shows before
the correction (the uncorrected ``predicted``) and after it; and the finalists of
both ``parallelize`` calls, predicted and measured, are listed.
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import flexflow as ff  # noqa: E402
from flexflow.calibrate.host import ensure_calibrated  # noqa: E402
from flexflow.cost.model import CostModel  # noqa: E402
from executor_overhead import _Trainer, batched_ddp  # noqa: E402


class WideMLP(nn.Module):
    """A model whose parameters dominate: two 4096-wide fully connected layers
    (21 M parameters, 84 MB of gradients per step) at a small batch."""

    def __init__(self, features=1024, hidden=4096, classes=16):
        super().__init__()
        self.fc1 = nn.Linear(features, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc3 = nn.Linear(hidden, classes)
        self.features, self.classes = features, classes

    def forward(self, x, y):  # x: (N, features), y: (N,)
        h = F.relu(self.fc2(F.relu(self.fc1(x))))
        return F.cross_entropy(self.fc3(h), y)


def build(name: str, batch: int):
    """(module, example inputs), the same on every rank."""
    if name == "wide_mlp":
        torch.manual_seed(0)
        m = WideMLP()
        g = torch.Generator().manual_seed(1)
        return m, (torch.randn(batch, m.features, generator=g),
                   torch.randint(0, m.classes, (batch,), generator=g))
    return ff.models.get(name, batch_size=batch, size="small", seed=0)


# (model, global batch)
CASES = [("wide_mlp", 32), ("alexnet", 64), ("transformer", 32), ("rnnlm", 32)]
ROUND_S = 0.1  # a round of short steps repeats them to about this long


def _worker(rank: int, name: str, batch: int, steps: int, rounds: int, budget: float,
            check_steps: int = 0, ride: bool = False):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    world = dist.get_world_size()
    module, inputs = build(name, batch)
    graph = ff.trace(module, inputs)
    machine = ff.Machine.detect().with_devices(world) if ff.Machine.detect().num_devices >= world \
        else ff.Machine.preset("cpu", devices=world)
    lo, hi = rank * batch // world, (rank + 1) * batch // world
    ddp = DDP(copy.deepcopy(module))
    ddp_batched = batched_ddp(module)
    dp = ff.parallelize(module, example_inputs=inputs, strategy=ff.Strategy.data_parallel(graph, machine),
                        machine=machine)
    first = ff.parallelize(module, example_inputs=inputs, budget=budget, machine=machine)  # teaches the model
    t0 = time.perf_counter()
    searched = ff.parallelize(module, example_inputs=inputs, budget=budget, machine=machine)
    search_s = time.perf_counter() - t0
    plan = searched.plan
    simulator = next((f for f in plan.finalists if f.name == plan.simulator_choice), None)
    runs = {"ddp": _Trainer(ddp, tuple(x[lo:hi] for x in inputs)), "flexflow_dp": _Trainer(dp, inputs),
            "flexflow_searched": _Trainer(searched, inputs),
            "ddp_batched": _Trainer(ddp_batched, tuple(x[lo:hi] for x in inputs))}
    if simulator is not None:
        runs["flexflow_simulator"] = _Trainer(ff.parallelize(
            module, example_inputs=inputs, strategy=ff.Strategy.from_json(simulator.strategy_json, graph),
            machine=machine), inputs)
    if ride:
        runs["flexflow_dp_eager"] = _Trainer(ff.parallelize(
            module, example_inputs=inputs, strategy=ff.Strategy.data_parallel(graph, machine), machine=machine,
            reduce_outputs="eager"), inputs)
    check = _losses(runs["flexflow_searched"], check_steps)  # from the initial parameters
    warm = {k: t.steps(3) for k, t in runs.items()}  # warm-up
    # short steps repeat until a round lasts about ROUND_S (the ranks agree on the count):
    # five 3-ms steps after another model's round time the switch more than the step
    got = [None] * world
    dist.all_gather_object(got, warm)
    count = {k: max(steps, math.ceil(ROUND_S / max(max(g[k] for g in got), 1e-6))) for k in runs}
    times = {k: [] for k in runs}
    for _ in range(rounds):
        for k, t in runs.items():
            dist.barrier()
            times[k].append(t.steps(count[k]))
    out = {"times": times, "check_losses": check}
    if rank == 0:
        # the cost model the search used: the op times parallelize() measured on this host
        sim = ff.Simulator(graph, machine, CostModel.for_machine(machine))
        dp_s = ff.Strategy.data_parallel(graph, machine)
        out["predicted_s"] = {"ddp": sim.simulate(dp_s).iteration_time,
                              "ddp_batched": sim.simulate(dp_s).iteration_time,
                              "flexflow_dp": sim.simulate(dp_s).iteration_time,
                              "flexflow_searched": sim.simulate(searched.strategy).iteration_time}
        out["plan_predicted_s"] = {"flexflow_searched": plan.predicted.iteration_time}
        if simulator is not None:
            out["predicted_s"]["flexflow_simulator"] = sim.simulate(
                ff.Strategy.from_json(simulator.strategy_json, graph)).iteration_time
            out["plan_predicted_s"]["flexflow_simulator"] = simulator.predicted_s
        out["choices"] = {"measured": plan.chosen, "simulator": plan.simulator_choice,
                          "first_measured": first.plan.chosen, "first_simulator": first.plan.simulator_choice,
                          "first_predicted_ms": first.plan.predicted.iteration_time * 1e3}
        out["finalists"] = [first.plan.finalists_line(), plan.finalists_line()]
        out["finalist_ms"] = [{f.name: f.measured_s * 1e3 for f in p.finalists if f.measured_s}
                              for p in (first.plan, plan)]
        out["corrections"] = plan.corrections
        if ride:
            out["predicted_s"]["flexflow_dp_eager"] = ff.Simulator(
                graph, machine, CostModel.for_machine(machine), reduce_outputs="eager").simulate(dp_s).iteration_time
        out["search_s"] = search_s
        out["machine"] = machine.name
        out["strategy_table"] = _strategy_lines(graph, searched.strategy, dp_s)
        out["strategy_json"] = searched.strategy.to_json()
    return out


def _strategy_lines(graph, strategy, dp) -> list[str]:
    """The ops whose config differs from data parallelism."""
    return [f"{op.name}: {strategy[op.name]}" for op in graph.compute_ops
            if strategy[op.name] != dp[op.name]]


def measure(name: str, batch: int, steps: int, rounds: int, budget: float, check_steps: int = 0,
            ride: bool = False) -> dict:
    """One launch of 2 processes for one model: the row of the report.  With
    ``check_steps``, also the searched run's first losses from the initial
    parameters (``check_losses``, rank 0), to compare with :func:`reference_losses`;
    ``ride``: one more contender, ``flexflow_dp_eager``."""
    ensure_calibrated()  # a new host is calibrated here, before the ranks read the cached figures
    res = ff.launch(_worker, 2, name, batch, steps, rounds, budget, check_steps, ride, timeout_s=900)
    per = {k: [max(r["times"][k][i] for r in res) for i in range(rounds)] for k in res[0]["times"]}
    med = {k: statistics.median(v) for k, v in per.items()}
    return {"model": name, "batch": batch, "processes": 2, "steps_per_round": steps, "rounds": rounds,
            "step_ms": {k: v * 1000 for k, v in med.items()},
            "spread_ms": {k: [min(v) * 1000, max(v) * 1000] for k, v in per.items()},
            "rounds_ms": {k: [x * 1000 for x in v] for k, v in per.items()},
            "steps_per_s": {k: 1 / v for k, v in med.items()},
            "vs_ddp": {k: med["ddp"] / v for k, v in med.items()},
            "predicted_ms": {k: v * 1000 for k, v in res[0]["predicted_s"].items()},
            "plan_predicted_ms": {k: v * 1000 for k, v in res[0]["plan_predicted_s"].items()},
            "choices": res[0]["choices"], "finalists": res[0]["finalists"], "corrections": res[0]["corrections"],
            "finalist_ms": res[0]["finalist_ms"],
            "search_s": res[0]["search_s"], "machine": res[0]["machine"],
            "searched_differs": res[0]["strategy_table"], "strategy_json": res[0]["strategy_json"],
            "check_losses": res[0]["check_losses"]}


def reference_losses(name: str, batch: int, steps: int) -> list[float]:
    """The plain module in this process, the same SGD steps on the same global batch."""
    module, inputs = build(name, batch)
    return _losses(_Trainer(module, inputs), steps)


def _losses(trainer, steps: int) -> list[float]:
    out = []
    for _ in range(steps):
        trainer.step()
        out.append(trainer.last_loss.item())
    return out


def run(cases, steps: int, rounds: int, budget: float) -> list[dict]:
    rows = []
    for name, batch in cases:
        row = measure(name, batch, steps, rounds, budget, ride=True)
        rows.append(row)
        print(f"{name:12s} " + "  ".join(f"{k} {row['step_ms'][k]:7.2f} ms ({row['vs_ddp'][k]:.2f}x DDP, "
                                         f"pred {row['predicted_ms'][k]:.2f})" for k in row["step_ms"]),
              flush=True)
        print(f"{'':12s} measured choice {row['choices']['measured']} (plan predicted "
              f"{row['plan_predicted_ms']['flexflow_searched']:.2f} ms), simulator's choice "
              f"{row['choices']['simulator']}", flush=True)
    return rows


def write_report(rows, command: str, seconds: float, out: Path) -> None:
    out.with_suffix(".json").write_text(json.dumps({"command": command, "rows": rows}, indent=1))
    names = [k for k in ("ddp", "ddp_batched", "flexflow_dp", "flexflow_dp_eager", "flexflow_simulator",
                         "flexflow_searched") if any(k in r["step_ms"] for r in rows)]
    lines = ["# Measured speed against DDP (2 gloo processes, CPU)", "",
             f"Command (from the repository root): `{command}` ({seconds:.0f} s; torch {torch.__version__}, "
             f"{os.cpu_count()} CPUs, one thread per process).", "",
             "Median step time over alternating rounds (a round counts at its slower rank; short steps "
             f"repeat until a round lasts about {ROUND_S} s, as the finalists' do); spread is "
             "min-max over rounds; ×DDP is DDP's step time over the contender's (higher is faster); "
             "predicted is the simulator's iteration time with the machine and op profile the search used "
             "(parallelize() profiles the ops on this host before it searches). `ddp_batched` is DDP on a "
             "group whose gloo event-loop threads run under SCHED_BATCH, as flexflow's groups do: the share "
             "of a ratio that is the thread policy, not the strategy. `flexflow_searched` is what "
             "parallelize() chose by measuring the search's finalists (its second call on the model, after "
             "the first one's measurements corrected the cost model); `flexflow_simulator` is what the "
             "simulator chose in that call; *plan ms* is the plan's own prediction (corrected cost model), "
             "*predicted ms* the uncorrected one.", "",
             ("| model | batch | contender | step ms (spread) | steps/s | ×DDP | predicted ms | error "
              "| plan ms | plan error |"),
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        for k in names:
            if k not in r["step_ms"]:
                continue
            lo, hi = r["spread_ms"][k]
            err = (r["predicted_ms"][k] - r["step_ms"][k]) / r["step_ms"][k] * 100
            planned = r.get("plan_predicted_ms", {}).get(k)
            after = "| - | - |" if planned is None else \
                f"| {planned:.2f} | {(planned - r['step_ms'][k]) / r['step_ms'][k] * 100:+.0f}% |"
            lines.append(f"| {r['model']} | {r['batch']} | {k} | {r['step_ms'][k]:.2f} ({lo:.2f}-{hi:.2f}) | "
                         f"{r['steps_per_s'][k]:.1f} | {r['vs_ddp'][k]:.2f} | {r['predicted_ms'][k]:.2f} | "
                         f"{err:+.0f}% {after}")
    lines += ["", ("The aims: the measured choice never slower than flexflow data parallelism by more than "
                   "the rounds' noise (the spread of either), never slower than DDP; its prediction within 15% "
                   "after the correction."), "",
              ("| model | measured choice | simulator's choice | × flexflow dp | × DDP | within noise of dp "
               "| error before | error after |"), "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        m, ms = r["step_ms"], r["spread_ms"]
        noise = max(hi - lo for lo, hi in (ms["flexflow_dp"], ms["flexflow_searched"]))
        ok = "yes" if m["flexflow_searched"] <= m["flexflow_dp"] + noise else "NO"
        before = (r["predicted_ms"]["flexflow_searched"] - m["flexflow_searched"]) / m["flexflow_searched"] * 100
        after = (r["plan_predicted_ms"]["flexflow_searched"] - m["flexflow_searched"]) / m["flexflow_searched"] * 100
        lines.append(f"| {r['model']} | {r['choices']['measured']} | {r['choices']['simulator']} | "
                     f"{m['flexflow_dp'] / m['flexflow_searched']:.2f} | {r['vs_ddp']['flexflow_searched']:.2f} | "
                     f"{ok} | {before:+.0f}% | {after:+.0f}% |")
    lines += ["", "What parallelize() measured (its finalists, first and second call; the corrections after):", ""]
    for r in rows:
        for line in r["finalists"]:
            lines.append(f"- {r['model']}: {line}")
    lines += ["", ("The same plans as finalists and as trained above: each call's finalist time over the "
                   "contender's step (data_parallel: `flexflow_dp`; the measured choice: `flexflow_searched`). "
                   "The correction learns from the finalists, so a ratio far from 1 is an error it carries."), "",
              "| model | plan | finalist, call 1 (ms) | finalist, call 2 (ms) | trained (ms) | ratios |",
              "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        calls = r.get("finalist_ms") or []
        pairs = [("data_parallel", "flexflow_dp")]
        if r["choices"]["measured"] != "data_parallel":
            pairs.append((r["choices"]["measured"], "flexflow_searched"))
        for name, k in pairs:
            got = [c.get(name) for c in calls] + [None] * (2 - len(calls))
            ratio = " / ".join("-" if g is None else f"{g / r['step_ms'][k]:.2f}" for g in got)
            cells = " | ".join("-" if g is None else f"{g:.2f}" for g in got)
            lines.append(f"| {r['model']} | {name} | {cells} | {r['step_ms'][k]:.2f} | {ratio} |")
    lines += ["", "Searched strategies (ops whose config differs from data parallelism; search seconds):", ""]
    for r in rows:
        diff = r["searched_differs"]
        shown = ", ".join(diff[:12]) + (f", ... ({len(diff)} in all)" if len(diff) > 12 else "")
        lines.append(f"- {r['model']} ({r['search_s']:.1f} s on `{r['machine']}`): "
                     + (shown if diff else "data parallelism"))
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=5, help="steps per round")
    p.add_argument("--rounds", type=int, default=16)
    p.add_argument("--budget", type=float, default=10.0, help="search seconds")
    p.add_argument("--only", help="one model")
    p.add_argument("--quick", action="store_true", help="2 steps x 2 rounds, 2-s search")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "real_speedup"))
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.rounds, args.budget = 2, 2, 2.0
    cases = [c for c in CASES if args.only in (None, c[0])]
    if not cases:
        p.error(f"--only {args.only!r}: not one of {[c[0] for c in CASES]}")
    extra = sys.argv[1:] if argv is None else list(argv)
    command = " ".join([".venv/bin/python benchmarks/real_speedup.py"] + extra)
    t0 = time.perf_counter()
    rows = run(cases, args.steps, args.rounds, args.budget)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_report(rows, command, time.perf_counter() - t0, out)
    print(f"wrote {out.with_suffix('.md')} and .json")


if __name__ == "__main__":
    main()
