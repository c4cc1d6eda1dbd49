"""Executor overhead on this CPU: flexflow against plain PyTorch.

1. Two gloo processes (one thread each): training throughput of
   ``flexflow.parallelize`` with ``Strategy.data_parallel`` against
   ``torch.nn.parallel.DistributedDataParallel`` on the same model, the same
   global batch and the same processes (DDP: each rank runs its half of the
   batch through the plain module).
2. One process: ``flexflow.parallelize`` (the graph run op by op through the
   partition rules) against the plain module.

Rounds alternate between the two contenders so that load from other
processes on the machine hits both alike; the figure per contender is the
median step time over rounds.  Writes ``benchmarks/results/executor_overhead.md``
and ``.json``.

    .venv/bin/python benchmarks/executor_overhead.py            # a few minutes
    .venv/bin/python benchmarks/executor_overhead.py --quick    # smoke run
"""
from __future__ import annotations

import argparse
import copy
import cProfile
import json
import os
import platform
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import flexflow as ff  # noqa: E402
from flexflow.api import parallelize  # noqa: E402
from flexflow.launch import launch  # noqa: E402
from flexflow.hardware.machine import Machine  # noqa: E402
from flexflow.strategy.strategy import Strategy  # noqa: E402

# (zoo model, size, global batch)
# (the transformer's batch differs from its sequence length 16: an axis as long as the
#  batch would be taken for the sample dim, e.g. the position embedding's)
CASES = [("alexnet", "small", 64), ("transformer", "small", 32), ("rnnlm", "small", 32)]
LR = 0.01


class _Trainer:
    """One SGD step at a time (forward, backward, update) on fixed inputs."""

    def __init__(self, model, inputs):
        self.model, self.inputs = model, inputs
        self.opt = torch.optim.SGD(model.parameters(), lr=LR)

    def step(self) -> float:
        t0 = time.perf_counter()
        self.opt.zero_grad()
        loss = self.model(*self.inputs)
        loss.backward()
        self.opt.step()
        self.last_loss = loss  # read it after the timing (.item() waits for it)
        return time.perf_counter() - t0

    def steps(self, n: int) -> float:
        """Seconds per step over n steps."""
        t0 = time.perf_counter()
        for _ in range(n):
            self.step()
        return (time.perf_counter() - t0) / n


