"""Plans of the task graph, cached per (graph, machine, cost model) in a :class:`Context`:
op templates per (op, config), transfer plans per (input edge, producer config, consumer
config), parameter plans per (cluster, users' configs; ``paramplans.py``).  Regions come only
from :func:`flexflow.strategy.partitions` and :func:`flexflow.strategy.param_placement`.

Under a precision other than ``32-true`` (:mod:`flexflow.cost.precision`) the ops are priced
as they run in it: ``Context.cops[o]`` is op o with its floating dtypes those of the
precision's compute (:func:`flexflow.cost.precision.priced_op`), which the templates' times,
the transfers' bytes and the activations' memory use; partitions and kinds come from the
traced ops.  Under ``32-true`` ``cops`` holds the traced ops themselves."""
from __future__ import annotations

import numpy as np

from ..cost.precision import precision as _precision
from ..cost.precision import priced_ops
from ..graph.ir import dtype_bytes
from ..graph.ops import picks_stacked_part
from ..graph.ops.base import region_numel
from ..strategy.regions import (
    overlap,
    partitions,
    pick_replica,
    validate_config,
)
from ..strategy.collective import regatherable
from ..strategy.units import shard_groups
from .collective import collective_seconds, receiver_resources, transfer_resources
from .memory import Liveness, optimizer_state_copies
from .paramplans import ParamPlanning
from .taskkeys import (
    _AB,
    _AMAX,
    _JB,
    _PB,
    PS,
    SYNC_MODELS,
    UPD,
    XB,
    XF,
    B,
    F,
    _prio,
    _ps,
)

__all__ = ["Context"]


def _geometry_key(op) -> tuple:
    """Everything about ``op`` its partitions (``strategy.partitions``: the rule's regions) and
    its partitions' times (``CostModel.op_time``) may depend on; the name and the producers'
    names are left out.  Two ops with equal keys get equal plans under equal configs."""
    tgt = op.target
    if op.call_kind == "call_module":
        tgt = (type(tgt).__qualname__, repr(tgt))
    elif not isinstance(tgt, (str, type(None))):
        tgt = (getattr(tgt, "__module__", None), getattr(tgt, "__qualname__", None), id(tgt))
    return (op.kind, op.rule, str(op.dtype), tuple(op.output_shape), tuple(op.dims),
            tuple(sorted(op.param_shapes.items())), tuple(sorted(op.param_views.items())),
            tuple(sorted(op.buffer_shapes.items())), tuple(map(tuple, op.input_shapes)),
            tuple(map(str, op.input_dtypes)), op.input_grads, repr(sorted(op.attrs.items(), key=lambda kv: kv[0])),
            op.call_kind, tgt, repr(op.args), repr(sorted(op.kwargs.items())))


class _Tmpl:
    """One op under one config: devices and times of its partitions, memory and busy rows.
    Under ``cfg.recompute`` a partition's backward lasts its forward plus its backward (the
    output is made again before the backward needs it; ``memory.py`` says where it lives)."""
    __slots__ = ("devs", "devk", "fwd", "bwd", "busy")


class _EdgePlan:
    """Producer u -> consumer o input j under a config pair: same-device pairs (direct), the
    transfers as task columns (fcols / bcols, producer and consumer partitions xq, xk), bytes received per device, busy row."""
    __slots__ = ("recv", "busy", "comm", "identity", "direct", "xq", "xk", "fcols", "bcols", "coll")


