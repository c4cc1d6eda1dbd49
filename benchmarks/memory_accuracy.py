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
- data parallelism for real: every small model as a ParallelModule on n = 2, 4 gloo ranks
  at the same batch per device (adam), each rank's peak against its device's prediction;
- the paper-size models at a small batch, with adam (``--quick`` skips them).

Training features (the section "Training features"; each rank's MemTracker peak against
its own device's prediction, the row showing the rank with the largest measured peak):
- ``bf16-mixed``: the plain module's step with its forward under
  ``torch.autocast("cpu", dtype=torch.bfloat16)`` against
  ``Simulator(..., precision="bf16-mixed")`` on one ``cpu`` device, sgd and adam (the
  simulator models flexflow's executor, whose readers of one tensor share one cast where
  the plain module under autocast casts it for each: q, k and v);
- ``bf16-mixed (flexflow)`` and ``bf16-params (flexflow)``: ``flexflow.parallelize`` on one
  ``cpu`` device under that precision, AdamW;
- recomputation: ``flexflow.parallelize`` on data parallelism over one ``cpu`` device,
  with ``recompute`` on every linear op, on every activation op (gelu, relu), and on
  nothing (the reference), adam;
- shard levels: ``Strategy.zero(1)``, ``zero(2)``, ``fsdp`` and data parallelism (the
  reference) on 2 gloo processes (``flexflow.launch``), adam (``torch.optim.AdamW``).
ParallelModules run with ``reduce_outputs="eager"`` (MemTracker's module hooks crash on
the default output path) and are predicted with the same; they take the global batch on
every rank, copied inside the tracked step.  The JSON keeps MemTracker's categories at
the peak and the largest tensors live there (the aten op that made each).
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

try:  # (to name the tensors live at a peak; the measurement works without it)
    from torch.distributed._tools.common_utils import get_untyped_storages
except ImportError:  # pragma: no cover - another torch
    get_untyped_storages = None

import flexflow as ff
from flexflow.graph.ir import repeated_block
from flexflow.hardware.machine import Machine
from flexflow.sim.simulate import Simulator
from flexflow.strategy.strategy import Strategy

OPTIMIZERS = {"sgd": lambda p: torch.optim.SGD(p, lr=0.01),
              "momentum": lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9),
              "adam": lambda p: torch.optim.Adam(p, lr=1e-4)}
PAPER_BATCH = {"lenet": 8, "alexnet": 2, "inception_v3": 2, "resnet101": 2, "rnntc": 2, "rnnlm": 2,
               "nmt": 2, "transformer": 1}


def _part(whole, local):
    """``local``'s share of ``whole`` (the global batch): a view along the dim they differ in."""
    for d, (a, b) in enumerate(zip(whole.shape, local.shape)):
        if a != b:
            return whole.narrow(d, 0, b)
    return whole


def measured_peak(module, inputs, optimizer: str, whole=None) -> int:
    """The step's peak; with ``whole`` (the global batch) held, as every rank of a
    data-parallel ParallelModule holds it, the step reading its share (a view)."""
    opt = OPTIMIZERS[optimizer](module.parameters())

    def step(xs):
        opt.zero_grad()
        module(*xs).backward()
        opt.step()
    step(inputs)
    mt = MemTracker()
    mt.track_external(module, opt)
    with mt:
        if whole is None:
            step([x.clone() for x in inputs])
        else:
            held = [x.clone() for x in whole]
            step([_part(w, x) for w, x in zip(held, inputs)])
    peak = mt.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    return int(peak)


def predicted_peak(graph, devices: int, optimizer: str) -> int:
    m = Machine.preset("cpu", devices=devices)
    res = Simulator(graph, m, optimizer=optimizer).simulate(Strategy.data_parallel(graph, m))
    return int(res.peak_memory[0])


