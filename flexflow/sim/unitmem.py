"""Memory events of the executor's gather units (shard levels 1-3), a mixin of
:class:`flexflow.sim.memory.Liveness`: what a unit's all-gathers and reduce-scatter hold and
when, as :mod:`flexflow.runtime.shard` and :mod:`flexflow.runtime.sync` run them.  The units
are the shard groups of :mod:`flexflow.strategy.units` (the executor forms the same ones);
a group's events are a function of its clusters' plans alone, so a delta simulation patches
them with those plans and agrees with a full one."""
from __future__ import annotations

import numpy as np

__all__ = ["UnitEvents"]


class UnitEvents:
    """Reads the Liveness's ``ctx``, ``n``, ``update_pos`` and ``_gev`` (its cache)."""

    def group_events(self, g: int, plans) -> tuple:
        key = (g,) + tuple(id(plans[c]) for c in self.ctx.sgroup_clusters[g])
        ev = self._gev.get(key)
        if ev is None:
            ev = self._gev[key] = self._group_events(g, plans)
        return ev

    def _group_events(self, g: int, plans) -> tuple:
        """Events of shard group g's gather units (one per shard level among its clusters'
        plans, ``plans``: cluster -> plan), as the executor runs them
        (:mod:`flexflow.runtime.shard`, :mod:`flexflow.runtime.sync`):

        - every forward (levels 1-3) the unit is all-gathered: a send buffer of the slices
          and, where the unit has more than one region or a padded slice, a receive buffer
          of the full unit (else the gather lands in the region itself), from where the
          gather is prefetched (the first use of the group before) to the unit's first use;
        - level 3: the full parameters from the gather to the last forward use, and again
          from the backward gather (prefetched at the backward of the group read just
          after in the forward) to the reduce-scatter;
        - levels 2-3: the full gradients autograd makes, from each cluster's last user's
          backward to the reduce-scatter at the unit's first user's backward; the
          reduce-scatter's input (the gradients laid out rank-major: a copy where the unit
          has several regions or a padded slice, else the gradient itself) until it is
          drained, two reduce-scatters later; the slices it yields (the gradients the
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
            lf = min(ctx.sgroup_prefetch_f[g], first)
            live(lf, first, send + recv)
            b = 2 * n - 1 - first
            if level >= 3:
                live(lf, last, full - recv)  # straight into the regions: from the launch
                live(first, last, recv)
                lb = 2 * n - 1 - max(ctx.sgroup_prefetch_b[g], last)
                live(lb, 2 * n - 1 - last, send + recv)
                live(lb, b, full - recv)
                live(2 * n - 1 - last, b, recv)
            if level >= 2:
                for c in cs:
                    live(2 * n - 1 - max(ctx.clusters[c][0]), b, plans[c].fgrad)
                grads = sum(plans[c].fgrad for c in cs)
                drain = max(ctx.sgroup_drain[g], b)
                live(b, drain, np.where(copy, grads, 0))
                if drain > b:
                    live(b + 1, drain, np.where(copy, 0, grads))
                live(b, self.update_pos, sum(plans[c].sl for c in cs))
        if not pos:
            return np.zeros(0, np.int64), np.zeros((0, ctx.D), np.int64)
        return np.array(pos, np.int64), np.stack(rows)

