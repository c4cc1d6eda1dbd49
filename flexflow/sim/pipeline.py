"""Pipelines in the simulator: one micro-batch simulated task by task, the step composed.

A pipelined strategy (``Strategy.pipeline``) runs its ops on device groups (stages), each
group running its runs of ops (virtual stages) for every micro-batch in its schedule's
order (:func:`flexflow.strategy.pipeline.schedule_order`).  The simulator times it in two
levels:

1. One micro-batch of the strategy is simulated as any strategy is (:class:`Simulator` on
   the graph a micro-batch makes, :func:`flexflow.graph.micro.microbatch_graph`): every
   op's partitions, their messages, the collectives inside each stage and the gradient
   sync, task by task.  Stages run one after another there, so each run's forward and
   backward are read off that timeline: from its first task's start to its last task's
   end (``F_r``, ``B_r``, waits on its own messages included), the gaps between runs (the
   activation sent forward and its gradient sent back), what precedes the first forward
   (parameters gathered) and, per group, what follows its last backward (the gradient
   sync and the optimizer step: ``tail_g``).
2. The step: each group runs its schedule's tasks in order, a forward of run r for
   micro-batch b once run r - 1's forward of b has ended and its activation arrived, a
   backward once run r + 1's backward of b has ended and its gradient arrived (the last
   run's once its own forward of b has).  The gradients accumulate over the micro-batches
   and each group syncs after its last backward (``tail_g``), overlapping the cool-down of
   the groups after it.  The step ends when the last group is done.

Memory: a device's peak for one micro-batch, plus the activations of the micro-batches it
holds in flight beyond one: each run's activations (what lives on the device at the end of
its forward, less what lived before it) times the largest number in flight at once in the
schedule (GPipe: all; 1F1B: at most p - s), and the whole batch's inputs.

Exact case: p equal stages with no messages take (m + p - 1) / m of the compute of m
micro-batches under GPipe and 1F1B, and (v m + p - 1) / (v m) interleaved over v chunks.
"""
from __future__ import annotations

import math

import numpy as np

from ..strategy.pipeline import schedule_order
from .memory import out_of_memory
from .schedcore import ALIVE, DUR, FIN, LAG, PRIO, RES1
from .taskkeys import _AB, _JB, _PB, PS, UPD, XB, XF, B, F

__all__ = ["StageTimes", "compose", "replicas", "simulate_pipelined", "stage_times"]

_AMAX = (1 << _AB) - 1


class StageTimes:
    """Per run (virtual stage) of one simulated micro-batch, in picoseconds: ``F``, ``B``
    (forward and backward spans), ``xf[r]`` / ``xb[r]`` (the gap from run r's forward to run
    r + 1's, and from run r + 1's backward to run r's), ``turn`` (from the last run's forward
    to its backward), ``lead`` (before the first forward), ``tail[g]`` per group (after its
    last backward), ``end`` (the micro-batch's schedule end)."""

    def __init__(self, F, B, xf, xb, turn, lead, tail, end):
        self.F, self.B, self.xf, self.xb = F, B, xf, xb
        self.turn, self.lead, self.tail, self.end = turn, lead, tail, end


