"""Fitting the ``cpu`` machine's communication figures to the executor's own steps.

The gloo micro-benchmarks in :mod:`flexflow.calibrate.comm` time a message or an all-reduce
between pieces of compute.  What one costs inside a training step also holds the
executor's Python, the peer's wake-up on shared cores and the jitter of the ranks, and
on a 2-core host those dominate: the micro-benchmark figures came out 2-3x below what
message-heavy strategies lose in real steps.  So the calibration ends by running a small
calibration model (:class:`CalibrationChain`, no part of any user model) under the
executor with four strategies, and fits the simulator's own parameters so that it
predicts those steps:

- ``single``: every op on rank 0 (the others idle): no message, only the loss returned
  to every rank -> what that adds to a step (``output_sync_s``: the all-reduce starts
  after the forward and is waited at the first read, so much of it hides);
- ``alternate``: layer ``i`` whole on rank ``i % 2``: an activation and a gradient
  message at every layer boundary, all on the critical path, the receiving peer idle;
- ``split``: every layer split by output features over ranks 0 and 1: both ranks busy,
  swapping halves at every layer, the two messages of a swap in flight together.  A
  message's latency is partly the cores' work (posting, the loopback's copy, the
  Python around it) and partly time that holds no core (the peer's wake-up): messages
  in flight together overlap that part.  The small alternating chain fixes the whole
  latency (``exchange_s``), the two split chains the part that holds no core
  (``message_lag_s``), the large alternating chain the bandwidth;
- ``data_parallel`` -> the all-reduce latency per ring step and the sync skew (what a
  synchronisation costs per second of compute before it, from the ranks' jitter).

Each strategy runs at two sizes (short and long compute).  The fit alternates: latency
and bandwidth by bisection (the simulated time moves monotonically with each), the
outputs' cost as the small single chain's residual, then the all-reduce latency and skew
by least squares (both add to the step after the task
graph, linearly), three rounds.  Each figure is clamped to a sane range; the measured
steps, the predictions with the fitted figures and the micro-benchmark figures are all
kept in the machine file (``measured.fit``).
"""
from __future__ import annotations

import dataclasses
import math
import statistics
import time

import torch
import torch.nn as nn

__all__ = ["CalibrationChain", "CASES", "measure_steps", "timed_rounds", "fit_figures"]

# (width, batch) of the calibration chains: about 2 ms and 10 ms of compute per step on
# one core, so that the all-reduce latency (per step) and the skew (per second of compute)
# can be told apart
CASES = ((64, 32), (256, 512))
LAYERS = 8
MESSAGES = ("alternate",)  # the strategies the message latency and bandwidth are fitted to
LAGGED = ("split",)  # ... and the part of the latency that holds no core
_LAT_RANGE = (5e-6, 5e-3)
_BW_RANGE = (1e7, 1e11)
_AR_RANGE = (0.0, 5e-3)
# the skew is capped: over a dozen calibrations it came out 0-0.13, and 0.36 and 0.5 twice,
# from data-parallel chains whose medians moved by up to 70% between calibrations; a skew
# that high overcharged long steps (wide_mlp's searched strategy predicted 44% slow)
_SKEW_RANGE = (0.0, 0.15)


class CalibrationChain(nn.Module):
    """``layers`` x (Linear(width, width), tanh), then a mean-squared error."""

    def __init__(self, width: int, layers: int = LAYERS):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))

    def forward(self, x, y):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return nn.functional.mse_loss(x, y)


def build(width: int, batch: int):
    """(module, example inputs), the same in every process."""
    torch.manual_seed(0)
    m = CalibrationChain(width)
    g = torch.Generator().manual_seed(1)
    return m, (torch.randn(batch, width, generator=g), torch.randn(batch, width, generator=g))


