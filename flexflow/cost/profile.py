"""Operator profiler with an on-disk cache, feeding :class:`flexflow.cost.model.CostModel`.

Each distinct op partition -- (op kind, input/output/parameter region shapes,
attrs, dtypes), the key of :meth:`CostModel.key` -- is timed once per device:
random tensors of the partition's input and parameter region shapes (integer
inputs drawn as valid indices for their consumer: token ids below the
embedding's vocabulary, class targets below the logits' class count), then
``RULES[op.rule].compute`` forward and a backward through it (gradient of
the sum of the output w.r.t. float inputs and parameters; in-place ops get
fresh untimed copies).  The partitions to measure run round-robin in graph
order, up to 32 at a time (:func:`profile_partitions`), as a step runs them:
each run of an op finds the caches as the other ops left them.  One warm-up
(two for fast ops), the median of ``repeats`` runs; CUDA events and a synchronize on GPUs, the CPU clock below
on CPU under the current ``torch.get_num_threads()`` (which the profiler
never changes; it is part of the CPU device name).

Two choices make an entry stand for the op inside a training step on a quiet
host:

- on a CPU with one torch thread, a run's time is the calling thread's CPU
  time (``time.thread_time``: the op and its backward run on that thread), so
  other jobs sharing the cores while it is profiled do not inflate it (with
  more threads, wall time);
- the fixed cost of one ``torch.autograd.grad`` call (measured once per run:
  a one-node backward less the cost per node) is taken off each backward, as
  a step's whole backward is one engine call (``bwd_call_s`` records it).

Cache layout: ``flexflow.hardware.machine.cache_dir()/profiles/<device name>.json``, one
file per device name (``cpu-<cpu model>-<threads>t``, ``cuda-<GPU name>``)::

    {"format": "flexflow-profile", "version": 2, "device_name": "cuda-NVIDIA_H200",
     "device_kind": "H200", "torch": "2.x", "entries": {
    "<json of CostModel.key>": {"fwd_s": .., "bwd_s": .., "kind": .., "rule": .., "dtype": ..,
        "flops": .., "bytes": .., "backward_factor": .., "output_shape": .., "runs": ..,
        "threads": .., "op": <first op name>, "bwd_call_s": .., ...},    <- one entry per line
    ...}}

Saving takes an exclusive ``fcntl.flock`` on ``<file>.lock``, re-reads the
file, merges (this process's new entries win) and replaces it atomically
(tempfile + ``os.replace``), so processes can share one cache.  A corrupt
file is rebuilt with a warning, and so is a file of an older format version
(version 1 timed CPU ops by wall time and kept the engine call in backward;
version 2 ran each op's runs back to back).
``flexflow/data/profile-<kind>.json`` in the
package is a read-only fallback (e.g. an H200 profile shipped with the code).
"""
from __future__ import annotations

import contextlib
import statistics
import sys
import time
import warnings
from dataclasses import dataclass, field

import torch

from ..graph.ops import RULES, region_shape
from ..graph.ops.base import leaves
from ..strategy.config import ParallelConfig
from ..strategy.regions import partitions
from .model import CostModel, fit_efficiency, partition_bytes, partition_flops
from .profiledb import (
    FORMAT,
    VERSION,
    ProfileDB,
    _torch_device,
    device_kind_of,
    device_name,
    key_str,
    package_profile_path,
    profiles_dir,
)

__all__ = ["ProfileDB", "ProfileReport", "profile_graph", "profile_partition", "profile_partitions", "device_kind_of",
           "device_name", "profiles_dir", "package_profile_path", "key_str", "fit_efficiency",
           "FORMAT", "VERSION"]

_KEYER = CostModel(None)  # key() needs no machine


# ---- measuring ---------------------------------------------------------------------------
def _int_bound(op, i: int) -> int | None:
    """Exclusive upper bound of valid values for integer input ``i`` of ``op``."""
    if op.rule == "embedding" and i == 0:
        return op.param_shapes["weight"][0]
    if op.rule == "loss" and i == 1 and len(op.input_shapes[0]) > 1:
        return op.input_shapes[0][1]
    return None


