"""Sharded training measured: DDP, torch FSDP2, flexflow fsdp and a searched plan under a memory cap.

    .venv/bin/python benchmarks/sharded.py                 # 2 and 4 processes, a few minutes
    .venv/bin/python benchmarks/sharded.py --quick         # smoke run (2 processes, few rounds)
    .venv/bin/python benchmarks/sharded.py --worlds 2

The model is the zoo's LLaMA-style decoder (``flexflow.models.llama``: RMSNorm,
rotary positions, SwiGLU, grouped-query attention) at a size that trains in
well under a second a step on one CPU core, with AdamW.  One launch of n gloo
processes (one thread each) builds every contender on the same processes and
the same global batch:

- ``ddp``: ``DistributedDataParallel`` on the plain module, each rank running
  its share of the batch;
- ``fsdp2``: torch's ``fully_shard`` on every decoder block and on the root
  (parameters, gradients and optimizer state sharded; reshard after forward);
- ``flexflow_fsdp``: ``flexflow.parallelize`` with ``Strategy.fsdp`` (every
  replicated parameter at shard level 3);  every flexflow contender runs with
  ``reduce_outputs="eager"`` (the loss all-reduced on its own, one more small
  collective than the default): MemTracker's module hooks crash on the default
  path's output (a segmentation fault in ``register_hook``, not yet understood);
- ``flexflow_dp``: ``Strategy.data_parallel``;
- ``flexflow_capped``: the strategy ``flexflow.search`` finds (shard levels
  allowed) on the same machine with a memory cap per device half-way between
  the predicted peaks of fsdp and data parallelism, so that data parallelism
  does not fit.

Rounds alternate between the contenders; a round is ``--steps`` AdamW steps,
timed on every rank, counted at the slowest.  Reported per contender: median
step time and spread, the measured peak memory of one step per rank (torch's
``MemTracker`` around ``zero_grad``, forward, backward, ``step``, after a
warm-up step so that the optimizer state exists), and the simulator's
prediction of both (``Simulator(graph, machine, optimizer="adam")`` on the
detected host, or the ``cpu`` preset).  DDP's prediction is data
parallelism's, FSDP2's is ``Strategy.fsdp``'s.  Writes
``benchmarks/results/sharded.md`` and ``.json``.
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
from flexflow.models._common import make_inputs  # noqa: E402
from flexflow.models.llama import Llama, LlamaConfig  # noqa: E402

CONFIG = dict(layers=4, width=256, heads=8, kv_heads=4, hidden=688, vocab=4096, seq_len=64)
BATCH = 8  # global
LR = 1e-3
NAMES = ("ddp", "fsdp2", "flexflow_dp", "flexflow_fsdp", "flexflow_capped")


def build():
    torch.manual_seed(0)
    module = Llama(LlamaConfig(**CONFIG))
    inputs = make_inputs(module.input_specs(BATCH), seed=1, device="cpu", dtype=torch.float32)
    return module, inputs


class Trainer:
    """AdamW steps on fixed inputs (the rank's share for ddp and fsdp2)."""

    def __init__(self, model, inputs):
        self.model, self.inputs = model, inputs
        self.opt = torch.optim.AdamW(model.parameters(), lr=LR)

    def step(self):
        self.opt.zero_grad()
        loss = self.model(*self.inputs)
        loss.backward()
        self.opt.step()
        return loss

    def steps(self, n: int) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            self.step()
        return (time.perf_counter() - t0) / n

    def _tracker(self):
        from torch.distributed._tools.mem_tracker import MemTracker
        return MemTracker()

    def peak(self) -> int:
        self.step()
        mt = self._tracker()
        mt.track_external(self.model, self.opt)
        with mt:
            self.step()
        return int(mt.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"])


def timed_rounds(runs: dict, steps: int, rounds: int, warm: int = 1) -> tuple[dict, dict]:
    """(MemTracker peak of one step, per-round seconds a step) of each trainer in ``runs``: the
    peaks first, ``warm`` untimed steps, then ``rounds`` rounds of ``steps`` steps taking the
    trainers in turn, every rank entering each together (a barrier)."""
    import torch.distributed as dist
    peaks = {k: t.peak() for k, t in runs.items()}
    for t in runs.values():
        t.steps(warm)
    times = {k: [] for k in runs}
    for _ in range(rounds):
        for k, t in runs.items():
            dist.barrier()
            times[k].append(t.steps(steps))
    return peaks, times


def _fsdp2(module):
    from torch.distributed.fsdp import fully_shard
    m = copy.deepcopy(module)
    for block in m.layers:
        fully_shard(block)
    fully_shard(m)
    return m


def host_machine(world: int):
    """This host's calibrated machine cut to ``world`` processes, or the ``cpu`` preset."""
    detected = ff.Machine.detect()
    return detected.with_devices(world) if detected.num_devices >= world else ff.Machine.preset("cpu", devices=world)


def capped_machine(graph, machine):
    """``machine`` capped half-way between fsdp's and data parallelism's predicted peaks."""
    sim = ff.Simulator(graph, machine, optimizer="adam")
    dp = max(sim.simulate(ff.Strategy.data_parallel(graph, machine)).peak_memory)
    fs = max(sim.simulate(ff.Strategy.fsdp(graph, machine)).peak_memory)
    return machine.with_memory((dp + fs) // 2), dp, fs


def _worker(rank: int, steps: int, rounds: int, budget: float):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    world = dist.get_world_size()
    module, inputs = build()
    graph = ff.trace(module, inputs)
    machine = host_machine(world)
    cap, dp_peak, fsdp_peak = capped_machine(graph, machine)
    capped = None
    if rank == 0:
        found = ff.search(graph, cap, budget=budget, optimizer="adam", seed=0)
        capped = found.strategy.to_json()
    box = [capped]
    dist.broadcast_object_list(box, src=0)
    capped = ff.Strategy.from_json(box[0], graph)
    lo, hi = rank * BATCH // world, (rank + 1) * BATCH // world
    local = tuple(x[lo:hi] for x in inputs)
    strategies = {"flexflow_dp": ff.Strategy.data_parallel(graph, machine),
                  "flexflow_fsdp": ff.Strategy.fsdp(graph, machine), "flexflow_capped": capped}
    runs = {"ddp": Trainer(DDP(copy.deepcopy(module)), local), "fsdp2": Trainer(_fsdp2(module), local)}
    for name, s in strategies.items():  # (the capped plan was made for the capped machine)
        runs[name] = Trainer(ff.parallelize(module, example_inputs=inputs, strategy=s, reduce_outputs="eager",
                                            machine=cap if name == "flexflow_capped" else machine), inputs)
    peaks, times = timed_rounds(runs, steps, rounds, warm=2)
    out = {"times": times, "peaks": peaks}
    if rank == 0:
        sim = ff.Simulator(graph, machine, optimizer="adam", reduce_outputs="eager")
        res = {k: sim.simulate(s) for k, s in strategies.items() if k != "flexflow_capped"}
        res["flexflow_capped"] = ff.Simulator(graph, cap, optimizer="adam", reduce_outputs="eager").simulate(capped)
        res["ddp"], res["fsdp2"] = res["flexflow_dp"], res["flexflow_fsdp"]
        out["predicted_ms"] = {k: r.iteration_time * 1000 for k, r in res.items()}
        out["predicted_peak"] = {k: r.peak_memory for k, r in res.items()}
        out["cap"] = cap.spec.memory_bytes
        out["dp_peak"], out["fsdp_peak"] = dp_peak, fsdp_peak
        out["machine"] = machine.name
        out["capped_levels"] = sorted({f"{capped[op.name].shard}" for op in graph.compute_ops if op.params})
        out["capped_fits"] = max(res["flexflow_capped"].peak_memory) <= cap.spec.memory_bytes
        out["params"] = sum(p.numel() for p in module.parameters())
    for t in runs.values():
        del t.opt
    return out


def measure(world: int, steps: int, rounds: int, budget: float) -> dict:
    res = ff.launch(_worker, world, steps, rounds, budget, timeout_s=1800)
    per = {k: [max(r["times"][k][i] for r in res) for i in range(rounds)] for k in res[0]["times"]}
    med = {k: statistics.median(v) for k, v in per.items()}
    r0 = res[0]
    row = {"processes": world, "steps_per_round": steps, "rounds": rounds, "machine": r0["machine"],
           "params": r0["params"], "step_ms": {k: v * 1000 for k, v in med.items()},
           "spread_ms": {k: [min(v) * 1000, max(v) * 1000] for k, v in per.items()},
           "predicted_ms": r0["predicted_ms"],
           "peak_bytes": {k: [r["peaks"][k] for r in res] for k in med},
           "predicted_peak_bytes": r0["predicted_peak"], "cap_bytes": r0["cap"],
           "capped_levels": r0["capped_levels"], "capped_fits": r0["capped_fits"]}
    # every rank's measured peak against its own device's prediction
    row["peak_err"] = {k: max(abs(m - p) / p for m, p in zip(row["peak_bytes"][k], row["predicted_peak_bytes"][k]))
                       for k in med}
    return row


def _mib(b) -> str:
    return f"{b / 2**20:.1f}"


def write(rows, command: str, seconds: float, out: Path) -> None:
    out.with_suffix(".json").write_text(json.dumps({"command": command, "config": CONFIG, "batch": BATCH,
                                                    "rows": rows}, indent=1))
    lines = ["# Sharded training measured (gloo processes on this CPU, AdamW)", "",
             f"Command: `{command}` ({seconds:.0f} s).  Model: `flexflow.models.llama.Llama({CONFIG})`, "
             f"global batch {BATCH}.  Step time: median over rounds, a round counted at the slowest rank; "
             "memory: MemTracker peak of one step, max over ranks; predictions from "
             "`Simulator(graph, machine, optimizer=\"adam\")` (DDP as data parallelism, FSDP2 as "
             "`Strategy.fsdp`).", ""]
    for row in rows:
        ddp, f2 = row["step_ms"]["ddp"], row["step_ms"]["fsdp2"]
        lines += [f"## {row['processes']} processes ({row['params'] / 1e6:.2f} M parameters; cap for "
                  f"`flexflow_capped`: {_mib(row['cap_bytes'])} MiB a device, levels used {row['capped_levels']}, "
                  f"fits: {row['capped_fits']})", "",
                  "| contender | step ms | spread | ×DDP | ×FSDP2 | predicted ms | peak MiB (max rank) | "
                  "predicted MiB | worst peak error |",
                  "|---|---:|---|---:|---:|---:|---:|---:|---:|"]
        for k in NAMES:
            ms = row["step_ms"][k]
            lo, hi = row["spread_ms"][k]
            lines.append(f"| {k} | {ms:.1f} | {lo:.1f}–{hi:.1f} | {ddp / ms:.2f} | {f2 / ms:.2f} | "
                         f"{row['predicted_ms'][k]:.1f} | {_mib(max(row['peak_bytes'][k]))} | "
                         f"{_mib(max(row['predicted_peak_bytes'][k]))} | {row['peak_err'][k] * 100:.1f}% |")
        lines.append("")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--budget", type=float, default=20.0)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "sharded"))
    args = ap.parse_args(argv)
    if args.quick:
        args.worlds, args.steps, args.rounds, args.budget = [2], 1, 2, 3.0
    t0 = time.perf_counter()
    rows = []
    for world in args.worlds:
        row = measure(world, args.steps, args.rounds, args.budget)
        rows.append(row)
        print(f"{world} processes: " + "  ".join(
            f"{k} {row['step_ms'][k]:.1f} ms (pred {row['predicted_ms'][k]:.1f}, peak "
            f"{_mib(max(row['peak_bytes'][k]))} MiB, pred {_mib(max(row['predicted_peak_bytes'][k]))})"
            for k in NAMES), flush=True)
    command = "python benchmarks/sharded.py" + ("" if argv is None and len(sys.argv) == 1 else " " + " ".join(
        sys.argv[1:] if argv is None else argv))
    write(rows, command, time.perf_counter() - t0, Path(args.out))


if __name__ == "__main__":
    main()