def dp_case(name: str, devices: int) -> dict:
    """Data parallelism on ``devices`` gloo ranks at 8 samples a device; the rank with the
    largest measured peak."""
    t0 = time.perf_counter()
    per = ff.models.get(name, size="small")[1][0].shape[0]
    res = [(r["data_parallel"]["predicted_bytes"], r["data_parallel"]["measured_bytes"])
           for r in ff.launch(_shard_worker, devices, name, ("data_parallel",), devices * per, timeout_s=900)]
    pred, meas = max(res, key=lambda r: r[1])
    row = {"model": name, "size": "small", "batch": int(per), "devices": devices, "optimizer": "adam",
           "predicted_bytes": pred, "measured_bytes": meas, "error": (pred - meas) / meas,
           "worst_rank_error": max(((p - m) / m for p, m in res), key=abs), "seconds": time.perf_counter() - t0}
    print(f"{name:13s} small  b{per:<4d} x{devices} adam     predicted {pred:>13,d} measured {meas:>13,d}  "
          f"{100 * row['error']:+6.1f}%", flush=True)
    return row


def case(name, size, batch, devices, optimizer) -> dict:
    if devices > 1:
        return dp_case(name, devices)
    t0 = time.perf_counter()
    torch.manual_seed(0)
    kw = {"size": size} if batch is None else {"size": size, "batch_size": batch}
    module, inputs = ff.models.get(name, **kw)
    local, whole = inputs, None
    if devices > 1:  # the per-device shard of the global batch, which every rank holds
        module_g, whole = ff.models.get(name, size=size, batch_size=devices * inputs[0].shape[0])
        graph = ff.trace(module_g, whole)
        del module_g
    else:
        graph = ff.trace(module, inputs)
    pred = predicted_peak(graph, devices, optimizer)
    meas = measured_peak(module, local, optimizer, whole)
    row = {"model": name, "size": size, "batch": int(local[0].shape[0]), "devices": devices,
           "optimizer": optimizer, "predicted_bytes": pred, "measured_bytes": meas,
           "error": (pred - meas) / meas, "seconds": time.perf_counter() - t0}
    print(f"{name:13s} {size:6s} b{row['batch']:<4d} x{devices} {optimizer:8s} predicted {pred:>13,d} "
          f"measured {meas:>13,d}  {100 * row['error']:+6.1f}%", flush=True)
    del module, inputs, graph
    gc.collect()
    return row


# ---- training features: bf16-mixed, recomputation, shard levels ---------------------------
CPU = torch.device("cpu")
BLOCKS = "blocks"  # recompute every op of the repeated blocks (block checkpointing)
BF16_MODELS = ("lenet", "alexnet", "rnnlm", "nmt", "transformer", "gpt2", "llama")
RECOMPUTE_MODELS = ("alexnet", "transformer", "gpt2", "llama")
SHARD_MODELS = ("transformer", "gpt2", "llama", "alexnet")
QUICK = {"bf16": ("alexnet", "transformer", "llama"), "recompute": ("transformer", "gpt2"),
         "shard": ("transformer",)}
RECOMPUTE = {"recompute none": (), "recompute linear": ("linear",), "recompute activation": ("gelu", "relu"),
             "recompute blocks": BLOCKS}
SHARD = ("data_parallel", "zero1", "zero2", "fsdp")
TOP_LIVE = 10  # tensors named per peak in the JSON


class PeakTracker(MemTracker):
    """MemTracker that also notes, at its peak, the largest tensors live (the aten op that
    made each, dtype, shape, forward/backward, innermost module)."""

    def __init__(self):
        super().__init__()
        self._func, self._best, self.peak_live, self.naming_failed = None, 0, [], False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self._func = func
        return super().__torch_dispatch__(func, types, args, kwargs)

    def _track(self, reftype, t):
        super()._track(reftype, t)
        try:
            for st in get_untyped_storages(t):
                w = self._WINFO.get(st, (None, None))[0]
                if w is not None and not hasattr(w, "made_by"):
                    mods = [m for m in self._mod_tracker.parents if m != "Global"]
                    w.made_by = (f"{str(self._func).removeprefix('aten.')} "
                                 f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)} "
                                 f"{'bw' if self._mod_tracker.is_bw else 'fw'} {max(mods, key=len) if mods else ''}")
        except Exception:  # noqa: BLE001 - naming is a nicety: the peak stands without it
            self.naming_failed = True

    def _update_peak_stats(self, peak_state):
        super()._update_peak_stats(peak_state)
        try:
            total = self._curr_mem_snap.get(CPU, {}).get("Total", 0)
            if total > self._best:
                self._best = total
                live = sorted(((w.mem_consumed, str(getattr(w.reftype, "value", w.reftype)), getattr(w, "made_by", None))
                               for w, _ in self._WINFO.values() if w.mem_consumed), key=lambda x: -x[0])
                self.peak_live = [{"bytes": b, "category": c, "made_by": m} for b, c, m in live[:TOP_LIVE]]
        except Exception:  # noqa: BLE001 - as in _track
            self.naming_failed = True


