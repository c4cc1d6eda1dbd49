"""Pipelines on gloo processes: flexflow's GPipe and 1F1B against torch.distributed.pipelining
on the same stage split and micro-batches, and against DDP.

    .venv/bin/python benchmarks/pipeline.py             # 2 and 4 processes
    .venv/bin/python benchmarks/pipeline.py --quick     # smoke run

Models: a deep decoder (``benchmarks/sharded.py``'s LLaMA-style decoder at 8 layers) and a
deep parameter-heavy MLP (8 tanh layers of 1024 x 1024 and a classifier), AdamW.  On p
processes every plan has p stages of one process each (``Strategy.megatron(tp=1, pp=p,
microbatches=M)``: the blocks cut by FLOPs, embedding first, head and loss last).  torch's
``PipelineStage`` runs the same blocks on each stage (read off the flexflow strategy) under
``ScheduleGPipe`` / ``Schedule1F1B`` / ``ScheduleInterleaved1F1B`` (two chunks a process) with
the same micro-batch count, its loss function the model's cross-entropy; each torch stage
holds its own blocks only.  DDP: the whole model on every process, each feeding its share of
the batch.  Reported: median step time over alternating rounds (a round counted at its
slowest rank), MemTracker's peak of one step (max over ranks), and the simulator's
prediction of each plan on this host's calibrated machine.  Writes
``benchmarks/results/pipeline.md`` and ``.json``.
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
import torch.nn as nn
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import flexflow as ff  # noqa: E402
import sharded  # noqa: E402
from flexflow.cost.model import CostModel  # noqa: E402
from flexflow.models._common import make_inputs  # noqa: E402
from flexflow.models.llama import Llama, LlamaConfig  # noqa: E402

MICRO = 8
DECODER = dict(sharded.CONFIG, layers=8)
DECODER_BATCH = 16
MLP_WIDTH, MLP_LAYERS, MLP_BATCH = 1024, 8, 256


class DeepMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(MLP_WIDTH, MLP_WIDTH), nn.Tanh())
                                    for _ in range(MLP_LAYERS))
        self.head = nn.Linear(MLP_WIDTH, 16)

    def forward(self, x, y):
        for b in self.blocks:
            x = b(x)
        return F.cross_entropy(self.head(x), y)


def build(name: str):
    torch.manual_seed(0)
    if name == "decoder":
        module = Llama(LlamaConfig(**DECODER))
        return module, make_inputs(module.input_specs(DECODER_BATCH), seed=1, device="cpu", dtype=torch.float32)
    module = DeepMLP()
    g = torch.Generator().manual_seed(1)
    return module, (torch.randn(MLP_BATCH, MLP_WIDTH, generator=g), torch.randint(0, 16, (MLP_BATCH,), generator=g))


class Stage(nn.Module):
    """Blocks ``ids`` of ``module`` (with its embedding on the first stage, its head on the
    last), and nothing else of it: what torch's PipelineStage runs."""

    def __init__(self, module, ids, first: bool, last: bool):
        super().__init__()
        self.llama, self.first, self.last = isinstance(module, Llama), first, last
        self.blocks = nn.ModuleList((module.layers if self.llama else module.blocks)[i] for i in ids)
        if self.llama:
            self.register_buffer("cos", module.cos, persistent=False)
            self.register_buffer("sin", module.sin, persistent=False)
            self.emb = module.tok_embeddings if first else None
            self.norm, self.out = (module.norm, module.output) if last else (None, None)
        else:
            self.head = module.head if last else None

    def forward(self, x):
        if self.llama:
            T = x.shape[1]
            cos, sin = self.cos.narrow(0, 0, T), self.sin.narrow(0, 0, T)
            if self.first:
                x = self.emb(x)
            for b in self.blocks:
                x = b(x, cos, sin)
            return self.out(self.norm(x)) if self.last else x
        for b in self.blocks:
            x = b(x)
        return self.head(x) if self.last else x


def _loss(out, target):
    return F.cross_entropy(out.transpose(1, 2), target) if out.dim() == 3 else F.cross_entropy(out, target)


def _split(graph, strategy) -> list[list[int]]:
    """Per virtual stage (run), the blocks flexflow placed there."""
    from flexflow.graph.ir import repeated_block
    stage_of = strategy.pipeline.stage_of()
    out = [[] for _ in strategy.pipeline.runs]
    for op in graph.compute_ops:
        block = repeated_block(op.module_path)
        if block:
            i = int(block.split(".")[-1])
            r = stage_of[op.name]
            if i not in out[r]:
                out[r].append(i)
    return out


