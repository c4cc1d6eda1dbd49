"""The same plans on torch's engines and on flexflow's runtime, measured.

    .venv/bin/python benchmarks/native.py                # 2 and 4 processes
    .venv/bin/python benchmarks/native.py --quick        # smoke run

The model is ``benchmarks/sharded.py``'s LLaMA-style decoder with AdamW.  Each plan is
made with ``ff.plan(..., strategy=S)`` and run twice on the same gloo processes: through
``plan.parallelize_fn()`` (FSDP2 / DTensor / DDP on a device mesh, each data-parallel rank
feeding its share of the batch) and through ``flexflow.parallelize`` (flexflow's runtime,
every rank taking the global batch).  Plans: ``fsdp`` and ``data_parallel`` on every
world; ``fsdp_tp`` (FSDP x TP, tensor parallelism of 2) on 4 processes.  Reported: median
step time over alternating rounds (a round counted at its slowest rank), MemTracker's
peak of one step (max over ranks), and the simulator's prediction of both for the plan.
Writes ``benchmarks/results/native.md`` and ``.json``.
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
import sharded  # noqa: E402
from flexflow.native import local_batch  # noqa: E402


def _strategies(graph, machine, world: int) -> dict:
    out = {"data_parallel": ff.Strategy.data_parallel(graph, machine), "fsdp": ff.Strategy.fsdp(graph, machine)}
    if world >= 4:
        out["fsdp_tp"] = ff.Strategy.megatron(graph, machine, tp=2, shard=3)
    return out


def _worker(rank: int, steps: int, rounds: int):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    world = dist.get_world_size()
    module, inputs = sharded.build()
    graph = ff.trace(module, inputs)
    machine = sharded.host_machine(world)
    runs, predicted, meshes = {}, {}, {}
    for name, s in _strategies(graph, machine, world).items():
        plan = ff.plan(module, machine, inputs, strategy=s, optimizer="adam")
        desc = plan.native()
        mesh = init_device_mesh("cpu", tuple(desc["mesh"]["shape"]), mesh_dim_names=tuple(desc["mesh"]["dim_names"]))
        meshes[name] = desc["mesh"]
        runs[f"torch:{name}"] = sharded.Trainer(plan.parallelize_fn()(copy.deepcopy(module), mesh),
                                                local_batch(inputs, mesh))
        runs[f"flexflow:{name}"] = sharded.Trainer(
            ff.parallelize(module, example_inputs=inputs, strategy=s, machine=machine, reduce_outputs="eager"),
            inputs)
        sim = ff.Simulator(graph, machine, optimizer="adam", reduce_outputs="eager").simulate(s, incremental=False)
        predicted[name] = {"ms": sim.iteration_time * 1000, "peak": max(sim.peak_memory)}
    peaks = {k: t.peak() for k, t in runs.items()}
    for t in runs.values():
        t.steps(2)
    times = {k: [] for k in runs}
    for _ in range(rounds):
        for k, t in runs.items():
            dist.barrier()
            times[k].append(t.steps(steps))
    for t in runs.values():
        del t.opt
    return {"times": times, "peaks": peaks, "predicted": predicted, "meshes": meshes, "machine": machine.name}


def measure(world: int, steps: int, rounds: int) -> dict:
    res = ff.launch(_worker, world, steps, rounds, timeout_s=1800)
    per = {k: [max(r["times"][k][i] for r in res) for i in range(rounds)] for k in res[0]["times"]}
    return {"processes": world, "machine": res[0]["machine"], "meshes": res[0]["meshes"],
            "step_ms": {k: statistics.median(v) * 1000 for k, v in per.items()},
            "spread_ms": {k: [min(v) * 1000, max(v) * 1000] for k, v in per.items()},
            "peak_bytes": {k: max(r["peaks"][k] for r in res) for k in per},
            "predicted": res[0]["predicted"]}


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