def stage_times(arrays, free, run_of_op: np.ndarray, prod_run: np.ndarray, groups: list,
                devices: list) -> StageTimes:
    """Read a micro-batch's :class:`StageTimes` off the scheduler's arrays (``arrays``:
    :class:`flexflow.sim.schedarrays.TaskArrays` after a run, ``free`` when each resource is
    done); ``run_of_op[o]``: the run of op index o (-1: none); ``prod_run[o, j]``: the run of
    the producer of op o's input j (-1: none); ``groups[g]``: the runs of group g;
    ``devices[g]``: its devices.

    The micro-batch runs its runs one after another, so run r's forward is taken from the
    arrival of its last activation from run r - 1 (or the end of run r - 1's forward, if
    later) to the end of its last forward task, and its backward likewise from the arrival
    of the last gradient from run r + 1 (the last run: from the end of its forward): tasks
    that could start early (ops fed by constants) do not stretch a run."""
    n = arrays.n
    H, C = arrays.H, arrays.C
    alive = C[:n, ALIVE] != 0
    fin, prio, dur = H[:n, FIN][alive], H[:n, PRIO][alive], H[:n, DUR][alive]
    lag = C[:n, LAG][alive] if arrays.xfer_lag else np.zeros(len(fin), np.int64)
    head = prio >> (2 * _PB + _JB)
    kind, a = head & 7, head >> 3
    jj = (prio >> (2 * _PB)) & ((1 << _JB) - 1)
    R = sum(len(g) for g in groups)

    def ends(k: int, op: np.ndarray) -> np.ndarray:
        sel = kind == k
        runs = run_of_op[op[sel]]
        keep = runs >= 0
        hi = np.zeros(R, np.int64)
        np.maximum.at(hi, runs[keep], fin[sel][keep])
        return hi

    def arrivals(k: int, op: np.ndarray, back: bool) -> tuple[np.ndarray, np.ndarray]:
        # per receiving run, the last message from its neighbour: when it arrived, and how
        # long the longest took (its transfer and the latency after it, no queueing: in the
        # step, a group's optimizer step does not sit between its micro-batches' messages)
        sel = kind == k
        ops, js, f, took = op[sel], jj[sel], fin[sel], dur[sel] + lag[sel]
        cons = run_of_op[ops]
        prod = prod_run[ops, np.minimum(js, prod_run.shape[1] - 1)]
        cross = (cons >= 0) & (prod >= 0) & (cons != prod)
        at, hi = np.zeros(R, np.int64), np.zeros(R, np.int64)
        to = prod[cross] if back else cons[cross]
        np.maximum.at(at, to, f[cross])
        np.maximum.at(hi, to, took[cross])
        return at, hi
    fe = ends(F, a)
    be = ends(B, _AMAX - a)
    af, tf = arrivals(XF, a, back=False)
    ab, tb = arrivals(XB, _AMAX - a, back=True)
    for r in range(1, R):  # a run with no tasks of its own (free views) ends where it starts
        fe[r] = max(fe[r], fe[r - 1])
    for r in reversed(range(R - 1)):
        be[r] = max(be[r], be[r + 1])
    be[R - 1] = max(be[R - 1], fe[R - 1])
    start_f = np.concatenate([[0], np.maximum(fe[:-1], af[1:])])
    start_b = np.concatenate([np.maximum(be[1:], ab[:-1]), [fe[-1]]])
    Fr = np.maximum(0, fe - start_f)
    Br = np.maximum(0, be - start_b)
    xf, xb = tf[1:], tb[:-1]
    end = int(free.max()) if len(free) else 0
    # per group, after its last backward: its optimizer step (the update tasks of its busiest
    # device; the caller adds the deferred gradient sync)
    sel = kind == UPD
    res, took = H[:n, RES1][alive][sel], dur[sel]
    ok = res >= 0
    upd = np.bincount(res[ok], weights=took[ok], minlength=len(free))
    tail = [int(upd[list(devices[g])].max()) for g in range(len(groups))]
    return StageTimes(Fr, Br, xf, xb, 0, 0, tail, end)


def compose(t: StageTimes, p: int, v: int, m: int, schedule: str, act=None):
    """The step of ``m`` micro-batches on ``p`` groups of ``v`` runs each (run ``c * p + s`` is
    chunk c of group s) under ``schedule``.  Returns (end of the step after ``lead``, per
    group the end of its last backward, per group its busy time, per group its first
    forward's start, per group the largest sum of ``act[r]`` over the (run, micro-batch)
    pairs it holds in flight at once; ``act``: (runs, k) array of per-run weights, or
    None)."""
    R = p * v
    orders = [schedule_order(schedule, p, v, m, s) for s in range(p)]
    pos = [0] * p
    free = [0] * p
    fdone = np.full((R, m), -1, np.int64)
    bdone = np.full((R, m), -1, np.int64)
    first = [None] * p
    k = act.shape[1] if act is not None else 0
    held = [np.zeros(k, np.int64) for _ in range(p)]
    peak = [np.zeros(k, np.int64) for _ in range(p)]
    busy = [0] * p
    left = sum(len(o) for o in orders)
    while left:
        moved = False
        for s in range(p):
            while pos[s] < len(orders[s]):
                what, c, b = orders[s][pos[s]]
                r = c * p + s
                if what == "F":
                    if r == 0:
                        ready = 0
                    elif fdone[r - 1, b] < 0:
                        break
                    else:
                        ready = int(fdone[r - 1, b]) + int(t.xf[r - 1])
                    start = max(ready, free[s])
                    end = fdone[r, b] = start + int(t.F[r])
                    if first[s] is None:
                        first[s] = start
                    if k:
                        held[s] += act[r]
                        np.maximum(peak[s], held[s], out=peak[s])
                    busy[s] += int(t.F[r])
                else:
                    if r == R - 1:
                        if fdone[r, b] < 0:
                            break
                        ready = int(fdone[r, b]) + t.turn
                    elif bdone[r + 1, b] < 0:
                        break
                    else:
                        ready = int(bdone[r + 1, b]) + int(t.xb[r])
                    if fdone[r, b] < 0:
                        break
                    start = max(ready, free[s])
                    end = bdone[r, b] = start + int(t.B[r])
                    if k:
                        held[s] -= act[r]
                    busy[s] += int(t.B[r])
                free[s] = end
                pos[s] += 1
                left -= 1
                moved = True
        if not moved:
            raise RuntimeError(f"pipeline schedule {schedule!r} deadlocks (p={p}, v={v}, m={m})")
    last_b = [max(int(bdone[c * p + s].max()) for c in range(v)) for s in range(p)]
    return last_b, busy, [f or 0 for f in first], peak


