"""Parameter plans of a :class:`flexflow.sim.plans.Context`: per cluster of parameters (those
used by the same ops) and its users' configs, the gradient syncs, the update tasks' times and
the memory the parameter state takes, in the dtypes of the context's precision
(:mod:`flexflow.cost.precision`).  Regions come only from
:func:`flexflow.strategy.param_placement`."""
from __future__ import annotations

import numpy as np

from ..cost.model import GRAD_BUCKET_BYTES
from ..cost.precision import gathers_in_compute
from ..graph.ir import dtype_bytes
from ..graph.ops.base import region_numel
from ..strategy.regions import param_placement
from .memory import UPDATE_TRAFFIC
from .taskkeys import PS, SYNC, _prio, _ps

__all__ = ["ParamPlanning"]


class _SubGraph:
    """Just enough of an OpGraph for param_placement over a few ops."""

    def __init__(self, ops):
        self.compute_ops = ops


class _ClusterPlan:
    """Placement of a cluster's parameters under its users' configs: syncs, updates, memory."""
    __slots__ = ("syncs", "upd", "mem", "grad", "maxshard", "busy", "sync_bytes", "ps_ps", "cols", "upd_lb",
                 "bucket_bytes", "cast", "kept", "ar_grad",
                 "level", "fval", "fgrad", "sl", "slg", "nreg", "padded", "gathers")


