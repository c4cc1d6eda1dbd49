"""The regions of every partition of an op as integer arrays, for many configs of the op
at a cost that grows with the sum of the degrees rather than their product.

A rule that declares itself separable (``Rule.separable``) promises that in the regions it
returns (each input's, each parameter's; the output's always qualify), every axis, and
whether an input is read at all, depends on the range of at most one parallel dim.  The
regions of partition (i_1, ..., i_m) of a config that splits dims d_1..d_m then follow from
*sweeps*, the regions with one dim split at a time: an axis that d_j's sweep moves (from
its range in the whole op) takes its range from that sweep at i_j, every other axis its
range in the whole op.  :class:`OpBoxes` assembles them that way, as (P, 2, rank) arrays of
[start, stop) per axis in partition order, and names the first partition of each distinct
combination of region shapes (so of each cost-model key) of a config.

A config whose sweeps move one axis, or one input's presence, by two dims gets None, as
do all configs of rules that do not declare themselves separable: callers then enumerate
:func:`~flexflow.strategy.regions.partitions`, which stays the one definition (the tests
check, for every op of the zoo, that the assembly equals it).  Replicated configs (every
partition the whole op) are assembled for every rule.
"""
from __future__ import annotations

import itertools
import math

import numpy as np

from ..graph.ir import Op
from ..graph.ops import RULES
from ..graph.ops.base import out_region
from .config import REPLICA, ParallelConfig
from .regions import Partition, block_ranges, partition_at, partitions, split_dims, validate_config

__all__ = ["OpBoxes", "region_array"]


def region_array(regions, rank: int) -> np.ndarray:
    """(P, 2, rank) int64 array of [start, stop) per axis of each region; None -> all zeros."""
    a = np.zeros((len(regions), 2, rank), dtype=np.int64)
    for k, r in enumerate(regions):
        if r is not None:
            a[k, 0] = [s.start for s in r]
            a[k, 1] = [s.stop for s in r]
    return a


class _Layout:
    """An op's regions (0: the output, 1..: the inputs, then parameters and buffers in the
    order the rule returns them) flattened into one row of ints: per region its starts,
    then its stops (zeros where absent)."""

    def __init__(self, op: Op, rule):
        ins, ps = rule.regions(op, {})
        self.n_in, self.names = len(ins), list(ps)
        regs = [out_region(op, {}), *ins, *(ps[n] for n in self.names)]
        self.ranks = [None if r is None else len(r) for r in regs]
        self.offsets, col_region = [], []
        at = 0
        for r, rank in enumerate(self.ranks):
            self.offsets.append(at)
            at += 2 * (rank or 0)
            col_region += [r] * (2 * (rank or 0))
        self.width = at
        self.col_region = np.array(col_region, dtype=np.int64)
        # the start and stop columns of every axis, axes numbered across regions
        self.starts = np.array([self.offsets[r] + a for r, rank in enumerate(self.ranks)
                                for a in range(rank or 0)], dtype=np.int64)
        self.stops = np.array([self.offsets[r] + rank + a for r, rank in enumerate(self.ranks)
                               for a in range(rank or 0)], dtype=np.int64)
        self.base_present = np.array([r is not None for r in regs])
        self.base = np.array(self.flat(regs), dtype=np.int64)

    def flat(self, regs) -> list:
        row = []
        for x, rank in zip(regs, self.ranks):
            if rank is None:
                continue
            if x is None:
                row += [0] * (2 * rank)
            else:
                row += [s.start for s in x]
                row += [s.stop for s in x]
        return row


class _Sweep:
    """The op's regions with dim ``d`` alone split ``k`` ways: rows (k, width), presence
    (k, regions), which axes and which regions' presence move from the whole op's, and the
    first block of each class of blocks alike in those moving lengths and presences."""

    def __init__(self, op: Op, rule, lay: _Layout, d, k):
        self.ok = True
        rows, pres = [], []
        for a, b in block_ranges(d.size, k, d.unit):
            block = {d.name: (a, b)}
            ins, ps = rule.regions(op, block)
            if len(ins) != lay.n_in or list(ps) != lay.names:
                self.ok = False
                return
            regs = [out_region(op, block), *ins, *(ps[n] for n in lay.names)]
            if any(x is not None and (rank is None or len(x) != rank) for x, rank in zip(regs, lay.ranks)):
                self.ok = False  # an input needed that the whole op does without, or a rank changed
                return
            rows.append(lay.flat(regs))
            pres.append([x is not None for x in regs])
        self.rows = np.array(rows, dtype=np.int64).reshape(k, lay.width)
        self.present = np.array(pres, dtype=bool).reshape(k, len(lay.ranks))
        moved_col = ((self.rows != lay.base) & self.present[:, lay.col_region]).any(0)
        moves = moved_col[lay.starts] | moved_col[lay.stops]  # per axis
        pmoves = ~self.present.all(0) & lay.base_present  # per region
        self.moves = sum(1 << a for a in np.flatnonzero(moves).tolist())  # as bit masks
        self.pmoves = sum(1 << r for r in np.flatnonzero(pmoves).tolist())
        # each row's change from the whole op's (zero where absent): assembling adds these
        self.delta = (self.rows - lay.base) * self.present[:, lay.col_region]
        lengths = (self.rows[:, lay.stops] - self.rows[:, lay.starts])[:, moves]
        sig = np.concatenate([lengths, self.present[:, pmoves]], axis=1).astype(np.int64)
        firsts: dict = {}
        for i, row in enumerate(sig.tolist()):
            firsts.setdefault(tuple(row), i)
        self.firsts = list(firsts.values())