def simulate_pipelined(sim, strategy, cross=None):
    """One step of pipelined ``strategy`` on ``sim`` (a :class:`flexflow.sim.Simulator`),
    as the module's doc says: the fields of its :class:`SimResult`, ``bubble`` included.
    Identical data-parallel replicas (:func:`replicas`) are simulated once
    (``_deduplicated``); ``cross``: (replicas, device stride, the whole machine) when
    ``sim`` simulates one of them, whose gradients each group then all-reduces across them
    after its last backward."""
    from ..graph.micro import microbatch_graph
    from ..strategy.strategy import Strategy
    if cross is None:
        d, rep = replicas(strategy)
        if d > 1:
            return _deduplicated(sim, strategy, d, rep)
    pipe = strategy.pipeline
    m, p, v = pipe.microbatches, pipe.num_stages, pipe.interleave
    subs = sim.__dict__.setdefault("_micro_simulators", {})
    sub = subs.get(m)
    if sub is None:
        graph = microbatch_graph(sim.graph, m)
        sync = "deferred" if sim.sync == "ring" else sim.sync  # synced once, after the last micro-batch
        sub = subs[m] = type(sim)(graph, sim.machine, sim.cost_model, optimizer=sim.optimizer, sync=sync,
                                  reduce_outputs=sim.reduce_outputs, precision=sim.precision)
    micro = Strategy(sub.graph, dict(strategy.items()), name=strategy.name)
    one = sub.simulate(micro)
    ctx = sub.ctx
    layouts = sub.__dict__.setdefault("_run_maps", {})  # per pipeline layout: op -> run, producers' runs
    maps = layouts.get(pipe.runs)
    if maps is None:
        stage = pipe.stage_of()
        maps = layouts[pipe.runs] = (np.array([stage.get(op.name, -1) for op in ctx.ops], np.int64),
                                     _producer_runs(ctx, stage))
    run_of_op, prod_run = maps
    groups = [[c * p + s for c in range(v)] for s in range(p)]
    t = stage_times(sub._sched.arrays, sub._sched.free, run_of_op, prod_run, groups, pipe.stages)
    if sub.sync == "deferred":  # each group's gradient sync follows its last backward
        tg = sub._tg
        owner = {d: g for g, devs in enumerate(pipe.stages) for d in devs}
        for c, cp in enumerate(tg.CPLAN):
            if tg.CLPS[c] and cp.bucket_bytes:
                t.tail[owner[next(iter(next(iter(cp.bucket_bytes))))]] += int(tg.CLPS[c])
    if cross is not None:
        _cross_sync(sub, pipe, t, *cross)
    act = _activations(sub, pipe, run_of_op)
    last_b, busy, first, held = compose(t, p, v, m, pipe.schedule, act)
    after = int(round(one.iteration_time * PS)) - t.end
    end = t.lead + max(last_b[g] + t.tail[g] for g in range(p)) + max(0, after)
    D = ctx.D
    peak = np.array(one.peak_memory, np.int64)
    for g in range(p):
        devs = list(pipe.stages[g])
        once = act[groups[g]].sum(axis=0)
        peak[devs] += np.maximum(0, held[g] - once)[devs]
    peak += ctx.live.input_bytes * (m - 1)  # every rank holds the whole batch it was handed
    if cross is not None:  # the buckets of the gradients all-reduced across the replicas
        peak += _cross_buckets(sub)
    peak_l = [int(x) for x in peak]
    msg = out_of_memory(peak_l, ctx.capacity)
    span = max(last_b[g] + t.tail[g] for g in range(p))
    gb = int(np.argmax(busy))
    bubble = max(0.0, (span - busy[gb] - t.tail[gb]) / end) if end > 0 else 0.0
    return dict(
        iteration_time=end / PS, comm_bytes=one.comm_bytes * m, sync_bytes=one.sync_bytes,
        peak_memory=peak_l, feasible=not msg, message=msg,
        device_busy=[x * m for x in one.device_busy[:D]], link_busy=[x * m for x in one.link_busy],
        memory_capacity=list(ctx.capacity), num_tasks=one.num_tasks * m, strategy_name=strategy.name,
        model_flops=sim._flops[0], peak_flops=sim._flops[1], tokens=sim._tokens, bubble=bubble)


