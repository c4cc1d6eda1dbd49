"""Pipelines: a strategy's step cut into micro-batches that flow through device groups.

A pipeline is placement plus time.  Placement says which ops run where; the pipeline adds
how many micro-batches a step's batch is cut into and the schedule in which each device
group runs their forwards and backwards.  Every op's degrees split one micro-batch.

Stages follow from placement.  The device sets of the ops that are not contained in
another op's set are the device groups; they must be disjoint (a device in two groups has
no place in a pipeline).  Walking the placed ops in graph order, a *run* is a maximal
stretch of ops on one group; runs are the virtual stages, and the groups, in the order of
their first run, are the stages.  Under ``"gpipe"`` and ``"1f1b"`` each group holds one
run; under ``"interleaved-1f1b"`` (and a looped ``"gpipe"``) each holds ``v`` runs, met in
round-robin order: stage 0, 1, ..., p-1, then stage 0 again.

Schedules (per group, the order of its forward and backward tasks; see
:func:`schedule_order`):

- ``gpipe``: every forward, then every backward;
- ``1f1b``: stage s runs ``min(p - s - 1, m)`` forwards ahead, then one forward and one
  backward in turn, then the remaining backwards (PipeDream-Flush, Megatron's default):
  at most ``p - s`` micro-batches in flight;
- ``interleaved-1f1b``: Megatron's interleaved schedule over ``v`` chunks a group
  (``m`` a multiple of ``p``): ``2 (p - s - 1) + (v - 1) p`` forwards ahead.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..graph.ir import OpGraph, repeated_block
from ..graph.micro import microbatch_graph
from ..graph.ops import RULES
from .config import ParallelConfig, StrategyError, format_devices
from .regions import partitions, validate_config

__all__ = ["SCHEDULES", "Pipeline", "chunk_of_ops", "pipeline_layout", "schedule_order", "stage_configs"]

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")


@dataclass(frozen=True)
class Pipeline:
    """A strategy's pipeline: ``microbatches`` (the step's batch cut into that many) and
    ``schedule`` (one of :data:`SCHEDULES`); ``stages`` (device groups in pipeline order)
    and ``runs`` (per virtual stage, its group's index and op names, in pipeline order) are
    derived from the strategy's placement."""

    microbatches: int
    schedule: str = "1f1b"
    stages: tuple = ()
    runs: tuple = ()

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def interleave(self) -> int:
        """Virtual stages per device group (1 without interleaving)."""
        return len(self.runs) // max(1, len(self.stages))

    def stage_of(self) -> dict[str, int]:
        """Op name -> index of its virtual stage (run)."""
        return {name: r for r, (_, names) in enumerate(self.runs) for name in names}

    def to_dict(self) -> dict:
        return {"microbatches": self.microbatches, "schedule": self.schedule}

    def describe(self) -> str:
        stages = ", ".join(format_devices(s) for s in self.stages)
        v = f", {self.interleave} virtual stages each" if self.interleave > 1 else ""
        return (f"pipeline: {self.num_stages} stage(s) {stages}{v}; {self.microbatches} micro-batches, "
                f"schedule {self.schedule}")

    def __str__(self) -> str:
        return self.describe()


def check_spec(microbatches, schedule) -> None:
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise StrategyError(f"microbatches must be a positive int, got {microbatches!r}")
    if schedule not in SCHEDULES:
        raise StrategyError(f"schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")


def pipeline_layout(graph: OpGraph, configs, microbatches: int, schedule: str) -> Pipeline:
    """The :class:`Pipeline` of ``configs`` (op name -> config) cut into ``microbatches``
    under ``schedule``; an impossible pipeline is a :class:`StrategyError` that says why."""
    check_spec(microbatches, schedule)
    m = microbatches
    B = graph.batch_size
    if m > 1 and B is not None and B % m:
        raise StrategyError(f"{m} micro-batches do not divide the batch of {B}")
    ops = graph.compute_ops
    sets = {}
    for op in ops:
        sets.setdefault(frozenset(configs[op.name].devices), op)
    maximal = [s for s in sets if not any(s < t for t in sets)]
    owner: dict[int, frozenset] = {}
    for s in maximal:
        for d in s:
            if d in owner:
                a, b = sets[owner[d]], sets[s]
                raise StrategyError(
                    f"a pipeline needs disjoint device groups, but {a.describe()} runs on "
                    f"{format_devices(sorted(owner[d]))} and {b.describe()} on {format_devices(sorted(s))}, "
                    f"which share device {d}")
            owner[d] = s
    runs: list[tuple[frozenset, list[str]]] = []
    for op in ops:
        g = owner[next(iter(configs[op.name].devices))]
        if runs and runs[-1][0] == g:
            runs[-1][1].append(op.name)
        else:
            runs.append((g, [op.name]))
    groups: list[frozenset] = []
    for g, _ in runs:
        if g not in groups:
            groups.append(g)
    p, v = len(groups), len(runs) // len(groups)
    expected = [groups[k % p] for k in range(len(runs))]
    if len(runs) % p or [g for g, _ in runs] != expected:
        bad = next((k for k in range(len(runs)) if runs[k][0] != expected[k]), len(runs) - len(runs) % p)
        first = graph.op(runs[bad][1][0])
        raise StrategyError(
            f"the pipeline's stages must be met in order ({p} device groups, then again from the "
            f"first for interleaving), but {first.describe()} returns to devices "
            f"{format_devices(sorted(runs[bad][0]))} out of turn (a cycle between stages): place it "
            "with its neighbours")
    if v > 1 and schedule == "1f1b":
        raise StrategyError(f"schedule '1f1b' needs one run of ops per stage, but each of the {p} stages "
                            f"runs {v}: use 'interleaved-1f1b' (or place each stage's ops together)")
    if schedule == "interleaved-1f1b":
        if v < 2:
            raise StrategyError("schedule 'interleaved-1f1b' needs at least 2 runs of ops (virtual stages) "
                                "on each device group; this placement has 1: use '1f1b', or interleave")
        if m % p:
            raise StrategyError(f"schedule 'interleaved-1f1b' needs the micro-batches ({m}) to be a "
                                f"multiple of the {p} stages")
    try:  # each op's degrees split one micro-batch: checked on the graph a micro-batch makes
        micro = microbatch_graph(graph, m)
    except ValueError:  # (a graph without its module: its batch dims cut by m)
        micro = None
    for op in ops:
        cfg = configs[op.name]
        if micro is not None:
            try:
                validate_config(micro.op(op.name), cfg)
            except StrategyError as e:
                raise StrategyError(f"{e}: the config does not fit one micro-batch of the {m}") from None
            continue
        d = op.sample_dim
        deg = cfg.degree(d.name) if d is not None else 1
        if d is not None and deg * m > d.blocks:
            raise StrategyError(f"{op.describe()}: its sample dim split {deg} ways does not fit one "
                                f"micro-batch of {d.blocks // m} ({m} micro-batches of {d.blocks})")
    stages = tuple(tuple(sorted(g)) for g in groups)
    index = {g: i for i, g in enumerate(groups)}
    return Pipeline(m, schedule, stages, tuple((index[g], tuple(names)) for g, names in runs))


def schedule_order(schedule: str, p: int, v: int, m: int, s: int) -> list[tuple[str, int, int]]:
    """The tasks device group ``s`` (of ``p``, each with ``v`` chunks) runs in a step of
    ``m`` micro-batches: ``("F" | "B", chunk, micro-batch)`` in order; chunk c of group s
    is virtual stage ``c * p + s``."""
    if schedule == "gpipe":  # chunk by chunk (looped over the chunks where v > 1)
        fwd = [("F", c, b) for c in range(v) for b in range(m)]
        return fwd + [("B", c, b) for c in reversed(range(v)) for b in range(m)]
    if schedule == "1f1b":
        warm = min(p - s - 1, m)
        out = [("F", 0, b) for b in range(warm)]
        for b in range(m - warm):
            out += [("F", 0, warm + b), ("B", 0, b)]
        return out + [("B", 0, b) for b in range(m - warm, m)]
    # interleaved: virtual micro-batch k -> (chunk, micro-batch), p micro-batches a round
    total = v * m

    def at(k: int, forward: bool) -> tuple[int, int]:
        c = (k // p) % v
        return (c if forward else v - 1 - c), (k // (p * v)) * p + k % p
    warm = min((p - s - 1) * 2 + (v - 1) * p, total)
    out = [("F",) + at(k, True) for k in range(warm)]
    for k in range(total - warm):
        out += [("F",) + at(warm + k, True), ("B",) + at(k, False)]
    return out + [("B",) + at(k, False) for k in range(total - warm, total)]


def chunk_of_ops(graph: OpGraph, chunks: int) -> dict[str, int]:
    """Op name -> chunk (0..chunks-1): the graph's repeated blocks cut into ``chunks``
    contiguous runs balanced by forward FLOPs, the ops before the first block with the
    first chunk and those after the last with the last; a graph without repeated blocks is
    cut along its ops' FLOPs in graph order.  Ops sharing parameters must fall in one
    chunk (a :class:`StrategyError` names them otherwise)."""
    whole = ParallelConfig({}, (0,))
    ops = graph.compute_ops

    def flops(op) -> float:
        try:
            return float(RULES[op.rule].flops(op, partitions(op, whole)[0].block))
        except Exception:  # noqa: BLE001 - an op without a FLOP count weighs nothing
            return 0.0
    units: list[list] = []  # [key, flops, op names]
    for op in ops:
        key = repeated_block(op.module_path) or None
        if key is None and not any(repeated_block(o.module_path) for o in ops):
            key = op.name  # no blocks: every op its own unit
        if units and (key is None or units[-1][0] == key):
            units[-1][1] += flops(op)
            units[-1][2].append(op.name)
        elif any(u[0] == key for u in units):
            raise StrategyError(f"{op.describe()} belongs to block {key!r}, which earlier ops left: a "
                                "pipeline cuts the graph into contiguous runs")
        else:
            units.append([key, flops(op), [op.name]])
    if units and units[0][0] is None and len(units) > 1:  # what precedes the first block joins it
        units[1][1] += units[0][1]
        units[1][2][:0] = units[0][2]
        units.pop(0)
    n = len(units)
    if chunks > n:
        raise StrategyError(f"{chunks} pipeline chunks need at least as many repeated blocks (or ops), "
                            f"and the graph has {n}")
    cost = [u[1] for u in units]
    cuts = _balanced_cuts(cost, chunks)
    out: dict[str, int] = {}
    for c, (a, b) in enumerate(zip([0] + cuts, cuts + [n])):
        for u in units[a:b]:
            for name in u[2]:
                out[name] = c
    for members in graph.groups.values():
        where = {out[m] for m in members}
        if len(where) > 1:
            raise StrategyError(f"ops {members[0]} and {members[-1]} share parameters but fall in pipeline "
                                f"chunks {sorted(where)}: a pipeline cannot split them (untie the weights, "
                                "or use fewer stages)")
    return out


def _balanced_cuts(cost: list[float], k: int) -> list[int]:
    """k - 1 cut points splitting ``cost`` into k contiguous non-empty runs whose largest
    sum is smallest (ties: the most even count of units)."""
    n = len(cost)
    pre = [0.0]
    for c in cost:
        pre.append(pre[-1] + c)
    INF = float("inf")
    # best[j][i]: (largest run, spread) cutting the first i units into j runs
    best = [[(INF, INF)] * (n + 1) for _ in range(k + 1)]
    arg = [[0] * (n + 1) for _ in range(k + 1)]
    best[0][0] = (0.0, 0.0)
    even = n / k
    for j in range(1, k + 1):
        for i in range(j, n - (k - j) + 1):
            for h in range(j - 1, i):
                prev = best[j - 1][h]
                if prev[0] == INF:
                    continue
                cand = (max(prev[0], pre[i] - pre[h]), prev[1] + (i - h - even) ** 2)
                if cand < best[j][i]:
                    best[j][i], arg[j][i] = cand, h
    cuts, i = [], n
    for j in range(k, 0, -1):
        i = arg[j][i]
        cuts.append(i)
    return sorted(cuts)[1:]


def stage_configs(graph: OpGraph, flat: dict, pp: int, interleave: int, per_stage: int, tp: int) -> dict:
    """``flat`` (op name -> config on ``per_stage`` devices, rank ``t + tp * d`` of a
    tensor-parallel group t of replica d) placed on the stages of a pipeline: chunk c of
    :func:`chunk_of_ops` on stage ``c % pp``, local device ``t + tp * d`` becoming
    ``t + tp * (s + pp * d)``."""
    chunk = chunk_of_ops(graph, pp * interleave)
    out = {}
    for name, cfg in flat.items():
        s = chunk[name] % pp
        devices = [(i % tp) + tp * (s + pp * (i // tp)) for i in cfg.devices]
        out[name] = ParallelConfig(cfg.degrees, devices, cfg.shard, cfg.recompute)
    return out