def tracked_step(step, module, opt) -> dict:
    """MemTracker around one ``step()`` after an untracked one (the optimizer state exists):
    the peak bytes, its categories and its largest live tensors."""
    step()
    mt = PeakTracker() if get_untyped_storages is not None else MemTracker()
    mt.track_external(module, opt)
    with mt:
        step()
    snap = mt.get_tracker_snapshot("peak")[CPU]
    cats = {str(getattr(k, "value", k)): int(v) for k, v in snap.items() if k != "Total" and v}
    return {"measured_bytes": int(snap["Total"]), "categories": cats, "peak_live": getattr(mt, "peak_live", [])}


def _feature_row(case, name, graph, devices, optimizer, ranks, t0) -> dict:
    """ranks: per rank {"predicted_bytes", "measured_bytes", "categories", "peak_live"}."""
    top = max(ranks, key=lambda r: r["measured_bytes"])
    pred, meas = top["predicted_bytes"], top["measured_bytes"]
    row = {"case": case, "model": name, "batch": graph.batch_size, "devices": devices, "optimizer": optimizer,
           "predicted_bytes": pred, "measured_bytes": meas, "error": (pred - meas) / meas,
           "worst_rank_error": max(((r["predicted_bytes"] - r["measured_bytes"]) / r["measured_bytes"]
                                    for r in ranks), key=abs),
           "categories": top["categories"], "peak_live": top["peak_live"],
           "ranks": [{k: r[k] for k in ("predicted_bytes", "measured_bytes")} for r in ranks],
           "seconds": time.perf_counter() - t0}
    print(f"{case:22s} {name:12s} x{devices} {optimizer:5s} predicted {pred:>11,d} measured {meas:>11,d}  "
          f"{100 * row['error']:+6.1f}%", flush=True)
    return row


def _small(name, batch=None):
    torch.manual_seed(0)
    module, inputs = ff.models.get(name, size="small", **({} if batch is None else {"batch_size": batch}))
    return module, inputs, ff.trace(module, inputs)


def bf16_case(name: str, optimizer: str) -> dict:
    """The plain module's step with its forward under CPU autocast (bfloat16)."""
    t0 = time.perf_counter()
    module, inputs, graph = _small(name)
    m = Machine.preset("cpu", devices=1)
    pred = Simulator(graph, m, optimizer=optimizer, precision="bf16-mixed").simulate(
        Strategy.data_parallel(graph, m)).peak_memory[0]
    opt = OPTIMIZERS[optimizer](module.parameters())

    def step():
        xs = [x.clone() for x in inputs]
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = module(*xs)
        loss.backward()
        opt.step()
    r = tracked_step(step, module, opt)
    return _feature_row("bf16-mixed", name, graph, 1, optimizer, [dict(r, predicted_bytes=int(pred))], t0)


def bf16_flexflow_case(name: str, precision: str) -> dict:
    """A ParallelModule on one device under ``precision`` (bf16-mixed: autocast, its readers of
    one tensor sharing one cast; bf16-params: parameters cast where read), AdamW."""
    t0 = time.perf_counter()
    module, inputs, graph = _small(name)
    m = Machine.preset("cpu", devices=1)
    s = Strategy.data_parallel(graph, m)
    pred = Simulator(graph, m, optimizer="adam", reduce_outputs="eager", precision=precision).simulate(
        s).peak_memory[0]
    par = ff.parallelize(module, example_inputs=inputs, strategy=s, machine=m, reduce_outputs="eager",
                         optimizer="adam", precision=precision)
    step, opt = _parallel_step(par, inputs)
    r = tracked_step(step, par, opt)
    del par, opt
    gc.collect()
    return _feature_row(f"{precision} (flexflow)", name, graph, 1, "adam", [dict(r, predicted_bytes=int(pred))], t0)


