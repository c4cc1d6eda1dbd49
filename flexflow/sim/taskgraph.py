"""Task graph: an OpGraph under a Strategy, timed by a CostModel, as tasks on devices and links.

Tasks (the paper's task graph, section 5):

- ``fwd`` / ``bwd``: one of each per partition of every placed op, on the partition's device.
  Chains of ops with the same config where each partition only reads the matching partition of
  the previous op (conv -> batch_norm -> relu under the same split) are fused into one unit:
  one fwd and one bwd task per partition, the members' times summed.
- ``xfer`` / ``xfer-grad``: for every (producer partition q, consumer partition k) on different
  devices whose regions overlap, the overlap (``overlap(k.inputs[i], q.output)`` elements x the
  producer's dtype bytes) moves q -> k after q's forward and before k's; its gradient moves
  back k -> q between the two backwards.  Partial producers send their overlap too (the
  consumer adds the partials).  A transfer holds every link of ``machine.route`` at once for
  ``machine.transfer_time_s``.
- ``sync``: per trainable parameter shard (``param_placement``) held by more than one device, a
  ring all-reduce among exactly its devices once every backward using it on them is done; it
  holds the ring's links (``machine.allreduce_links``) for ``machine.allreduce_time_s`` and
  overlaps the remaining backward work.  With ``sync="ps"`` (the paper's runtime, for
  side-by-side figures only) the sync task takes no time and each replicated gradient costs a
  transfer from every other replica to the first and one back, after the task graph.
- ``gather``: at a shard level, per parameter cluster and group of replicas, the parameters'
  all-gather (the gather dtype's bytes, half a ring all-reduce) on the sync's links, before
  the users' forward tasks there, with no predecessor (the executor prefetches it); at level
  3 another before their backward tasks, after their forward.  The sync task then keeps the
  reduce-scatter.
- ``update``: per unit and device, the optimizer update of the trainable shards whose
  parameters the unit uses first (memory bound: the optimizer's ``UPDATE_TRAFFIC`` x bytes / memory
  bandwidth + one launch per shard), after their syncs (or their last backward when unsynced).

Memory: every op and parameter cluster adds allocation/free events to ``MEMDIFF`` (positions x
devices; see ``memory.py``); ``memory_peak()`` is the per-device peak.

Same-device producer/consumer pairs are plain dependencies; a backward that nothing flows back
into follows its own forward.  ``op.everywhere`` ops (graph inputs, constants) have no tasks.
Regions come only from :func:`flexflow.strategy.partitions` and
:func:`flexflow.strategy.param_placement`.

Times are integer picoseconds, so sums are exact and a delta simulation reproduces a full one
bit for bit.  Tasks live in flat lists indexed by task id; every task has a canonical priority
(op index, kind, input, partitions) that breaks ties the same way however the graph was built.
:meth:`TaskGraph.patch` edits the graph in place for a strategy that differs in a few ops and
says which tasks died, changed or were born (the delta simulation in ``simulate.py``).

Modules: ``taskkeys.py`` (kinds, priorities, picoseconds), ``plans.py`` (the cached per-config
plans of a :class:`Context`), ``taskpatch.py`` (task allocation and the delta patch), this one
(building the task arrays).
"""
from __future__ import annotations

import numpy as np

from ..strategy.regions import partitions
from .plans import Context
from .schedcore import prefix_peak
from .taskkeys import GATHER, KIND_NAMES, PS, SYNC_MODELS, TID_BITS, TID_MASK, _prio, decode_prio
from .taskpatch import _Patching

__all__ = ["Context", "TaskGraph", "PS", "KIND_NAMES", "SYNC_MODELS", "decode_prio"]