def batched_ddp(module):
    """DDP on a new process group of all ranks whose gloo event-loop threads run under
    SCHED_BATCH, as flexflow's own groups do (``flexflow.runtime.gloo.batch_gloo_loops``):
    DDP with the thread policy, to tell that policy's share of a ratio from the rest."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from flexflow.runtime.gloo import batched_gloo_loops
    with batched_gloo_loops():
        group = dist.new_group(list(range(dist.get_world_size())))
        dist.barrier(group=group)
    return DDP(copy.deepcopy(module), process_group=group)


# --------------------------------------------------------------------------- 2 processes
def _two_process_worker(rank: int, name: str, size: str, batch: int, steps: int, rounds: int):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    world = dist.get_world_size()
    module, inputs = ff.models.get(name, batch_size=batch, size=size)
    graph = ff.trace(module, inputs)
    strategy = Strategy.data_parallel(graph, Machine.preset("cpu", devices=world))
    ddp = DDP(copy.deepcopy(module))
    lo, hi = rank * batch // world, (rank + 1) * batch // world
    local = tuple(x[lo:hi] for x in inputs)
    ffm = parallelize(module, example_inputs=inputs, strategy=strategy)
    eager = parallelize(module, example_inputs=inputs, strategy=strategy, reduce_outputs="eager")
    runs = {"ddp": _Trainer(ddp, local), "ddp_global_loss": _Trainer(_GlobalLoss(ddp), local),
            "flexflow": _Trainer(ffm, inputs), "flexflow_eager": _Trainer(eager, inputs),
            "ddp_batched": _Trainer(batched_ddp(module), local)}
    for t in runs.values():
        t.steps(3)  # warm-up
    times = {k: [] for k in runs}
    for _ in range(rounds):  # alternate contenders: load from other jobs hits both alike
        for k, t in runs.items():
            dist.barrier()
            times[k].append(t.steps(steps))
    prof = cProfile.Profile()  # where flexflow's time goes on this rank
    dist.barrier()
    prof.enable()
    runs["flexflow"].steps(steps)
    prof.disable()
    return {"times": times, "profile": _profile_summary(prof, steps)}


class _GlobalLoss(torch.nn.Module):
    """DDP that also returns the global loss on every rank, as flexflow does:
    one all_reduce of the loss per forward (its value only; DDP's gradients
    stay as they are)."""

    def __init__(self, ddp):
        super().__init__()
        self.ddp = ddp

    def forward(self, *inputs):
        import torch.distributed as dist
        loss = self.ddp(*inputs)
        total = loss.detach().clone()
        dist.all_reduce(total)
        return loss + (total / dist.get_world_size() - loss.detach())


def _profile_summary(prof, steps: int) -> dict:
    """Milliseconds per step in a few parts of the flexflow step (cProfile)."""
    from flexflow.runtime import execute as ex
    st = pstats.Stats(prof)

    def code(fn):
        c = fn.__code__
        return (c.co_filename, c.co_firstlineno, c.co_name)
    parts = {
        "forward total": (code(ex.Runtime.run), "cum"),
        "executor loop itself": (code(ex.Runtime.run), "self"),
        "loss all_reduce": (code(ex._OutputFn.forward), "cum"),
        "backward total": (None, "backward"),
        "grad all-reduce (flush + wait)": (code(ex._GradSync.finish), "cum"),
    }
    out = {}
    for label, (key, kind) in parts.items():
        total = 0.0
        for k, (_, _, tt, ct, _) in st.stats.items():
            if kind == "backward" and k[2] == "<method 'run_backward' of 'torch._C._EngineBase' objects>":
                total += ct
            elif k == key:
                total += ct if kind == "cum" else tt
        out[label] = round(total * 1000 / steps, 3)
    return out


def two_processes(steps: int, rounds: int) -> list[dict]:
    rows = []
    for name, size, batch in CASES:
        res = launch(_two_process_worker, 2, name, size, batch, steps, rounds, timeout_s=600)
        # a step ends when the slower rank ends: take the max over ranks per round
        per = {k: [max(r["times"][k][i] for r in res) for i in range(rounds)] for k in res[0]["times"]}
        ddp_s, ff_s = statistics.median(per["ddp"]), statistics.median(per["flexflow"])
        dgl_s = statistics.median(per["ddp_global_loss"])
        eager_s = statistics.median(per["flexflow_eager"])
        batched_s = statistics.median(per["ddp_batched"])
        rows.append({"model": name, "size": size, "batch": batch, "processes": 2,
                     "ddp_samples_per_s": batch / ddp_s, "flexflow_samples_per_s": batch / ff_s,
                     "flexflow_eager_samples_per_s": batch / eager_s, "ratio_eager": ddp_s / eager_s,
                     "ddp_global_loss_samples_per_s": batch / dgl_s,
                     "ratio": ddp_s / ff_s, "ratio_vs_ddp_global_loss": dgl_s / ff_s,
                     "ddp_batched_samples_per_s": batch / batched_s, "ratio_vs_ddp_batched": batched_s / ff_s,
                     "ddp_step_ms": ddp_s * 1000, "flexflow_step_ms": ff_s * 1000,
                     "rounds_ms": {k: [round(v * 1000, 2) for v in vs] for k, vs in per.items()},
                     "profile_rank0_ms_per_step": res[0]["profile"]})
        print(f"2 procs {name:12s} DDP {batch / ddp_s:8.1f}  DDP+global loss {batch / dgl_s:8.1f}  "
              f"flexflow {batch / ff_s:8.1f}  flexflow eager {batch / eager_s:8.1f} samples/s  "
              f"ratio {ddp_s / ff_s:.3f} / {dgl_s / ff_s:.3f}, eager {ddp_s / eager_s:.3f}, "
              f"vs DDP batched {batched_s / ff_s:.3f}",
              flush=True)
    return rows


# --------------------------------------------------------------------------- 1 process
def one_process(steps: int, rounds: int) -> list[dict]:
    torch.set_num_threads(1)
    rows = []
    for name, size, batch in CASES:
        module, inputs = ff.models.get(name, batch_size=batch, size=size)
        plain = copy.deepcopy(module)
        ffm = parallelize(module, example_inputs=inputs)
        runs = {"plain": _Trainer(plain, inputs), "flexflow": _Trainer(ffm, inputs)}
        for t in runs.values():
            t.steps(3)  # warm-up
        per = {"plain": [], "flexflow": []}
        for _ in range(rounds * steps):  # alternate single steps
            for k, t in runs.items():
                per[k].append(t.step())
        p_s, f_s = statistics.median(per["plain"]), statistics.median(per["flexflow"])
        rows.append({"model": name, "size": size, "batch": batch, "processes": 1,
                     "plain_samples_per_s": batch / p_s, "flexflow_samples_per_s": batch / f_s,
                     "overhead_pct": 100 * (f_s / p_s - 1), "plain_step_ms": p_s * 1000,
                     "flexflow_step_ms": f_s * 1000,
                     "min_step_ms": {k: round(min(v) * 1000, 3) for k, v in per.items()},
                     "p10_p90_step_ms": {k: [round(_quantile(v, q) * 1000, 3) for q in (0.1, 0.9)]
                                         for k, v in per.items()},
                     "executor_loop_ms": _loop_ms(runs["flexflow"], steps),
                     "top_ops_ms": _top_ops(ffm, plain, inputs)})
        print(f"1 proc  {name:12s} plain {batch / p_s:8.1f} samples/s  flexflow {batch / f_s:8.1f} "
              f"samples/s  overhead {100 * (f_s / p_s - 1):+.1f}%", flush=True)
    return rows


def _quantile(v: list, q: float) -> float:
    s = sorted(v)
    return s[int(q * (len(s) - 1))]


def _loop_ms(trainer, steps: int) -> float:
    """Self time of the executor's run loop per step (cProfile): flexflow's own bookkeeping."""
    prof = cProfile.Profile()
    prof.enable()
    trainer.steps(steps)
    prof.disable()
    return _profile_summary(prof, steps)["executor loop itself"]


def _top_ops(ffm, plain, inputs, steps: int = 3) -> dict:
    """Self CPU time per step (ms) of the aten ops whose time differs most between
    flexflow and the plain module: what the op-by-op rules cost."""
    from torch.profiler import ProfilerActivity, profile

    def measure(model):
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                opt.zero_grad()
                model(*inputs).backward()
                opt.step()
        return {e.key: e.self_cpu_time_total / 1000 / steps for e in prof.key_averages()}
    a, b = measure(ffm), measure(plain)
    diff = {k: a.get(k, 0.0) - b.get(k, 0.0) for k in set(a) | set(b)}
    top = sorted(diff.items(), key=lambda kv: -abs(kv[1]))[:6]
    return {k: round(v, 3) for k, v in top}


# --------------------------------------------------------------------------- report
def write_report(two: list[dict], one: list[dict], command: str, seconds: float, out: Path) -> None:
    data = {"command": command, "seconds": round(seconds, 1), "host": platform.node(),
            "cpus": os.cpu_count(), "torch": torch.__version__, "two_processes": two, "one_process": one}
    out.with_suffix(".json").write_text(json.dumps(data, indent=1) + "\n")
    lines = [
        "# Executor overhead (CPU, gloo)",
        "",
        f"Command (from the repository root): `{command}` ({seconds:.0f} s; {os.cpu_count()} CPUs "
        "shared with other jobs, "
        f"torch {torch.__version__}, one thread per process).  Median over alternating rounds.",
        "",
        "## Data parallel, 2 processes: flexflow against DistributedDataParallel",
        "",
        "DDP+global loss: DDP that also all-reduces the loss value so that every rank returns",
        "the global loss, as flexflow's `reduce_outputs=\"eager\"` (the *flexflow eager* column) does (one",
        "more collective per step).  flexflow: the default, the global loss carried by the gradient",
        "all-reduce (no collective beyond DDP's).  DDP batched: DDP on a group whose gloo event-loop",
        "threads run under SCHED_BATCH, as flexflow's groups do (`flexflow.runtime.gloo.batch_gloo_loops`);",
        "DDP and DDP+global loss run on the launch's default group, whose threads are left as they are.",
        "",
        "| model | global batch | DDP samples/s | DDP+global loss samples/s | DDP batched samples/s "
        "| flexflow samples/s | flexflow eager samples/s | flexflow / DDP | flexflow / DDP+global loss "
        "| flexflow / DDP batched | flexflow eager / DDP |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in two:
        lines.append(f"| {r['model']} ({r['size']}) | {r['batch']} | {r['ddp_samples_per_s']:.1f} | "
                     f"{r['ddp_global_loss_samples_per_s']:.1f} | {r['ddp_batched_samples_per_s']:.1f} | "
                     f"{r['flexflow_samples_per_s']:.1f} | {r['flexflow_eager_samples_per_s']:.1f} | "
                     f"{r['ratio']:.2f} | {r['ratio_vs_ddp_global_loss']:.2f} | {r['ratio_vs_ddp_batched']:.2f} | "
                     f"{r['ratio_eager']:.2f} |")
    lines += ["", "The spread: step time per round, median (fastest-slowest round), ms (a round ends "
              "when the slower rank does):", "",
              "| model | DDP | DDP+global loss | DDP batched | flexflow | flexflow eager |",
              "| --- | --- | --- | --- | --- | --- |"]
    for r in two:
        cells = []
        for k in ("ddp", "ddp_global_loss", "ddp_batched", "flexflow", "flexflow_eager"):
            v = r["rounds_ms"][k]
            cells.append(f"{statistics.median(v):.2f} ({min(v):.2f}-{max(v):.2f})")
        lines.append(f"| {r['model']} | " + " | ".join(cells) + " |")
    lines += ["", "Where a flexflow step goes on rank 0 (ms per step, cProfile):", ""]
    for r in two:
        parts = ", ".join(f"{k} {v:.2f}" for k, v in r["profile_rank0_ms_per_step"].items())
        lines.append(f"- {r['model']}: step {r['flexflow_step_ms']:.2f} ms (DDP {r['ddp_step_ms']:.2f} ms): {parts}")
    lines += [
        "",
        "## One process: flexflow against the plain module",
        "",
        "Single steps alternate between the two; the spread is the 10th-90th percentile of the steps.",
        "",
        "| model | batch | plain samples/s | flexflow samples/s | overhead | plain step ms (p10-p90) "
        "| flexflow step ms (p10-p90) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in one:
        (pa, pb), (fa, fb) = r["p10_p90_step_ms"]["plain"], r["p10_p90_step_ms"]["flexflow"]
        lines.append(f"| {r['model']} ({r['size']}) | {r['batch']} | {r['plain_samples_per_s']:.1f} | "
                     f"{r['flexflow_samples_per_s']:.1f} | {r['overhead_pct']:+.1f}% | "
                     f"{r['plain_step_ms']:.3f} ({pa:.3f}-{pb:.3f}) | {r['flexflow_step_ms']:.3f} ({fa:.3f}-{fb:.3f}) |")
    lines += ["", "Executor loop self time, and the aten ops whose self CPU time differs most "
              "(flexflow minus plain), ms per step:", ""]
    for r in one:
        parts = ", ".join(f"{k} {v:+.2f}" for k, v in r["top_ops_ms"].items())
        lines.append(f"- {r['model']}: loop {r['executor_loop_ms']:.2f}; {parts}")
    lines += ["", "## What costs the difference", "", NOTES.strip(), ""]
    out.with_suffix(".md").write_text("\n".join(lines))


NOTES = """
**Quiet host.**  Read the ratios as ±10%: under load from other jobs the
same script moves them by that much, and rnnlm's (a 2-3 ms step, half of it
the gradient all-reduce's latency) by more: over nine runs on one day its
data-parallel ratio ranged 0.77-1.01, DDP's own throughput 9,500-11,900
samples/s.