def with_recompute(strategy, graph, kinds):
    """``strategy`` with ``recompute`` on every op of these kinds (``BLOCKS``: on every op of
    the repeated blocks, ``Strategy.recompute_blocks``)."""
    if kinds == BLOCKS:
        return strategy.recompute_blocks()
    for op in graph.compute_ops:
        if op.kind in kinds:
            strategy = strategy.replace(op.name, strategy[op.name].with_recompute())
    return strategy


def _parallel_step(par, inputs):
    opt = torch.optim.AdamW(par.parameters(), lr=1e-4)

    def step():
        xs = [x.clone() for x in inputs]
        opt.zero_grad()
        par(*xs).backward()
        opt.step()
    return step, opt


def recompute_case(name: str, case: str) -> dict | None:
    """A ParallelModule on one device with ``recompute`` on the ops of the case's kinds
    (None where the model has none)."""
    t0 = time.perf_counter()
    module, inputs, graph = _small(name)
    kinds = RECOMPUTE[case]
    if kinds and not any(op.kind in kinds if kinds != BLOCKS else repeated_block(op.module_path)
                         for op in graph.compute_ops):
        return None
    m = Machine.preset("cpu", devices=1)
    s = with_recompute(Strategy.data_parallel(graph, m), graph, kinds)
    pred = Simulator(graph, m, optimizer="adam", reduce_outputs="eager").simulate(s).peak_memory[0]
    par = ff.parallelize(module, example_inputs=inputs, strategy=s, machine=m, reduce_outputs="eager",
                         optimizer="adam")
    step, opt = _parallel_step(par, inputs)
    r = tracked_step(step, par, opt)
    del par, opt
    gc.collect()
    return _feature_row(case, name, graph, 1, "adam", [dict(r, predicted_bytes=int(pred))], t0)


def _shard_strategy(case, graph, machine):
    if case == "data_parallel":
        return Strategy.data_parallel(graph, machine)
    if case == "fsdp":
        return Strategy.fsdp(graph, machine)
    return Strategy.zero(graph, machine, int(case[-1]))


def _shard_worker(rank: int, name: str, cases, batch=None) -> dict:
    """On each of the gloo ranks: every case's prediction for this rank's device and its
    measured step (the model's small size, at the global ``batch`` if given)."""
    torch.set_num_threads(1)
    module, inputs, graph = _small(name, batch)
    m = Machine.preset("cpu", devices=torch.distributed.get_world_size())
    sim = Simulator(graph, m, optimizer="adam", reduce_outputs="eager")
    out = {}
    for case in cases:
        s = _shard_strategy(case, graph, m)
        par = ff.parallelize(module, example_inputs=inputs, strategy=s, machine=m, reduce_outputs="eager",
                             optimizer="adam")
        step, opt = _parallel_step(par, inputs)
        r = tracked_step(step, par, opt)
        out[case] = dict(r, predicted_bytes=int(sim.simulate(s).peak_memory[rank]))
        del par, opt, step
        gc.collect()
    return out


def shard_cases(name: str, devices: int = 2) -> list[dict]:
    t0 = time.perf_counter()
    res = ff.launch(_shard_worker, devices, name, SHARD, timeout_s=900)
    graph = _small(name)[2]
    rows = []
    for case in SHARD:
        label = "shard " + {"data_parallel": "none (data parallel)", "zero1": "1 (zero 1)",
                            "zero2": "2 (zero 2)", "fsdp": "3 (fsdp)"}[case]
        rows.append(_feature_row(label, name, graph, devices, "adam", [r[case] for r in res], t0))
    return rows


def feature_rows(quick: bool, only=None) -> list[dict]:
    pick = (lambda key, full: [n for n in (QUICK[key] if quick else full) if not only or n in only])
    rows = []
    for name in pick("bf16", BF16_MODELS):
        for o in ("sgd", "adam"):
            rows.append(bf16_case(name, o))
        for p in ("bf16-mixed", "bf16-params"):
            rows.append(bf16_flexflow_case(name, p))
    for name in pick("recompute", RECOMPUTE_MODELS):
        for case in RECOMPUTE:
            r = recompute_case(name, case)
            if r is not None:
                rows.append(r)
    for name in pick("shard", SHARD_MODELS):
        rows += shard_cases(name)
    return rows


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