class TaskGraph(_Patching):
    """Flat task arrays for one strategy; :meth:`patch` moves it to a nearby strategy.

    Ops are grouped into units: a chain u -> v fuses when v reads only u (one input edge
    besides graph inputs), u feeds only v, both have the same config and every partition of v
    reads exactly the output of u's partition with the same index on the same device.  A
    unit has one fwd and one bwd task per partition (the members' times summed); only its
    head has input edges and only its tail has output edges."""

    def __init__(self, ctx: Context, strategy):
        self.ctx = ctx
        n, nc = len(ctx.ops), len(ctx.clusters)
        # task arrays (index = task id)
        self.DUR: list[int] = []
        self.RES1: list[int] = []      # the single resource, or -1
        self.RESM: list = []           # tuple of resources when several (inter-node, ring)
        self.KP: list[int] = []        # prio << TID_BITS | tid
        self.PRED: list = []
        self.ALIVE: list[bool] = []
        # what changed since the scheduler's arrays last mirrored the lists (take_touched)
        self._killed: set = set()
        self._repred: set = set()
        self._newcols = ([], [], [], [], [])  # ids, durations, single resources, routes, priorities
        self._free: list[int] = []
        self._born: list[int] = []
        self._dead: list[int] = []
        self.cfg = [None] * n
        self.unit = [-1] * n       # op -> head op of its unit
        self.members = [None] * n  # head -> member ops in order
        self.tmpl = [None] * n
        self.FT = [None] * n       # op -> fwd task per partition (shared by a unit's members)
        self.BT = [None] * n
        self.EDGES = [None] * n    # o -> per input j: [(q, k, xf, xb)] for unit-external edges, else None
        self.EPLAN = [None] * n
        self.ESHARE = [None] * n   # o -> per input j: its transfers are another reader's (shared read)
        self.SYNCT = [None] * nc   # cluster -> sync task per plan entry, then its gather tasks
        self.GATH = [({}, {})] * nc  # cluster -> (device -> forward gather task, -> backward gather task)
        self.CPLAN = [None] * nc
        self.UPDT = [None] * n     # head -> {device: tid}
        D, R = ctx.D, ctx.R
        self.OPBUSY = np.zeros((n, R), np.int64)
        self.OPCOMM = np.zeros(n, np.int64)
        self.UBUSY = np.zeros((n, D), np.int64)  # update tasks, per unit head
        self.CLMAXSH = np.zeros((nc, D), np.int64)  # largest trainable shard per cluster
        self.CLTRAIN = np.zeros((nc, D), np.int64)  # trainable bytes per cluster
        # memory by liveness: allocations (+) and frees (-) per position and device
        self.MEMDIFF = np.zeros((ctx.live.npos, D), np.int64)
        self.MEMDIFF[0] += ctx.live.input_bytes  # the global inputs, on every rank the whole step
        self.MEMDIFF[-1] -= ctx.live.input_bytes
        self.MEV = [None] * n      # op -> its memory events (positions, rows)
        self.CEV = [None] * nc     # cluster -> its memory events
        self.GEV = [None] * len(ctx.sgroup_clusters)  # shard group -> its gather units' events
        self.CLBUSY = np.zeros((nc, R), np.int64)
        self.CLSYNC = np.zeros(nc, np.int64)
        self.CLPS = np.zeros(nc, np.int64)  # parameter-server sync picoseconds (sync="ps")
        # running column sums of the rows above (a delta patch adds each changed row's
        # difference, so a result needs no sum over every op): ops' busy time per resource,
        # clusters' busy time, update tasks' per device, activation and sync bytes
        self.OPSUM = np.zeros(R, np.int64)
        self.CLSUM = np.zeros(R, np.int64)
        self.USUM = np.zeros(D, np.int64)
        self.comm_sum = self.sync_sum = 0
        self.strategy = strategy
        comp = ctx.compute
        ops = ctx.ops
        self._bulk = []  # priorities of the tasks allocated so far
        for o in comp:
            self.cfg[o] = strategy[ops[o].name]
        self._form_units(comp)
        heads = [o for o in comp if self.unit[o] == o]
        for h in heads:
            self._make_unit(h)
        for o in comp:
            self.EDGES[o] = [None] * len(ctx.inputs[o])
            self.EPLAN[o] = [None] * len(ctx.inputs[o])
            self.ESHARE[o] = [False] * len(ctx.inputs[o])
            for j in ctx.ext_inputs[o]:
                self._make_edge(o, j, False)
        for c in range(nc):
            self._make_syncs(c, False)
        if nc:
            cps = self.CPLAN
            self.CLMAXSH[:] = np.stack([cp.maxshard for cp in cps])
            self.CLTRAIN[:] = np.stack([cp.grad for cp in cps])
            self.CLBUSY[:] = np.stack([cp.busy for cp in cps])
            self.CLSYNC[:] = [cp.sync_bytes for cp in cps]
            self.CLPS[:] = [cp.ps_ps for cp in cps]
        for h in heads:
            self._make_updates(h, False)
        nt = len(self.DUR)
        if nt > TID_MASK:
            raise ValueError("too many tasks for the simulator")
        self.KP = [p << TID_BITS | t for t, p in enumerate(self._bulk)]
        self._bulk = None
        self.ALIVE = [True] * nt
        PRED = self.PRED
        for h in heads:
            for t, p in zip(self.FT[h], self._f_preds(h)):
                PRED[t] = p
            for t, p in zip(self.BT[h], self._b_preds(h)):
                PRED[t] = p
        if comp:
            rows = [self._row(o) for o in comp]
            self.OPBUSY[comp] = np.stack([r[0] for r in rows])
            self.OPCOMM[comp] = [r[1] for r in rows]
        live, cfg = ctx.live, self.cfg
        evs = [live.op_events(o, cfg) for o in comp]
        evs += [live.cluster_events(c, self.CPLAN[c]) for c in range(nc)]
        self.GSTAT = [live.group_status(g, self.CPLAN) for g in range(len(self.GEV))]
        self.GNB = live.neighbours(self.GSTAT)
        evs += [live.group_events(g, self.CPLAN, nb) for g, nb in enumerate(self.GNB)]
        for o, ev in zip(comp, evs):
            self.MEV[o] = ev
        for c in range(nc):
            self.CEV[c] = evs[len(comp) + c]
        for g in range(len(self.GEV)):
            self.GEV[g] = evs[len(comp) + nc + g]
        if evs:
            np.add.at(self.MEMDIFF, np.concatenate([e[0] for e in evs]), np.concatenate([e[1] for e in evs]))
        self.OPSUM[:] = self.OPBUSY.sum(0)
        self.CLSUM[:] = self.CLBUSY.sum(0)
        self.USUM[:] = self.UBUSY.sum(0)
        self.comm_sum, self.sync_sum = int(self.OPCOMM.sum()), int(self.CLSYNC.sum())
        self._born.clear()

    # ---- building blocks ------------------------------------------------------------------
    def _fusable(self, v: int) -> bool:
        ctx, cfg = self.ctx, self.cfg
        ext = ctx.ext_inputs[v]
        if len(ext) != 1:
            return False
        j = ext[0]
        u = ctx.inputs[v][j]
        if len(ctx.cons[u]) != 1 or (cfg[u] is not cfg[v] and cfg[u] != cfg[v]):
            return False
        return ctx.fusable(v, cfg[v])

    def _form_units(self, ops: list[int]) -> None:
        """Units over ``ops`` (topological order, closed under fusion)."""
        unit, members, inputs, ext = self.unit, self.members, self.ctx.inputs, self.ctx.ext_inputs
        for v in ops:
            if self._fusable(v):
                h = unit[inputs[v][ext[v][0]]]
                unit[v] = h
                members[h].append(v)
            else:
                unit[v] = v
                members[v] = [v]

    def _make_unit(self, h: int) -> None:
        ctx, cfg = self.ctx, self.cfg[h]
        ms = self.members[h]
        ts, fwd, bwd = ctx.unit_template(tuple(ms), cfg)
        tmpl = self.tmpl
        for o, t in zip(ms, ts):
            tmpl[o] = t
        t = ts[0]
        nones, fp, bp = ctx.unit_prios(h, len(t.devs))
        ft = self._alloc(fwd, t.devs, nones, fp)
        bt = self._alloc(bwd, t.devs, nones, bp)
        for o in ms:
            self.FT[o], self.BT[o] = ft, bt

    def _make_edge(self, o: int, j: int, link: bool) -> None:
        """The transfers of input j of o if it crosses units (else record None)."""
        ctx = self.ctx
        u = ctx.inputs[o][j]
        if self.unit[u] == self.unit[o]:
            self.EDGES[o][j] = self.EPLAN[o][j] = None
            return
        plan = self.EPLAN[o][j] = ctx.edge_plan(u, o, j, self.cfg[u], self.cfg[o])
        src = self._share_src(o, j, plan)
        self.ESHARE[o][j] = src is not None
        rec = list(plan.direct)
        if src is not None:  # an earlier reader's transfers bring it (its backward's take the gradient)
            kmap = self._kmap(src, o, j)
            rec += [(q, kmap[k], f, -2) for q, k, f, _ in self.EDGES[src[0]][src[1]] if f >= 0]
            self.EDGES[o][j] = rec
            return
        uF, uB, oF, oB = self.FT[u], self.BT[u], self.FT[o], self.BT[o]
        if plan.xq:
            xf = self._alloc(*plan.fcols)
            xb = self._alloc(*plan.bcols)
            PRED = self.PRED
            for q, k, f, b in zip(plan.xq, plan.xk, xf, xb):
                PRED[f], PRED[b] = (uF[q],), (oB[k],)
                rec.append((q, k, f, b))
            if link:  # (new tasks: their predecessors changed from none)
                self._repred.update(xf)
                self._repred.update(xb)
        self.EDGES[o][j] = rec

    def _share_src(self, o: int, j: int, plan):
        """The earlier reader (op, input) whose transfers bring op o its input j (the same
        regions to the same devices: the executor receives it once), or None."""
        if not plan.xq:
            return None
        g = self.ctx.live.read_group(o, j, self.cfg)
        if g is None or g[0] == (o, j):
            return None
        o0, j0 = g[0]
        if self.EDGES[o0][j0] is None or self.ESHARE[o0][j0] or not self.EPLAN[o0][j0].xq:
            return None
        return g[0]

    def _kmap(self, src: tuple, o: int, j: int) -> dict:
        """Partition of the earlier reader -> o's partition reading the same region there."""
        ops, cfg = self.ctx.ops, self.cfg
        (o0, j0) = src
        mine = {(p.device, tuple((s.start, s.stop) for s in p.inputs[j])): p.index
                for p in partitions(ops[o], cfg[o]) if p.inputs[j] is not None}
        return {p.index: mine[(p.device, tuple((s.start, s.stop) for s in p.inputs[j0]))]
                for p in partitions(ops[o0], cfg[o0]) if p.inputs[j0] is not None}

    def _make_syncs(self, c: int, link: bool) -> None:
        ctx = self.ctx
        cp = self.CPLAN[c] = ctx.cluster_plan(c, self.cfg)
        BT, PRED, setp = self.BT, self.PRED, self._set_pred
        st = self._alloc(*cp.cols)
        multi = len(ctx.clusters[c][0]) > 1
        for t, x in zip(st, cp.syncs):
            pred = [BT[o][k] for o, k in x[6]]
            if multi:
                pred = list(dict.fromkeys(pred))
            if link:
                setp(t, pred)
            else:
                PRED[t] = tuple(pred)
        self.SYNCT[c] = st
        if cp.gathers:
            self._make_gathers(c, cp, link)
        else:
            self.GATH[c] = ({}, {})
        if link:  # (a full build fills these rows in one go)
            self.CLMAXSH[c] = cp.maxshard
            self.CLTRAIN[c] = cp.grad
            self._set_events(self.CEV, c, self.ctx.live.cluster_events(c, cp))
            g = self.ctx.cluster_sgroup[c]
            if g >= 0:
                self._group_changed(g)
            self.CLSUM += cp.busy - self.CLBUSY[c]
            self.CLBUSY[c] = cp.busy
            self.sync_sum += int(cp.sync_bytes) - int(self.CLSYNC[c])
            self.CLSYNC[c] = cp.sync_bytes
            self.CLPS[c] = cp.ps_ps

    def _group_changed(self, g: int) -> None:
        """Shard group g's clusters have new plans: its memory events anew, and every
        group's whose place among the sharded units moved (:meth:`Liveness.neighbours`)."""
        live = self.ctx.live
        st = live.group_status(g, self.CPLAN)
        if st is None and self.GSTAT[g] is None:  # not sharded, before or now: no events to change
            return
        if st != self.GSTAT[g]:
            self.GSTAT[g] = st
            nbs = live.neighbours(self.GSTAT)
            for h, (a, b) in enumerate(zip(self.GNB, nbs)):
                if a != b and h != g:
                    self._set_events(self.GEV, h, live.group_events(h, self.CPLAN, b))
            self.GNB = nbs
        self._set_events(self.GEV, g, live.group_events(g, self.CPLAN, self.GNB[g]))

    def _make_gathers(self, c: int, cp, link: bool) -> None:
        """Cluster c's all-gather tasks (shard levels): per group of devices one before its
        users' forward tasks there (no predecessor: prefetched from the start of the step)
        and, at level 3, one before their backward tasks (after their forward)."""
        G = cp.gathers
        fwd = self._alloc([g[1] for g in G], [g[3] for g in G], [g[4] for g in G],
                          [_prio(g[6], GATHER, 0, g[7]) for g in G])
        back = [g for g in G if g[2]]
        bwd = self._alloc([g[2] for g in back], [g[3] for g in back], [g[4] for g in back],
                          [_prio(g[6], GATHER, 1, g[7]) for g in back]) if back else []
        FT, PRED, setp = self.FT, self.PRED, self._set_pred
        for t, g in zip(bwd, back):
            pred = list(dict.fromkeys(FT[o][k] for o, k in g[5]))
            if link:
                setp(t, pred)
            else:
                PRED[t] = tuple(pred)
        self.GATH[c] = ({d: t for t, g in zip(fwd, G) for d in g[0]},
                        {d: t for t, g in zip(bwd, back) for d in g[0]})
        self.SYNCT[c] = list(self.SYNCT[c]) + list(fwd) + list(bwd)

    def _with_gathers(self, h: int, side: int, preds: list) -> list:
        """``preds`` of unit h's forward (``side`` 0) or backward (1) tasks, each with the
        gather tasks it waits for appended."""
        extra = self._gather_preds(h, side)
        return preds if extra is None else [p + e for p, e in zip(preds, extra)]

    def _gather_preds(self, h: int, side: int):
        """Per task of unit h (forward: ``side`` 0, backward: 1), the gather tasks it waits
        for; None where there are none."""
        extra = None
        devs = self.tmpl[h].devs
        for o in self.members[h]:
            for c in self.ctx.op_clusters[o]:
                by_dev = self.GATH[c][side]
                if by_dev:
                    if extra is None:
                        extra = [() for _ in devs]
                    for k, d in enumerate(devs):
                        t = by_dev.get(d)
                        if t is not None:
                            extra[k] += (t,)
        return extra

    def _make_updates(self, h: int, link: bool) -> None:
        """One update task per device for the clusters first used by the unit's ops."""
        cls = [c for o in self.members[h] for c in self.ctx.first_clusters[o]]
        if not cls:
            self.UPDT[h] = {}
            self._set_ubusy(h, 0)
            return
        plans = tuple(self.CPLAN[c] for c in cls)
        ds, durs, refs, row, nones, prios = self.ctx.update_plan(h, cls, plans)
        tids = self._alloc(durs, ds, nones, prios)
        PRED, setp, BT, SYNCT = self.PRED, self._set_pred, self.BT, self.SYNCT
        for t, (srefs, brefs) in zip(tids, refs):
            pred = [SYNCT[c][i] for c, i in srefs]
            if brefs:
                pred = list(dict.fromkeys(pred + [BT[o][k] for o, k in brefs]))
            if link:
                setp(t, pred)
            else:
                PRED[t] = tuple(pred)
        self._set_ubusy(h, row)
        self.UPDT[h] = dict(zip(ds, tids))

    def _set_ubusy(self, h: int, row) -> None:
        self.USUM -= self.UBUSY[h]
        self.UBUSY[h] = row
        self.USUM += self.UBUSY[h]

    def _f_preds(self, h: int) -> list[tuple]:
        """The predecessors of each fwd task of unit h, as tuples.  Where every input edge
        of the unit is an identity (partition k reads partition k of the producer, on its
        device: data parallelism's usual case) they are the producers' tasks side by side."""
        EDGES, EPLAN, ins = self.EDGES, self.EPLAN, self.ctx.inputs
        cols = []
        for o in self.members[h]:
            for j, rec in enumerate(EDGES[o]):
                if rec is not None:
                    if not EPLAN[o][j].identity:
                        return self._with_gathers(h, 0, [tuple(p) for p in self._f_pred(h)])
                    cols.append(self.FT[ins[o][j]])
        return self._with_gathers(h, 0, list(zip(*cols)) if cols else [()] * len(self.FT[h]))

    def _b_preds(self, h: int) -> list[tuple]:
        """The predecessors of each bwd task of unit h, as tuples (``_f_preds``'s shortcut
        where every consumer edge is an identity)."""
        EDGES, EPLAN = self.EDGES, self.EPLAN
        cols = []
        for o in self.members[h]:
            for v, j in self.ctx.cons[o]:
                rec = EDGES[v][j]
                if rec is not None:
                    if not EPLAN[v][j].identity:
                        return self._with_gathers(h, 1, [tuple(p) for p in self._b_pred(h)])
                    cols.append(self.BT[v])
        return self._with_gathers(h, 1, list(zip(*cols)) if cols else [(f,) for f in self.FT[h]])

    def _f_pred(self, h: int) -> list[list[int]]:
        ctx = self.ctx
        preds = [[] for _ in self.FT[h]]
        for o in self.members[h]:
            for j, rec in enumerate(self.EDGES[o]):
                if rec is None:
                    continue
                uF = self.FT[ctx.inputs[o][j]]
                for q, k, xf, _ in rec:
                    preds[k].append(xf if xf >= 0 else uF[q])
        return preds

    def _b_pred(self, h: int) -> list[list[int]]:
        preds = [[] for _ in self.BT[h]]
        EDGES, BT = self.EDGES, self.BT
        for o in self.members[h]:
            for v, j in self.ctx.cons[o]:
                rec = EDGES[v][j]
                if rec is None:
                    continue
                vB = BT[v]
                for q, k, _, xb in rec:
                    if xb != -2:  # (-2: a shared read's gradient goes back with the first reader's)
                        preds[q].append(xb if xb >= 0 else vB[k])
        for p, f in zip(preds, self.FT[h]):
            if not p:  # nothing flows back into it: it follows its own forward
                p.append(f)
        return preds

    def _row(self, o: int):
        """(busy, comm bytes) rows of op o."""
        t = self.tmpl[o]
        busy, comm = t.busy, 0
        for e, shared in zip(self.EPLAN[o], self.ESHARE[o]):
            if e is not None and e.comm and not shared:
                busy = busy + e.busy
                comm += e.comm
        return busy, comm

    def _rows(self, o: int) -> None:
        busy, comm = self._row(o)
        self.OPSUM += busy - self.OPBUSY[o]
        self.comm_sum += comm - int(self.OPCOMM[o])
        self.OPBUSY[o], self.OPCOMM[o] = busy, comm

    def _set_events(self, store: list, i: int, ev) -> None:
        """Replace the memory events of op / cluster i (a delta patch)."""
        old = store[i]
        if old is ev:
            return
        diff = self.MEMDIFF
        if old is not None and len(old[0]):
            np.subtract.at(diff, old[0], old[1])
        if len(ev[0]):
            np.add.at(diff, ev[0], ev[1])
        store[i] = ev

    def memory_peak(self):
        """Per-device peak bytes of the step (memory.py): the largest live sum over the
        forward and backward positions, and the update with the optimizer's temporaries."""
        live = self.ctx.live
        peak, at_update = prefix_peak(self.MEMDIFF, live.update_pos)
        return np.maximum(peak, at_update + live.update_temp(self.CLMAXSH, self.CLTRAIN))