def _tracker():
    """torch's MemTracker, taking a module called again at top level in one step (a stage, or an
    op's module, once per micro-batch) as a fresh call; the totals it reports are its own."""
    from torch.distributed._tools.mem_tracker import MemTracker

    class Tracker(MemTracker):
        def _pre_fw_hook(self, module, inputs):
            if module in self.memory_tracking and not self._mod_tracker.is_bw:
                name = self._mod_tracker.get_known_fqn(module)
                if set(self._mod_tracker.parents) - {name} == {"Global"}:
                    del self.memory_tracking[module]
            super()._pre_fw_hook(module, inputs)
    return Tracker()


class Trainer(sharded.Trainer):
    """``sharded.Trainer`` whose step is ``run()`` (a schedule's step, backward included) and
    whose MemTracker takes a module called once per micro-batch (:func:`_tracker`)."""

    def __init__(self, model, run):
        super().__init__(model, ())
        self.run = run

    def step(self):
        self.opt.zero_grad()
        self.run()
        self.opt.step()

    def _tracker(self):
        return _tracker()


def _worker(rank: int, name: str, steps: int, rounds: int):
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    world = dist.get_world_size()
    module, inputs = build(name)
    graph = ff.trace(module, inputs)
    machine = sharded.host_machine(world)
    runs, predicted = {}, {}
    sim = ff.Simulator(graph, machine, CostModel.for_machine(machine), optimizer="adam", reduce_outputs="eager")
    plans = _plans(graph, machine, world)
    split = None
    for sched in ("1f1b", "gpipe", "interleaved"):
        s = plans[sched]
        runs_split = _split(graph, s)
        if sched == "1f1b":
            split = runs_split
        pm = ff.parallelize(module, example_inputs=inputs, strategy=s, machine=machine)
        # forward() runs the schedule, backwards included: called as a function, not a tracked module call
        runs[f"flexflow {sched}"] = Trainer(pm, lambda pm=pm: pm.forward(*inputs).backward())
        r = sim.simulate(s)
        predicted[sched] = {"ms": r.iteration_time * 1e3, "peak": max(r.peak_memory), "bubble": r.bubble}
        copy_ = copy.deepcopy(module)
        n = len(runs_split)  # torch's stages: this rank's runs, stage index r (run r on rank r % world)
        mine = [r for r in range(n) if r % world == rank]
        mods = [Stage(copy_, runs_split[r], r == 0, r == n - 1) for r in mine]
        stages = [PipelineStage(mod, r, n, torch.device("cpu")) for mod, r in zip(mods, mine)]
        if sched == "interleaved":
            schedule = ScheduleInterleaved1F1B(stages, MICRO, loss_fn=_loss)
        else:
            schedule = (Schedule1F1B if sched == "1f1b" else ScheduleGPipe)(stages[0], MICRO, loss_fn=_loss)
        stage_mod = nn.ModuleList(mods)

        def run(schedule=schedule):
            if rank == 0:
                schedule.step(inputs[0])
            elif rank == world - 1:
                schedule.step(target=inputs[1])
            else:
                schedule.step()
        runs[f"torch {sched}"] = Trainer(stage_mod, run)
    r = sim.simulate(plans["ddp"])
    predicted["ddp"] = {"ms": r.iteration_time * 1e3, "peak": max(r.peak_memory), "bubble": 0.0}
    share = [x.chunk(world)[rank] for x in inputs]
    ddp = DDP(copy.deepcopy(module))
    runs["torch ddp"] = Trainer(ddp, lambda: ddp(*share).backward())
    peaks, times = sharded.timed_rounds(runs, steps, rounds, warm=1)
    for k, t in runs.items():
        if k.startswith("flexflow"):
            t.model.runtime.close()
    return {"times": times, "peaks": peaks, "predicted": predicted, "split": split, "machine": machine.name,
            "interleaved_split": runs_split}


def _plans(graph, machine, world: int) -> dict:
    mk = ff.Strategy.megatron
    return {"1f1b": mk(graph, machine, tp=1, pp=world, microbatches=MICRO, schedule="1f1b"),
            "gpipe": mk(graph, machine, tp=1, pp=world, microbatches=MICRO, schedule="gpipe"),
            "interleaved": mk(graph, machine, tp=1, pp=world, microbatches=MICRO, interleave=2),
            "ddp": ff.Strategy.data_parallel(graph, machine)}


def profile(name: str, world: int) -> None:
    """Time every partition the plans run on this host (one thread, as the workers), into the
    op profile the simulator reads (``CostModel.for_machine``): the pipelines' on the graph
    of one micro-batch."""
    from flexflow.cost.profile import profile_graph
    from flexflow.graph.micro import microbatch_graph
    torch.set_num_threads(1)
    module, inputs = build(name)
    graph = ff.trace(module, inputs)
    for s in _plans(graph, sharded.host_machine(world), world).values():
        if s.pipeline is None:
            profile_graph(graph, "cpu", strategy=s)
        else:
            micro = microbatch_graph(graph, s.pipeline.microbatches)
            profile_graph(micro, "cpu", strategy=ff.Strategy(micro, dict(s.items())))