def strategies(graph, machine) -> dict:
    """The calibration strategies of one chain on ``machine``."""
    from ..strategy.config import ParallelConfig
    from ..strategy.strategy import Strategy
    cfg, layer = {}, 0
    for op in graph.compute_ops:  # linear_i and the tanh after it on rank i % 2; the loss with the last
        if op.kind == "linear" and cfg:
            layer += 1
        cfg[op.name] = ParallelConfig({}, (layer % 2,))
    split = {op.name: ParallelConfig({"c": 2}, (0, 1)) if op.kind != "mse_loss" else ParallelConfig({}, (0,))
             for op in graph.compute_ops}
    return {"single": Strategy.single_device(graph, machine, 0),
            "alternate": Strategy(graph, cfg, machine, name="alternate"),
            "split": Strategy(graph, split, machine, name="split"),
            "data_parallel": Strategy.data_parallel(graph, machine)}


def measure_steps(nprocs: int, rounds: int = 21, steps: int = 3, warmup: int = 3) -> dict:
    """In every rank of a running gloo group: {"<width>x<batch>": {strategy: [seconds per
    step, one per round]}} under the executor, strategies in interleaved rounds between
    barriers (:func:`timed_rounds`)."""
    from .. import settings
    from ..graph.trace import trace
    from ..runtime.execute import Runtime
    from ..runtime.module import ParallelModule
    from ..runtime.program import check_programs
    from ..hardware.machine import _cpu_default
    machine = dataclasses.replace(_cpu_default(), num_nodes=1, devices_per_node=nprocs, num_devices=nprocs)
    out = {}
    for width, batch in CASES:
        module, inputs = build(width, batch)
        graph = trace(module, inputs)
        runs = {}
        for label, s in strategies(graph, machine).items():
            runtime = Runtime(graph, s, module, list(range(nprocs)), device=torch.device("cpu"),
                              timeout_s=settings.timeout_s())
            check_programs(runtime)
            model = ParallelModule(module, runtime)
            runs[label] = (model, torch.optim.SGD(model.parameters(), lr=1e-3))
        out[f"{width}x{batch}"] = timed_rounds(runs, inputs, rounds, steps, warmup)
    return out


def timed_rounds(runs: dict, inputs, rounds: int, steps: int, warmup: int, round_s: float = 0.0) -> dict:
    """In every rank of a running group: label -> [seconds per step, one per round] of
    ``runs`` (label -> (model, optimizer)), each step zero_grad, forward on ``inputs``,
    backward, optimizer step and a read of the loss; after ``warmup`` steps each, rounds of
    ``steps`` steps per model in turn, between barriers (a round ends when the slowest rank
    does).  ``round_s``: a model whose warm-up steps were short takes more steps per round,
    enough to last about this long (the ranks agree on the count), so a round of a
    millisecond step measures the step, not the switch from the previous model."""
    import math

    import torch.distributed as dist

    def step(model, opt):
        opt.zero_grad()
        loss = model(*inputs)
        loss.backward()
        opt.step()
        loss.item()
    per = {}
    for label, (model, opt) in runs.items():
        t0 = time.perf_counter()
        for _ in range(warmup):
            step(model, opt)
        per[label] = (time.perf_counter() - t0) / max(warmup, 1)
    counts = {k: steps for k in runs}
    if round_s > 0 and warmup > 0:
        got = [None] * dist.get_world_size()
        dist.all_gather_object(got, per)
        counts = {k: max(steps, math.ceil(round_s / max(max(g[k] for g in got), 1e-6))) for k in runs}
    times = {k: [] for k in runs}
    for _ in range(rounds):
        for label, (model, opt) in runs.items():
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(counts[label]):
                step(model, opt)
            dist.barrier()
            times[label].append((time.perf_counter() - t0) / counts[label])
    return times


