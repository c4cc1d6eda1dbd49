"""Moves of a pipeline, and the descent that takes them: the search's pipeline dimension.

A pipelined strategy's neighbours (:func:`neighbours`): twice or half the micro-batches,
the other schedule (GPipe / 1F1B), interleaving on or off (the blocks cut again into two
chunks a device group, or one, balanced by FLOPs), and each stage boundary moved by one
repeated block
(the last block of a run handed to the next run, or the first block of a run to the one
before), its ops' partitions taken to the same places on the other stage's devices.  The
search (:func:`descend_pipeline`) starts from the fastest pipelined plan it has and takes
the best neighbour while one improves, within its share of the budget.
"""
from __future__ import annotations

from ..graph.ir import repeated_block
from ..strategy.config import ParallelConfig, StrategyError
from .common import _better

__all__ = ["descend_pipeline", "neighbours"]


def _block_edge(graph, names: list, last: bool) -> list:
    """The ops of a run's last (or first) repeated block, with the ops between it and the
    run's end (start) that belong to no block; [] when the run has one block or none."""
    blocks = [repeated_block(graph.op(n).module_path) for n in names]
    keys = [b for b in dict.fromkeys(blocks) if b]
    if len(keys) < 2:
        return []
    edge = keys[-1] if last else keys[0]
    idx = [i for i, b in enumerate(blocks) if b == edge]
    return names[idx[0]:] if last else names[:idx[-1] + 1]


def neighbours(strategy) -> list:
    """The pipelined strategy's neighbours (see the module's doc), each a valid strategy."""
    pipe = strategy.pipeline
    if pipe is None:
        return []
    out = []
    m, sched = pipe.microbatches, pipe.schedule
    specs = [(m * 2, sched), (m // 2, sched)]
    if pipe.interleave == 1:
        specs.append((m, "gpipe" if sched == "1f1b" else "1f1b"))
    for mb, sc in specs:
        if mb >= 1:
            try:
                out.append(strategy.with_pipeline(mb, sc))
            except StrategyError:
                pass
    for v in ((2,) if pipe.interleave == 1 else (1,)):
        other = _rechunked(strategy, v)
        if other is not None:
            out.append(other)
    graph, stages, runs = strategy.graph, pipe.stages, pipe.runs
    for r in range(len(runs) - 1):
        (g, a), (h, b) = runs[r], runs[r + 1]
        if len(stages[g]) != len(stages[h]):
            continue
        for names, src, dst in ((_block_edge(graph, list(a), True), g, h), (_block_edge(graph, list(b), False), h, g)):
            if not names:
                continue
            where = dict(zip(stages[src], stages[dst]))
            changes = {}
            for n in names:
                c = strategy[n]
                if any(x not in where for x in c.devices):
                    changes = None
                    break
                changes[n] = ParallelConfig(c.degrees, [where[x] for x in c.devices], c.shard, c.recompute)
            if not changes:
                continue
            try:
                out.append(strategy.replaced(changes))
            except StrategyError:  # a shared parameter across the boundary, a cycle
                pass
    return out


def _rechunked(strategy, v: int):
    """The strategy with its blocks cut again into ``v`` chunks a device group (chunk c on
    group c mod p, :func:`flexflow.strategy.pipeline.chunk_of_ops`), each op's partitions
    taken to the same places on its new group's devices; None where that is no pipeline."""
    from ..strategy.pipeline import chunk_of_ops
    pipe = strategy.pipeline
    p, stages = pipe.num_stages, pipe.stages
    if len({len(s) for s in stages}) != 1 or (v > 1 and pipe.microbatches % p):
        return None
    try:
        chunk = chunk_of_ops(strategy.graph, p * v)
    except StrategyError:
        return None
    run_of = pipe.stage_of()
    changes = {}
    for name, c in strategy.items():
        here, there = pipe.runs[run_of[name]][0], chunk[name] % p
        if here != there:
            where = dict(zip(stages[here], stages[there]))
            if any(x not in where for x in c.devices):
                return None
            changes[name] = ParallelConfig(c.degrees, [where[x] for x in c.devices], c.shard, c.recompute)
    schedule = "interleaved-1f1b" if v > 1 else ("1f1b" if pipe.schedule == "interleaved-1f1b" else pipe.schedule)
    try:
        return strategy.without_pipeline().replaced(changes).with_pipeline(pipe.microbatches, schedule)
    except StrategyError:
        return None


def descend_pipeline(run, sim, start, start_res, share: float) -> None:
    """From ``start`` (simulated as ``start_res``), take the best improving neighbour while
    one improves and the search's ``share`` of the budget lasts; every neighbour simulated
    counts as an evaluation of ``run`` (which keeps the best)."""
    cur, key = start, run.key(start_res)
    seen = {cur}
    while not run.spent(share, patience=False):
        best, best_key = None, None
        for n in neighbours(cur):
            if n in seen:
                continue
            seen.add(n)
            if run.spent(share, patience=False):
                return
            k = run.seen(n, sim.simulate(n))
            if _better(k, best_key):
                best, best_key = n, k
        if best is None or not _better(best_key, key):
            return
        cur, key = best, best_key