def _producer_runs(ctx, stage: dict) -> np.ndarray:
    """(ops, most inputs): the run of the producer of each op's input j (-1: none)."""
    width = max((len(op.inputs) for op in ctx.ops), default=0) or 1
    out = np.full((len(ctx.ops), width), -1, np.int64)
    for o, op in enumerate(ctx.ops):
        for j, src in enumerate(op.inputs):
            out[o, j] = stage.get(src, -1)
    return out


def _activations(sub, pipe, run_of_op: np.ndarray) -> np.ndarray:
    """(runs, devices): the activations a micro-batch leaves on each device of a run's group
    from the run's forward: the ops' memory events (memory.py; position o is op o's
    forward) that fall in the run's forward, less those freed there: what its ops allocate
    and still hold at the end of its forward.  Parameters, their gradients and optimizer
    state, and the bfloat16 copies of the weights (events of the parameter clusters, shared
    by every micro-batch) are not counted."""
    tg = sub._tg
    R, D = len(pipe.runs), tg.MEMDIFF.shape[1]
    placed = np.nonzero(run_of_op >= 0)[0]
    # runs are contiguous stretches of op positions, in run order: a position's run by bisection
    first = np.array([placed[run_of_op[placed] == r].min() for r in range(R)], np.int64)
    last = np.array([placed[run_of_op[placed] == r].max() for r in range(R)], np.int64)
    act = np.zeros((R, D), np.int64)
    for o in placed:
        ev = tg.MEV[o]
        if ev is None or not len(ev[0]):
            continue
        pos, rows = ev
        r = np.searchsorted(first, pos, side="right") - 1
        ok = (r >= 0) & (pos <= last[np.maximum(r, 0)])
        if ok.any():
            np.add.at(act, r[ok], rows[ok])
    for r in range(R):
        keep = np.zeros(D, bool)
        keep[list(pipe.stages[pipe.runs[r][0]])] = True
        act[r][~keep] = 0
    return np.maximum(act, 0)


def replicas(strategy) -> tuple[int, dict | None]:
    """(d, configs of replica 0) where the strategy's ops are d identical data-parallel
    replicas: every op split along its sample dim (or replicated) first, d dividing that
    degree, the partitions of replica r on the devices of replica 0 plus ``r * D / d``, and
    no parameter sharded (a shard level spans the replicas); else (1, None).  Replica 0's
    configs split one d-th of each micro-batch on devices ``0 .. D / d - 1``."""
    from ..strategy.config import REPLICA, ParallelConfig
    D = strategy.num_devices or (max(strategy.devices_used()) + 1)
    graph = strategy.graph
    ks = []
    for name, cfg in strategy.items():
        if cfg.shard:
            return 1, None
        op = graph.op(name)
        sd = op.sample_dim
        first = next((x.name for x in op.dims if cfg.degree(x.name) > 1), None)
        axis = sd.name if sd is not None and cfg.degree(sd.name) > 1 else REPLICA
        if cfg.degree(axis) < 2 or (axis != REPLICA and first != axis):
            return 1, None
        ks.append(cfg.degree(axis))
    d = 0
    for k in ks:
        d = math.gcd(d, k)
    d = math.gcd(d, D)
    if d < 2 or D % d:
        return 1, None
    S = D // d
    out = {}
    for name, cfg in strategy.items():
        devs = cfg.devices
        block = len(devs) // d
        base = devs[:block]
        if max(base) >= S or any(devs[r * block + j] != base[j] + r * S for r in range(d) for j in range(block)):
            return 1, None
        op = graph.op(name)
        sd = op.sample_dim
        axis = sd.name if sd is not None and cfg.degree(sd.name) > 1 else REPLICA
        degrees = dict(cfg.degrees)
        degrees[axis] //= d
        out[name] = ParallelConfig(degrees, base, cfg.shard, cfg.recompute)
    return d, out