def _machine(base, latency_s: float, ar_latency_s: float, skew: float, bandwidth_Bps: float | None = None,
             output_sync_s: float | None = None, lag_s: float = 0.0):
    link = dataclasses.replace(base.intra_node, latency_s=latency_s, allreduce_latency_s=ar_latency_s,
                               bandwidth_Bps=bandwidth_Bps or base.intra_node.bandwidth_Bps)
    spec = dataclasses.replace(base.spec, sync_skew=skew, output_sync_s=output_sync_s,
                               message_lag_s=min(lag_s, latency_s))
    return dataclasses.replace(base, intra_node=link, spec=spec)


def _bisect(f, lo: float, hi: float, steps: int = 20) -> float:
    """x in [lo, hi] (log scale) where the increasing f crosses 0; a bound when it does not
    (the ranges are 1000-10000x wide: 20 halvings in log leave under 0.001%)."""
    if f(lo) > 0:
        return lo
    if f(hi) < 0:
        return hi
    for _ in range(steps):
        mid = math.sqrt(lo * hi)
        if f(mid) > 0:
            hi = mid
        else:
            lo = mid
    return math.sqrt(lo * hi)


def fit_figures(base, samples: dict, nprocs: int, profile: bool = True) -> dict:
    """The figures that make the simulator predict the measured calibration steps.

    ``base``: the cpu Machine built from the micro-benchmarks (``comm_on_cores`` set),
    with ``nprocs`` devices; ``samples``: :func:`measure_steps` of rank 0.  Profiles the
    chains' ops on this CPU first (``profile``).  Returns ``exchange_s`` (a message's
    latency), ``message_lag_s`` (the part of it that holds no core), ``bandwidth_Bps``
    (a message's bandwidth), ``allreduce_latency_s``,
    ``sync_skew``, ``output_sync_s`` and ``fit`` (measured and predicted ms per case, the relative errors)."""
    from ..cost.model import CostModel
    from ..cost.profile import profile_graph
    from ..graph.trace import trace
    from ..sim.simulate import Simulator
    measured, graphs = {}, {}
    for width, batch in CASES:
        module, inputs = build(width, batch)
        graph = trace(module, inputs)
        case = f"{width}x{batch}"
        graphs[case] = graph
        if profile:
            threads = torch.get_num_threads()
            torch.set_num_threads(1)  # as the ranks run
            try:
                for s in strategies(graph, base).values():
                    profile_graph(graph, "cpu", strategy=s)
            finally:
                torch.set_num_threads(threads)
        measured[case] = {k: statistics.median(v) for k, v in samples[case].items()}

    cost = CostModel.for_machine(base)  # op times: the same for every figure tried below

    def predict(lat, ar, skew, labels, bw=None, cases=None, out=None, lag=None):
        m = _machine(base, lat, ar, skew, bw, out, lag_s if lag is None else lag)
        out = {}
        for case, graph in graphs.items():
            if cases is not None and case not in cases:
                continue
            sim = Simulator(graph, m, cost)
            for label, s in strategies(graph, m).items():
                if label in labels:
                    out[(case, label)] = sim.simulate(s, incremental=False).iteration_time
        return out

    def log_err(case, labels=MESSAGES, **kw):  # the chains ``labels`` of one case: sum of log(predicted / measured)
        p = predict(kw.get("lat", lat), ar, skew, labels, kw.get("bw", bw), {case}, out, kw.get("lag"))
        return sum(math.log(p[(case, k)] / measured[case][k]) for k in labels)

    small, large = (f"{w}x{b}" for w, b in CASES)
    lat, bw = base.intra_node.latency_s, base.intra_node.bandwidth_Bps
    ar = base.intra_node.allreduce_latency_s or 0.0
    skew = base.spec.sync_skew
    out = base.allreduce_latency_s(range(base.num_devices))  # the outputs' all-reduce, as uncalibrated
    lag_s = 0.0
    for _ in range(3):
        # messages: the latency from the small chain's messages (8 KB), the bandwidth from
        # the large one's (512 KB), the part of the latency that holds no core from the split
        # chains (two messages in flight at once: the more of the latency holds no core, the
        # more they overlap); each moves its own case most, so a few rounds settle
        for _ in range(20):  # until none moves by more than 0.1%
            lat0, bw0, lag0 = lat, bw, lag_s
            lat = _bisect(lambda x: log_err(small, lat=x), *_LAT_RANGE)
            bw = _bisect(lambda x: -log_err(large, bw=x), *_BW_RANGE)
            lag_s = _bisect(lambda x: -log_err(small, LAGGED, lag=x) - log_err(large, LAGGED, lag=x),
                            _LAT_RANGE[0] * 1e-3, lat)
            if lag_s <= _LAT_RANGE[0]:  # (below the smallest latency the fit takes: none overlaps)
                lag_s = 0.0
            if abs(lat / lat0 - 1) < 1e-3 and abs(bw / bw0 - 1) < 1e-3 and abs(lag_s - lag0) <= 1e-3 * lat:
                break
        # returning the loss to every rank: adds after the task graph; the small single-device
        # chain has nothing else to synchronise and little compute to mispredict (the large
        # one's residual is mostly compute: ops run slower in a step than profiled alone)
        p0 = predict(lat, ar, skew, {"single"}, bw, {small}, out=0.0)
        out = min(max(measured[small]["single"] - p0[(small, "single")], _AR_RANGE[0]), _AR_RANGE[1])
        # all-reduce latency and skew: linear in both (after the task graph)
        p0 = predict(lat, 0.0, 0.0, {"data_parallel"}, bw, out=out)
        pa = predict(lat, 1e-3, 0.0, {"data_parallel"}, bw, out=out)
        ps = predict(lat, 0.0, 0.1, {"data_parallel"}, bw, out=out)
        rows, rhs = [], []
        for w in graphs:
            k = (w, "data_parallel")
            rows.append(((pa[k] - p0[k]) / 1e-3, (ps[k] - p0[k]) / 0.1))
            rhs.append(measured[w]["data_parallel"] - p0[k])
        ar, skew = _solve2(rows, rhs)
    pred = predict(lat, ar, skew, {"single", "alternate", "split", "data_parallel"}, bw, out=out)
    return {"exchange_s": lat, "message_lag_s": lag_s, "bandwidth_Bps": bw, "allreduce_latency_s": ar,
            "sync_skew": skew,
            "output_sync_s": out,
            "fit": {"measured_ms": {f"{lbl}@{w}": round(measured[w][lbl] * 1e3, 4) for w in graphs for lbl in measured[w]},
                    "predicted_ms": {f"{lbl}@{w}": round(pred[(w, lbl)] * 1e3, 4) for (w, lbl) in pred},
                    "error": {f"{lbl}@{w}": round(pred[(w, lbl)] / measured[w][lbl] - 1, 4) for (w, lbl) in pred}}}


def _solve2(rows, rhs) -> tuple[float, float]:
    """Least squares a*x + b*y = r over the rows with x in _AR_RANGE and y in _SKEW_RANGE
    (a bound hit: the other refitted alone)."""
    import numpy as np
    a = np.array(rows, dtype=float)
    r = np.array(rhs, dtype=float)
    (x, y), *_ = np.linalg.lstsq(a, r, rcond=None)

    def one(col, lo, hi, other):
        c = a[:, col]
        rr = r - a[:, 1 - col] * other
        v = float(c @ rr / (c @ c)) if float(c @ c) > 0 else lo
        return min(max(v, lo), hi)
    if not (_AR_RANGE[0] <= x <= _AR_RANGE[1] and _SKEW_RANGE[0] <= y <= _SKEW_RANGE[1]):
        y = min(max(float(y), _SKEW_RANGE[0]), _SKEW_RANGE[1])
        x = one(0, *_AR_RANGE, y)
        y = one(1, *_SKEW_RANGE, x)
    return float(x), float(y)