def _make_inputs(op, part, dev, gen, graph=None) -> tuple[list, dict]:
    """Random tensors for a partition's input regions and parameter regions."""
    ins = []
    for i, (r, dt) in enumerate(zip(part.inputs, op.input_dtypes)):
        if r is None:
            ins.append(None)
            continue
        shape = region_shape(r)
        if dt.is_floating_point:
            t = torch.randn(shape, generator=gen, device=dev).to(dt).requires_grad_(op.input_needs_grad(i))
        elif dt == torch.bool:
            t = torch.randint(0, 2, shape, generator=gen, device=dev).to(torch.bool)
        else:
            t = _int_input(op, i, r, shape, gen, graph, dev).to(dev, dt)
        ins.append(t)
    params = {}
    for k, r in part.params.items():
        shape = region_shape(r)
        if k in op.buffers:  # running stats: positive variances, integer counters
            if "num_batches" in k:
                params[k] = torch.zeros(shape, dtype=torch.long, device=dev)
            else:
                params[k] = (torch.rand(shape, generator=gen, device=dev) + 0.5).to(op.dtype)
        else:
            w = torch.randn(shape, generator=gen, device=dev) * 0.1
            params[k] = w.to(op.dtype).requires_grad_(True)
    return ins, params


def _int_input(op, i, region, shape, gen, graph, dev):
    bound = _int_bound(op, i)
    if bound:
        return torch.randint(0, bound, shape, generator=gen, device=dev)
    src = graph.op(op.inputs[i]) if graph is not None and op.inputs[i] in graph else None
    if src is not None and src.kind == "constant" and graph.module is not None:
        with contextlib.suppress(Exception):  # the real constant (e.g. positions), when it exists
            from ..strategy.localrun import constant_value_of
            v = constant_value_of(src, graph.module)
            if v.device.type != "meta":
                return v[region].detach().cpu().clone()
    return torch.zeros(shape, dtype=torch.long, device=dev)  # index 0 is valid for any consumer


def _tensors(x):
    return (t for t in leaves(x) if isinstance(t, torch.Tensor))