def measure(name: str, world: int, steps: int, rounds: int) -> dict:
    profile(name, world)
    res = ff.launch(_worker, world, name, steps, rounds, timeout_s=1800)
    per = {k: [max(r["times"][k][i] for r in res) for i in range(rounds)] for k in res[0]["times"]}
    return {"model": name, "processes": world, "machine": res[0]["machine"], "split": res[0]["split"],
            "interleaved_split": res[0]["interleaved_split"],
            "step_ms": {k: statistics.median(v) * 1000 for k, v in per.items()},
            "spread_ms": {k: [min(v) * 1000, max(v) * 1000] for k, v in per.items()},
            "peak_bytes": {k: max(r["peaks"][k] for r in res) for k in per},
            "predicted": res[0]["predicted"]}


def write(rows, command: str, seconds: float, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"command": command, "seconds": seconds, "rows": rows}, indent=1))
    lines = ["# Pipelines on gloo processes: flexflow against torch.distributed.pipelining and DDP (AdamW)", "",
             f"Command: `{command}` ({seconds:.0f} s). Decoder: `benchmarks/sharded.py`'s LLaMA-style decoder "
             f"at {DECODER['layers']} layers ({DECODER}), batch {DECODER_BATCH}; MLP: {MLP_LAYERS} tanh layers "
             f"of {MLP_WIDTH} x {MLP_WIDTH} and a classifier, batch {MLP_BATCH}. p processes = p stages of one "
             f"process, {MICRO} micro-batches; torch's stages run the blocks flexflow placed on them. Step: median "
             "over alternating rounds, a round at its slowest rank; peak: MemTracker, one step, max over ranks; "
             "predicted: the simulator (this host's calibrated machine, its ops profiled on it first) for the plan (flexflow's and torch's "
             "schedule the same plan; DDP: data parallelism).", ""]
    for row in rows:
        lines += [f"## {row['model']}, {row['processes']} processes (machine `{row['machine']}`, blocks per "
                  f"stage {row['split']})", "",
                  "| run | step ms (spread) | predicted ms | error | peak MiB | predicted MiB | error | "
                  "predicted bubble |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for k, ms in row["step_ms"].items():
            pred = row["predicted"][k.split()[-1]]
            lo, hi = row["spread_ms"][k]
            peak = row["peak_bytes"][k]
            lines.append(f"| {k} | {ms:.1f} ({lo:.0f}-{hi:.0f}) | {pred['ms']:.1f} | {pred['ms'] / ms - 1:+.0%} | "
                         f"{peak / 2**20:.1f} | {pred['peak'] / 2**20:.1f} | {pred['peak'] / peak - 1:+.0%} | "
                         f"{pred['bubble']:.2f} |")
        f, t = row["step_ms"].get("flexflow 1f1b"), row["step_ms"].get("torch 1f1b")
        fi, ti = row["step_ms"].get("flexflow interleaved"), row["step_ms"].get("torch interleaved")
        if fi and ti:
            lines += ["", f"Interleaved (2 chunks a process, blocks per virtual stage {row['interleaved_split']}): "
                      f"flexflow / torch ScheduleInterleaved1F1B {fi / ti:.2f}x."]
        if f and t:
            lines += ["", f"flexflow 1F1B / torch Schedule1F1B: {f / t:.2f}x (aim: at most 1.1x). "
                      f"1F1B peak below GPipe's: flexflow "
                      f"{'yes' if row['peak_bytes']['flexflow 1f1b'] < row['peak_bytes']['flexflow gpipe'] else 'no'}"
                      f", predicted {'yes' if row['predicted']['1f1b']['peak'] < row['predicted']['gpipe']['peak'] else 'no'}."]
        lines.append("")
    out.with_suffix(".md").write_text("\n".join(lines))
    print("\n".join(lines))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", type=int, nargs="*", default=[2, 4])
    ap.add_argument("--models", nargs="*", default=["decoder", "mlp"])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=str(HERE / "results" / "pipeline"))
    a = ap.parse_args(argv)
    if a.quick:
        a.worlds, a.steps, a.rounds = [2], 1, 2
    t0 = time.perf_counter()
    rows = [measure(m, w, a.steps, a.rounds) for m in a.models for w in a.worlds]
    command = "python benchmarks/pipeline.py " + " ".join(argv if argv is not None else sys.argv[1:])
    write(rows, command.strip(), time.perf_counter() - t0, Path(a.out))


if __name__ == "__main__":
    main()
