"""The same plans on torch's engines and on flexflow's runtime, measured.

    .venv/bin/python benchmarks/native.py                # 2 and 4 processes
    .venv/bin/python benchmarks/native.py --quick        # smoke run

The model is ``benchmarks/sharded.py``'s LLaMA-style decoder with AdamW.  Each plan is
made with ``ff.plan(..., strategy=S)`` and run twice on the same gloo processes: through
torch's engines (``plan.parallelize_fn()``: FSDP2 / DTensor / DDP on a device mesh;
``plan.pipeline()``: ``torch.distributed.pipelining``; each data-parallel rank feeding its
share of the batch) and through ``flexflow.parallelize`` (flexflow's runtime, every rank
taking the global batch).  Plans: ``fsdp`` and ``data_parallel`` on every world; ``pp``
(two stages, 4 micro-batches, 1F1B) on 2 processes; ``fsdp_tp`` (FSDP x TP with sequence
parallelism, tensor parallelism of 2) and ``pp_fsdp`` (two stages of FSDP on 2, GPipe) on
4.  Reported: median step time over alternating rounds (a round counted at its slowest
rank), MemTracker's peak of one step (max over ranks), and the simulator's prediction of
both for the plan.

Phases (rank 0, median over the timed steps): the step cut where a training loop cuts it
-- the forward (the module call), the backward (``loss.backward()``, the engines'
gradient reduction included: FSDP2 and DDP wait for it there), the optimizer step -- beside
the simulator's timeline of device 0 for the same plan: the busy time of its forward,
backward and update tasks, and the rest of its step (waiting on communication).  A
pipeline's schedule runs forwards and backwards together, so it has one "forward +
backward" phase, and the simulator no per-device timeline for it.  Writes
``benchmarks/results/native.md`` and ``.json``.
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

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import flexflow as ff  # noqa: E402
import pipeline as pipebench  # noqa: E402
import sharded  # noqa: E402
from flexflow.native import local_batch  # noqa: E402


def _strategies(graph, machine, world: int) -> dict:
    mk = ff.Strategy.megatron
    out = {"data_parallel": ff.Strategy.data_parallel(graph, machine), "fsdp": ff.Strategy.fsdp(graph, machine)}
    if world == 2:
        out["pp"] = mk(graph, machine, tp=1, pp=2, microbatches=4)
    if world >= 4:
        out["fsdp_tp"] = mk(graph, machine, tp=2, shard=3)
        out["pp_fsdp"] = mk(graph, machine, tp=1, shard=3, pp=2, microbatches=2, schedule="gpipe")
    return out


class PhaseTrainer(sharded.Trainer):
    """``sharded.Trainer`` timing its step's forward, backward and optimizer step."""

    def __init__(self, model, inputs):
        super().__init__(model, inputs)
        self.phases = {"forward": [], "backward": [], "optimizer": []}

    def step(self):
        t0 = time.perf_counter()
        self.opt.zero_grad()
        loss = self.model(*self.inputs)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        self.opt.step()
        t3 = time.perf_counter()
        for v, dt in zip(self.phases.values(), (t1 - t0, t2 - t1, t3 - t2)):
            v.append(dt)
        return loss


class PipeTrainer(pipebench.Trainer):
    """A pipeline's step (``run()``: the schedule, backwards included) and optimizer step, timed."""

    def __init__(self, model, run):
        super().__init__(model, run)
        self.phases = {"forward + backward": [], "optimizer": []}

    def step(self):
        t0 = time.perf_counter()
        self.opt.zero_grad()
        self.run()
        t1 = time.perf_counter()
        self.opt.step()
        t2 = time.perf_counter()
        self.phases["forward + backward"].append(t1 - t0)
        self.phases["optimizer"].append(t2 - t1)


def _sim_phases(sim, strategy) -> dict:
    """Device 0's busy time per task kind in the simulator's timeline (ms), and the rest of
    its step."""
    events, _ = sim.timeline(strategy)
    busy = {"forward": 0, "backward": 0, "optimizer": 0}
    kinds = {"fwd": "forward", "bwd": "backward", "update": "optimizer"}
    for _, kind, resource, _, dur in events:
        if resource == 0 and kind in kinds:
            busy[kinds[kind]] += dur
    return {k: v / 1e9 for k, v in busy.items()}


def _worker(rank: int, steps: int, rounds: int):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    world = dist.get_world_size()
    module, inputs = sharded.build()
    graph = ff.trace(module, inputs)
    machine = sharded.host_machine(world)
    runs, predicted, meshes, sim_phases = {}, {}, {}, {}
    simulator = ff.Simulator(graph, machine, optimizer="adam", reduce_outputs="eager")
    for name, s in _strategies(graph, machine, world).items():
        plan = ff.plan(module, machine, inputs, strategy=s, optimizer="adam")
        desc = plan.native()
        mesh = init_device_mesh("cpu", tuple(desc["mesh"]["shape"]), mesh_dim_names=tuple(desc["mesh"]["dim_names"]))
        meshes[name] = desc["mesh"]
        flex = ff.parallelize(module, example_inputs=inputs, strategy=s, machine=machine, reduce_outputs="eager")
        if s.pipeline is None:
            runs[f"torch:{name}"] = PhaseTrainer(plan.parallelize_fn()(copy.deepcopy(module), mesh),
                                                 local_batch(inputs, mesh))
            runs[f"flexflow:{name}"] = PhaseTrainer(flex, inputs)
            sim_phases[name] = _sim_phases(simulator, s)
        else:
            pipe = plan.pipeline(copy.deepcopy(module), mesh)
            share = local_batch(inputs, mesh)
            runs[f"torch:{name}"] = PipeTrainer(torch.nn.ModuleList(st.submod for st in pipe.stages),
                                                lambda pipe=pipe, share=share: pipe.step(*share))
            # forward() runs the schedule, backwards included
            runs[f"flexflow:{name}"] = PipeTrainer(flex, lambda flex=flex: flex.forward(*inputs).backward())
        sim = simulator.simulate(s, incremental=False)
        predicted[name] = {"ms": sim.iteration_time * 1000, "peak": max(sim.peak_memory)}
    peaks, times = sharded.timed_rounds(runs, steps, rounds, warm=2)
    phases = {k: {p: statistics.median(v) * 1000 for p, v in t.phases.items()} for k, t in runs.items()}
    for k, t in runs.items():
        del t.opt
        if k.startswith("flexflow") and hasattr(t.model, "runtime"):
            t.model.runtime.close()
    return {"times": times, "peaks": peaks, "predicted": predicted, "meshes": meshes, "machine": machine.name,
            "phases": phases, "sim_phases": sim_phases}


