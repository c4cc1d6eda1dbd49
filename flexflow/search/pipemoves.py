"""Moves of a pipeline, and the descent that takes them: the search's pipeline dimension.

A pipelined strategy's neighbours (:func:`neighbours`): twice or half the micro-batches,
the other schedule (GPipe / 1F1B), and each stage boundary moved by one repeated block
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