CATEGORY_COLUMNS = (("Parameter", "param"), ("Buffer", "buffer"), ("Gradient", "grad"),
                    ("Activation", "act"), ("Temp", "temp"), ("Optstate", "opt"))


def feature_lines(features) -> list[str]:
    """The "Training features" section of the page."""
    if not features:
        return []
    worst = max(features, key=lambda r: abs(r["error"]))
    within = sum(abs(r["error"]) <= 0.10 for r in features)
    lines = ["", "## Training features", "",
             ("bf16-mixed: the plain module's forward under `torch.autocast('cpu', dtype=torch.bfloat16)` "
              "against `Simulator(..., precision='bf16-mixed')`, one device (the simulator models flexflow's "
              "executor, whose readers of one tensor share one bfloat16 cast where the plain module casts it for "
              "each reader: q, k and v).  bf16-mixed / bf16-params (flexflow): `flexflow.parallelize` on one "
              "`cpu` device under that precision, AdamW.  Recomputation: "
              "`flexflow.parallelize` on `Strategy.data_parallel` over one `cpu` device with `recompute` on every "
              "linear op, every activation op (gelu, relu) or none.  Shard levels: `Strategy.zero(graph, machine, "
              "1)`, `zero(.., 2)`, `Strategy.fsdp` and data parallelism on 2 gloo processes (`flexflow.launch`), "
              "each rank's peak against its own device's prediction; the row shows the rank with the largest "
              "measured peak (the worst rank's error in the last column).  ParallelModules run, and are "
              "predicted, with `reduce_outputs='eager'` and take the global batch on every rank, AdamW.  "
              "Measured MiB at the peak by MemTracker's category: param, buffer, grad, act(ivation), temp, "
              "opt(imizer state); under shard levels the flat slices the optimizer updates are param, the "
              "full regions the executor keeps or gathers count as act, its communication buffers as act "
              "(forward) or temp (backward), and the all-reduce bucket kept from step to step (data "
              "parallelism, level 1) as grad."), "",
             (f"**{within} of {len(features)} cases within 10%; largest error {100 * worst['error']:+.1f}% "
              f"({worst['case']}, {worst['model']}, {worst['optimizer']}).**"), "",
             "| case | model | batch | devices | optimizer | predicted MiB | measured MiB | error | "
             + " | ".join(c for _, c in CATEGORY_COLUMNS) + " | worst rank |",
             "|---|---|---:|---:|---|---:|---:|---:|" + "---:|" * (len(CATEGORY_COLUMNS) + 1)]
    for r in features:
        cats = " | ".join(_mib(r["categories"].get(k, 0)) for k, _ in CATEGORY_COLUMNS)
        lines.append(f"| {r['case']} | {r['model']} | {r['batch']} | {r['devices']} | {r['optimizer']} | "
                     f"{_mib(r['predicted_bytes'])} | {_mib(r['measured_bytes'])} | {100 * r['error']:+.1f}% | "
                     f"{cats} | {100 * r['worst_rank_error']:+.1f}% |")
    return lines


