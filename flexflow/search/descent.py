"""The local descent that polishes the MCMC's best strategy, and the local-optimum check.

The descent tries changes of the current strategy and takes the ones that improve it.  Its
changes are simulated in rounds (``parallel.py``): up to ``ROUND`` changes that pass the load
bound's screen, each on its own simulator, side by side; of a round's improving changes the
best is taken.  A round's changes are all made from the same current strategy, so taking
the best of them is a first-improvement step of a descent that looks ``ROUND`` changes ahead.
"""
from __future__ import annotations

import itertools
import random

from ..graph.ir import OpGraph
from ..sim.bound import LoadBound
from ..sim.taskkeys import PS
from ..strategy.strategy import Strategy
from .common import Candidates, _analytic_model, _better, _penalised, _Run, _simulator, _Space
from .levers import Levers
from .parallel import ROUND, Evaluator
from .repeats import Repeats

__all__ = ["descend", "is_local_optimum"]


def _evaluate(sim, strategy, limit_s: float | None, delta: bool):
    """One simulation of a round: the result, or None when it was stopped above ``limit_s``."""
    if limit_s is None:
        return sim.simulate(strategy, incremental=delta)
    return sim.simulate_within(strategy, limit_s, incremental=delta)


class _Descent:
    """The current strategy, its cost key and its load bound; ``round`` tries changes of it."""

    def __init__(self, run: _Run, sims: list, make_sim, ev: Evaluator, delta: bool, screen: bool,
                 until: float = 1.0):
        self.run, self.sims, self.make_sim, self.ev, self.delta = run, list(sims), make_sim, ev, delta
        self.until = until
        self.cur = run.best
        while len(self.sims) < ROUND:
            self.sims.append(None)  # made when a round first needs it
        res = self._sim(0).simulate(self.cur, incremental=delta)
        self.key = run.seen(self.cur, res, start=True)
        self.bound = LoadBound(self.sims[0].ctx, self.cur) if screen else None
        self.screened = 0

    def _sim(self, i: int):
        if self.sims[i] is None:
            self.sims[i] = self.make_sim()
        return self.sims[i]

    def round(self, items) -> bool | None:
        """Pull up to ``ROUND`` changes ``(strategy, changed groups)`` of the current strategy
        from the iterator ``items``; settle those the screen can (a change whose load bound is
        no lower than the current cost cannot improve it), simulate the others side by side
        and move to the best improving one.  (A screened change keeps its place in the round:
        the descent is the same with and without the screen.)  Returns True when it moved,
        False when not, None when the budget ran out before a change was pulled."""
        run, bound = self.run, self.bound
        pulled = []  # (strategy, groups, screened), counted in this order below
        while len(pulled) < ROUND:
            if run.spent(self.until, patience=False, pending=len(pulled)):
                if not pulled:
                    return None
                break
            nxt = next(items, None)
            if nxt is None:
                break
            new, groups = nxt
            # cost >= bound >= the current cost: no improvement
            out = bound is not None and self.key[0] == 0 and bound.lower_bound(new, groups) / PS >= self.key[1]
            pulled.append((new, groups, out))
        if not pulled:
            return False
        # only a strictly lower cost improves: a schedule stops once it proves more
        limit = self.key[1] * (1.0 + 1e-9) if bound is not None and self.key[0] == 0 else None
        take = [(new, groups) for new, groups, out in pulled if not out]
        results = iter(self.ev.map([(_evaluate, self._sim(i), new, limit, self.delta)
                                    for i, (new, _) in enumerate(take)]))
        best = None
        for new, groups, out in pulled:
            self.screened += out
            k, _ = run.settle(new, results, out)
            if k is not None and _better(k, self.key):
                best, self.key = (new, groups), k
        if best is None:
            return False
        self.cur = best[0]
        if bound is not None:
            bound.lower_bound(*best)
            bound.commit(best[0])
        return True


class _Lookahead:
    """An iterator that says when it has run dry (``done``)."""

    def __init__(self, items):
        self._it = iter(items)
        self.done = False

    def __iter__(self):
        return self

    def __next__(self):
        try:
            return next(self._it)
        except StopIteration:
            self.done = True
            raise


