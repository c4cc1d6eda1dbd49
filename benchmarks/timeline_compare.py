"""Predicted against measured, op by op: the simulator's timeline of one
training step beside a ``torch.profiler`` trace of the real step.

    .venv/bin/python benchmarks/timeline_compare.py                      # rnnlm, data parallel
    .venv/bin/python benchmarks/timeline_compare.py --model alexnet --strategy random1
    .venv/bin/python benchmarks/timeline_compare.py --strategy model_parallel --batch 64

On 2 gloo processes (one thread each) the executor runs the strategy; after
warm-up steps, one step per rank is recorded with ``torch.profiler``.  The
executor names each partition's compute ``"<op> fwd"`` under the profiler,
as the simulator names its tasks, so the two traces open side by side in
Perfetto (https://ui.perfetto.dev: open both files).  The backward of an op
is found through autograd's sequence numbers: the backward functions whose
sequence number belongs to an aten op recorded inside the op's forward range.

Writes, under ``benchmarks/results/timeline/``: ``<model>-<strategy>-predicted.json``
(``SimResult.to_chrome_trace``), ``<model>-<strategy>-rank<r>.json.gz`` (the
profiler's trace of the recorded step) and ``<model>-<strategy>.md``: per
device, the predicted and measured forward and backward time of every op
partition (the cost model's ``op_time``, which the simulator's tasks
sum), the totals, and what the measured step spends outside op compute
(waits, communication, dispatch, the optimizer).  The cost model is the one
``flexflow.parallelize`` searches with on this host (``Machine.detect()``,
``CostModel.for_machine``); profile the strategy first
(``flexflow profile``) for measured op times rather than analytic ones.
"""
from __future__ import annotations

import argparse
import gzip
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import flexflow as ff  # noqa: E402
from flexflow.calibrate.host import ensure_calibrated  # noqa: E402

NPROCS = 2
BACKWARD_PREFIX = "autograd::engine::evaluate_function: "


def make_strategy(graph, machine, name: str):
    if name.startswith("random"):
        return ff.Strategy.random(graph, machine, int(name[len("random"):] or 0))
    if name.endswith(".json"):
        return ff.Strategy.from_json(Path(name).read_text(), graph, machine)
    return getattr(ff.Strategy, name)(graph, machine)


def measured_ops(prof_events, step_label: str, op_names) -> dict:
    """From the profiler's events: the recorded step's span, forward and backward
    seconds per op ("<op> fwd" ranges and the backward functions of the aten
    ops inside them), the optimizer step, and the whole backward."""
    evs = list(prof_events)
    step = next(e for e in evs if e.name == step_label)
    t0, t1 = step.time_range.start, step.time_range.end
    inside = [e for e in evs if t0 <= e.time_range.start and e.time_range.end <= t1]
    labels = {e.name[:-4]: e for e in inside if e.name.endswith(" fwd") and e.name[:-4] in op_names}
    main = step.thread
    seq_of: dict[int, str] = {}
    for e in inside:
        if e.thread != main or e.sequence_nr < 0 or e.name.startswith(BACKWARD_PREFIX):
            continue
        for name, lab in labels.items():
            if lab.time_range.start <= e.time_range.start and e.time_range.end <= lab.time_range.end:
                seq_of.setdefault(e.sequence_nr, name)
                break
    bwd = {name: 0.0 for name in labels}
    for e in inside:
        if e.name.startswith(BACKWARD_PREFIX):
            name = seq_of.get(e.sequence_nr)
            if name is not None:
                bwd[name] += (e.time_range.end - e.time_range.start) * 1e-6
    spans = {"step": (t1 - t0) * 1e-6}
    for label, key in (("ff forward", "forward"), ("ff backward", "backward"), ("ff optimizer", "optimizer")):
        ev = next((e for e in inside if e.name == label), None)
        if ev is not None:
            spans[key] = (ev.time_range.end - ev.time_range.start) * 1e-6
    return {"fwd": {n: (e.time_range.end - e.time_range.start) * 1e-6 for n, e in labels.items()},
            "bwd": bwd, "spans": spans}