def _deduplicated(sim, strategy, d: int, rep: dict) -> dict:
    """``strategy``'s step from one of its d replicas: replica 0 simulated on the first D / d
    devices with a d-th of the batch, its gradient sync across the replicas costed on the
    whole machine; every replica's devices given replica 0's figures."""
    from ..graph.micro import microbatch_graph
    from ..strategy.strategy import Strategy
    D = sim.ctx.D
    S = D // d
    subs = sim.__dict__.setdefault("_replica_simulators", {})
    rsim = subs.get(d)
    if rsim is None:
        graph = microbatch_graph(sim.graph, d)
        rsim = subs[d] = type(sim)(graph, sim.machine.with_devices(S), sim.cost_model, optimizer=sim.optimizer,
                                   sync=sim.sync, reduce_outputs=sim.reduce_outputs, precision=sim.precision)
    one = Strategy(rsim.graph, rep, name=strategy.name, pipeline=strategy.pipeline.to_dict())
    out = simulate_pipelined(rsim, one, cross=(d, S, sim.machine))
    extra = sim.ctx.live.input_bytes - rsim.ctx.live.input_bytes  # every rank holds the whole batch
    peak = [int(x) + extra for _ in range(d) for x in out["peak_memory"]]
    msg = out_of_memory(peak, sim.ctx.capacity)
    out.update(peak_memory=peak, feasible=not msg, message=msg, memory_capacity=list(sim.ctx.capacity),
               device_busy=[x for _ in range(d) for x in out["device_busy"]],
               link_busy=[0.0] * len(sim.machine.links),  # (per link of one replica's machine only)
               comm_bytes=out["comm_bytes"] * d, num_tasks=out["num_tasks"] * d,
               model_flops=sim._flops[0], peak_flops=sim._flops[1], tokens=sim._tokens)
    return out


def _cross_buckets(sub) -> np.ndarray:
    """Per device, the gradient bytes it all-reduces across the replicas and no bucket
    among its own replica's devices holds yet: the flat buckets the executor keeps for them
    the whole step (memory.py's communication buffers)."""
    D = sub.ctx.D
    grad = np.zeros(D, np.int64)
    held = np.zeros(D, np.int64)
    for cp in sub._tg.CPLAN:
        grad += cp.grad
        for devices, nb in cp.bucket_bytes.items():
            held[list(devices)] += nb
    return np.maximum(0, grad - held)


def _cross_sync(sub, pipe, t: StageTimes, d: int, S: int, machine) -> None:
    """Add to each group's tail the all-reduce of its devices' gradients across the d
    replicas (device j with ``j + r * S``), in buckets as the executor sends them; a group's
    devices reduce at once, the slowest counted."""
    from ..cost.model import GRAD_BUCKET_BYTES
    grad = np.zeros(sub.ctx.D, np.int64)
    for cp in sub._tg.CPLAN:
        grad += cp.grad
    seen: dict = {}
    for g, devs in enumerate(pipe.stages):
        worst = 0
        for j in devs:
            key = (j % machine.devices_per_node, int(grad[j]))
            if key not in seen:
                group = [j + r * S for r in range(d)]
                s = (machine.allreduce_time_s(group, int(grad[j])) if machine.spec.comm_on_cores
                     else machine.bucketed_allreduce_time_s(group, int(grad[j]), GRAD_BUCKET_BYTES))
                seen[key] = int(round(s * PS))
            worst = max(worst, seen[key])
        t.tail[g] += worst