class _Timer:
    """CUDA events on a GPU; on a CPU the calling thread's CPU time when torch runs one
    thread (time other jobs hold the core is not counted), else wall time.

    On a GPU nothing waits between ops: ``stop`` gives a pending time (the two events),
    read by :meth:`read` once :meth:`flush` has waited for the device.  Timed so, one
    op's time is what it adds to a stream of ops, as a training step runs them: its
    kernels' time when the device is the bottleneck (the host launches ahead), its
    launch time when the host is; waiting before every op would add the host's launch
    latency to every op instead."""

    def __init__(self, dev: torch.device):
        self.cuda = dev.type == "cuda"
        self.dev = dev
        self.clock = time.thread_time if not self.cuda and torch.get_num_threads() == 1 else time.perf_counter

    def start(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return self.clock()

    def stop(self, t0):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return t0, ev
        return self.clock() - t0

    def flush(self):
        """Wait for the device's queued work (a GPU's): every pending time is readable after."""
        if self.cuda:
            torch.cuda.synchronize(self.dev)

    @staticmethod
    def read(t) -> float:
        """Seconds of a time ``stop`` gave (after :meth:`flush` for a pending one)."""
        return t[0].elapsed_time(t[1]) / 1e3 if isinstance(t, tuple) else t


def _engine_call_s(dev, timer, runs: int = 31) -> float:
    """Fixed seconds of one ``torch.autograd.grad`` call beyond the work of its nodes:
    the time of a one-node backward less the cost per node (from an 11-node chain).  A
    profiled backward is one engine call per op; in a training step the whole backward
    is one call, so the profiler takes this off each op's backward."""
    x = torch.ones(4, device=dev, requires_grad=True)

    def grad_of(n: int) -> float:
        ts = []
        for _ in range(runs):
            y = x
            for _ in range(n):
                y = y * 1.0
            t0 = timer.start()
            torch.autograd.grad([y], [x], [torch.ones_like(y)])
            ts.append(timer.stop(t0))
        timer.flush()
        return statistics.median(timer.read(t) for t in ts)
    grad_of(1)
    one, eleven = grad_of(1), grad_of(11)
    per_node = max(eleven - one, 0.0) / 10
    return max(one - per_node, 0.0)


def profile_partition(op, part, device="cpu", repeats: int = 5, warmup: int = 1, graph=None,
                      max_seconds: float = 2.0, seed: int = 0) -> tuple[float, float, int]:
    """Measure one partition of ``op``: (median forward_s, median backward_s, runs).

    Forward is the rule bound to the partition (``RULES[op.rule].bind``, what the
    executor calls); backward is the gradient of the sum of its
    (grad-requiring) outputs w.r.t. the float inputs and parameters (0 when nothing
    needs one).  ``warmup`` runs (one more when the first is under 10 ms) are not
    counted; runs stop early after ``max_seconds`` once 3 were counted.  ``graph``
    lets integer inputs fed by constants use the real constant."""
    got = profile_partitions([(op, part)], device, repeats, warmup, graph, max_seconds, seed)[0]
    if isinstance(got, Exception):
        raise got
    return got


# partitions measured together, round-robin (profile_partitions): at most this many, and
# at most this many bytes of inputs, parameters and outputs among them
WINDOW_OPS = 32
WINDOW_BYTES = 512 * 2**20


class _Run:
    """One partition being measured: its inputs and its forward / backward times."""

    def __init__(self, op, part, ins, params):
        self.op, self.part, self.ins, self.params = op, part, ins, params
        # what the executor calls every step: the rule bound to the partition once
        self.fn = RULES[op.rule].bind(op, part.block)
        self.leaves = [t for t in list(ins) + list(params.values()) if t is not None and t.requires_grad]
        self.clone = False  # an in-place op on a leaf: fed fresh copies (made untimed)
        self.grads = None
        self.times: list[tuple[float, float]] = []
        self.warm = 0

    def once(self, timer) -> tuple:
        """One forward and backward: their times as ``timer.stop`` gives them."""
        args = [t.clone() if self.clone and t is not None and t.is_floating_point() else t for t in self.ins]
        t0 = timer.start()
        out = self.fn(args, self.params)
        tf = timer.stop(t0)
        outs = [o for o in _tensors(out) if o.requires_grad]
        tb = 0.0
        if outs and self.leaves:
            if self.grads is None:
                self.grads = [torch.ones_like(o) for o in outs]
            t0 = timer.start()
            torch.autograd.grad(outs, self.leaves, self.grads, allow_unused=True)
            tb = timer.stop(t0)
        return tf, tb

    @property
    def counted(self) -> int:
        return len(self.times) - self.warm


def profile_partitions(items, device="cpu", repeats: int = 5, warmup: int = 1, graph=None,
                       max_seconds: float = 2.0, seed: int = 0, order=None) -> list:
    """Measure partitions ``items`` ((op, part) pairs) together: per item (median
    forward_s, median backward_s, runs), or the exception that stopped it.

    A round runs the items in ``order`` (indices into ``items``, an index once for each
    op of the step that has that partition, in graph order; default each item once, in
    the order given); rounds repeat until every item has ``repeats`` counted runs, after
    its own ``warmup`` runs (one more when its first took under 10 ms).  Run back to back, an
    op keeps its code, branch history and data in the caches, and a step never runs it
    so: the transformer's ops timed that way summed to 60% of its forward in a step,
    round-robin to 100%.  Once every item has 3 counted runs, the rounds stop when they
    have taken ``max_seconds`` per item."""
    dev = _torch_device(device)
    timer = _Timer(dev)
    out: list = [None] * len(items)
    runs: dict = {}  # item index -> its _Run, while it is measured
    for i, (op, part) in enumerate(items):
        gen = torch.Generator(device=dev).manual_seed(seed)
        try:
            runs[i] = _Run(op, part, *_make_inputs(op, part, dev, gen, graph))
        except Exception as e:  # noqa: BLE001 - reported for this item
            out[i] = e
    seq = list(range(len(items))) if order is None else list(order)
    started = None
    while runs:
        got = []  # (run, forward, backward) of this round, read after it (a GPU's pending times)
        for i in seq:
            r = runs.get(i)
            if r is None:
                continue
            try:
                got.append((r, *r.once(timer)))
            except Exception as e:  # noqa: BLE001 - reported for this item
                if isinstance(e, RuntimeError) and "in-place" in str(e) and not r.clone:
                    r.clone, r.times, r.warm = True, [], 0
                    got = [g for g in got if g[0] is not r]
                else:
                    out[i] = e
                    del runs[i]
                    got = [g for g in got if g[0] is not r]
                continue
        timer.flush()
        for r, tf, tb in got:
            tf, tb = timer.read(tf), timer.read(tb)
            if not r.times:
                r.warm = max(0, warmup) + (1 if warmup and tf + tb < 0.01 else 0)
            r.times.append((tf, tb))
        if not runs:
            break
        low = min(r.counted for r in runs.values())
        if low >= 1 and started is None:
            started = time.perf_counter()
        if low >= max(1, repeats):
            break
        if low >= min(3, repeats) and started is not None and \
                time.perf_counter() - started > max_seconds * len(runs):
            break
    for i, r in runs.items():
        kept = r.times[r.warm:]
        out[i] = (statistics.median(t for t, _ in kept), statistics.median(t for _, t in kept), len(kept))
    return out


def _windows(todo: dict, seq: list):
    """Groups for :func:`profile_partitions`: (keys, order) with ``keys`` the distinct keys
    of ``todo`` (key -> (op, part)) in their first appearance in ``seq`` (the keys of the
    step's op partitions in graph order, with repeats), at most ``WINDOW_OPS`` of them
    and ``WINDOW_BYTES`` of their partitions' bytes, and ``order`` the indices of the
    appearances of those keys in ``seq``."""
    home, wins, size = {}, [[]], 0
    for k in seq:
        if k not in todo or k in home:
            continue
        nb = partition_bytes(*todo[k])
        if wins[-1] and (len(wins[-1]) >= WINDOW_OPS or size + nb > WINDOW_BYTES):
            wins.append([])
            size = 0
        home[k] = len(wins) - 1
        wins[-1].append(k)
        size += nb
    orders = [[] for _ in wins]
    index = [{k: i for i, k in enumerate(w)} for w in wins]
    for k in seq:
        if k in home:
            orders[home[k]].append(index[home[k]][k])
    return [(w, o) for w, o in zip(wins, orders) if w]


@dataclass
class ProfileReport:
    """What :func:`profile_graph` did.  ``ops``: one dict per distinct key, in graph
    order: ``op`` (first op name), ``ops`` (every op name sharing the key), ``count``
    (partitions sharing it), ``kind``, ``rule``, ``dtype``, ``output_shape``,
    ``input_shapes``, ``param_shapes``, ``forward_ms``, ``backward_ms``, ``flops``,
    ``bytes``, ``cached`` (served from the cache), ``error`` (None, or why it could not
    be measured).  ``measured`` / ``cached``: counts measured now / served from cache."""
    device: str
    device_name: str
    device_kind: str
    path: str
    threads: int
    ops: list = field(default_factory=list)
    measured: int = 0
    cached: int = 0
    errors: int = 0
    skipped: int = 0
    seconds: float = 0.0

    def total_ms(self) -> tuple[float, float]:
        """(forward, backward) ms summed over every profiled partition instance."""
        ok = [e for e in self.ops if e["error"] is None]
        return (sum(e["forward_ms"] * e["count"] for e in ok), sum(e["backward_ms"] * e["count"] for e in ok))

    def to_dict(self) -> dict:
        fwd, bwd = self.total_ms()
        return {"device": self.device, "device_name": self.device_name, "device_kind": self.device_kind,
                "cache": self.path, "threads": self.threads, "entries": len(self.ops),
                "measured": self.measured, "cached": self.cached, "errors": self.errors,
                "skipped": self.skipped,
                "seconds": round(self.seconds, 3), "total_forward_ms": fwd, "total_backward_ms": bwd,
                "ops": [{k: v for k, v in e.items() if k != "key"} for e in self.ops]}

    def table(self) -> str:
        """Plain-text table: one line per distinct key."""
        lines = [f"{'op':<28} {'kind':<18} {'n':>3} {'output':<22} {'fwd ms':>9} {'bwd ms':>9} "
                 f"{'GFLOP':>8}  src"]
        for e in self.ops:
            src = ("skipped" if e.get("skipped") else "error") if e["error"] else \
                ("cache" if e["cached"] else "measured")
            f = "-" if e["error"] else f"{e['forward_ms']:.4f}"
            b = "-" if e["error"] else f"{e['backward_ms']:.4f}"
            lines.append(f"{e['op'][:28]:<28} {e['kind'][:18]:<18} {len(e['ops']):>3} "
                         f"{str(tuple(e['output_shape']))[:22]:<22} {f:>9} {b:>9} {e['flops'] / 1e9:>8.3f}  {src}")
        fwd, bwd = self.total_ms()
        lines.append(f"{len(self.ops)} distinct ops on {self.device_name} ({self.device_kind}): "
                     f"{self.measured} measured, {self.cached} from cache, {self.errors} failed"
                     f"{f', {self.skipped} skipped (out of time)' if self.skipped else ''}; "
                     f"forward {fwd:.3f} ms + backward {bwd:.3f} ms per iteration; cache {self.path}")
        return "\n".join(lines)


def _configs_for(op, strategy, configs) -> list:
    out = []
    if strategy is not None and op.name in strategy:
        out.append(strategy[op.name])
    extra = (configs or {}).get(op.name)
    if isinstance(extra, ParallelConfig):
        extra = [extra]
    out.extend(c for c in (extra or ()) if c not in out)
    return out or [ParallelConfig({}, (0,))]


def profile_graph(graph, device="cpu", strategy=None, configs=None, repeats: int = 5,
                  progress: bool = False, *, db: ProfileDB | None = None, profile_dir=None,
                  warmup: int = 1, max_seconds: float = 2.0, save: bool = True,
                  ops=None, budget_s: float | None = None, precision: str = "32-true") -> ProfileReport:
    """Profile every distinct partition key of ``graph``'s compute ops on ``device``
    ("cpu", "cuda", "cuda:1"), each once; keys already in the cache are not re-run.

    Partitions: each op whole when ``strategy`` and ``configs`` are None; else the
    partitions of ``strategy[op]`` and of ``configs[op]`` (a ParallelConfig or a list,
    e.g. ``candidate_configs(op, machine)``), ops covered by neither whole.
    ``db``: the ProfileDB to use (default: this device's file in ``profile_dir`` or the
    cache).  New measurements are saved (merged under a lock) unless ``save=False``.
    ``ops``: only these op names (default: every compute op).
    ``progress``: a tqdm bar on stderr when it is a terminal.  An op that fails to run
    is reported with its ``error`` and not cached; the others go on.
    ``budget_s``: measure nothing new once this many seconds have passed; the keys
    left are reported with ``skipped`` (``ProfileReport.skipped`` counts them).
    ``precision``: the training precision (:mod:`flexflow.cost.precision`) whose ops are
    timed: under "bf16-mixed" each op runs in the dtypes autocast gives it on ``device``, under the keys
    a simulator of that precision looks up; "32-true", the graph's own dtypes."""
    from .precision import precision as _precision, priced_ops
    t_start = time.perf_counter()
    dev = _torch_device(device)
    priced = dict(zip((o.name for o in graph.ops), priced_ops(graph, _precision(precision, dev))))
    name = device_name(dev)
    if db is None:
        db = ProfileDB.load(name, profile_dir=profile_dir, device_kind=device_kind_of(dev))
    groups: dict[str, dict] = {}
    seq = []  # the keys of each op's partitions, in graph order (an op's several once each)
    only = None if ops is None else set(ops)
    for op in graph.compute_ops:
        if only is not None and op.name not in only:
            continue
        op = priced[op.name]
        mine = set()
        for config in _configs_for(op, strategy, configs):
            for part in partitions(op, config):
                k = key_str(_KEYER.key(op, part))
                if k not in mine:
                    mine.add(k)
                    seq.append(k)
                g = groups.get(k)
                if g is None:
                    groups[k] = g = {"key": k, "op": op.name, "ops": [], "count": 0, "_op": op, "_part": part}
                if op.name not in g["ops"]:
                    g["ops"].append(op.name)
                g["count"] += 1
    report = ProfileReport(str(dev), name, db.device_kind, str(db.path), torch.get_num_threads())
    call_s = None
    bar = None
    if progress and sys.stderr.isatty():
        with contextlib.suppress(ImportError):
            from tqdm import tqdm
            bar = tqdm(total=len(groups), desc=f"profiling on {name}", unit="op", file=sys.stderr)
    last_save = time.perf_counter()
    entries = {}  # key -> report entry, in graph order
    todo = {}  # key -> (op, part) to measure
    for k, g in groups.items():
        op, part = g.pop("_op"), g.pop("_part")
        e = entries[k] = _describe(op, part, g)
        hit = db.get(k)
        if hit is not None:
            e.update(forward_ms=hit["fwd_s"] * 1e3, backward_ms=hit["bwd_s"] * 1e3, cached=True)
            report.cached += 1
            if bar is not None:
                bar.update(1)
        else:
            todo[k] = (op, part)
    try:
        for win, order in _windows(todo, seq):
            if budget_s is not None and time.perf_counter() - t_start > budget_s:
                for k in win:
                    entries[k].update(error="skipped: out of profiling time", skipped=True)
                    report.skipped += 1
                continue
            if call_s is None:  # measured once, and only when something is measured
                call_s = _engine_call_s(dev, _Timer(dev))
            got = profile_partitions([todo[k] for k in win], dev, repeats, warmup, graph, max_seconds,
                                     order=order)
            for k, res in zip(win, got):
                op, part = todo[k]
                e = entries[k]
                if isinstance(res, Exception):  # an op that cannot run on random data: report it
                    e["error"] = f"{type(res).__name__}: {res}".splitlines()[0][:300]
                    warnings.warn(f"profiling {op.describe()} failed: {e['error']}")
                    report.errors += 1
                else:
                    fwd, raw_bwd, runs = res
                    # the backward as one node of a step's backward (one engine call per step)
                    bwd = max(raw_bwd - call_s, 0.2 * raw_bwd) if raw_bwd > 0 else 0.0
                    meta = _meta(op, e, runs, name)
                    meta.update(bwd_call_s=raw_bwd - bwd)
                    db.record(k, fwd, bwd, meta)
                    e.update(forward_ms=fwd * 1e3, backward_ms=bwd * 1e3)
                    report.measured += 1
                if bar is not None:
                    bar.update(1)
            if save and time.perf_counter() - last_save > 60:
                db.save()  # keep progress of long runs
                last_save = time.perf_counter()
    finally:
        if bar is not None:
            bar.close()
        if save and db._dirty:
            db.save()
    report.ops = list(entries.values())
    report.seconds = time.perf_counter() - t_start
    return report


def _describe(op, part, g) -> dict:
    return {**g, "kind": op.kind, "rule": op.rule, "dtype": str(op.dtype).removeprefix("torch."),
            "output_shape": list(region_shape(part.output)),
            "input_shapes": [None if r is None else list(region_shape(r)) for r in part.inputs],
            "param_shapes": {k: list(region_shape(r)) for k, r in part.params.items()},
            "flops": partition_flops(op, part), "bytes": partition_bytes(op, part),
            "backward_factor": RULES[op.rule].backward_factor(op),
            "forward_ms": None, "backward_ms": None, "cached": False, "error": None}


def _meta(op, e, runs, name) -> dict:
    m = {k: e[k] for k in ("kind", "rule", "dtype", "output_shape", "input_shapes", "param_shapes",
                           "flops", "bytes", "backward_factor")}
    m.update(op=op.name, runs=runs, threads=torch.get_num_threads(), torch=torch.__version__,
             device_name=name, time=round(time.time()))
    return m