class _Plan:
    """A config's assembly: its split dims' sweeps (``ok``: no axis, and no region's
    presence, moved by two of them) and the first partition of each combination of the
    sweeps' classes (the first of each distinct combination of region shapes), in order."""

    def __init__(self, sweeps, ks):
        self.sweeps, self.ks = sweeps, ks
        self.ok, seen, pseen = True, 0, 0
        for s in sweeps:
            if s.moves & seen or s.pmoves & pseen:
                self.ok = False
            seen, pseen = seen | s.moves, pseen | s.pmoves
        strides = [math.prod(ks[j + 1:]) for j in range(len(ks))]
        self.firsts = sorted(sum(i * st for i, st in zip(combo, strides))
                             for combo in itertools.product(*(s.firsts for s in sweeps)))


class OpBoxes:
    """Partition regions of ``op`` (and of every op with the same rule, shapes and attrs)
    as arrays, config by config; sweeps and plans are kept for the op's other configs.

    Regions are numbered: 0 the output, 1.. the inputs, then the parameters and buffers in
    the order the rule returns them (``param_index``)."""

    def __init__(self, op: Op):
        self.op = op
        self.rule = RULES[op.rule]
        self.layout = lay = _Layout(op, self.rule)
        self.param_index = {n: 1 + lay.n_in + i for i, n in enumerate(lay.names)}
        self._sweeps: dict = {}
        self._plans: dict = {}

    def _sweep(self, d, k):
        key = (d.name, k)
        hit = self._sweeps.get(key)
        if hit is None:
            hit = self._sweeps[key] = _Sweep(self.op, self.rule, self.layout, d, k)
        return hit

    def plan(self, config: ParallelConfig):
        """The assembly of ``config`` ("replica" for a replicated one; None: enumerate the
        partitions instead)."""
        key = config._degrees
        if key in self._plans:
            return self._plans[key]
        degs = config.degrees
        plan = None
        if REPLICA in degs:
            plan = "replica"
        elif self.rule.separable:
            validate_config(self.op, config)
            split = split_dims(self.op, config)
            ks = [degs[d.name] for d in split]
            sweeps = [self._sweep(d, k) for d, k in zip(split, ks)]
            if all(s.ok for s in sweeps):
                plan = _Plan(sweeps, ks)
                plan = plan if plan.ok else None
        self._plans[key] = plan
        return plan

    def firsts(self, config: ParallelConfig) -> list[Partition] | None:
        """The first partition of each distinct combination of region shapes under
        ``config`` (the :class:`Partition` objects ``partitions`` builds), in partition
        order; None when ``config`` has no assembly."""
        plan = self.plan(config)
        if plan is None:
            return None
        if plan == "replica":
            return [partitions(self.op, config)[0]]
        return [partition_at(self.op, config, i, check=False) for i in plan.firsts]

    def boxes(self, config: ParallelConfig, r: int, rank: int | None = None):
        """(P, 2, rank) array of region ``r`` of every partition, as :func:`region_array`
        makes from ``partitions`` (``rank`` for a region absent everywhere); None when
        ``config`` has no assembly."""
        plan = self.plan(config)
        if plan is None:
            return None
        lay = self.layout
        P = config.num_partitions
        rk = lay.ranks[r]
        if rk is None:
            return np.zeros((P, 2, rank or 0), dtype=np.int64)
        cols = slice(lay.offsets[r], lay.offsets[r] + 2 * rk)
        base = lay.base[cols]
        if plan == "replica":
            return np.broadcast_to(base.reshape(2, rk), (P, 2, rk)).copy()
        # each axis moved by at most one sweep: the whole op's ranges plus each sweep's
        # change, broadcast along its dim
        ks = tuple(plan.ks)
        m = len(ks)
        arr = base
        for j, sw in enumerate(plan.sweeps):
            shape = [1] * m + [2 * rk]
            shape[j] = ks[j]
            arr = arr + sw.delta[:, cols].reshape(shape)
        arr = np.broadcast_to(arr, ks + (2 * rk,))
        for j, sw in enumerate(plan.sweeps):
            if sw.pmoves >> r & 1:
                shape = [1] * m + [1]
                shape[j] = ks[j]
                arr = arr * sw.present[:, r].reshape(shape)
        return np.ascontiguousarray(arr).reshape(P, 2, rk)
