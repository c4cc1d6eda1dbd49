"""Predicted peak memory of one training step against PyTorch's own MemTracker.

    python benchmarks/memory_accuracy.py [--quick] [--out PATH] [--only MODEL ...] [--render]

Measured: ``torch.distributed._tools.mem_tracker.MemTracker`` around one training step
(``zero_grad``, forward, backward, ``optimizer.step``) of the plain module on this CPU, after
one untracked step so that the optimizer state exists (steady state); the batch is copied
inside the tracked step so that it counts, as it would on a device.  Predicted: the
simulator's ``peak_memory`` (``Simulator(graph, machine, optimizer=...)``) on the ``cpu``
preset (one-tensor optimizer kernels, as torch runs them on CPUs).

Cases:
- every zoo model at ``size="small"`` on one device, with sgd, momentum and adam;
- data-parallel shards: the small models traced at a global batch of n x their batch and
  simulated under data parallelism on n = 2, 4 devices; device 0's prediction against the
  module run at the per-device batch (the all-reduce buffers the prediction adds are not
  in the plain module's step);
- the paper-size models at a small batch, with adam (``--quick`` skips them).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.distributed._tools.mem_tracker import MemTracker

import flexflow as ff
from flexflow.hardware.machine import Machine
from flexflow.sim.simulate import Simulator
from flexflow.strategy.strategy import Strategy

OPTIMIZERS = {"sgd": lambda p: torch.optim.SGD(p, lr=0.01),
              "momentum": lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9),
              "adam": lambda p: torch.optim.Adam(p, lr=1e-4)}
PAPER_BATCH = {"lenet": 8, "alexnet": 2, "inception_v3": 2, "resnet101": 2, "rnntc": 2, "rnnlm": 2,
               "nmt": 2, "transformer": 1}


def measured_peak(module, inputs, optimizer: str) -> int:
    opt = OPTIMIZERS[optimizer](module.parameters())

    def step(xs):
        opt.zero_grad()
        module(*xs).backward()
        opt.step()
    step(inputs)
    mt = MemTracker()
    mt.track_external(module, opt)
    with mt:
        step([x.clone() for x in inputs])
    peak = mt.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    del opt, mt
    return int(peak)


def predicted_peak(graph, devices: int, optimizer: str) -> int:
    m = Machine.preset("cpu", devices=devices)
    res = Simulator(graph, m, optimizer=optimizer).simulate(Strategy.data_parallel(graph, m))
    return int(res.peak_memory[0])


def case(name, size, batch, devices, optimizer) -> dict:
    t0 = time.perf_counter()
    torch.manual_seed(0)
    kw = {"size": size} if batch is None else {"size": size, "batch_size": batch}
    module, inputs = ff.models.get(name, **kw)
    local = inputs
    if devices > 1:  # the per-device shard of the global batch
        module_g, inputs_g = ff.models.get(name, size=size, batch_size=devices * inputs[0].shape[0])
        graph = ff.trace(module_g, inputs_g)
        del module_g, inputs_g
    else:
        graph = ff.trace(module, inputs)
    pred = predicted_peak(graph, devices, optimizer)
    meas = measured_peak(module, local, optimizer)
    row = {"model": name, "size": size, "batch": int(local[0].shape[0]), "devices": devices,
           "optimizer": optimizer, "predicted_bytes": pred, "measured_bytes": meas,
           "error": (pred - meas) / meas, "seconds": time.perf_counter() - t0}
    print(f"{name:13s} {size:6s} b{row['batch']:<4d} x{devices} {optimizer:8s} predicted {pred:>13,d} "
          f"measured {meas:>13,d}  {100 * row['error']:+6.1f}%", flush=True)
    del module, inputs, graph
    gc.collect()
    return row


def _mib(b: int) -> str:
    return f"{b / 2**20:,.2f}"


def paper_batch_rows() -> list[dict]:
    """Predictions only: data parallelism of the paper networks at the paper's per-device
    batch on 4 K80s (12 GB each), traced on the meta device."""
    out = []
    m = Machine.preset("k80-cluster", devices=4)
    for name in ff.models.names():
        per = ff.models.paper_batch(name)
        module, inputs = ff.models.get(name, batch_size=per * 4, device="meta")
        g = ff.trace(module, inputs)
        r = {"model": name, "batch": per}
        for o in OPTIMIZERS:
            res = Simulator(g, m, optimizer=o).simulate(Strategy.data_parallel(g, m))
            r[o] = int(max(res.peak_memory))
            r[o + "_fits"] = bool(res.feasible)
        out.append(r)
    return out


def _command(argv) -> str:
    return " ".join(["python", "benchmarks/memory_accuracy.py"] + list(argv))


def write(rows, out: Path, commands: list, paper=None, rendered=False) -> None:
    """commands: the command lines that made the rows (a rerun of some models last)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"commands": commands, "rows": rows, "paper_batch": paper},
                                                   indent=1) + "\n")
    worst = max(rows, key=lambda r: abs(r["error"]))
    within = sum(abs(r["error"]) <= 0.10 for r in rows)
    lines = ["# Peak memory: predicted against MemTracker", "",
             "Command: " + ", then ".join(f"`{c}`" for c in commands)
             + (" (this page rewritten from its .json by `--render`)" if rendered else ""),
             "",
             f"torch {torch.__version__}, {os.cpu_count()} CPU cores.  One training step (zero_grad, forward, "
             "backward, optimizer step) after one untracked step; the batch copied inside the tracked step. "
             "Predicted: `Simulator(graph, Machine.preset('cpu', devices=n), optimizer=...).simulate("
             "Strategy.data_parallel(...)).peak_memory[0]`; for n > 1 the graph is traced at n times the "
             "batch and the measurement runs the module at the per-device batch.", "",
             f"**{within} of {len(rows)} cases within 10%; largest error {100 * worst['error']:+.1f}% "
             f"({worst['model']}, {worst['size']}, batch {worst['batch']}, {worst['devices']} device(s), "
             f"{worst['optimizer']}).**", "",
             "| model | size | batch per device | devices | optimizer | predicted MiB | measured MiB | error |",
             "|---|---|---:|---:|---|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['size']} | {r['batch']} | {r['devices']} | {r['optimizer']} | "
                     f"{_mib(r['predicted_bytes'])} | {_mib(r['measured_bytes'])} | {100 * r['error']:+.1f}% |")
    if paper:
        gib = lambda b: f"{b / 2**30:.2f}"
        lines += ["", "## At the paper's batch (prediction only)", "",
                  "Data parallelism on 4 K80s (12 GiB each), the paper's per-device batch, graphs traced on "
                  "the meta device: GiB per device.  The measurements above "
                  "check the same model at small batches; activations grow linearly with the batch.", "",
                  "| model | batch per device | sgd GiB | momentum GiB | adam GiB |", "|---|---:|---:|---:|---:|"]
        for r in paper:
            cells = " | ".join(f"{gib(r[o])}{'' if r[o + '_fits'] else ' (does not fit)'}" for o in OPTIMIZERS)
            lines.append(f"| {r['model']} | {r['batch']} | {cells} |")
    lines += ["", "What the prediction counts (`flexflow/memory.py`): parameters, buffers and optimizer "
              "state; the batch; each activation from its forward to its last use (the last forward "
              "reading it or the backward of the last op saving it, per op kind); gradients of "
              "activations from the backward of their last consumer to their own backward; parameter "
              "gradients from the backward of their last user; the all-reduce buffer of replicated "
              "gradients; transients inside ops and the optimizer step (Adam's one-tensor kernels keep "
              "two temporaries of the largest parameter).", ""]
    out.with_suffix(".md").write_text("\n".join(lines))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small models only, adam only")
    p.add_argument("--out", default=None, help="path without extension (default: benchmarks/results/"
                   "memory_accuracy; with --quick a temporary directory)")
    p.add_argument("--only", nargs="+", choices=ff.models.names(),
                   help="rerun these models' cases and replace their rows in the existing .json")
    p.add_argument("--render", action="store_true",
                   help="rewrite the .md from the .json's measured rows (predictions at the paper's batch anew)")
    a = p.parse_args(argv)
    if a.out is None:
        a.out = str(Path(tempfile.mkdtemp()) / "memory_accuracy") if a.quick else "benchmarks/results/memory_accuracy"
    if a.render:
        data = json.loads(Path(a.out).with_suffix(".json").read_text())
        write(data["rows"], Path(a.out), data["commands"], paper_batch_rows(), rendered=True)
        return 0
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    rows = []
    opts = ["adam"] if a.quick else list(OPTIMIZERS)
    names = a.only or ff.models.names()
    for name in names:
        for o in opts:
            rows.append(case(name, "small", None, 1, o))
    for name in names:
        for n in (2, 4):
            rows.append(case(name, "small", None, n, "adam"))
    if not a.quick:
        for name in names:
            rows.append(case(name, "paper", PAPER_BATCH[name], 1, "adam"))
    if a.only:  # merge into the recorded rows, in their order
        data = json.loads(Path(a.out).with_suffix(".json").read_text())
        new = {(r["model"], r["size"], r["devices"], r["optimizer"]): r for r in rows}
        rows = [new.pop((r["model"], r["size"], r["devices"], r["optimizer"]), r) for r in data["rows"]]
        rows += list(new.values())
        commands = data["commands"] + [_command(argv)]
    else:
        commands = [_command(argv)]
    write(rows, Path(a.out), commands, paper_batch_rows())
    return 0


if __name__ == "__main__":
    sys.exit(main())