class ParamPlanning:
    """The parameter-plan half of :class:`flexflow.sim.plans.Context` (mixed into it): it reads
    the context's ``machine``, ``ops``, ``clusters``, ``param_names``, ``param_first``,
    ``cluster_reps``, ``optimizer_copies``, ``sync``, ``comm_on_cores``, ``precision``,
    ``D``, ``R``, ``template`` and ``_cluster``."""

    def ps_sync_ps(self, devices, nbytes: int) -> int:
        """Parameter-server sync of one gradient among ``devices``: every other replica sends
        it to the first, which sends the updated values back, one transfer after another."""
        root, rest = devices[0], devices[1:]
        return sum(self.transfer_ps(d, root, nbytes) + self.transfer_ps(root, d, nbytes) for d in rest)

    def _allreduce_s(self, devices, nbytes: int) -> float:
        """What a gradient all-reduce task of ``nbytes`` lasts: bucketed (its share of the
        buckets' latency), or with communication on the computing cores the bandwidth term
        (the latency is added per bucket after the graph)."""
        m = self.machine
        if self.comm_on_cores:
            return m.allreduce_time_s(devices, nbytes) - m.allreduce_latency_s(devices)
        return m.bucketed_allreduce_time_s(devices, nbytes, GRAD_BUCKET_BYTES)

    def _sync_figures(self, devices, level: int, reduce_bytes: int, gather_bytes: int) -> tuple[int, float]:
        """(task picoseconds, bytes sent) of a cluster's gradient sync among ``devices``.
        Level 0 all-reduces the gradients (in the reduce dtype); levels 1-2 reduce-scatter them
        and all-gather the updated parameters (in the all-gather dtype), level 3 gathers the
        parameters once more (forward and backward).  A ring reduce-scatter or all-gather
        moves half what a ring all-reduce moves."""
        m = self.machine
        if level == 0 or reduce_bytes == gather_bytes:
            dur = _ps(self._allreduce_s(devices, reduce_bytes))
            sent = m.allreduce_bytes_sent(devices, reduce_bytes)
            if level >= 3:
                dur, sent = dur * 3 // 2, sent * 1.5
            return dur, sent
        gathers = 2 if level >= 3 else 1
        dur = _ps(self._allreduce_s(devices, reduce_bytes) / 2 + gathers * self._allreduce_s(devices, gather_bytes) / 2)
        sent = m.allreduce_bytes_sent(devices, reduce_bytes) / 2 + gathers * m.allreduce_bytes_sent(devices,
                                                                                                    gather_bytes) / 2
        return dur, sent

    def cluster_plan(self, c: int, cfg: list) -> _ClusterPlan:
        """Parameter plan of cluster c; ``cfg``: op index -> config."""
        us, pidx = self.clusters[c]
        reps = self.cluster_reps[c]
        key = (c, cfg[reps[0]]) if len(reps) == 1 else (c,) + tuple(cfg[r] for r in reps)
        cp = self._cluster.get(key)
        if cp is not None:
            return cp
        m, D, oc, ops, prec = self.machine, self.D, self.optimizer_copies, self.ops, self.precision
        traffic = UPDATE_TRAFFIC[self.optimizer]  # bytes the update moves per parameter byte
        cfgs = {ops[o].name: cfg[o] for o in us}
        level = max(cfg[o].shard for o in us)  # shard level (ZeRO stage) of the cluster's replicas
        place = param_placement(_SubGraph([ops[o] for o in us]), cfgs)
        devs = [(o, self.template(o, cfg[o]).devs) for o in us]
        cp = _ClusterPlan()
        cp.syncs, cp.upd = [], {}
        cp.mem = np.zeros(D, np.int64)       # values (parameters, buffers) + optimizer state
        cp.grad = np.zeros(D, np.int64)      # parameter gradients
        cp.kept = np.zeros(D, np.int64)      # all-reduce buckets, kept step to step (the synced gradients)
        cp.ar_grad = np.zeros(D, np.int64)   # all-reduced gradients as autograd makes them (of cp.grad)
        cp.maxshard = np.zeros(D, np.int64)  # largest trainable shard (optimizer temporaries)
        # sharded replicas (levels 1-3), what the gather units are made of (memory.py's
        # Liveness.group_events): the full parameters in the all-gather dtype, their full
        # gradients as autograd makes them, the flat slices (parameter and gather dtypes),
        # the number of sharded regions and whether any slice is padded
        cp.level = level
        cp.fval = np.zeros(D, np.int64)
        cp.fgrad = np.zeros(D, np.int64)
        cp.sl = np.zeros(D, np.int64)
        cp.slg = np.zeros(D, np.int64)
        cp.nreg = np.zeros(D, np.int64)
        cp.padded = np.zeros(D, bool)
        cp.cast = np.zeros(D, np.int64)      # *-mixed: the parameters cast to the compute dtype
        cp.busy = np.zeros(self.R, np.int64)
        cp.sync_bytes = 0
        cp.ps_ps = 0  # parameter-server sync time added after the task graph (sync="ps")
        cp.bucket_bytes = {}  # devices -> gradient bytes they all-reduce (comm_on_cores)
        upd_s: dict[int, float] = {}
        upd_syncs: dict[int, list[int]] = {}
        upd_bdep: set[int] = set()
        # Gradients of the cluster's shards held by the same devices travel in one
        # all-reduce (the executor buckets them), charged per bucket share.
        groups: dict[tuple, list] = {}  # devices -> [bytes, first (param, shard), reduce bytes, gather bytes]
        shard_list = []
        lowered = not prec.mixed or gathers_in_compute(prec, (ops[o].rule for o in us))
        for pi in pidx:
            _, shards, trainable = place[self.param_names[pi]]
            o0, local = self.param_first[pi]
            traced = ops[o0].dtype
            # parameters, their gradients and optimizer state in one dtype (every precision has it so)
            bpe = dtype_bytes(prec.param_dtype(traced))
            # sharded parameters gather in the gather dtype where only lowered ops (matrix
            # products, convolutions: autocast casts their weights anyway) read them, as the
            # executor does; in their own dtype elsewhere (norm weights, embedding tables)
            gdt = prec.gather_dtype(traced) if lowered else prec.param_dtype(traced)
            rbpe, gbpe = dtype_bytes(prec.reduce_dtype(traced)), dtype_bytes(gdt)
            # autocast casts a parameter (not a buffer) for the ops that use it
            cdt = self.cops[o0].dtype
            cbpe = dtype_bytes(cdt) if prec.mixed and local in ops[o0].params and cdt != prec.param_dtype(traced) else 0
            for si, sh in enumerate(shards):
                numel = region_numel(sh.region)
                nb = numel * bpe
                shard_list.append((pi, si, sh, nb, trainable, numel * rbpe, numel * gbpe, numel * cbpe))
                if trainable and nb > 0 and len(sh.devices) > 1:
                    g = groups.setdefault(tuple(sh.devices), [0, (pi, si), 0, 0])
                    g[0] += nb
                    g[2] += numel * rbpe
                    g[3] += numel * gbpe
        group_sync: dict[tuple, int] = {}
        cp.gathers = []  # (devices, all-gather picoseconds, level 3's backward one too, r1, rm, users, pi, si)
        for devices, (nb, (pi, si), rb, gb) in groups.items():
            dur, sent = self._sync_figures(devices, level, rb, gb)
            gather = 0
            if self.sync == "ps":
                cp.ps_ps += self.ps_sync_ps(devices, rb)
                dur = 1  # the sync task only orders the updates; its time comes after the graph
            elif self.sync == "deferred":
                cp.ps_ps = max(cp.ps_ps, dur)
                dur = 1
            elif level and gb:
                # the parameters' all-gathers are tasks of their own, as the executor runs them:
                # before the users' forward (prefetched: ready from the start of the step) and at
                # level 3 again before their backward; the sync task keeps the reduce-scatter
                rs = _ps(self._allreduce_s(devices, rb) / 2)
                gather = _ps(self._allreduce_s(devices, gb) / 2)
                dur = rs
            links = tuple(D + l for l in m.allreduce_links(devices))
            if self.comm_on_cores:  # every member's cores reduce and move the buckets
                links = tuple(sorted(devices)) + links
            r1, rm = (links[0], None) if len(links) == 1 else (-1, links)
            cp.bucket_bytes[devices] = rb
            group_sync[devices] = len(cp.syncs)
            ds = set(devices)
            users = [(o, k) for o, dv in devs for k, d in enumerate(dv) if d in ds]
            cp.syncs.append((pi, si, frozenset(devices), dur, r1, rm, users))
            cp.sync_bytes += sent
            if gather:
                cp.gathers.append((devices, gather, gather if level >= 3 else 0, r1, rm, users, pi, si))
            for r in links:
                cp.busy[r] += dur + gather * (2 if level >= 3 else 1)
        for pi, si, sh, nb, trainable, reduced, gathered, cast in shard_list:
            # what each replica keeps of the shard at the cluster's level: a 1/n slice of the
            # optimizer state (level >= 1), of the gradient (>= 2), of the parameter (3)
            n = len(sh.devices) if trainable and level else 1
            part = -(-nb // n)
            # level 3 keeps the slice only; levels 1-2 the full parameter the ops read and the
            # flat slice the optimizer updates (the executor's own tensor)
            sharded = bool(level and n > 1)
            value = part if level >= 3 else gathered + part if sharded else nb
            # level 3 gathers the full parameter into storage of its own (the gather units,
            # memory.py); below it the compute-dtype copies autocast makes (``cast``), none of
            # a parameter gathered in the compute dtype
            for d in sh.devices:
                cp.mem[d] += value + ((part if level >= 1 else nb) * oc if trainable else 0)  # value, optimizer state
                if sharded:
                    cp.fval[d] += gathered
                    cp.fgrad[d] += gathered  # (autograd's, in the full parameter's dtype)
                    cp.sl[d] += part
                    cp.slg[d] += -(-gathered // n)
                    cp.nreg[d] += 1
                    cp.padded[d] |= part * n != nb
                if not (sharded and (level >= 3 or gathered != nb)):
                    cp.cast[d] += cast
            if not trainable or nb <= 0:
                continue
            sync = group_sync.get(tuple(sh.devices), -1)
            grad, upd = (part if level >= 2 else gathered if sharded else nb), (part if level >= 1 else nb)
            for d in sh.devices:
                cp.grad[d] += grad
                cp.maxshard[d] = max(cp.maxshard[d], upd)
                if sync >= 0 and level < 2:
                    # the all-reduce bucket (reduce dtype) that the executor, as DDP, keeps from step
                    # to step and hands the synced gradients out of; autograd's own until it
                    cp.kept[d] += reduced
                    cp.ar_grad[d] += grad
                s = m.devices[d].spec
                upd_s[d] = upd_s.get(d, 0.0) + traffic * upd / s.mem_bw_Bps + s.launch_overhead_s
                if sync < 0:
                    upd_bdep.add(d)
                elif sync not in upd_syncs.get(d, ()):
                    upd_syncs.setdefault(d, []).append(sync)
        cp.cols = ([x[3] for x in cp.syncs], [x[4] for x in cp.syncs], [x[5] for x in cp.syncs],
                   [_prio(x[0], SYNC, 0, x[1]) for x in cp.syncs])
        for d in sorted(upd_s):
            bdep = [(o, dv.index(d)) for o, dv in devs if d in dv] if d in upd_bdep else []
            cp.upd[d] = (upd_s[d], upd_syncs.get(d, []), bdep)
        # a lower bound on this cluster's share of its devices' update tasks: a unit's update
        # lasts round(sum of its clusters' seconds) >= that sum - 1/2 ps (float slack besides)
        cp.upd_lb = np.zeros(D, np.int64)
        for d, (s, _, _) in cp.upd.items():
            cp.upd_lb[d] = max(0, int(s * PS * (1.0 - 1e-9) - 0.5))
        self._cluster[key] = cp
        return cp
