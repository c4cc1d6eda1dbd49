"""A cheap lower bound on a strategy's simulated iteration time, kept incrementally.

Every device and every link runs one task at a time in the simulator, so an iteration lasts
at least as long as the busiest resource is busy: for each resource, the sum of the durations
of its tasks (forward and backward partitions, transfers on every link of their routes, ring
all-reduces on their links, optimizer updates), plus, under ``sync="ps"``, the parameter-server
time added after the task graph.  Each term comes from the same cached integer plans the task
graph is built from (:mod:`flexflow.sim.plans`), so the bound never exceeds the simulated time.

:class:`LoadBound` keeps the per-op and per-cluster rows of one strategy; ``lower_bound`` of a
strategy that differs in a few share groups touches only their ops, their consumers and their
parameter clusters.  The search uses it to reject, without simulating, proposals the
acceptance test would reject anyway (see ``search/mcmc.py``)."""
from __future__ import annotations

import numpy as np

__all__ = ["LoadBound"]


class _Cfg:
    """Op index -> config of a strategy with a few ops overridden (for ``cluster_plan``)."""
    __slots__ = ("base", "over")

    def __init__(self, base: list, over: dict):
        self.base, self.over = base, over

    def __getitem__(self, o: int):
        c = self.over.get(o)
        return self.base[o] if c is None else c


def _count(diff: dict, row, k: int) -> None:
    e = diff.get(id(row))
    if e is None:
        diff[id(row)] = [row, k]
    else:
        e[1] += k


class LoadBound:
    """Per-resource busy picoseconds of a strategy, kept per op (its partitions and the
    transfers on its input edges) and per parameter cluster (syncs, update lower bound)."""

    def __init__(self, ctx, strategy):
        self.ctx = ctx
        ops = ctx.ops
        # rows shared by every bound of this context: an op's row depends only on its kind,
        # its config and its producers' (kinds, configs), so the unrolled steps of a recurrent
        # layer (and the repeated blocks of a deep net) share their rows
        self._rows = ctx.__dict__.setdefault("_load_rows", {})
        self._clrows = ctx.__dict__.setdefault("_load_cluster_rows", {})
        self.cfg = [None] * len(ops)
        for o in ctx.compute:
            self.cfg[o] = strategy[ops[o].name]
        self.oprow = [None] * len(ops)
        self.total = np.zeros(ctx.R, np.int64)
        for o in ctx.compute:
            r = self.oprow[o] = self._op_row(o, self.cfg)
            self.total += r
        self.clrow, self.clps = [], []
        for c in range(len(ctx.clusters)):
            r, p = self._cl_row(c, self.cfg)
            self.clrow.append(r)
            self.clps.append(p)
            self.total += r
        self.ps = int(sum(self.clps))
        self._pending = None

    def _op_row(self, o: int, cfg):
        """Op o's busy row (shared: never modified)."""
        ctx = self.ctx
        co = cfg[o]
        ins, kind = ctx.inputs[o], ctx.kind
        key = (kind[o], co, tuple([(j, kind[ins[j]], cfg[ins[j]]) for j in ctx.ext_inputs[o]]))
        row = self._rows.get(key)
        if row is not None:
            return row
        row = ctx.template(o, co).busy
        for j in ctx.ext_inputs[o]:
            u = ins[j]
            e = ctx.edge_plan(u, o, j, cfg[u], co)
            # (a read several ops may share has one set of transfers in the task graph, which
            # depends on the other readers' configs: left out, the bound stays a bound)
            if e.comm and not ctx.live.readers[u]:
                row = row + e.busy
        self._rows[key] = row
        return row

    def _cl_row(self, c: int, cfg):
        """(busy row, parameter-server picoseconds) of cluster c (the row shared: never modified)."""
        cp = self.ctx.cluster_plan(c, cfg)
        hit = self._clrows.get(id(cp))
        if hit is None or hit[0] is not cp:
            row = cp.busy.copy()
            row[:self.ctx.D] += cp.upd_lb
            hit = self._clrows[id(cp)] = (cp, row, int(cp.ps_ps))
        return hit[1], hit[2]

    def value(self) -> int:
        """The bound of the current strategy, in picoseconds."""
        return int(self.total.max(initial=0)) + self.ps

    def lower_bound(self, strategy, groups) -> int:
        """The bound (picoseconds) of ``strategy``, which differs from the current one only in
        share ``groups``; remembered for :meth:`commit`."""
        ctx = self.ctx
        ops = ctx.ops
        get = getattr(strategy, "_configs", strategy).__getitem__  # (a Strategy's own dict)
        over = {}
        for g in groups:
            for o in ctx.groups[g]:
                over[o] = get(ops[o].name)
        cfg = _Cfg(self.cfg, over)
        touched = set(over)
        for o in over:
            touched.update(ctx.consumers[o])
        # the change of the total, as (row, net count) per distinct row: ops that share a
        # row (a recurrent layer's steps) cost one addition together
        diff = {}
        rows = {}
        oprow = self.oprow
        for o in touched:
            r = rows[o] = self._op_row(o, cfg)
            old = oprow[o]
            if r is not old:
                _count(diff, r, 1)
                _count(diff, old, -1)
        cls = {c for g in groups for c in ctx.group_clusters[g]}
        crow = {}
        ps = self.ps
        for c in cls:
            r, p = crow[c] = self._cl_row(c, cfg)
            if r is not self.clrow[c]:
                _count(diff, r, 1)
                _count(diff, self.clrow[c], -1)
            ps += p - self.clps[c]
        total = self.total.copy()
        for r, k in diff.values():
            if k == 1:
                total += r
            elif k == -1:
                total -= r
            elif k:
                total += k * r
        self._pending = (strategy, over, rows, crow, total, ps)
        return int(total.max(initial=0)) + ps

    def commit(self, strategy) -> None:
        """Move to ``strategy``, the one the last :meth:`lower_bound` call was about."""
        p = self._pending
        if p is None or p[0] is not strategy:
            raise ValueError("commit() must follow lower_bound() of the same strategy")
        _, over, rows, crow, self.total, self.ps = p
        for o, c in over.items():
            self.cfg[o] = c
        for o, r in rows.items():
            self.oprow[o] = r
        for c, (r, q) in crow.items():
            self.clrow[c], self.clps[c] = r, q
        self._pending = None