def descend(run: _Run, space: _Space, graph, sims: list, make_sim, ev: Evaluator, delta: bool, seed: int,
            screen: bool = True, levers: Levers | None = None,
            repeats: Repeats | None = None, until: float = 1.0) -> tuple[bool, int]:
    """Local descent from the run's best strategy: single-group changes (groups in a seeded
    order, each group's candidates in rounds) until a pass over every group improves
    nothing; then whole-kind lever moves and aligned repeated blocks; then pair moves (two
    adjacent groups, producer and consumer, to one common config: a change the one-group
    proposals only reach through a worse intermediate strategy); back to single changes
    after one of those improves.  ``sims``: simulators to use (the chains', best first; more
    are made by ``make_sim`` when a round needs them).  Returns True when it converged (no
    single-group or pair change improves: a local optimum), False when the budget ran out
    first; and how many changes the load lower bound settled.  ``until``: the share of the
    budget it may use up to."""
    if run.spent(until, patience=False):
        return False, 0
    d = _Descent(run, sims[:ROUND], make_sim, ev, delta, screen, until)
    order = list(range(len(space.reps)))
    random.Random(seed).shuffle(order)
    pairs = None  # (producer group, consumer group, their common configs): made when first reached

    def singles(gi):
        rep = space.reps[gi]
        base = d.cur[rep]
        # (a head-tail attention keeps its split: it moves with the token layout, strategy.layout)
        cfgs = [levers.carry(gi, c, base) if levers is not None else c for c in space.cands[gi]] \
            if base.degree("z") < 2 else []
        cfgs += list(levers.variants(gi, base)) if levers is not None else []
        for cfg in dict.fromkeys(cfgs):
            if cfg != d.cur[rep]:
                yield d.cur.replace(rep, cfg), (gi,)

    def pair_moves():
        nonlocal pairs
        if pairs is None:
            pairs = _pairs(graph, space)
        for a, b, common in pairs:
            ra, rb = space.reps[a], space.reps[b]
            for cfg in common:
                cur = d.cur
                ca = cfg if levers is None else levers.carry(a, cfg, cur[ra])
                cb = cfg if levers is None else levers.carry(b, cfg, cur[rb])
                if cur[ra] != ca and cur[rb] != cb and cur[ra].degree("z") < 2 and cur[rb].degree("z") < 2:
                    # (else a single-group change, tried; a head-tail attention stays)
                    yield cur.replace(ra, ca).replace(rb, cb), (a, b)

    while True:
        quiet, i = 0, 0  # groups scanned in a row without an improvement
        while quiet < len(order):
            items = _Lookahead(singles(order[i]))
            improved = False
            while not items.done:
                r = d.round(items)
                if r is None:
                    return False, d.screened
                improved |= r
            quiet = 0 if improved else quiet + 1
            i = (i + 1) % len(order)
        # whole-kind lever moves first, then the repeated blocks aligned, then pairs: each
        # made from the current strategy when reached; the first round that moves ends them
        sources = ([lambda: levers.block_moves(d.cur)] if levers is not None else []) + \
            ([lambda: repeats.align_moves(d.cur, levers)] if repeats else []) + [pair_moves]
        items = _Lookahead(itertools.chain.from_iterable(f() for f in sources))
        moved = False
        while not items.done and not moved:
            r = d.round(items)
            if r is None:
                return False, d.screened
            moved = r
        if not moved:
            return True, d.screened


def _pairs(graph: OpGraph, space: _Space) -> list[tuple[int, int, list]]:
    """The descent's pair moves: (producer group, consumer group, the configs both may take)
    for the adjacent groups that share a candidate."""
    out = []
    for a, b in _adjacent_groups(graph, space):
        common = [c for c in space.cands[a] if c in space.index[b]]
        if common:
            out.append((a, b, common))
    return out


def _adjacent_groups(graph: OpGraph, space: _Space) -> list[tuple[int, int]]:
    """(producer group, consumer group) pairs joined by an edge, in graph order."""
    gid = {op: i for i, k in enumerate(space.keys) for op in graph.groups[k]}
    out = {}
    for op in graph.compute_ops:
        for u in op.inputs:
            if u in gid and gid[u] != gid[op.name]:
                out[gid[u], gid[op.name]] = None
    return list(out)


def is_local_optimum(graph: OpGraph, machine, strategy: Strategy, cost_model=None, *,
                     candidates: Candidates | None = None, optimizer: str = "sgd", precision: str = "32-true"):
    """(True, None) when no single share-group change (to any candidate config)
    improves ``strategy``; else (False, (op_name, config, iteration_time_s)), the
    first improving change found.  Feasible beats infeasible; ties do not improve."""
    cm = cost_model if cost_model is not None else _analytic_model(machine, graph)
    space = _Space(graph, machine, candidates)
    sim = _simulator(graph, machine, cm, optimizer, precision=precision)
    res = sim.simulate(strategy, incremental=False)
    scale = res.iteration_time
    key = lambda r: (0 if r.feasible else 1, _penalised(r, machine, scale))
    k0 = key(res)
    for rep, cs in zip(space.reps, space.cands):
        for cfg in cs:
            if cfg == strategy[rep] or strategy[rep].degree("z") > 1:
                continue
            r = sim.simulate(strategy.replace(rep, cfg), incremental=True)
            if _better(key(r), k0):
                return False, (rep, cfg, r.iteration_time)
    return True, None
