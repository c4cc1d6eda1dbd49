"""Delta edits of a :class:`flexflow.sim.taskgraph.TaskGraph`: task allocation that reuses
released ids, killing tasks, replacing predecessor lists (the scheduler's arrays derive the
successors, ``schedcore.py``) and :meth:`patch`, which moves the graph to a strategy that differs in a few share groups and
says which tasks died, changed or were born (the delta simulation in ``simulate.py``)."""
from __future__ import annotations

from .taskkeys import TID_BITS, TID_MASK

__all__ = []


class _Patching:
    """Task allocation and the delta patch; mixed into TaskGraph, whose building blocks
    (``_form_units``, ``_make_unit``, ``_make_edge``, ...) it calls."""

    keep_columns = False  # keep the task columns as lists after hand_over (for checks)

    # ---- task allocation ------------------------------------------------------------------
    def _alloc(self, durs: list, r1s: list, rms: list, prios: list):
        """New task ids for tasks given column-wise (reusing released ids first).

        Once the scheduler's arrays hold the columns (:meth:`hand_over`), a patch only
        records its allocations for them (``take_touched``); the lists are kept up to date
        as well only where ``keep_columns`` is set (the consistency checks of the tests)."""
        n = len(durs)
        if self._bulk is not None:  # building from scratch: the other columns come at the end
            base = len(self.DUR)
            self.DUR += durs
            self.RES1 += r1s
            self.RESM += rms
            self.PRED += [()] * n
            self._bulk += prios
            return range(base, base + n)
        free = self._free
        keep = self.DUR is not None
        if len(free) >= n:
            tids = free[len(free) - n:]
            tids.reverse()
            del free[len(free) - n:]  # (a released id's predecessors are () already: _kill)
            if keep:
                DUR, RES1, RESM, KP, ALIVE = self.DUR, self.RES1, self.RESM, self.KP, self.ALIVE
                for t, d, r1, rm, p in zip(tids, durs, r1s, rms, prios):
                    DUR[t], RES1[t], RESM[t], KP[t] = d, r1, rm, p << TID_BITS | t
                    ALIVE[t] = True
        else:
            base = len(self.PRED)
            if base + n > TID_MASK:
                raise ValueError("too many tasks for the simulator")
            tids = list(range(base, base + n))
            self.PRED += [()] * n
            if keep:
                self.DUR += durs
                self.RES1 += r1s
                self.RESM += rms
                self.KP += [p << TID_BITS | t for p, t in zip(prios, tids)]
                self.ALIVE += [True] * n
        self._born += tids
        ni, nd, nr, nm, npr = self._newcols
        ni += tids
        nd += durs
        nr += r1s
        nm += rms
        npr += prios
        return tids

    def hand_over(self) -> None:
        """The scheduler's arrays now hold the task columns (durations, resources,
        priorities, liveness): the lists are dropped, unless ``keep_columns``."""
        if not self.keep_columns:
            self.DUR = self.RES1 = self.RESM = self.KP = self.ALIVE = None

    def _kill(self, ts) -> None:
        """Mark tasks ``ts`` dead (the scheduler's arrays drop them from their predecessors'
        successors)."""
        PRED = self.PRED
        for t in ts:
            PRED[t] = ()
        if self.ALIVE is not None:
            ALIVE = self.ALIVE
            for t in ts:
                ALIVE[t] = False
        self._dead.extend(ts)
        self._killed.update(ts)
        self._repred.update(ts)  # (their predecessor rows empty)

    def _set_pred(self, t: int, new) -> bool:
        """Replace t's predecessors; True if they changed.  Predecessors may repeat (an op
        reading one tensor twice)."""
        new = tuple(new)
        if self.PRED[t] == new:
            return False
        self.PRED[t] = new
        self._repred.add(t)
        return True

    def take_touched(self) -> tuple[set, set, tuple]:
        """What changed since the last call, for the scheduler's arrays: (ids killed, ids
        whose predecessors changed, the allocations as five lists: ids, durations, single
        resources, routes, priorities)."""
        out = self._killed, self._repred, self._newcols
        self._killed, self._repred, self._newcols = set(), set(), ([], [], [], [], [])
        return out

    def release(self) -> None:
        """After a schedule no longer refers to the dead tasks: reuse their ids."""
        if self._dead:
            # in descending order on top of the stack: the next allocations take these ids
            # back in ascending runs (sorting the whole free list too cost more than it gave)
            self._dead.sort(reverse=True)
            self._free.extend(self._dead)
        self._dead.clear()
        self._born.clear()

    def num_tasks(self) -> int:
        return len(self.PRED) - len(self._free) - len(self._dead)

    # ---- delta ----------------------------------------------------------------------------
    def changed_groups(self, strategy) -> list[int]:
        """Share groups whose config in ``strategy`` differs from the current one."""
        cfg, out = self.cfg, []
        get = getattr(strategy, "_configs", strategy).__getitem__  # (a Strategy's own dict: no Mapping layer)
        for g, (o, name) in enumerate(self.ctx.group_reps):
            new = get(name)
            old = cfg[o]
            if new is not old:
                if new == old:
                    cfg[o] = new  # an equal config: held from now on, so the next test is by identity
                else:
                    out.append(g)
        return out

    def patch(self, strategy, groups: list[int]):
        """Move to ``strategy``, which differs from the current one in ``groups``.

        Returns (dead, dirty, born): killed task ids, surviving tasks whose predecessors
        changed, new task ids."""
        ctx = self.ctx
        unit, members = self.unit, self.members
        co = {o for g in groups for o in ctx.groups[g]}
        for o in co:
            self.cfg[o] = strategy[ctx.ops[o].name]
        self.strategy = strategy
        a0 = set(co)
        for o in co:
            a0.update(ctx.producers[o])
            a0.update(ctx.consumers[o])
        old_units = {}
        for o in a0:
            h = unit[o]
            if h not in old_units:
                old_units[h] = tuple(members[h])
        M = sorted(o for ms in old_units.values() for o in ms)
        self._form_units(M)
        new_heads = {unit[o] for o in M}
        kept = {h for h in new_heads if old_units.get(h) == tuple(members[h])
                and not any(o in co for o in members[h])}
        r_ops = [o for o in M if unit[o] not in kept]
        r_set = set(r_ops)
        edges = set()
        for o in r_ops:
            for j in ctx.ext_inputs[o]:
                edges.add((o, j))
            edges.update(ctx.cons[o])
        readers = ctx.live.readers  # a read shared with a rebuilt edge is rebuilt with it
        for o, j in list(edges):
            edges.update((v, jj) for v, jj in readers[ctx.inputs[o][j]] if jj in ctx.ext_inputs[v])
        clusters = sorted({c for o in r_ops for c in ctx.op_clusters[o]})
        upd_units = {h for h in new_heads if h not in kept}
        upd_units.update(unit[ctx.clusters[c][0][0]] for c in clusters)
        # kill what the change touches
        kill = []
        for o, j in edges:
            rec = self.EDGES[o][j]
            if rec and not self.ESHARE[o][j]:
                for _, _, xf, xb in rec:
                    if xf >= 0:
                        kill.append(xf)
                        kill.append(xb)
        for h in old_units:
            if h not in kept:
                kill += self.FT[h]
                kill += self.BT[h]
                kill += self.UPDT[h].values()
                self.UPDT[h] = {}
        for h in upd_units:
            if self.UPDT[h]:
                kill += self.UPDT[h].values()
        for c in clusters:
            kill += self.SYNCT[c]
        self._kill(kill)
        for h in old_units:  # heads that are no longer heads
            if unit[h] != h:
                self.UPDT[h] = {}
                self._set_ubusy(h, 0)
        # rebuild
        for h in sorted(new_heads - kept):
            self._make_unit(h)
        for o, j in sorted(edges):
            self._make_edge(o, j, True)
        for c in clusters:
            self._make_syncs(c, True)
        for h in sorted(upd_units):
            self._make_updates(h, True)
        pf = set(new_heads)
        pf.update(unit[o] for o, _ in edges)
        pb = set(new_heads)
        pb.update(unit[ctx.inputs[o][j]] for o, j in edges)
        # the users of a rebuilt cluster wait for its new gather tasks (or no longer any)
        gh = {unit[o] for c in clusters for o in ctx.clusters[c][0]}
        pf.update(gh)
        pb.update(gh)
        born = set(self._born)
        dirty = []
        PRED, repred = self.PRED, self._repred
        for h in pf:
            for t, p in zip(self.FT[h], self._f_preds(h)):
                if PRED[t] != p:  # (_set_pred, inline)
                    PRED[t] = p
                    repred.add(t)
                    if t not in born:
                        dirty.append(t)
        for h in pb:
            for t, p in zip(self.BT[h], self._b_preds(h)):
                if PRED[t] != p:
                    PRED[t] = p
                    repred.add(t)
                    if t not in born:
                        dirty.append(t)
        for o in r_set.union(o for o, _ in edges):
            self._rows(o)
        live, cfg = ctx.live, self.cfg
        for o in sorted({x for v in co for x in live.dependents[v]}):
            if not ctx.everywhere[o]:
                self._set_events(self.MEV, o, live.op_events(o, cfg))
        return list(self._dead), dirty, list(self._born)

    def validate(self) -> None:
        """Consistency of the task lists (for tests): dead tasks have no predecessors and no
        live task refers to a dead one."""
        if self.ALIVE is None:
            raise ValueError("validate() needs a task graph that keeps its columns (keep_columns)")
        for t, preds in enumerate(self.PRED):
            if not self.ALIVE[t]:
                assert not preds, t
                continue
            for p in preds:
                assert self.ALIVE[p], (t, p)
