"""Execution simulator: full and delta simulation of one training iteration.

Scheduling (the paper's full simulation): event-driven list scheduling over the task graph of
:mod:`flexflow.sim.taskgraph`.  Every device and every link runs one task at a time.  Tasks whose
inputs are all done wait in one ready queue ordered by (ready time, canonical priority); the
first is dequeued and starts at max(ready time, time its resources are free) -- on all of its
resources at once (a transfer holds every link of its route, an all-reduce its ring's links).
Each resource thus runs its tasks in FIFO order of readiness.  Times are integer picoseconds.

Delta simulation (``incremental=True``): the task graph is patched in place for the ops whose
config changed (their tasks, the transfers on their edges, their neighbours' dependencies,
the sync and update tasks of their parameters).  Let t* be the earliest time any dead or
changed task was ready in the previous run, or any new or changed task could become ready
(the latest finish of its unchanged predecessors).  Every task the previous run dequeued with
ready time < t* is dequeued identically now, so the scheduler restarts at t*: each resource is
free when its last such task finished, and the remaining tasks are re-counted.  The result is
the one a full simulation gives, bit for bit (integer times, canonical tie-breaking).

Memory (``peak_memory``): per device, the peak over one training step by liveness -- parameters,
buffers and optimizer state, gradients from the backward that makes them, activations from
their forward to their last use in the backward, communication buffers (see ``memory.py``).

Recomputation (``ParallelConfig.recompute``): a recomputed op's backward tasks last its
forward plus its backward, and its output lives only over the forward and again from its
recomputation (``memory.py``).
"""
from __future__ import annotations

import contextlib
import gc
import json
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ..cost.model import GRAD_BUCKET_BYTES, CostModel, partition_flops
from ..cost.precision import precision as _precision
from ..strategy.config import ParallelConfig
from ..strategy.regions import partitions
from .memory import optimizer_state_copies, out_of_memory
from .pipeline import simulate_pipelined
from .schedarrays import TaskArrays
from .schedcore import NO_LIMIT
from .taskgraph import (
    KIND_NAMES,
    PS,
    SYNC_MODELS,
    Context,
    TaskGraph,
    decode_prio,
)

__all__ = ["Simulator", "SimResult"]



@dataclass
class SimResult:
    """What one simulated training iteration costs.

    Times in seconds, sizes in bytes; ``device_busy[d]`` / ``link_busy[l]`` are the seconds
    device d / link l (``machine.links[l]``) is occupied per iteration."""

    iteration_time: float
    comm_bytes: int
    sync_bytes: int
    peak_memory: list
    feasible: bool
    message: str
    device_busy: list
    link_busy: list
    memory_capacity: list
    num_tasks: int
    strategy_name: str = ""
    # model FLOPs of one training step and the machine's peak FLOP/s at the compute dtype
    # (see ``mfu``); 0 where unknown
    model_flops: float = 0.0
    peak_flops: float = 0.0
    # token ids one step reads, where the model's first input holds them (an integer tensor,
    # batch by sequence); 0 otherwise
    tokens: int = 0
    # the fraction of the step the busiest pipeline stage's devices wait on the pipeline
    # (its bubble; 0 without a pipeline)
    bubble: float = 0.0
    _trace: Callable | None = field(default=None, repr=False, compare=False)

    @property
    def throughput(self) -> float:
        """Iterations per second."""
        return 1.0 / self.iteration_time if self.iteration_time > 0 else float("inf")

    @property
    def mfu(self) -> float:
        """Model FLOPs utilisation: ``model_flops / (iteration_time * peak_flops)``.

        ``model_flops`` counts one training step: each placed op's forward FLOPs (the op
        rule's analytic count, 2 per multiply-add, for the whole op: replicas and
        recomputation are not counted) times 3, the backward taken as twice the forward
        (the usual 6N-per-token convention; attention's score products count as the ops
        that compute them).  ``peak_flops``: the sum over the machine's devices of their
        peak rate at the compute dtype (the precision's; under ``32-true`` the floating
        dtype that carries most of the model's FLOPs)."""
        if self.iteration_time <= 0 or self.peak_flops <= 0:
            return 0.0
        return self.model_flops / (self.iteration_time * self.peak_flops)

    @property
    def tokens_per_s_per_device(self) -> float:
        """Tokens a second per device (``tokens / iteration_time / devices``); 0 where the
        inputs are not token ids."""
        if self.iteration_time <= 0 or not self.tokens or not self.peak_memory:
            return 0.0
        return self.tokens / self.iteration_time / len(self.peak_memory)

    def to_chrome_trace(self, path) -> None:
        """Write the timeline as Chrome / Perfetto trace JSON (ph "X" events in microseconds;
        one row per device and per link that runs a task)."""
        if self._trace is None:
            raise ValueError("this SimResult carries no timeline")
        events, rows = self._trace()
        used = sorted({e[2] for e in events})
        tid = {r: i for i, r in enumerate(used)}
        out = [{"name": "process_name", "ph": "M", "pid": 0, "tid": 0,
                "args": {"name": f"flexflow simulation ({self.strategy_name})"}}]
        for r in used:
            out.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": tid[r], "args": {"name": rows[r]}})
            out.append({"name": "thread_sort_index", "ph": "M", "pid": 0, "tid": tid[r],
                        "args": {"sort_index": tid[r]}})
        for name, cat, r, start, dur in events:
            out.append({"name": name, "cat": cat, "ph": "X", "pid": 0, "tid": tid[r],
                        "ts": start / 1e6, "dur": dur / 1e6})
        with open(path, "w") as f:
            json.dump({"traceEvents": out, "displayTimeUnit": "ms"}, f)


