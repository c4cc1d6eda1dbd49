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
- ``update``: per unit and device, the optimizer update of the trainable shards whose
  parameters the unit uses first (memory bound: (3 + 2 x optimizer copies) x bytes / memory
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
"""
from __future__ import annotations

import itertools
from collections import Counter

import numpy as np

from .cost import GRAD_BUCKET_BYTES
from .ir import dtype_bytes
from .memory import Liveness, optimizer_state_copies
from .ops.base import region_numel
from .strategy import overlap, param_placement, partitions, pick_replica, validate_config

__all__ = ["Context", "TaskGraph", "PS", "KIND_NAMES", "SYNC_MODELS", "decode_prio"]

# "ring": bucketed ring all-reduce overlapping the backward (what the executor and DDP do);
# "ps": the paper's runtime -- gradients gathered to one replica, updated, sent back, after
# the task graph with no overlap (only to set the paper's figures side by side)
SYNC_MODELS = ("ring", "ps")

PS = 10**12  # picoseconds per second
F, B, XF, XB, SYNC, UPD = range(6)
KIND_NAMES = ("fwd", "bwd", "xfer", "xfer-grad", "sync", "update")
_JB, _PB, _AB = 10, 10, 16  # bits: input index, partition index, op/param/cluster index
PRIO_BITS = _AB + 3 + _JB + 2 * _PB
TID_BITS = 24
KEY_SHIFT = PRIO_BITS + TID_BITS  # heap key = ready << KEY_SHIFT | prio << TID_BITS | tid
TID_MASK = (1 << TID_BITS) - 1


def _prio(a: int, kind: int, j: int = 0, k: int = 0, q: int = 0) -> int:
    return ((((a << 3 | kind) << _JB | j) << _PB | k) << _PB) | q


def decode_prio(p: int) -> tuple[int, int, int, int, int]:
    """(a, kind, j, k, q) of a priority: a is the op (fwd/bwd/xfer), param (sync) or cluster
    (update) index, j the input index, k / q the consumer / producer partition (or device)."""
    m = (1 << _PB) - 1
    q, k = p & m, (p >> _PB) & m
    p >>= 2 * _PB
    j = p & ((1 << _JB) - 1)
    p >>= _JB
    return p >> 3, p & 7, j, k, q


def _ps(seconds: float) -> int:
    """Seconds -> integer picoseconds, at least 1 (every task takes time: keeps keys ordered)."""
    return max(1, int(round(seconds * PS)))


class _SubGraph:
    """Just enough of an OpGraph for param_placement over a few ops."""

    def __init__(self, ops):
        self.compute_ops = ops


class _Tmpl:
    """One op under one config: devices and times of its partitions, memory and busy rows."""
    __slots__ = ("devs", "devk", "fwd", "bwd", "busy")


class _EdgePlan:
    """Producer u -> consumer o input j under a config pair: (q, k, bytes, fwd/bwd transfer)."""
    __slots__ = ("pairs", "recv", "busy", "comm", "identity", "direct", "xqk", "fcols", "bcols")


class _ClusterPlan:
    """Placement of a cluster's parameters under its users' configs: syncs, updates, memory."""
    __slots__ = ("syncs", "upd", "mem", "grad", "synced", "maxshard", "busy", "sync_bytes", "ps_ps", "cols")


class Context:
    """Per (graph, machine, cost model): static structure and caches shared by task graphs.

    Caches: op templates per (op, config), transfer plans per (input edge, producer config,
    consumer config), parameter plans per (cluster, users' configs).  They only grow."""

    def __init__(self, graph, machine, cost_model, optimizer: str = "sgd", sync: str = "ring"):
        self.graph, self.machine, self.cost = graph, machine, cost_model
        if sync not in SYNC_MODELS:
            raise ValueError(f"unknown sync model {sync!r}: expected one of {', '.join(SYNC_MODELS)}")
        self.optimizer, self.sync = optimizer, sync
        self.optimizer_copies = optimizer_state_copies(optimizer)
        ops = self.ops = graph.ops
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
        if len(self.param_names) >= 1 << _AB:
            raise ValueError("too many parameters for the simulator")
        D = self.D = machine.num_devices
        if D >= 1 << _PB:
            raise ValueError(f"the simulator handles at most {(1 << _PB) - 1} devices")
        self.R = D + len(machine.links)
        self.capacity = [d.spec.memory_bytes for d in machine.devices]
        self._tmpl: dict = {}
        self._unit: dict = {}
        self._fuse: dict = {}
        self._update: dict = {}
        self._uprio: dict = {}
        self._edge: dict = {}
        self._cluster: dict = {}
        self._route: dict = {}
        self._xfer: dict = {}
        self.live = Liveness(self, optimizer)  # memory by liveness (memory.py)

    # ---- cached plans ---------------------------------------------------------------------
    def template(self, o: int, cfg) -> _Tmpl:
        key = (o, cfg)
        t = self._tmpl.get(key)
        if t is not None:
            return t
        op, D = self.ops[o], self.D
        validate_config(op, cfg, D)
        parts = partitions(op, cfg)
        t = _Tmpl()
        t.devs = [p.device for p in parts]
        t.devk = {p.device: k for k, p in enumerate(parts)}
        t.fwd, t.bwd = [], []
        t.busy = np.zeros(self.R, np.int64)
        for p in parts:
            f, b = self.cost.op_time(op, p, p.device)
            f, b = _ps(f), _ps(b)
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
            links = tuple(self.D + l for l in self.machine.route(a, b))
            r = self._route[a, b] = (links[0], None) if len(links) == 1 else (-1, links)
        return r

    def edge_plan(self, u: int, o: int, j: int, cu, co) -> _EdgePlan:
        key = (o, j, cu, co)
        e = self._edge.get(key)
        if e is not None:
            return e
        opu, opo, m = self.ops[u], self.ops[o], self.machine
        pu, po = partitions(opu, cu), partitions(opo, co)
        validate_config(opu, cu, self.D)
        validate_config(opo, co, self.D)
        nd = len(opu.output_shape)
        axis_iv = [sorted({(p.output[a].start, p.output[a].stop) for p in pu}) for a in range(nd)]
        by_box: dict[tuple, list[int]] = {}
        for q, p in enumerate(pu):
            by_box.setdefault(tuple((s.start, s.stop) for s in p.output), []).append(q)
        bpe = dtype_bytes(opu.dtype)
        e = _EdgePlan()
        e.pairs = []
        e.recv = np.zeros(self.D, np.int64)
        e.busy = np.zeros(self.R, np.int64)
        e.comm = 0
        for k, pk in enumerate(po):
            reg = pk.inputs[j]
            if reg is None:
                continue
            cands = [[iv for iv in axis_iv[a] if iv[0] < reg[a].stop and reg[a].start < iv[1]]
                     for a in range(nd)]
            for box in itertools.product(*cands):
                qs = by_box.get(box, ())
                if len(qs) > 1 and not pu[0].partial:  # replicas (not partial sums): read one copy
                    qs = (pick_replica(qs, pu, pk.device, k),)
                for q in qs:
                    ov = overlap(reg, pu[q].output)
                    nb = 0 if ov is None else region_numel(ov) * bpe
                    if nb <= 0:
                        continue
                    a, b = pu[q].device, pk.device
                    if a == b:
                        e.pairs.append((q, k, nb, -1, None, None, -1, None, None))
                        continue
                    fr1, frm = self.route(a, b)
                    br1, brm = self.route(b, a)
                    fd, bd = self.transfer_ps(a, b, nb), self.transfer_ps(b, a, nb)
                    e.pairs.append((q, k, nb, fr1, frm, fd, br1, brm, bd))
                    e.recv[b] += nb
                    e.comm += 2 * nb
                    for r in (frm or (fr1,)):
                        e.busy[r] += fd
                    for r in (brm or (br1,)):
                        e.busy[r] += bd
        e.identity = (len(pu) == len(po) and len(e.pairs) == len(po)
                      and all(x[0] == x[1] == k and x[5] is None for k, x in enumerate(e.pairs)))
        xs = [x for x in e.pairs if x[5] is not None]
        e.direct = [(q, k, -1, -1) for q, k, _, _, _, fd, _, _, _ in e.pairs if fd is None]
        e.xqk = [(x[0], x[1]) for x in xs]
        e.fcols = ([x[5] for x in xs], [x[3] for x in xs], [x[4] for x in xs],
                   [_prio(o, XF, j, x[1], x[0]) for x in xs])
        e.bcols = ([x[8] for x in xs], [x[6] for x in xs], [x[7] for x in xs],
                   [_prio(o, XB, j, x[1], x[0]) for x in xs])
        self._edge[key] = e
        return e

    def ps_sync_ps(self, devices, nbytes: int) -> int:
        """Parameter-server sync of one gradient among ``devices``: every other replica sends
        it to the first, which sends the updated values back, one transfer after another."""
        root, rest = devices[0], devices[1:]
        return sum(self.transfer_ps(d, root, nbytes) + self.transfer_ps(root, d, nbytes) for d in rest)

    def cluster_plan(self, c: int, cfg: list) -> _ClusterPlan:
        """Parameter plan of cluster c; ``cfg``: op index -> config."""
        us, pidx = self.clusters[c]
        reps = self.cluster_reps[c]
        key = (c, cfg[reps[0]]) if len(reps) == 1 else (c,) + tuple(cfg[r] for r in reps)
        cp = self._cluster.get(key)
        if cp is not None:
            return cp
        m, D, oc, ops = self.machine, self.D, self.optimizer_copies, self.ops
        cfgs = {ops[o].name: cfg[o] for o in us}
        place = param_placement(_SubGraph([ops[o] for o in us]), cfgs)
        devs = [(o, self.template(o, cfg[o]).devs) for o in us]
        cp = _ClusterPlan()
        cp.syncs, cp.upd = [], {}
        cp.mem = np.zeros(D, np.int64)       # values (parameters, buffers) + optimizer state
        cp.grad = np.zeros(D, np.int64)      # parameter gradients
        cp.synced = np.zeros(D, np.int64)    # gradients all-reduced (the bucket buffer)
        cp.maxshard = np.zeros(D, np.int64)  # largest trainable shard (optimizer temporaries)
        cp.busy = np.zeros(self.R, np.int64)
        cp.sync_bytes = 0
        cp.ps_ps = 0  # parameter-server sync time added after the task graph (sync="ps")
        upd_s: dict[int, float] = {}
        upd_syncs: dict[int, list[int]] = {}
        upd_bdep: set[int] = set()
        # Gradients of the cluster's shards held by the same devices travel in one
        # all-reduce (the executor buckets them), charged per bucket share.
        groups: dict[tuple, list] = {}  # devices -> [bytes, first (param, shard)]
        shard_list = []
        for pi in pidx:
            _, shards, trainable = place[self.param_names[pi]]
            bpe = dtype_bytes(ops[self.param_first[pi][0]].dtype)
            for si, sh in enumerate(shards):
                nb = region_numel(sh.region) * bpe
                shard_list.append((pi, si, sh, nb, trainable))
                if trainable and nb > 0 and len(sh.devices) > 1:
                    g = groups.setdefault(tuple(sh.devices), [0, (pi, si)])
                    g[0] += nb
        group_sync: dict[tuple, int] = {}
        for devices, (nb, (pi, si)) in groups.items():
            if self.sync == "ps":
                cp.ps_ps += self.ps_sync_ps(devices, nb)
                dur = 1  # the sync task only orders the updates; its time comes after the graph
            else:
                dur = _ps(m.bucketed_allreduce_time_s(devices, nb, GRAD_BUCKET_BYTES))
            links = tuple(D + l for l in m.allreduce_links(devices))
            r1, rm = (links[0], None) if len(links) == 1 else (-1, links)
            group_sync[devices] = len(cp.syncs)
            ds = set(devices)
            users = [(o, k) for o, dv in devs for k, d in enumerate(dv) if d in ds]
            cp.syncs.append((pi, si, frozenset(devices), dur, r1, rm, users))
            cp.sync_bytes += m.allreduce_bytes_sent(devices, nb)
            for r in links:
                cp.busy[r] += dur
        for pi, si, sh, nb, trainable in shard_list:
            for d in sh.devices:
                cp.mem[d] += nb * (1 + (oc if trainable else 0))  # value, optimizer state
            if not trainable or nb <= 0:
                continue
            sync = group_sync.get(tuple(sh.devices), -1)
            for d in sh.devices:
                cp.grad[d] += nb
                cp.maxshard[d] = max(cp.maxshard[d], nb)
                if sync >= 0:
                    cp.synced[d] += nb
                s = m.devices[d].spec
                upd_s[d] = upd_s.get(d, 0.0) + (3 + 2 * oc) * nb / s.mem_bw_Bps + s.launch_overhead_s
                if sync < 0:
                    upd_bdep.add(d)
                elif sync not in upd_syncs.get(d, ()):
                    upd_syncs.setdefault(d, []).append(sync)
        cp.cols = ([x[3] for x in cp.syncs], [x[4] for x in cp.syncs], [x[5] for x in cp.syncs],
                   [_prio(x[0], SYNC, 0, x[1]) for x in cp.syncs])
        for d in sorted(upd_s):
            bdep = [(o, dv.index(d)) for o, dv in devs if d in dv] if d in upd_bdep else []
            cp.upd[d] = (upd_s[d], upd_syncs.get(d, []), bdep)
        self._cluster[key] = cp
        return cp


class TaskGraph:
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
        self.SUCC: list = []
        self.PRED: list = []
        self.ALIVE: list[bool] = []
        self.READY: list[int] = []
        self.FIN: list[int] = []
        self.CNT: list[int] = []
        self._free: list[int] = []
        self._born: list[int] = []
        self._dead: list[int] = []
        self._drop: dict[int, dict] = {}  # queued successor removals (patch): p -> {t: count}
        self._add: dict[int, list] = {}   # queued successor additions (patch)
        self.cfg = [None] * n
        self.unit = [-1] * n       # op -> head op of its unit
        self.members = [None] * n  # head -> member ops in order
        self.tmpl = [None] * n
        self.FT = [None] * n       # op -> fwd task per partition (shared by a unit's members)
        self.BT = [None] * n
        self.EDGES = [None] * n    # o -> per input j: [(q, k, xf, xb)] for unit-external edges, else None
        self.EPLAN = [None] * n
        self.SYNCT = [None] * nc   # cluster -> sync task per plan entry
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
        self.MEV = [None] * n      # op -> its memory events (positions, rows)
        self.CEV = [None] * nc     # cluster -> its memory events
        self.CLBUSY = np.zeros((nc, R), np.int64)
        self.CLSYNC = np.zeros(nc, np.int64)
        self.CLPS = np.zeros(nc, np.int64)  # parameter-server sync picoseconds (sync="ps")
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
        self.READY, self.FIN, self.CNT = [0] * nt, [0] * nt, [0] * nt
        PRED = self.PRED
        for h in heads:
            for t, p in zip(self.FT[h], self._f_pred(h)):
                PRED[t] = tuple(p)
            for t, p in zip(self.BT[h], self._b_pred(h)):
                PRED[t] = tuple(p)
        # successors from predecessors (their order does not matter to the scheduler).
        # Tuples, not lists: the cyclic garbage collector stops tracking tuples of ints,
        # so a big task graph does not slow every later collection down.
        succ = [[] for _ in PRED]
        for t, preds in enumerate(PRED):
            for p in preds:
                succ[p].append(t)
        self.SUCC = [tuple(x) for x in succ]
        if comp:
            rows = [self._row(o) for o in comp]
            self.OPBUSY[comp] = np.stack([r[0] for r in rows])
            self.OPCOMM[comp] = [r[1] for r in rows]
        live, cfg = ctx.live, self.cfg
        evs = [live.op_events(o, cfg) for o in comp]
        evs += [live.cluster_events(c, self.CPLAN[c]) for c in range(nc)]
        for o, ev in zip(comp, evs):
            self.MEV[o] = ev
        for c in range(nc):
            self.CEV[c] = evs[len(comp) + c]
        if evs:
            np.add.at(self.MEMDIFF, np.concatenate([e[0] for e in evs]), np.concatenate([e[1] for e in evs]))
        self._born.clear()

    # ---- task allocation ------------------------------------------------------------------
    def _alloc(self, durs: list, r1s: list, rms: list, prios: list):
        """New task ids for tasks given column-wise (reusing released ids first)."""
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
        if len(free) >= n:
            tids = free[len(free) - n:]
            del free[len(free) - n:]
            DUR, RES1, RESM, KP, SUCC, PRED, ALIVE = (self.DUR, self.RES1, self.RESM, self.KP, self.SUCC,
                                                      self.PRED, self.ALIVE)
            for t, d, r1, rm, p in zip(tids, durs, r1s, rms, prios):
                DUR[t], RES1[t], RESM[t], KP[t] = d, r1, rm, p << TID_BITS | t
                SUCC[t] = PRED[t] = ()
                ALIVE[t] = True
        else:
            base = len(self.DUR)
            if base + n > TID_MASK:
                raise ValueError("too many tasks for the simulator")
            tids = list(range(base, base + n))
            self.DUR += durs
            self.RES1 += r1s
            self.RESM += rms
            self.KP += [p << TID_BITS | t for p, t in zip(prios, tids)]
            self.SUCC += [()] * n
            self.PRED += [()] * n
            self.ALIVE += [True] * n
            zeros = [0] * n
            self.READY += zeros
            self.FIN += zeros
            self.CNT += zeros
        self._born += tids
        return tids

    def _kill(self, t: int) -> None:
        """Mark t dead; successor lists are fixed in one pass by :meth:`_flush`."""
        self.ALIVE[t] = False
        drop = self._drop
        for p in self.PRED[t]:
            d = drop.setdefault(p, {})
            d[t] = d.get(t, 0) + 1
        self.PRED[t] = self.SUCC[t] = ()
        self._dead.append(t)

    def _set_pred(self, t: int, new) -> bool:
        """Replace t's predecessors (successors follow in :meth:`_flush`); True if changed.
        Predecessors may repeat (an op reading one tensor twice): multiset difference."""
        old = self.PRED[t]
        new = tuple(new)
        if old == new:
            return False
        drop, add = self._drop, self._add
        self.PRED[t] = new
        if not old:
            for p in new:
                add.setdefault(p, []).append(t)
            return True
        gone, came = Counter(old), Counter(new)
        gone.subtract(new)
        came.subtract(old)
        for p, n in gone.items():
            if n > 0:
                d = drop.setdefault(p, {})
                d[t] = d.get(t, 0) + n
        for p, n in came.items():
            if n > 0:
                add.setdefault(p, []).extend([t] * n)
        return True

    def _flush(self) -> None:
        """Apply the successor-list edits queued by _kill and _set_pred."""
        SUCC, ALIVE, drop, add = self.SUCC, self.ALIVE, self._drop, self._add
        for p, ts in drop.items():
            if ALIVE[p]:
                out = []
                for x in SUCC[p]:
                    n = ts.get(x)
                    if n:
                        ts[x] = n - 1
                    else:
                        out.append(x)
                SUCC[p] = tuple(out)
        for p, ts in add.items():
            SUCC[p] += tuple(ts)
        drop.clear()
        add.clear()

    def release(self) -> None:
        """After a schedule no longer refers to the dead tasks: reuse their ids."""
        self._free.extend(self._dead)
        self._dead.clear()
        self._born.clear()

    def num_tasks(self) -> int:
        return len(self.DUR) - len(self._free) - len(self._dead)

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
        uF, uB, oF, oB = self.FT[u], self.BT[u], self.FT[o], self.BT[o]
        rec = list(plan.direct)
        if plan.xqk:
            xf = self._alloc(*plan.fcols)
            xb = self._alloc(*plan.bcols)
            PRED, setp = self.PRED, self._set_pred
            for (q, k), f, b in zip(plan.xqk, xf, xb):
                if link:
                    setp(f, [uF[q]])
                    setp(b, [oB[k]])
                else:
                    PRED[f], PRED[b] = (uF[q],), (oB[k],)
                rec.append((q, k, f, b))
        self.EDGES[o][j] = rec

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
        if link:  # (a full build fills these rows in one go)
            self.CLMAXSH[c] = cp.maxshard
            self.CLTRAIN[c] = cp.grad
            self._set_events(self.CEV, c, self.ctx.live.cluster_events(c, cp))
            self.CLBUSY[c] = cp.busy
            self.CLSYNC[c] = cp.sync_bytes
            self.CLPS[c] = cp.ps_ps

    def _make_updates(self, h: int, link: bool) -> None:
        """One update task per device for the clusters first used by the unit's ops."""
        cls = [c for o in self.members[h] for c in self.ctx.first_clusters[o]]
        if not cls:
            self.UPDT[h] = {}
            self.UBUSY[h] = 0
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
        self.UBUSY[h] = row
        self.UPDT[h] = dict(zip(ds, tids))

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
                    preds[q].append(xb if xb >= 0 else vB[k])
        for p, f in zip(preds, self.FT[h]):
            if not p:  # nothing flows back into it: it follows its own forward
                p.append(f)
        return preds

    def _row(self, o: int):
        """(busy, comm bytes) rows of op o."""
        t = self.tmpl[o]
        busy, comm = t.busy, 0
        for e in self.EPLAN[o]:
            if e is not None and e.comm:
                busy = busy + e.busy
                comm += e.comm
        return busy, comm

    def _rows(self, o: int) -> None:
        self.OPBUSY[o], self.OPCOMM[o] = self._row(o)

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
        cum = np.cumsum(self.MEMDIFF, axis=0)
        u = live.update_pos
        peak = cum[:u].max(0) if u else np.zeros(self.ctx.D, np.int64)
        return np.maximum(peak, cum[u] + live.update_temp(self.CLMAXSH, self.CLTRAIN))

    # ---- delta ----------------------------------------------------------------------------
    def changed_groups(self, strategy) -> list[int]:
        ctx, cfg, out = self.ctx, self.cfg, []
        ops = ctx.ops
        for g, members in enumerate(ctx.groups):
            o = members[0]
            new = strategy[ops[o].name]
            old = cfg[o]
            if new is not old and new != old:
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
        clusters = sorted({c for o in r_ops for c in ctx.op_clusters[o]})
        upd_units = {h for h in new_heads if h not in kept}
        upd_units.update(unit[ctx.clusters[c][0][0]] for c in clusters)
        # kill what the change touches
        kill = self._kill
        for o, j in edges:
            rec = self.EDGES[o][j]
            if rec:
                for _, _, xf, xb in rec:
                    if xf >= 0:
                        kill(xf)
                        kill(xb)
        for h in old_units:
            if h not in kept:
                for t in self.FT[h]:
                    kill(t)
                for t in self.BT[h]:
                    kill(t)
                for t in self.UPDT[h].values():
                    kill(t)
                self.UPDT[h] = {}
        for h in upd_units:
            if self.UPDT[h]:
                for t in self.UPDT[h].values():
                    kill(t)
        for c in clusters:
            for t in self.SYNCT[c]:
                kill(t)
        for h in old_units:  # heads that are no longer heads
            if unit[h] != h:
                self.UPDT[h] = {}
                self.UBUSY[h] = 0
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
        born = set(self._born)
        dirty = []
        setp = self._set_pred
        for h in pf:
            for t, p in zip(self.FT[h], self._f_pred(h)):
                if setp(t, p) and t not in born:
                    dirty.append(t)
        for h in pb:
            for t, p in zip(self.BT[h], self._b_pred(h)):
                if setp(t, p) and t not in born:
                    dirty.append(t)
        self._flush()
        for o in r_set.union(o for o, _ in edges):
            self._rows(o)
        live, cfg = ctx.live, self.cfg
        for o in sorted({x for v in co for x in live.dependents[v]}):
            if not ctx.everywhere[o]:
                self._set_events(self.MEV, o, live.op_events(o, cfg))
        return list(self._dead), dirty, list(self._born)

    def validate(self) -> None:
        """Consistency of the task arrays (for tests): successor lists mirror predecessor
        lists and no live task refers to a dead one."""
        succ_from_pred: dict[int, list] = {}
        for t, preds in enumerate(self.PRED):
            if not self.ALIVE[t]:
                assert not preds and not self.SUCC[t], t
                continue
            for p in preds:
                assert self.ALIVE[p], (t, p)
                succ_from_pred.setdefault(p, []).append(t)
        for t, succ in enumerate(self.SUCC):
            if self.ALIVE[t]:
                assert sorted(succ) == sorted(succ_from_pred.get(t, [])), t