def _worker(rank, name, batch, strategy_json, warmup, out_dir, tag):
    from torch.profiler import ProfilerActivity, profile, record_function

    from real_speedup import build
    torch.set_num_threads(1)
    module, inputs = build(name, batch)
    graph = ff.trace(module, inputs)
    strategy = ff.Strategy.from_json(strategy_json, graph)
    model = ff.parallelize(module, NPROCS, example_inputs=inputs, strategy=strategy)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step():
        with record_function("ff forward"):
            opt.zero_grad()
            loss = model(*inputs)
        with record_function("ff backward"):
            loss.backward()
        with record_function("ff optimizer"):
            opt.step()
        return loss

    for _ in range(warmup):
        step().item()
    torch.distributed.barrier()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for k in range(2):  # the second step is the one compared (the first warms the profiler)
            with record_function(f"ff step {k}"):
                step().item()
    raw = Path(out_dir) / f"{tag}-rank{rank}.json"
    prof.export_chrome_trace(str(raw))
    with open(raw, "rb") as f, gzip.open(str(raw) + ".gz", "wb") as g:  # Perfetto opens .json.gz
        g.write(f.read())
    raw.unlink()
    return measured_ops(prof.events(), "ff step 1", {op.name for op in graph.ops})


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="rnnlm", help="a zoo model or wide_mlp (benchmarks/real_speedup.py)")
    p.add_argument("--strategy", default="data_parallel",
                   help="data_parallel, model_parallel, expert, randomK or a strategy .json file")
    p.add_argument("--batch", type=int, default=None, help="global batch (default: the model's in sim_accuracy)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "timeline"))
    a = p.parse_args(argv)
    from real_speedup import build
    from sim_accuracy import CASES
    from flexflow.cost.model import CostModel
    batch = a.batch or dict(CASES).get(a.model, 32)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    module, inputs = build(a.model, batch)
    graph = ff.trace(module, inputs)
    ensure_calibrated()
    machine = ff.Machine.detect().with_devices(NPROCS)
    strategy = make_strategy(graph, machine, a.strategy)
    tag = f"{a.model}-{Path(a.strategy).stem}"
    cost = CostModel.for_machine(machine)
    sim = ff.Simulator(graph, machine, cost)
    res = sim.simulate(strategy, incremental=False)
    res.to_chrome_trace(str(out / f"{tag}-predicted.json"))
    t0 = time.perf_counter()
    got = ff.launch(_worker, NPROCS, a.model, batch, strategy.to_json(), a.warmup, str(out), tag, timeout_s=600)
    lines = [f"# Predicted against measured, op by op: {a.model} (batch {batch}), {strategy.name}", "",
             f"Command: `python benchmarks/timeline_compare.py --model {a.model} --strategy {a.strategy} "
             f"--batch {batch}` ({time.perf_counter() - t0:.0f} s for the run); machine `{machine.name}`. "
             f"Traces: `{tag}-predicted.json` (simulated) and `{tag}-rank<r>.json.gz` (torch.profiler), "
             "in this folder; open them side by side in Perfetto.", "",
             f"Simulated iteration: **{res.iteration_time * 1e3:.2f} ms**; measured step (rank 0 / 1): "
             + " / ".join(f"**{g['spans']['step'] * 1e3:.2f} ms**" for g in got)
             + " (under the profiler, which adds its own cost per op).", ""]
    for d, g in enumerate(got):
        rows, pf, pb, mf, mb, src = [], 0.0, 0.0, 0.0, 0.0, {"measured": 0, "analytic": 0}
        for op in graph.compute_ops:
            part = next((q for q in ff.strategy.partitions(op, strategy[op.name]) if q.device == d), None)
            if part is None:
                continue
            f, b = cost.op_time(op, part, d)
            src[cost.source(op, part, d)] += 1
            m_f, m_b = g["fwd"].get(op.name, 0.0), g["bwd"].get(op.name, 0.0)
            rows.append((abs(m_f + m_b - f - b), op.name, f, b, m_f, m_b))
            pf, pb, mf, mb = pf + f, pb + b, mf + m_f, mb + m_b
        sp = g["spans"]
        lines += [f"## Device {d} (rank {d})", "",
                  f"- op partitions: {len(rows)} ({src['measured']} with measured op times, "
                  f"{src['analytic']} analytic)",
                  f"- forward compute: predicted {pf * 1e3:.2f} ms, measured {mf * 1e3:.2f} ms; "
                  f"backward compute: predicted {pb * 1e3:.2f} ms, measured {mb * 1e3:.2f} ms",
                  f"- measured phases: forward {sp.get('forward', 0) * 1e3:.2f} ms, backward "
                  f"{sp.get('backward', 0) * 1e3:.2f} ms, optimizer {sp.get('optimizer', 0) * 1e3:.2f} ms; "
                  f"outside op compute: {(sp['step'] - mf - mb) * 1e3:.2f} ms of {sp['step'] * 1e3:.2f} "
                  "(waits, communication, dispatch, the optimizer, the profiler)",
                  "", "| op | predicted fwd ms | measured fwd ms | predicted bwd ms | measured bwd ms |",
                  "|---|---:|---:|---:|---:|"]
        for _, name, f, b, m_f, m_b in sorted(rows, reverse=True)[:15]:
            lines.append(f"| {name} | {f * 1e3:.3f} | {m_f * 1e3:.3f} | {b * 1e3:.3f} | {m_b * 1e3:.3f} |")
        lines.append("")
    lines += ["(the 15 op partitions per device whose predicted and measured times differ most)", ""]
    (out / f"{tag}.md").write_text("\n".join(lines))
    print("\n".join(lines[:8]))
    print(f"wrote {out / (tag + '.md')} and the traces")
    return 0


if __name__ == "__main__":
    sys.exit(main())