class Simulator:
    """Simulates training iterations of ``graph`` on ``machine`` under strategies.

    ``simulate(strategy, incremental=True)`` reuses the previous call's task graph and
    timeline (delta simulation); ``incremental=False`` simulates from scratch.  Both return
    the same :class:`SimResult`.  ``optimizer``: "sgd", "momentum" or "adam", the optimizer
    whose state and step temporaries count in ``peak_memory``.  ``sync``: "ring" (bucketed
    ring all-reduce overlapping the backward, as the executor and DDP sync) or "ps" (the
    paper's runtime: gradients gathered to one replica and sent back, added after the task
    graph with no overlap -- only to put the paper's figures side by side).
    ``reduce_outputs``: how the executor returns the loss to every rank
    (:func:`flexflow.parallelize`): "with_gradients" (its default) rides on a gradient
    all-reduce over every device where the strategy has one and moves no activation
    between devices, and costs nothing of its own there; otherwise, and under "eager",
    the loss's all-reduce adds its latency (``output_sync_s``) to the step.
    ``precision``: "32-true" (the module's own dtypes), "bf16-mixed", "16-mixed" or
    "bf16-true" (:mod:`flexflow.cost.precision`): ops are timed at the compute dtype's rate,
    activations, messages and memory counted in their dtypes, gradients synced in the
    reduce dtype and sharded parameters gathered in the all-gather dtype."""

    def __init__(self, graph, machine, cost_model: CostModel | None = None, *, optimizer: str = "sgd",
                 sync: str = "ring", max_delta_fraction: float = 0.25,
                 reduce_outputs: str = "with_gradients", precision: str = "32-true"):
        self.graph, self.machine = graph, machine
        self.cost_model = cost_model or CostModel(machine)
        self._fingerprint = machine.fingerprint()
        # simulators sharing a cost model (and graph, machine) share the per-config caches
        shared = self.cost_model.__dict__.setdefault("_simulator_contexts", {})
        optimizer_state_copies(optimizer)  # a clear error for an unknown optimizer
        self.precision = _precision(precision).name  # a clear error for an unknown name
        if sync not in SYNC_MODELS:
            raise ValueError(f"unknown sync model {sync!r}: expected one of {', '.join(SYNC_MODELS)}")
        if reduce_outputs not in ("eager", "with_gradients"):
            raise ValueError(f"reduce_outputs must be 'eager' or 'with_gradients', got {reduce_outputs!r}")
        self.optimizer, self.sync, self.reduce_outputs = optimizer, sync, reduce_outputs
        key = (id(graph), self._fingerprint, optimizer, sync)
        if self.precision != "32-true":
            key += (self.precision,)
        ctx = shared.get(key)
        if ctx is None or ctx.graph is not graph:
            ctx = shared[key] = Context(graph, machine, self.cost_model, optimizer, sync, self.precision)
        self.ctx = ctx
        self.max_delta_fraction = max_delta_fraction
        out_sync = machine.spec.output_sync_s  # the outputs' all-reduce (calibrated, or one latency)
        self._loss_latency_s = machine.allreduce_latency_s(range(ctx.D)) if out_sync is None or ctx.D < 2 \
            else float(out_sync)
        self._flops = _model_flops(ctx)
        self._tokens = _tokens(graph)
        self._tg: TaskGraph | None = None
        self._sched: _Schedule | None = None
        self.stats = {"full": 0, "delta": 0, "same": 0, "resimulated_tasks": 0, "stopped": 0}

    # ---- public ---------------------------------------------------------------------------
    def simulate(self, strategy, incremental: bool = True) -> SimResult:
        """One training step of ``strategy``, simulated: a :class:`SimResult`.
        ``incremental=True`` patches the previous call's task graph (delta simulation);
        ``False`` simulates from scratch; both give the same result."""
        return self._simulate_gc(strategy, incremental, NO_LIMIT)

    def simulate_within(self, strategy, limit_s: float, incremental: bool = True) -> SimResult | None:
        """``simulate(strategy)``, or None as soon as the schedule proves that the iteration
        time exceeds ``limit_s``: some device or link is busy until t and still has work w
        queued, with t + w (plus what is added after the graph) above the limit.  A search
        that would reject every strategy slower than ``limit_s`` decides exactly as with the
        full result, usually sooner."""
        if not limit_s < NO_LIMIT / PS:
            return self._simulate_gc(strategy, incremental, NO_LIMIT)
        return self._simulate_gc(strategy, incremental, max(0, int(limit_s * PS)))

    def _simulate_gc(self, strategy, incremental: bool, limit: int):
        # many small lists per call: the cyclic collector would rescan them over and over
        with paused_gc():
            return self._simulate(strategy, incremental, limit)

    def _simulate(self, strategy, incremental: bool, limit: int) -> SimResult | None:
        if getattr(strategy, "pipeline", None) is not None:
            res = SimResult(**simulate_pipelined(self, strategy))
            return res if res.iteration_time * PS <= limit else self._stopped()
        g = getattr(strategy, "graph", None)
        if g is not None and g is not self.graph and g.fingerprint() != self.graph.fingerprint():
            raise ValueError("strategy was made for another graph (fingerprint "
                             f"{g.fingerprint()}, simulator's graph {self.graph.fingerprint()})")
        fp = getattr(strategy, "machine_fingerprint", None)
        if fp and fp != self._fingerprint:
            raise ValueError(f"strategy was made for another machine (fingerprint {fp}, "
                             f"this machine {self._fingerprint})")
        tg = self._tg
        if incremental and tg is not None:
            groups = tg.changed_groups(strategy)
            arrays = self._sched.arrays
            if not groups and arrays.complete:
                self.stats["same"] += 1
                tg.strategy = strategy
                after = self._after_graph_ps(tg)
                return self._result(tg, after) if self._end_ps(after) <= limit else self._stopped()
            if len(groups) <= self.max_delta_fraction * len(self.ctx.groups):
                ctx = self.ctx
                for g in groups:  # refuse a bad config before touching the task graph
                    o = ctx.groups[g][0]
                    ctx.template(o, strategy[ctx.ops[o].name])
                try:
                    dead, dirty, born = tg.patch(strategy, groups) if groups else ([], [], [])
                    arrays.update(tg, *tg.take_touched())
                    after = self._after_graph_ps(tg)
                    n, done = arrays.run_delta(dead, dirty, born, limit - after)
                    tg.release()
                except BaseException:
                    self._tg = self._sched = None  # half-patched: the next call starts afresh
                    raise
                self.stats["resimulated_tasks"] += n
                self.stats["delta"] += 1
                return self._result(tg, after) if done else self._stopped()
        tg = self._tg = TaskGraph(self.ctx, strategy)
        if self._sched is None:
            self._sched = _Schedule(self.ctx.R, self.ctx.xfer_lag_ps)
        after = self._after_graph_ps(tg)
        done = self._sched.run_full(tg, limit - after)
        self.stats["full"] += 1
        return self._result(tg, after) if done else self._stopped()

    def _stopped(self) -> None:
        self.stats["stopped"] += 1
        return None

    def timeline(self, strategy) -> tuple[list, list]:
        """(events, row names): events (name, category, resource, start_ps, dur_ps) of a fresh
        full simulation of ``strategy``; resource r < num_devices is a device, else a link."""
        tg = TaskGraph(self.ctx, strategy)
        sched = _Schedule(self.ctx.R, self.ctx.xfer_lag_ps)
        sched.run_full(tg)
        ctx, ops, D = self.ctx, self.ctx.ops, self.ctx.D
        arr = sched.arrays
        FIN, DUR, PRIO = arr.FIN.tolist(), arr.column("dur"), arr.column("prio")
        events = []
        for r, tids in enumerate(sched.per_resource(tg)):
            for t in tids:
                a, kind, j, k, q = decode_prio(PRIO[t])
                if kind <= 3:
                    name = f"{ops[a].name} {KIND_NAMES[kind]}"
                elif kind in (4, 6):
                    name = f"{ctx.param_names[a]} {KIND_NAMES[kind]}"
                else:
                    name = f"{ops[a].name} update"
                events.append((name, KIND_NAMES[kind], r, FIN[t] - DUR[t], DUR[t]))
        rows = [f"device {d}" for d in range(D)] + [l.name for l in self.machine.links]
        return events, rows

    # ---- results --------------------------------------------------------------------------
    def _collective_latency_ps(self, tg: TaskGraph) -> int:
        """Where communication runs on the cores that compute (``comm_on_cores``), each
        collective's latency holds its members' cores, so it adds to the step: one per
        gradient bucket the executor forms (per device group, ``GRAD_BUCKET_BYTES`` each)
        and the all-reduce of the outputs (the loss) among all ranks (``output_sync_s``
        where calibrated), unless the loss rides on a bucket over every device: the
        executor does so when that bucket's gate follows every activation exchange, which
        this takes as "no exchange at all" (a strategy that mixes both is charged the
        loss's latency)."""
        if self.sync == "ps":
            return 0
        m, per_group = self.machine, {}
        for cp in tg.CPLAN:
            for devices, nb in cp.bucket_bytes.items():
                per_group[devices] = per_group.get(devices, 0) + nb
        lat = sum(-(-nb // GRAD_BUCKET_BYTES) * m.allreduce_latency_s(devices) for devices, nb in per_group.items())
        D = self.ctx.D
        rides = (self.reduce_outputs == "with_gradients" and D > 1 and any(len(set(k)) == D for k in per_group)
                 and not tg.comm_sum)
        return int(round((lat + (0.0 if rides else self._loss_latency_s)) * PS))

    def _after_graph_ps(self, tg: TaskGraph) -> int:
        """What the step adds after the task graph: the parameter server's time (sync="ps")
        and, with communication on the computing cores, the collectives' latencies."""
        extra = int(tg.CLPS.sum()) if self.sync != "deferred" else 0
        if self.ctx.comm_on_cores:
            extra += self._collective_latency_ps(tg) + self._skew_ps(tg)
        return extra

    def _skew_ps(self, tg: TaskGraph) -> int:
        """Where the ranks' speeds jitter (``sync_skew``), the step's synchronisations wait
        for the slowest rank: the skew times the second largest busy time of the devices'
        op and update tasks (with one device computing, the others wait idle and nothing is
        lost to jitter)."""
        skew = self.machine.spec.sync_skew
        D = self.ctx.D
        if not skew or D < 2:
            return 0
        busy = tg.OPSUM[:D] + tg.USUM
        return int(round(skew * float(np.partition(busy, D - 2)[D - 2])))

    def _end_ps(self, after_graph_ps: int) -> int:
        free = self._sched.free
        return (int(free.max()) if len(free) else 0) + after_graph_ps

    def _result(self, tg: TaskGraph, after_graph_ps: int) -> SimResult:
        ctx = self.ctx
        D = ctx.D
        end = self._end_ps(after_graph_ps)
        mem = tg.memory_peak()
        busy = tg.OPSUM + tg.CLSUM
        busy[:D] += tg.USUM
        peak = [int(x) for x in mem]
        cap = ctx.capacity
        msg = out_of_memory(peak, cap)
        over = bool(msg)
        strategy = tg.strategy
        res = SimResult(
            iteration_time=end / PS,
            comm_bytes=tg.comm_sum,
            sync_bytes=tg.sync_sum,
            peak_memory=peak,
            feasible=not over,
            message=msg,
            device_busy=[int(x) / PS for x in busy[:D]],
            link_busy=[int(x) / PS for x in busy[D:]],
            memory_capacity=list(cap),
            num_tasks=tg.num_tasks(),
            strategy_name=getattr(strategy, "name", ""),
            model_flops=self._flops[0],
            peak_flops=self._flops[1],
            tokens=self._tokens,
        )
        res._trace = lambda: self.timeline(strategy)
        return res


def _tokens(graph) -> int:
    """Token ids per step: the elements of the graph's first input where it is an integer
    tensor (token ids, batch first), else 0."""
    first = next((op for op in graph.ops if op.kind == "input"), None)
    dt = None if first is None else first.dtype
    if dt is None or dt.is_floating_point or dt.is_complex or str(dt) == "torch.bool" or not first.output_shape:
        return 0
    return int(np.prod(first.output_shape, dtype=np.int64))


def _model_flops(ctx) -> tuple[float, float]:
    """(model FLOPs of one training step, the machine's peak FLOP/s at the compute dtype):
    ``SimResult.mfu``'s figures, computed once per context."""
    hit = ctx.__dict__.get("_model_flops")
    if hit is None:
        whole = ParallelConfig({}, (0,))
        by_dtype: dict = {}
        for o in ctx.compute:
            if ctx.free[o]:
                continue
            op = ctx.ops[o]
            f = partition_flops(op, partitions(op, whole)[0])
            dt = ctx.cops[o].dtype
            if f > 0 and dt.is_floating_point:
                by_dtype[dt] = by_dtype.get(dt, 0.0) + f
        total = 3.0 * sum(by_dtype.values())  # forward + backward (twice the forward)
        prec = ctx.precision
        dtype = prec.compute if not prec.native else max(by_dtype, key=by_dtype.get, default="float32")
        peak = sum(d.spec.flops(dtype) for d in ctx.machine.devices)
        hit = ctx.__dict__["_model_flops"] = (total, float(peak))
    return hit


@contextlib.contextmanager
def paused_gc():
    """The cyclic garbage collector off for the block (as it was before, after it): a
    simulation allocates many small lists, which the collector would rescan over and over,
    and nothing it makes needs the collector (reference counting frees it)."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@contextlib.contextmanager
def deferred_collections():
    """The cyclic collector off in the block (as it was before, after it); what the block
    leaves alive goes to the oldest generation at the end, unscanned.

    A search allocates millions of small objects: plans that live as long as their cost
    model, and task lists that reference counting frees as the delta patches replace them.
    The automatic collector rescans the young ones every few hundred allocations and again
    as they move up a generation, and its full collections rescan every cached plan (about
    a second at 64 devices): 6-8% of a search's evaluations at 64 devices.  A search makes
    no cyclic garbage (its cost model becomes some only when dropped, after it), so nothing
    is lost by not collecting in it; and handing its survivors to the oldest generation
    (``gc.freeze`` then ``gc.unfreeze``: no scan) spares the caller a young collection of
    millions of objects (0.4-2 s) right after.  Where objects were frozen by someone else,
    the young generations are collected instead."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if gc.get_freeze_count() == 0:
            gc.freeze()
            gc.unfreeze()
        else:
            gc.collect(1)
        if was:
            gc.enable()


class _Schedule:
    """The timeline of the last run, in the compiled scheduler's arrays
    (:class:`flexflow.schedarrays.TaskArrays`): each task's finish time, the order tasks were
    dequeued, and when each resource is free."""

    def __init__(self, R: int, xfer_lag: int = 0):
        self.arrays = TaskArrays(R, xfer_lag)

    @property
    def free(self):
        return self.arrays.free

    def run_full(self, tg: TaskGraph, limit: int = NO_LIMIT) -> bool:
        """Schedule ``tg`` from scratch; False if stopped early at ``limit``."""
        a = self.arrays
        tg.take_touched()
        a.load(tg)
        tg.hand_over()
        done = a.run_full(limit)
        tg.release()
        return done

    def per_resource(self, tg: TaskGraph) -> list[list[int]]:
        """Per resource, the tasks it ran in order."""
        a = self.arrays
        out = [[] for _ in range(a.R)]
        for t in a.log().tolist():
            for r in a.resources(t):
                out[r].append(t)
        return out