class Context(ParamPlanning):
    """Per (graph, machine, cost model, optimizer, sync, precision): static structure and
    caches shared by task graphs.

    Caches: op templates per (op, config), transfer plans per (input edge, producer config,
    consumer config), parameter plans per (cluster, users' configs).  They only grow."""

    def __init__(self, graph, machine, cost_model, optimizer: str = "sgd", sync: str = "ring",
                 precision: str = "32-true"):
        self.graph, self.machine, self.cost = graph, machine, cost_model
        if sync not in SYNC_MODELS:
            raise ValueError(f"unknown sync model {sync!r}: expected one of {', '.join(SYNC_MODELS)}")
        self.optimizer, self.sync = optimizer, sync
        self.precision = _precision(precision, machine)  # the machine's autocast
        self.optimizer_copies = optimizer_state_copies(optimizer)
        self.comm_on_cores = bool(machine.spec.comm_on_cores)
        # a message's latency that holds no core (comm_on_cores): the transfer task holds its
        # devices for the rest, and its consumer starts this much after it (schedcore's LAG)
        self.xfer_lag_s = float(machine.spec.message_lag_s) if self.comm_on_cores else 0.0
        self.xfer_lag_ps = _ps(self.xfer_lag_s) if self.xfer_lag_s > 0 else 0
        ops = self.ops = graph.ops
        # the ops as priced under the precision (the traced ops themselves under 32-true)
        self.cops = priced_ops(graph, self.precision)
        n = len(ops)
        if n >= 1 << _AB:
            raise ValueError(f"graph has {n} ops; the simulator handles at most {(1 << _AB) - 1}")
        idx = graph.index
        self.everywhere = [op.everywhere for op in ops]
        self.compute = [i for i, op in enumerate(ops) if not op.everywhere]
        self.inputs = [[idx[s] for s in op.inputs] for op in ops]
        self.cons = [[] for _ in ops]  # producer -> [(consumer, input index)]
        for v in self.compute:
            if len(self.inputs[v]) >= 1 << _JB:
                raise ValueError(f"op {ops[v].name} has too many inputs for the simulator")
            for j, u in enumerate(self.inputs[v]):
                if not self.everywhere[u]:
                    self.cons[u].append((v, j))
        self.ext_inputs = [[j for j, u in enumerate(ins) if not self.everywhere[u]] for ins in self.inputs]
        self.producers = [sorted({u for u in ins if not self.everywhere[u]}) for ins in self.inputs]
        self.consumers = [sorted({v for v, _ in c}) for c in self.cons]
        self.group_of = [-1] * n
        self.groups = []
        for members in graph.groups.values():
            for m in members:
                self.group_of[idx[m]] = len(self.groups)
            self.groups.append([idx[m] for m in members])
        self.group_reps = [(ms[0], ops[ms[0]].name) for ms in self.groups]  # (op index, name) per group
        # parameter clusters: parameters (and buffers) used by the same set of ops
        users: dict[str, list[int]] = {}
        first: dict[str, tuple[int, str]] = {}
        for o in self.compute:
            op = ops[o]
            for local, qual in list(op.params.items()) + list(op.buffers.items()):
                if o not in users.setdefault(qual, []):
                    users[qual].append(o)
                first.setdefault(qual, (o, local))
        self.param_names = list(users)
        self.param_first = [first[q] for q in self.param_names]
        by_users: dict[tuple, list[int]] = {}
        for pi, qual in enumerate(self.param_names):
            by_users.setdefault(tuple(users[qual]), []).append(pi)
        self.clusters = list(by_users.items())  # [(user ops, param indices)]
        self.cluster_groups = [sorted({self.group_of[o] for o in us}) for us, _ in self.clusters]
        self.cluster_reps = [[self.groups[g][0] for g in gs] for gs in self.cluster_groups]
        self.op_clusters = [[] for _ in ops]
        for c, (us, _) in enumerate(self.clusters):
            for o in us:
                self.op_clusters[o].append(c)
        self.group_clusters = [sorted({c for o in g for c in self.op_clusters[o]}) for g in self.groups]
        self.first_clusters = [[] for _ in ops]  # op -> clusters whose first user it is
        for c, (us, _) in enumerate(self.clusters):
            self.first_clusters[us[0]].append(c)
        self._shard_groups(graph)
        if len(self.param_names) >= 1 << _AB:
            raise ValueError("too many parameters for the simulator")
        D = self.D = machine.num_devices
        if D >= 1 << _PB:
            raise ValueError(f"the simulator handles at most {(1 << _PB) - 1} devices")
        self.R = D + len(machine.links)
        self.capacity = [d.spec.memory_bytes for d in machine.devices]
        # ops that only differ in name and in which tensors they read (an unrolled step of a
        # recurrent layer, a repeated block) have the same partitions under every config and
        # the same times: their templates and transfer plans are computed once
        kinds: dict = {}
        # index ops that pick a part of a stacked output (an LSTM cell's h): the executor runs
        # no op for them (ops.picks_stacked_part), so their partitions take no time
        self.free = [len(op.inputs) == 1 and op.inputs[0] in graph.index
                     and picks_stacked_part(op, ops[graph.index[op.inputs[0]]]) for op in ops]
        self.kind = [kinds.setdefault((_geometry_key(op), self.free[i]), len(kinds)) if not op.everywhere else -1
                     for i, op in enumerate(ops)]
        self._tmpl: dict = {}
        self._unit: dict = {}
        self._fuse: dict = {}
        self._update: dict = {}
        self._uprio: dict = {}
        self._edge: dict = {}
        self._egeo: dict = {}
        self._obox: dict = {}  # (producer kind, config) -> output boxes (_out_boxes)
        self._ibox: dict = {}  # (consumer kind, config, input) -> regions read (_in_boxes)
        self._cluster: dict = {}
        self._route: dict = {}
        self._xfer: dict = {}
        self._xtab = None  # (see _transfer_tables)
        self._rtab = None  # (see _receiver_tables)
        self.live = Liveness(self, optimizer)  # memory by liveness (memory.py)

    def _shard_groups(self, graph) -> None:
        """The executor's gather units (:func:`flexflow.strategy.units.shard_groups`) over the
        clusters: ``cluster_sgroup[c]`` (-1: buffers only) and ``sgroup_clusters[g]``."""
        sg = shard_groups(graph)
        self.cluster_sgroup = [min((sg[self.param_names[pi]] for pi in pidx if self.param_names[pi] in sg),
                                   default=-1) for _, pidx in self.clusters]
        ng = max(self.cluster_sgroup, default=-1) + 1
        self.sgroup_clusters = [[] for _ in range(ng)]
        for c, g in enumerate(self.cluster_sgroup):
            if g >= 0:
                self.sgroup_clusters[g].append(c)

    # ---- cached plans ---------------------------------------------------------------------
    def template(self, o: int, cfg) -> _Tmpl:
        key = (self.kind[o], cfg)
        t = self._tmpl.get(key)
        if t is not None:
            return t
        op, D = self.ops[o], self.D
        validate_config(op, cfg, D)
        parts = partitions(op, cfg)
        priced = self.cops[o]
        t = _Tmpl()
        t.devs = [p.device for p in parts]
        t.devk = {p.device: k for k, p in enumerate(parts)}
        t.fwd, t.bwd = [], []
        t.busy = np.zeros(self.R, np.int64)
        free, again = self.free[o], cfg.recompute
        for p in parts:
            f, b = (0.0, 0.0) if free else self.cost.op_time(priced, p, p.device)
            f, b = _ps(f), _ps(b)
            if again:  # recomputed: its backward runs its forward again first
                b += f
            t.fwd.append(f)
            t.bwd.append(b)
            t.busy[p.device] += f + b
        self._tmpl[key] = t
        return t

    def unit_template(self, members: tuple, cfg) -> tuple[list, list, list]:
        """(member templates, fwd, bwd per partition) of a chain of ops sharing ``cfg``."""
        key = (members, cfg)
        u = self._unit.get(key)
        if u is None:
            ts = [self.template(o, cfg) for o in members]
            if len(ts) == 1:
                u = (ts, ts[0].fwd, ts[0].bwd)
            else:
                u = (ts, [sum(x) for x in zip(*(t.fwd for t in ts))], [sum(x) for x in zip(*(t.bwd for t in ts))])
            self._unit[key] = u
        return u

    def fusable(self, v: int, cfg) -> bool:
        """Whether v (under cfg, as its only producer) reads exactly its producer's partitions."""
        key = (v, cfg)
        f = self._fuse.get(key)
        if f is None:
            j = self.ext_inputs[v][0]
            f = self._fuse[key] = self.edge_plan(self.inputs[v][j], v, j, cfg, cfg).identity
        return f

    def update_plan(self, h: int, cls: list, plans: tuple):
        """Update tasks of unit h for its clusters: (devices, durations, per device (sync refs
        (cluster, index), backward refs (op, partition)), busy row)."""
        key = (h, plans)
        up = self._update.get(key)
        if up is not None:
            return up
        secs: dict[int, float] = {}
        srefs: dict[int, list] = {}
        brefs: dict[int, list] = {}
        for c, cp in zip(cls, plans):
            for d, (s, sidx, bdep) in cp.upd.items():
                secs[d] = secs.get(d, 0.0) + s
                srefs.setdefault(d, []).extend((c, i) for i in sidx)
                brefs.setdefault(d, []).extend(bdep)
        ds = sorted(secs)
        durs = [_ps(secs[d]) for d in ds]
        row = np.zeros(self.D, np.int64)
        row[ds] = durs
        up = self._update[key] = (ds, durs, [(srefs[d], list(dict.fromkeys(brefs[d]))) for d in ds], row,
                                  [None] * len(ds), [_prio(h, UPD, 0, d) for d in ds])
        return up

    def unit_prios(self, h: int, n: int):
        key = (h, n)
        p = self._uprio.get(key)
        if p is None:
            p = self._uprio[key] = ([None] * n, [_prio(h, F, 0, k) for k in range(n)],
                                    [_prio(h, B, 0, k) for k in range(n)])
        return p

    def transfer_ps(self, a: int, b: int, nbytes: int) -> int:
        key = (a, b, nbytes)
        t = self._xfer.get(key)
        if t is None:
            t = self._xfer[key] = _ps(self.machine.transfer_time_s(a, b, nbytes))
        return t

    def route(self, a: int, b: int):
        """(single resource or -1, resource tuple or None) of a point-to-point transfer."""
        r = self._route.get((a, b))
        if r is None:
            links = transfer_resources(self.machine, a, b)  # (with comm_on_cores, both ends' cores)
            r = self._route[a, b] = (links[0], None) if len(links) == 1 else (-1, links)
        return r

    def _transfer_tables(self):
        """Per (src, dst) device pair: route (single resource or -1; resource tuple or None;
        resources padded with -1), the latency the transfer task holds (the links' sum less
        ``xfer_lag_s``, at least 0) and slowest bandwidth -- as arrays for a whole transfer
        plan at once."""
        if self._xtab is None:
            D, m = self.D, self.machine
            lat, bw = np.zeros((D, D)), np.ones((D, D))
            r1 = np.full((D, D), -1, np.int64)
            rm = np.empty((D, D), object)
            routes = {}
            for a in range(D):
                for b in range(D):
                    if a == b:
                        continue
                    lat[a, b], bw[a, b] = m.route_figures(a, b)  # what Machine.transfer_time_s uses
                    lat[a, b] = max(lat[a, b] - self.xfer_lag_s, 0.0)
                    r1[a, b], rm[a, b] = routes[a, b] = self.route(a, b)
            width = max((len(x[1] or (x[0],)) for x in routes.values()), default=1)
            pad = np.full((D, D, width), -1, np.int64)
            for (a, b), (x1, xm) in routes.items():
                res = xm or (x1,)
                pad[a, b, :len(res)] = res
            self._xtab = (lat, bw, r1, rm, pad)
        return self._xtab

    def _receiver_tables(self):
        """(single resource or -1, resource tuple or None, padded resources) per (src, dst): what
        a collective's piece holds (:func:`flexflow.sim.collective.receiver_resources`)."""
        if self._rtab is None:
            D, m = self.D, self.machine
            r1 = np.full((D, D), -1, np.int64)
            rm = np.empty((D, D), object)
            pad = np.full((D, D, max(self._transfer_tables()[4].shape[2], 1)), -1, np.int64)
            for a in range(D):
                for b in range(D):
                    if a == b:
                        continue
                    res = receiver_resources(m, a, b)
                    r1[a, b], rm[a, b] = (res[0], None) if len(res) == 1 else (-1, tuple(res))
                    pad[a, b, :len(res)] = res
            self._rtab = (r1, rm, pad)
        return self._rtab

    def _transfer_ps_array(self, a: np.ndarray, b: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
        """A transfer task's picoseconds: the held latency plus the bytes at the route's bandwidth."""
        lat, bw = self._transfer_tables()[:2]
        return np.maximum(1, np.rint((lat[a, b] + nbytes / bw[a, b]) * PS)).astype(np.int64)

    def edge_plan(self, u: int, o: int, j: int, cu, co) -> _EdgePlan:
        key = (o, j, cu, co)
        e = self._edge.get(key)
        if e is not None:
            return e
        gkey = (self.kind[u], self.kind[o], j, cu, co)
        g = self._egeo.get(gkey)
        if g is None:
            g = self._egeo[gkey] = self._edge_geometry(u, o, j, cu, co)
        e = _EdgePlan()
        e.recv, e.busy, e.comm, e.identity, e.direct = g.recv, g.busy, g.comm, g.identity, g.direct
        e.xq, e.xk, e.coll = g.xq, g.xk, g.coll
        low = g.fcols[3]
        e.fcols = g.fcols[:3] + (((((o << 3 | XF) << _JB | j) << 2 * _PB) + low).tolist(),)
        e.bcols = g.bcols[:3] + ((((((_AMAX - o) << 3 | XB) << _JB | j) << 2 * _PB) + low).tolist(),)
        self._edge[key] = e
        return e

    def _edge_geometry(self, u: int, o: int, j: int, cu, co) -> _EdgePlan:
        """The plan of ``edge_plan`` with the transfers' priority offsets (consumer and producer
        partition) in place of their priorities: what every edge between ops of the same
        kinds (``self.kind``) shares under the same configs."""
        pu, boxes, by_box, single, lo, hi, devu, bpe = self._out_boxes(u, cu)
        po, ks, rlo, rhi, devo = self._in_boxes(o, co, j)
        if rlo is None:  # not expected: the plain intersection
            K, BX, N = self._overlaps_slow(po, ks, j, boxes)
        else:
            K, BX, N = self._overlaps(ks, rlo, rhi, lo, hi)
        if single is not None:  # one producer per box: vectorised
            Q = single[BX]
        else:  # replicas read one copy (pick_replica); partial sums are all read
            partial = pu[0].partial
            qs_l, ks_l, ns_l = [], [], []
            for k, bx, n in zip(K.tolist(), BX.tolist(), N.tolist()):
                qs = by_box[bx]
                if len(qs) > 1 and not partial:
                    qs = (pick_replica(qs, pu, po[k].device, k),)
                for q in qs:
                    qs_l.append(q)
                    ks_l.append(k)
                    ns_l.append(n)
            Q, K, N = (np.array(x, np.int64) for x in (qs_l, ks_l, ns_l))
        NB = N * bpe
        A = devu[Q]
        Bd = devo[K]
        cross = A != Bd
        e = _EdgePlan()
        e.recv = np.zeros(self.D, np.int64)
        e.busy = np.zeros(self.R, np.int64)
        same = ~cross
        n_same = int(same.sum())
        e.direct = list(zip(Q[same].tolist(), K[same].tolist(), [-1] * n_same, [-1] * n_same))
        e.identity = (len(pu) == len(po) and len(Q) == len(po) and n_same == len(Q)
                      and bool((Q == np.arange(len(Q))).all() and (K == Q).all()))
        Qx, Kx, NBx, Ax, Bx = Q[cross], K[cross], NB[cross], A[cross], Bd[cross]
        e.xq, e.xk = Qx.tolist(), Kx.tolist()
        e.comm = 2 * int(NBx.sum())
        np.add.at(e.recv, Bx, NBx)
        _, _, r1, rm, pad = self._transfer_tables()
        fd = self._transfer_ps_array(Ax, Bx, NBx)
        bd = self._transfer_ps_array(Bx, Ax, NBx)
        e.coll = None
        coll = collective_seconds(self.machine, Ax, Bx, NBx, bool(pu[0].partial), lambda i: po[e.xk[i]].inputs[j],
                                  lambda i: region_numel(pu[e.xq[i]].output) * bpe, self.xfer_lag_s)
        if coll is not None:  # (see collective.py)
            r1, rm, pad = self._receiver_tables()
            fd = bd = np.maximum(1, np.rint(coll[0] * PS)).astype(np.int64)
            e.coll = coll[1]
            if e.coll == "gather" and regatherable(self.ops[o], co):  # gathered again before its backward
                bd = 2 * bd
        for src, dst, dur in ((Ax, Bx, fd), (Bx, Ax, bd)):
            res = pad[src, dst]
            for c in range(res.shape[1]):
                col = res[:, c]
                used = col >= 0
                np.add.at(e.busy, col[used], dur[used])
        low = (Kx << _PB) | Qx
        e.fcols = (fd.tolist(), r1[Ax, Bx].tolist(), rm[Ax, Bx].tolist(), low)
        e.bcols = (bd.tolist(), r1[Bx, Ax].tolist(), rm[Bx, Ax].tolist(), low)
        return e

    def _out_boxes(self, u: int, cu):
        """Producer side of ``_edge_geometry``, per (kind, config): the partitions, their
        distinct output boxes in order, the partitions per box, for one producer per box an
        array box -> partition (else None), the boxes' corners, the partitions' devices and
        the element size."""
        key = (self.kind[u], cu)  # (only reached through edge_plan, itself keyed by kinds)
        hit = self._obox.get(key)
        if hit is not None:
            return hit
        opu = self.ops[u]
        pu = partitions(opu, cu)
        validate_config(opu, cu, self.D)
        nd = len(opu.output_shape)
        groups: dict[tuple, list[int]] = {}
        for q, p in enumerate(pu):
            groups.setdefault(tuple((s.start, s.stop) for s in p.output), []).append(q)
        boxes = sorted(groups)
        by_box = [groups[b] for b in boxes]
        single = np.array([qs[0] for qs in by_box], np.int64) if all(len(qs) == 1 for qs in by_box) else None
        lo = np.array([[iv[0] for iv in b] for b in boxes], np.int64).reshape(len(boxes), nd)
        hi = np.array([[iv[1] for iv in b] for b in boxes], np.int64).reshape(len(boxes), nd)
        devu = np.array([p.device for p in pu], np.int64)
        hit = self._obox[key] = (pu, boxes, by_box, single, lo, hi, devu, dtype_bytes(self.cops[u].dtype))
        return hit

    def _in_boxes(self, o: int, co, j: int):
        """Consumer side of ``_edge_geometry``, per (kind, config, input): the partitions,
        those that read input j, the corners of what they read (None where a region's rank
        is not the producer's), the partitions' devices."""
        key = (self.kind[o], co, j)
        hit = self._ibox.get(key)
        if hit is not None:
            return hit
        opo = self.ops[o]
        po = partitions(opo, co)
        validate_config(opo, co, self.D)
        nd = len(self.ops[self.inputs[o][j]].output_shape)
        regs = [pk.inputs[j] for pk in po]
        ks = [k for k, r in enumerate(regs) if r is not None]
        rlo = rhi = None
        if all(len(regs[k]) == nd for k in ks):
            rlo = np.array([[x.start for x in regs[k]] for k in ks], np.int64).reshape(len(ks), nd)
            rhi = np.array([[x.stop for x in regs[k]] for k in ks], np.int64).reshape(len(ks), nd)
        devo = np.array([p.device for p in po], np.int64)
        hit = self._ibox[key] = (po, np.array(ks, np.int64), rlo, rhi, devo)
        return hit

    @staticmethod
    def _overlaps(ks, rlo, rhi, lo, hi):
        """Arrays (consumer partition k, box index, elements) for every producer output box
        (corners lo, hi) that overlaps what k reads (corners rlo, rhi, partitions ks),
        k-major and boxes in order."""
        ln = np.minimum(hi[None], rhi[:, None]) - np.maximum(lo[None], rlo[:, None])
        num = np.clip(ln, 0, None).prod(axis=2)
        kk, bb = np.nonzero(num)
        return ks[kk], bb.astype(np.int64), num[kk, bb].astype(np.int64)

    @staticmethod
    def _overlaps_slow(po, ks, j: int, boxes: list):
        """``_overlaps`` by plain intersection, for regions whose rank differs from the boxes'."""
        out = []
        for k in ks.tolist():
            reg = po[k].inputs[j]
            for bx, box in enumerate(boxes):
                ov = overlap(reg, tuple(slice(a, b) for a, b in box))
                n = 0 if ov is None else region_numel(ov)
                if n > 0:
                    out.append((k, bx, n))
        empty = np.zeros(0, np.int64)
        return tuple(np.array(x, np.int64).reshape(-1) for x in zip(*out)) if out else (empty, empty, empty)
