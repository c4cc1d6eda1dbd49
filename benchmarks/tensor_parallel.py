"""Tensor parallelism on gloo processes: flexflow's ``Strategy.megatron`` against torch's
DTensor plans (``parallelize_module``) on the same LLaMA-style decoder.

    .venv/bin/python benchmarks/tensor_parallel.py            # 2 and 4 processes
    .venv/bin/python benchmarks/tensor_parallel.py --quick    # smoke run

Model: ``benchmarks/sharded.py``'s decoder (``flexflow.models.llama.Llama``), its whole batch
on every process (one tensor-parallel group, tp = processes), AdamW.  Plans:

- flexflow ``megatron(tp=p)``: attention split by heads, the MLP by hidden units, the rest
  (embedding, norms, residual adds, head and loss) split along the tokens -- Megatron's
  sequence parallelism -- the transitions an all-gather (its input gathered again for the
  backward) and a reduce-scatter on 4 processes, point-to-point messages on 2 (a pair's
  collective is one message each way);
- flexflow ``megatron(tp=p, sequence_parallel=False)``: the ops between the pairs whole on
  every process, the row-parallel partial sums all-reduced (point to point on 2);
- flexflow ``megatron(tp=p).recompute_blocks()``: every op of the blocks recomputed (on 4
  processes the recomputation gathers the linear layers' inputs again);
- torch TP: ``ColwiseParallel`` on q, k, v, gate and up, ``RowwiseParallel`` on the output and
  down projections; embedding, norms and head replicated;
- torch TP + SP: the same with ``SequenceParallel`` norms, the embedding and the two row-parallel
  layers returning sequence shards, the blocks' inputs gathered (``PrepareModuleInput``) and the
  head column-parallel from sequence shards (torchtitan's plan).

Reported: median step time over alternating rounds (a round counted at its slowest rank),
MemTracker's peak of one step (max over ranks), the simulator's prediction of the flexflow
plan on this host's calibrated machine, and the flexflow/torch loss after the timed steps
(they train the same model from the same weights).  Writes
``benchmarks/results/tensor_parallel.md`` and ``.json``.
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
from flexflow.cost.model import CostModel  # noqa: E402


def _torch_tp(module, world: int, sp: bool):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)
    mesh = init_device_mesh("cpu", (world,))
    m = copy.deepcopy(module)
    for block in m.layers:
        plan = {"attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
                "attention.wv": ColwiseParallel(), "feed_forward.w1": ColwiseParallel(),
                "feed_forward.w3": ColwiseParallel()}
        if sp:
            plan.update({
                "attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel(),
                "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                                desired_input_layouts=(Replicate(), None, None)),
                "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
                "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1))})
        else:
            plan.update({"attention.wo": RowwiseParallel(), "feed_forward.w2": RowwiseParallel()})
        parallelize_module(block, mesh, plan)
    if sp:
        parallelize_module(m, mesh, {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())})
    return m


def _worker(rank: int, steps: int, rounds: int):
    import torch.distributed as dist
    torch.set_num_threads(1)
    world = dist.get_world_size()
    module, inputs = sharded.build()
    graph = ff.trace(module, inputs)
    machine = sharded.host_machine(world)
    sim = ff.Simulator(graph, machine, CostModel.for_machine(machine), optimizer="adam")
    plans = {"flexflow megatron": ff.Strategy.megatron(graph, machine, tp=world),
             "flexflow megatron, no sp": ff.Strategy.megatron(graph, machine, tp=world, sequence_parallel=False),
             "flexflow megatron, blocks recomputed": ff.Strategy.megatron(graph, machine, tp=world).recompute_blocks()}
    predicted, pms = {}, {}
    for k, s in plans.items():
        r = sim.simulate(s)
        predicted[k] = {"ms": r.iteration_time * 1e3, "peak": max(r.peak_memory)}
        pms[k] = ff.parallelize(copy.deepcopy(module), example_inputs=inputs, strategy=s, machine=machine)
    runs = {k: sharded.Trainer(pm, inputs) for k, pm in pms.items()}
    runs.update({"torch tp": sharded.Trainer(_torch_tp(module, world, False), inputs),
                 "torch tp+sp": sharded.Trainer(_torch_tp(module, world, True), inputs)})
    peaks, times = sharded.timed_rounds(runs, steps, rounds, warm=1)
    losses = {k: float(t.step().detach()) for k, t in runs.items()}
    for pm in pms.values():
        pm.runtime.close()
    return {"times": times, "peaks": peaks, "predicted": predicted, "losses": losses, "machine": machine.name}


def profile(world: int) -> None:
    from flexflow.cost.profile import profile_graph
    torch.set_num_threads(1)
    module, inputs = sharded.build()
    graph = ff.trace(module, inputs)
    for sp in (True, False):
        profile_graph(graph, "cpu", strategy=ff.Strategy.megatron(graph, sharded.host_machine(world), tp=world,
                                                                  sequence_parallel=sp))


def measure(world: int, steps: int, rounds: int) -> dict:
    profile(world)
    res = ff.launch(_worker, world, steps, rounds, timeout_s=1800)
    per = {k: [max(r["times"][k][i] for r in res) for i in range(rounds)] for k in res[0]["times"]}
    return {"processes": world, "machine": res[0]["machine"],
            "step_ms": {k: statistics.median(v) * 1000 for k, v in per.items()},
            "spread_ms": {k: [min(v) * 1000, max(v) * 1000] for k, v in per.items()},
            "peak_bytes": {k: max(r["peaks"][k] for r in res) for k in per},
            "predicted": res[0]["predicted"], "losses": res[0]["losses"]}


def write(rows, command: str, seconds: float, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"command": command, "seconds": seconds, "config": sharded.CONFIG,
                                                    "batch": sharded.BATCH, "rows": rows}, indent=1))
    lines = ["# Tensor parallelism on gloo processes: flexflow megatron against torch's DTensor plans (AdamW)", "",
             f"Command: `{command}` ({seconds:.0f} s). Model: `flexflow.models.llama.Llama({sharded.CONFIG})`, "
             f"batch {sharded.BATCH}, the whole batch on every process (one tensor-parallel group). Step: median over "
             "alternating rounds, a round at its slowest rank; peak: MemTracker, one step, max over ranks; predicted: "
             "the simulator on this host's calibrated machine.", "",
             "| processes | plan | step ms (spread) | / torch tp+sp | predicted ms | peak MiB | predicted peak MiB | "
             "loss after |", "|---:|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        ref = r["step_ms"]["torch tp+sp"]
        for k, ms in r["step_ms"].items():
            lo, hi = r["spread_ms"][k]
            p = r["predicted"].get(k)
            pred = f"{p['ms']:.1f} ({100 * (p['ms'] / ms - 1):+.0f}%)" if p else ""
            ppk = f"{p['peak'] / 2**20:.1f} ({100 * (p['peak'] / r['peak_bytes'][k] - 1):+.0f}%)" if p else ""
            lines.append(f"| {r['processes']} | {k} | {ms:.1f} ({lo:.1f}-{hi:.1f}) | {ms / ref:.2f} | {pred} | "
                         f"{r['peak_bytes'][k] / 2**20:.1f} | {ppk} | {r['losses'][k]:.5f} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--worlds", default="2,4")
    ap.add_argument("--out", default=str(HERE / "results" / "tensor_parallel"))
    a = ap.parse_args(argv)
    steps, rounds = (2, 2) if a.quick else (5, 7)
    t0 = time.perf_counter()
    rows = [measure(int(w), steps, rounds) for w in a.worlds.split(",")]
    command = "python benchmarks/tensor_parallel.py " + " ".join(argv if argv is not None else sys.argv[1:])
    write(rows, command.strip(), time.perf_counter() - t0, Path(a.out))


if __name__ == "__main__":
    main()
