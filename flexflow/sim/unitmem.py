"""Memory events of the executor's gather units (shard levels 1-3), a mixin of
:class:`flexflow.sim.memory.Liveness`: what a unit's all-gathers and reduce-scatter hold and
when, as :mod:`flexflow.runtime.shard` and :mod:`flexflow.runtime.sync` run them.  The units
are the shard groups of :mod:`flexflow.strategy.units` (the executor forms the same ones);
a group's events are a function of its clusters' plans alone, so a delta simulation patches
them with those plans and agrees with a full one."""
from __future__ import annotations

import itertools

import numpy as np

__all__ = ["UnitEvents"]


class UnitEvents:
    """Reads the Liveness's ``ctx``, ``n``, ``update_pos`` and ``_gev`` (its cache).  The
    events of a group depend on its clusters' plans and, through :meth:`neighbours`, on
    which other groups are sharded; a task graph recomputes every group's events when
    that changes."""

    @property
    def _none(self):
        return np.zeros(0, np.int64), np.zeros((0, self.ctx.D), np.int64)

    def group_status(self, g: int, plans):
        """(first user, last user, highest level) of shard group g's sharded clusters under
        ``plans``; None where it has none."""
        ctx = self.ctx
        cs = [c for c in ctx.sgroup_clusters[g] if plans[c].level and plans[c].nreg.any()]
        if not cs:
            return None
        return (min(ctx.clusters[c][0][0] for c in cs), max(ctx.clusters[c][0][-1] for c in cs),
                max(plans[c].level for c in cs))

    def neighbours(self, status: list) -> list:
        """Per shard group (``status``: :meth:`group_status` of every group), where the
        executor's order of the sharded units puts its events: (the first use of the
        sharded group before it, where its forward gather is launched, 0 for the first;
        the last forward use of the level-3 group whose backward comes just before it,
        where its backward gather is launched, -1 for none; the backward position of the
        reduce-scatter two after its own, where its reduce-scatter is drained)."""
        end = 2 * self.n - 1
        act = sorted((s[0], g) for g, s in enumerate(status) if s)
        prev_first = {g1: f0 for (f0, _), (_, g1) in itertools.pairwise(act)}
        l3 = sorted(((s[1], g) for g, s in enumerate(status) if s and s[2] >= 3), reverse=True)
        prev_last = {g1: l0 for (l0, _), (_, g1) in itertools.pairwise(l3)}
        rs = sorted(((s[0], g) for g, s in enumerate(status) if s and s[2] >= 2), reverse=True)
        drain = {g: end - rs[i + 2][0] for i, (_, g) in enumerate(rs[:-2])}
        return [(prev_first.get(g, 0), prev_last.get(g, -1), drain.get(g, end)) if s else None
                for g, s in enumerate(status)]

    def group_events(self, g: int, plans, nb) -> tuple:
        """Events of shard group g (``nb``: its entry of :meth:`neighbours`), cached."""
        if nb is None:
            return self._none
        key = (g, nb) + tuple(id(plans[c]) for c in self.ctx.sgroup_clusters[g])
        ev = self._gev.get(key)
        if ev is None:
            ev = self._gev[key] = self._group_events(g, plans, nb)
        return ev

    def _group_events(self, g: int, plans, nb) -> tuple:
        """Events of shard group g's gather units (one per shard level among its clusters'
        plans, ``plans``: cluster -> plan), as the executor runs them
        (:mod:`flexflow.runtime.shard`, :mod:`flexflow.runtime.sync`):

        - every forward (levels 1-3) the unit is all-gathered: a send buffer of the slices
          and, where the unit has more than one region or a padded slice, a receive buffer
          of the full unit (else the gather lands in the region itself), from where the
          gather is prefetched (the first use of the sharded group before) to the unit's
          first use;
        - level 3: the full parameters from the gather to the last forward use, and again
          from the backward gather (prefetched at the backward of the level-3 group read
          just after in the forward) to the reduce-scatter;
        - levels 2-3: the full gradients autograd makes, from each cluster's last user's
          backward to the reduce-scatter at the unit's first user's backward; the
          reduce-scatter's input (the gradients laid out rank-major: a copy where the unit
          has several regions or a padded slice, else the gradient itself) until it is
          drained, two reduce-scatters later (of any group); the slices it yields (the gradients the
          optimizer reads) from there to the update."""
        ctx, n = self.ctx, self.n
        pos, rows = [], []

        def live(a, b, row):
            if row.any():
                pos.extend((a, b + 1))
                rows.extend((row, -row))

        members = ctx.sgroup_clusters[g]
        for level in (1, 2, 3):
            cs = [c for c in members if plans[c].level == level and plans[c].nreg.any()]
            if not cs:
                continue
            first = min(ctx.clusters[c][0][0] for c in cs)
            last = max(ctx.clusters[c][0][-1] for c in cs)
            full = sum(plans[c].fval for c in cs)
            send = sum(plans[c].slg for c in cs)
            copy = (sum(plans[c].nreg for c in cs) > 1) | np.logical_or.reduce([plans[c].padded for c in cs])
            recv = np.where(copy, full, 0)
            lf = min(nb[0], first)
            live(lf, first, send + recv)
            b = 2 * n - 1 - first
            if level >= 3:
                live(lf, last, full - recv)  # straight into the regions: from the launch
                live(first, last, recv)
                lb = 2 * n - 1 - max(nb[1], last)
                live(lb, 2 * n - 1 - last, send + recv)
                live(lb, b, full - recv)
                live(2 * n - 1 - last, b, recv)
            if level >= 2:
                for c in cs:
                    live(2 * n - 1 - max(ctx.clusters[c][0]), b, plans[c].fgrad)
                grads = sum(plans[c].fgrad for c in cs)
                drain = max(nb[2], b)
                live(b, drain, np.where(copy, grads, 0))
                if drain > b:
                    live(b + 1, drain, np.where(copy, 0, grads))
                live(b, self.update_pos, sum(plans[c].sl for c in cs))
        if not pos:
            return np.zeros(0, np.int64), np.zeros((0, ctx.D), np.int64)
        return np.array(pos, np.int64), np.stack(rows)