def write(rows, out: Path, commands: list, paper=None, rendered=False, features=None) -> None:
    """commands: the command lines that made the rows (a rerun of some models last);
    features: the training-feature rows (bf16-mixed, recomputation, shard levels)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"commands": commands, "rows": rows, "paper_batch": paper,
                                                    "features": features or []}, indent=1) + "\n")
    worst = max(rows, key=lambda r: abs(r["error"]))
    within = sum(abs(r["error"]) <= 0.10 for r in rows)
    lines = ["# Peak memory: predicted against MemTracker", "",
             "Command: " + ", then ".join(f"`{c}`" for c in commands)
             + (" (this page rewritten from its .json by `--render`)" if rendered else ""),
             "",
             (f"torch {torch.__version__}, {os.cpu_count()} CPU cores.  One training step (zero_grad, forward, "
              "backward, optimizer step) after one untracked step; the batch copied inside the tracked step. "
              "Predicted: `Simulator(graph, Machine.preset('cpu', devices=n), optimizer=...).simulate("
              "Strategy.data_parallel(...)).peak_memory[0]`.  For n > 1 devices: data parallelism for real, "
              "a ParallelModule (`reduce_outputs='eager'`, AdamW) on n gloo processes over the global batch of "
              "n times the batch, each rank's MemTracker peak against its own device's prediction; the row is "
              "the rank with the largest measured peak."), "",
             (f"**{within} of {len(rows)} cases within 10%; largest error {100 * worst['error']:+.1f}% "
              f"({worst['model']}, {worst['size']}, batch {worst['batch']}, {worst['devices']} device(s), "
              f"{worst['optimizer']}).**"), "",
             "| model | size | batch per device | devices | optimizer | predicted MiB | measured MiB | error |",
             "|---|---|---:|---:|---|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['size']} | {r['batch']} | {r['devices']} | {r['optimizer']} | "
                     f"{_mib(r['predicted_bytes'])} | {_mib(r['measured_bytes'])} | {100 * r['error']:+.1f}% |")
    if paper:
        gib = lambda b: f"{b / 2**30:.2f}"
        lines += ["", "## At the paper's batch (prediction only)", "",
                  ("Data parallelism on 4 K80s (12 GiB each), the paper's per-device batch, graphs traced on "
                   "the meta device: GiB per device.  The measurements above "
                   "check the same model at small batches; activations grow linearly with the batch."), "",
                  "| model | batch per device | sgd GiB | momentum GiB | adam GiB |", "|---|---:|---:|---:|---:|"]
        for r in paper:
            cells = " | ".join(f"{gib(r[o])}{'' if r[o + '_fits'] else ' (does not fit)'}" for o in OPTIMIZERS)
            lines.append(f"| {r['model']} | {r['batch']} | {cells} |")
    lines += feature_lines(features)
    counts = ("What the prediction counts (`flexflow/sim/memory.py`): parameters, buffers and optimizer "
              "state; the batch; each activation from its forward to its last use (the last forward "
              "reading it or the backward of the last op saving it, per op kind); gradients of "
              "activations from the backward of their last consumer to their own backward; parameter "
              "gradients from the backward of their last user; the all-reduce buffer of replicated "
              "gradients; transients inside ops and the optimizer step (Adam's one-tensor kernels keep "
              "two temporaries of the largest parameter); the global batch on every rank; under shard "
              "levels each gather unit as the executor runs it (its gather buffers, prefetched one unit "
              "ahead; level 3's full parameters in the forward and again from the backward gather to "
              "the reduce-scatter; autograd's full gradients until their unit's reduce-scatter, whose "
              "input lives until drained); under bf16-mixed each op's dtype as autocast gives it and "
              "the copies it makes of inputs in another dtype.")
    out_rows = [f"{r['model']} x{r['devices']} {r['optimizer']} ({100 * r['error']:+.1f}%)"
                for r in rows if abs(r["error"]) > 0.10]
    out_rows += [f"{r['case']}, {r['model']} {r['optimizer']} ({100 * r['error']:+.1f}%)"
                 for r in features or [] if abs(r["error"]) > 0.10]
    misses = "Outside 10%: " + ("; ".join(out_rows) if out_rows else "none") + "."
    lines += ["", counts, "", misses, ""]
    out.with_suffix(".md").write_text("\n".join(lines))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="small models only, adam only; the training features on a few models")
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
        write(data["rows"], Path(a.out), data["commands"], paper_batch_rows(), rendered=True,
              features=data.get("features"))
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
            if name in PAPER_BATCH:
                rows.append(case(name, "paper", PAPER_BATCH[name], 1, "adam"))
    features = feature_rows(a.quick, a.only)
    if a.only:  # merge into the recorded rows, in their order
        data = json.loads(Path(a.out).with_suffix(".json").read_text())
        new = {(r["model"], r["size"], r["devices"], r["optimizer"]): r for r in rows}
        rows = [new.pop((r["model"], r["size"], r["devices"], r["optimizer"]), r) for r in data["rows"]]
        rows += list(new.values())
        new = {(r["case"], r["model"], r["optimizer"]): r for r in features}
        features = [new.pop((r["case"], r["model"], r["optimizer"]), r) for r in data.get("features", [])]
        features += list(new.values())
        commands = data["commands"] + [_command(argv)]
    else:
        commands = [_command(argv)]
    write(rows, Path(a.out), commands, paper_batch_rows(), features=features)
    return 0


if __name__ == "__main__":
    sys.exit(main())