**Two processes, data parallel.**  What the executor does per step: every
receive posted at the start of the step and waited on at first use, sends
posted as soon as their producer is computed, the gradient buckets all-reduced
asynchronously from the backward, and the global loss all-reduced while the
backward runs (the returned loss waits at its first read): both ride on the
gradient all-reduce by default.  The ops that
read only constants (the transformer's position embedding) are replicated,
so data parallelism exchanges no activation at all.  By default the
global loss rides at the end of a gradient bucket and the step has DDP's
collectives only; the *flexflow eager* column all-reduces it on its own
(`reduce_outputs="eager"`), which costs about as much as a few dozen small
ops on this host.  The collectives and gloo's point-to-point calls go
straight to the process group (``dist.all_reduce``'s checks cost tens of
microseconds a call).  The gloo event-loop threads of the runtime's groups
run under SCHED_BATCH (`flexflow.runtime.gloo.batch_gloo_loops`): a loop thread
woken by a socket event otherwise preempts the thread that holds the pair's
lock on its core and spins on it for the rest of its time slice, and a send
or a collective step comes back milliseconds late now and then.  DDP here
runs on the launch's default group with its threads left as they are; the
*DDP batched* column gives DDP the same policy, so the share of a ratio that
is the thread policy shows.  Beyond it, what flexflow's data parallelism
costs over DDP's on rnnlm is local CPU time, not communication
(`benchmarks/dp_phases.py` times each phase: its forward 0.1 ms more, for
the gradient gate that hands a bucket's gradients to the all-reduce and the
output that rides, and its backward up to the launch 0.05 ms more).

**One process.**  Each step of a rank's program is compiled once into a
function (how every input and parameter is read, the rule's per-partition
work fixed: index tuples, reshapes, the loss's reduction), an index op that
reads h or c of an LSTM cell returns the part itself, and a whole LSTM
weight is held in the module's own shape (no reshape per use): rnnlm's
one-process overhead went from +26-31% to a few percent.  An index of a
partition's region (an unrolled RNN's ``x[:, t]``) runs as one index of the
held tensor, as the module runs it, not as a slice and then an index (one
op and one backward node less per time step), and a stack as
``torch.stack``: rnnlm's one-process overhead went from +5-7.5% to 0-3%.  Convolutions and
pools along unsplit axes let the kernel pad (no copy of the input).
"""


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=5, help="steps per round")
    p.add_argument("--rounds", type=int, default=36)
    p.add_argument("--quick", action="store_true", help="2 steps x 2 rounds")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "executor_overhead"))
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.rounds = 2, 2
    extra = sys.argv[1:] if argv is None else list(argv)
    command = " ".join([".venv/bin/python benchmarks/executor_overhead.py"] + extra)
    t0 = time.perf_counter()
    two = two_processes(args.steps, args.rounds)
    one = one_process(args.steps, args.rounds)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_report(two, one, command, time.perf_counter() - t0, out)
    print(f"wrote {out.with_suffix('.md')} and .json")


if __name__ == "__main__":
    main()