def measure(world: int, steps: int, rounds: int) -> dict:
    res = ff.launch(_worker, world, steps, rounds, timeout_s=1800)
    per = {k: [max(r["times"][k][i] for r in res) for i in range(rounds)] for k in res[0]["times"]}
    return {"processes": world, "machine": res[0]["machine"], "meshes": res[0]["meshes"],
            "step_ms": {k: statistics.median(v) * 1000 for k, v in per.items()},
            "spread_ms": {k: [min(v) * 1000, max(v) * 1000] for k, v in per.items()},
            "peak_bytes": {k: max(r["peaks"][k] for r in res) for k in per},
            "predicted": res[0]["predicted"], "phases": res[0]["phases"], "sim_phases": res[0]["sim_phases"]}


def write(rows, command: str, seconds: float, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"command": command, "seconds": seconds, "rows": rows}, indent=1))
    lines = ["# Plans on torch's engines and on flexflow's runtime (gloo processes on this CPU, AdamW)", "",
             f"Command: `{command}` ({seconds:.0f} s). Model: `benchmarks/sharded.py`'s LLaMA-style decoder "
             f"({sharded.CONFIG}), global batch {sharded.BATCH}. `torch`: the plan through `plan.parallelize_fn()` "
             "(FSDP2 / DTensor / DDP, each data-parallel rank feeding its share of the batch); `flexflow`: the "
             "same strategy through `flexflow.parallelize`. Step: median over alternating rounds, a round at its "
             "slowest rank; peak: MemTracker, one step, max over ranks; predicted: the simulator, for the plan.",
             ""]
    for row in rows:
        lines += [f"## {row['processes']} processes (machine `{row['machine']}`)", "",
                  "| plan | mesh | engine | step ms (spread) | predicted ms | error | peak MiB | predicted MiB | error |",
                  "|---|---|---|---:|---:|---:|---:|---:|---:|"]
        for plan, pred in row["predicted"].items():
            mesh = "×".join(map(str, row["meshes"][plan]["shape"])) + " " + ",".join(row["meshes"][plan]["dim_names"])
            for engine in ("torch", "flexflow"):
                k = f"{engine}:{plan}"
                ms, (lo, hi), peak = row["step_ms"][k], row["spread_ms"][k], row["peak_bytes"][k]
                lines.append(f"| {plan} | {mesh} | {engine} | {ms:.1f} ({lo:.0f}-{hi:.0f}) | {pred['ms']:.1f} | "
                             f"{pred['ms'] / ms - 1:+.0%} | {peak / 2**20:.1f} | {pred['peak'] / 2**20:.1f} | "
                             f"{pred['peak'] / peak - 1:+.0%} |")
        lines.append("")
        lines += [f"Phases, rank 0 (ms): measured | the simulator's device 0 (busy time per task kind; "
                  "'rest' = its step minus those)", "",
                  "| plan | engine | forward | backward | optimizer | step | sim forward | sim backward | "
                  "sim update | sim rest |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for plan, pred in row["predicted"].items():
            sp = row["sim_phases"].get(plan)
            for engine in ("torch", "flexflow"):
                ph = row["phases"][f"{engine}:{plan}"]
                if "forward" in ph:
                    meas = f"{ph['forward']:.1f} | {ph['backward']:.1f} | {ph['optimizer']:.1f}"
                else:
                    meas = f"{ph['forward + backward']:.1f} (with backward) | | {ph['optimizer']:.1f}"
                sims = (f"{sp['forward']:.1f} | {sp['backward']:.1f} | {sp['optimizer']:.1f} | "
                        f"{pred['ms'] - sum(sp.values()):.1f}") if sp else "| | |"
                lines.append(f"| {plan} | {engine} | {meas} | {row['step_ms'][f'{engine}:{plan}']:.1f} | {sims} |")
        lines.append("")
    out.with_suffix(".md").write_text("\n".join(lines))
    print("\n".join(lines))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", type=int, nargs="*", default=[2, 4])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=str(HERE / "results" / "native"))
    a = ap.parse_args(argv)
    if a.quick:
        a.worlds, a.steps, a.rounds = [2], 1, 2
    t0 = time.perf_counter()
    rows = [measure(w, a.steps, a.rounds) for w in a.worlds]
    command = "python benchmarks/native.py " + " ".join(argv if argv is not None else sys.argv[1:])
    write(rows, command.strip(), time.perf_counter() - t0, Path(a.out))


if __name__ == "__main__":
    main()
