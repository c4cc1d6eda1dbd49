"""Exhaustive branch-and-bound search for small cases (the paper's optimality check)."""
from __future__ import annotations

import math

import numpy as np

from ..cost.model import CostModel
from ..graph.ir import Op, OpGraph, dtype_bytes
from ..graph.ops.base import region_numel
from ..sim.collective import collective_seconds
from ..strategy.collective import regatherable
from ..strategy.config import ParallelConfig
from ..strategy.regions import overlap, partitions
from ..strategy.strategy import Strategy
from .common import (
    _REL,
    Candidates,
    SearchError,
    _better,
    _penalised,
    _simulator,
    _Space,
)

__all__ = ["exhaustive_search"]


# --------------------------------------------------------------------------- exhaustive
class _Bound:
    """Lower bounds on the simulated iteration time of every completion of a
    partial strategy, from what the simulator's task graph guarantees:

    - task dependencies: a partition's forward waits for the producer
      partitions it reads (plus the transfer, ``machine.transfer_time_s``, when
      they sit on another device); its backward for its own forward and for the
      backward of the consumer partitions that read it (plus the gradient
      transfer); a parameter shard's all-reduce (``machine.allreduce_time_s``)
      for the backward of its holders, its update for the all-reduce.  Ops not
      yet assigned count with their fastest partition and only with the
      dependencies that hold under any config.  This gives earliest start
      times (release times) of the assigned ops' tasks.
    - every device and link runs one task at a time: for each resource,
      max over its tasks k of (release_k + total duration of its tasks released
      no earlier than k); and all the work over all devices, unassigned groups
      at their least work, divided by the number of devices.
    """

    def __init__(self, graph: OpGraph, machine, space: _Space, cm):
        self.D = D = machine.num_devices
        self.machine, self.space = machine, space
        ops = self.ops = graph.compute_ops
        self.pos = pos = {op.name: k for k, op in enumerate(ops)}
        self.group_of = [0] * len(ops)
        for gi, key in enumerate(space.keys):
            for m in graph.groups[key]:
                self.group_of[pos[m]] = gi
        # inputs[k]: (input index, producer position); consumers[k]: (consumer position, input index)
        self.inputs = [[(i, pos[u]) for i, u in enumerate(op.inputs) if u in pos] for op in ops]
        self.consumers = [[] for _ in ops]
        for k, ins in enumerate(self.inputs):
            for i, u in ins:
                self.consumers[u].append((k, i))
        self.members = [[pos[m] for m in graph.groups[key]] for key in space.keys]
        self.work, self.total, self.tasks, self.syncs, self.update, self.devs = [], [], [], [], [], []
        self.f_min = np.zeros(len(ops))
        self.b_min = np.zeros(len(ops))
        needs_all = [{i: True for i, _ in ins} for ins in self.inputs]
        # a parameter used by several share groups (tied weights) is left out of the
        # sync tasks and counted in the updates of its first group only
        users: dict[str, list[int]] = {}
        for gi, members in enumerate(self.members):
            for k in members:
                for qual in ops[k].params.values():
                    if gi not in users.setdefault(qual, []):
                        users[qual].append(gi)
        for gi, members in enumerate(self.members):
            rep = ops[members[0]]
            own = [loc for loc, q in rep.params.items() if users[q][0] == gi]
            alone = [loc for loc, q in rep.params.items() if users[q] == [gi]]
            w_rows, t_rows, s_rows, u_rows = [], [], [], []
            for cfg in space.cands[gi]:
                w = np.zeros(D)
                t_row = {}
                for k in members:
                    op = ops[k]
                    parts = partitions(op, cfg)
                    ts = np.array([cm.op_time(op, p, p.device) for p in parts])
                    devs = [p.device for p in parts]
                    np.add.at(w, devs, ts.sum(1))
                    t_row[k] = (ts[:, 0].copy(), ts[:, 1].copy(), np.array(devs, dtype=np.int64))
                    for i, _ in self.inputs[k]:
                        if any(p.inputs[i] is None for p in parts):
                            needs_all[k][i] = False
                t_rows.append(t_row)
                s_rows.append(_sync_tasks(machine, rep, cfg, alone))
                # SGD update of the held parameter blocks: reads parameter and gradient and
                # writes the parameter at least (memory bound), one kernel per parameter
                upd = np.zeros(D)
                for p in partitions(rep, cfg):
                    spec = machine.devices[p.device].spec
                    for local in own:
                        nbytes = region_numel(p.params[local]) * dtype_bytes(rep.dtype)
                        upd[p.device] += 3 * nbytes / spec.mem_bw_Bps + spec.launch_overhead_s
                u_rows.append(upd)
                w_rows.append(w + upd)
            self.work.append(np.array(w_rows))
            self.total.append(np.array(w_rows).sum(1))
            self.tasks.append(t_rows)
            self.syncs.append(s_rows)
            self.update.append(np.array(u_rows))
            self.devs.append([row[members[0]][2] for row in t_rows])
            for k in members:
                self.f_min[k] = min(r[k][0].min() for r in t_rows)
                self.b_min[k] = min(r[k][1].min() for r in t_rows)
        self.min_total = [float(t.min()) for t in self.total]
        self.suffix_min = np.concatenate([np.cumsum(self.min_total[::-1])[::-1], [0.0]])
        self.needs_all = needs_all
        # covers[k][i]: op k as a whole reads all of input i, so under any config every
        # partition of the producer is read by some partition of op k
        self.covers = []
        for k, op in enumerate(ops):
            whole = partitions(op, ParallelConfig({}, (0,)))[0]
            cov = {}
            for i, u in self.inputs[k]:
                r = whole.inputs[i]
                cov[i] = r is not None and all(s.start <= 0 and s.stop >= n
                                               for s, n in zip(r, ops[u].output_shape))
            self.covers.append(cov)
        # the simulator rounds each task to integer picoseconds: allow for it
        self.slack_s = 1e-12 * (8 * len(ops) * max(D, 1) + 16)
        self._x: dict = {}

    def _xfer(self, u: int, ju: int, v: int, jv: int, i: int):
        """(fwd, bwd, remote) for producer u on candidate ju, consumer v on jv, input i:
        (P_v, P_u) matrices, -inf where consumer partition a reads nothing of
        producer partition b, else the transfer time (0 on one device), forward
        b -> a, backward a -> b; remote lists (a, b, fwd_s, fwd links, bwd_s, bwd links)."""
        key = (u, ju, v, jv, i)
        hit = self._x.get(key)
        if hit is None:
            uop, vop = self.ops[u], self.ops[v]
            cu = self.space.cands[self.group_of[u]][ju]
            cv = self.space.cands[self.group_of[v]][jv]
            pu, pv = partitions(uop, cu), partitions(vop, cv)
            esize = dtype_bytes(uop.dtype)
            fwd = np.full((len(pv), len(pu)), -np.inf)
            bwd = np.full((len(pv), len(pu)), -np.inf)
            remote, sizes = [], []
            m, D = self.machine, self.D
            for a, p in enumerate(pv):
                r = p.inputs[i]
                if r is None:
                    continue
                for b, q in enumerate(pu):
                    ov = overlap(r, q.output)
                    if ov is None:
                        continue
                    if q.device == p.device:
                        fwd[a, b] = bwd[a, b] = 0.0
                        continue
                    nbytes = region_numel(ov) * esize
                    fwd[a, b] = tf = m.transfer_time_s(q.device, p.device, nbytes)
                    bwd[a, b] = tb = m.transfer_time_s(p.device, q.device, nbytes)
                    remote.append((a, b, tf, [D + l for l in m.route(q.device, p.device)],
                                   tb, [D + l for l in m.route(p.device, q.device)]))
                    sizes.append(nbytes)
            remote = self._as_collectives(remote, sizes, pu, pv, i, esize, vop, cv, fwd, bwd)
            # per link a transfer occupies: (link, producer partition, fwd s), (link, consumer partition, bwd s)
            fl = [(l, b, tf) for a, b, tf, lf, tb, lb in remote for l in lf]
            bl = [(l, a, tb) for a, b, tf, lf, tb, lb in remote for l in lb]
            as_arrays = lambda rows: (np.array([r[0] for r in rows], dtype=np.int64),
                                      np.array([r[1] for r in rows], dtype=np.int64),
                                      np.array([r[2] for r in rows], dtype=float))
            hit = self._x[key] = (fwd, bwd, as_arrays(fl), as_arrays(bl))
        return hit

    def _as_collectives(self, remote: list, sizes: list, pu, pv, i: int, esize: int, vop, cv, fwd, bwd) -> list:
        """``remote`` with the transfers' times those the task graph gives them where they are
        collectives (:func:`flexflow.sim.collective.collective_seconds`; the input gathered
        again before a linear reader's backward), ``fwd`` / ``bwd`` updated alike."""
        if not remote:
            return remote
        coll = collective_seconds(self.machine, [pu[b].device for _, b, *_ in remote],
                                  [pv[a].device for a, *_ in remote], sizes, bool(pu[0].partial),
                                  lambda k: pv[remote[k][0]].inputs[i],
                                  lambda k: region_numel(pu[remote[k][1]].output) * esize)
        if coll is None:
            return remote
        secs, kind = coll
        back = 2 if kind == "gather" and regatherable(vop, cv) else 1
        out = []
        for (a, b, _, lf, _, lb), t in zip(remote, secs.tolist()):
            fwd[a, b], bwd[a, b] = t, back * t
            if not self.machine.spec.comm_on_cores:  # the receiving end (receiver_resources)
                lf, lb = lf[-1:], lb[-1:]
            out.append((a, b, t, lf, back * t, lb))
        return out

    def __call__(self, assign: list[int]) -> float:
        """assign[g] = candidate index of group g, for the first len(assign) groups."""
        n_assigned = len(assign)
        load = np.zeros(self.D)
        done = 0.0
        for gi, j in enumerate(assign):
            load += self.work[gi][j]
            done += self.total[gi][j]
        bound = max(load.max(), (done + self.suffix_min[n_assigned]) / self.D)
        n = len(self.ops)
        jof = [assign[g] if g < n_assigned else -1 for g in self.group_of]
        tasks = self.tasks
        # earliest finish of the forward: per partition (assigned) or of the earliest partition
        ef: list = [None] * n
        ef_min = [0.0] * n
        for k in range(n):
            j = jof[k]
            if j >= 0:
                f = tasks[self.group_of[k]][j][k][0]
                start = np.zeros(len(f))
                for i, u in self.inputs[k]:
                    if jof[u] >= 0:
                        x = self._xfer(u, jof[u], k, j, i)[0]
                        start = np.maximum(start, (ef[u][None, :] + x).max(1))
                    elif self.needs_all[k][i]:
                        start = np.maximum(start, ef_min[u])
                ef[k] = start + f
                ef_min[k] = float(ef[k].min())
            else:
                start = max((ef_min[u] for i, u in self.inputs[k] if self.needs_all[k][i]), default=0.0)
                ef[k] = ef_min[k] = start + self.f_min[k]
        eb: list = [None] * n
        eb_min = [0.0] * n
        for k in reversed(range(n)):
            j = jof[k]
            if j >= 0:
                start = np.array(ef[k], dtype=float)
                for w, i in self.consumers[k]:
                    if jof[w] >= 0:
                        x = self._xfer(k, j, w, jof[w], i)[1]
                        start = np.maximum(start, (eb[w][:, None] + x).max(0))
                    elif self.covers[w][i]:
                        start = np.maximum(start, eb_min[w])
                eb[k] = start + tasks[self.group_of[k]][j][k][1]
                eb_min[k] = float(eb[k].min())
                bound = max(bound, float(eb[k].max()))
            else:
                start = max([ef_min[k]] + [eb_min[w] for w, i in self.consumers[k] if self.covers[w][i]])
                eb[k] = eb_min[k] = start + self.b_min[k]
                bound = max(bound, eb_min[k])
        # one task at a time per resource, tasks released at their earliest start
        res, rel, dur = [], [], []
        for k in range(n):
            j = jof[k]
            if j < 0:
                continue
            f, b, devs = tasks[self.group_of[k]][j][k]
            res += (devs, devs)
            rel += (ef[k] - f, eb[k] - b)
            dur += (f, b)
            for i, u in self.inputs[k]:
                if jof[u] >= 0:
                    _, _, (lf, qf, tf), (lb, qb, tb) = self._xfer(u, jof[u], k, j, i)
                    if len(lf):
                        res += (lf, lb)
                        rel += (ef[u][qf], eb[k][qb])
                        dur += (tf, tb)
        for gi in range(n_assigned):
            j = assign[gi]
            members = self.members[gi]
            upd = self.update[gi][j]
            if not upd.any():
                continue
            devs = self.devs[gi][j]
            held = np.max([eb[k] for k in members], axis=0)  # backward done on each partition
            after = held.copy()  # when each partition's update may start
            for sdur, links, parts in self.syncs[gi][j]:
                r = float(held[parts].max())
                res.append(links)
                rel.append(np.full(len(links), r))
                dur.append(np.full(len(links), sdur))
                after[parts] = np.maximum(after[parts], r + sdur)
            res.append(devs)
            rel.append(after)
            dur.append(upd[devs])
        if res:
            res, rel, dur = np.concatenate(res), np.concatenate(rel), np.concatenate(dur)
            order = np.lexsort((-rel, res))  # by resource, latest release first
            res, rel, dur = res[order], rel[order], dur[order]
            acc = np.cumsum(dur)
            first = np.flatnonzero(np.r_[True, res[1:] != res[:-1]])  # start of each resource's run
            base = np.repeat(np.r_[0.0, acc[first[1:] - 1]], np.diff(np.r_[first, len(res)]))
            bound = max(bound, float((rel + acc - base).max()))
        return bound - self.slack_s


def _sync_tasks(machine, op: Op, config: ParallelConfig, params) -> list:
    """(all-reduce seconds, link resource ids, holder partition indices) for every
    shard of the op's parameters ``params`` (local names) held by several
    partitions (equal or disjoint regions: partitions form a grid).  Only the bandwidth
    term of the ring all-reduce counts (t(2b) - t(b) of ``machine.allreduce_time_s``):
    the simulator may fuse gradients into buckets and share out the latency."""
    D = machine.num_devices
    out = []
    parts = partitions(op, config)
    for local in params:
        holders: dict = {}
        for p in parts:
            holders.setdefault(tuple((s.start, s.stop) for s in p.params[local]), []).append(p.index)
        for region, idx in holders.items():
            if len(idx) > 1:
                devs = [parts[i].device for i in idx]
                nbytes = math.prod(b - a for a, b in region) * dtype_bytes(op.dtype)
                bw_s = machine.allreduce_time_s(devs, 2 * nbytes) - machine.allreduce_time_s(devs, nbytes)
                out.append((max(bw_s, 0.0), [D + l for l in machine.allreduce_links(devs)], np.array(idx)))
    return out


def exhaustive_search(graph: OpGraph, machine, cost_model=None, max_states: int = 1_000_000, *,
                      candidates: Candidates | None = None, incumbent: Strategy | None = None,
                      optimizer: str = "sgd"):
    """Global optimum by branch and bound over every combination of candidate
    configs (one per share group), groups assigned in topological order, a
    subtree pruned when :class:`_Bound` proves it cannot beat the best
    simulated strategy so far.  Returns (strategy, SimResult, explored) where
    explored counts search-tree nodes.  Raises SearchError after ``max_states``
    nodes rather than claim an optimum it has not proved.  Feasibility is not
    pruned on: the optimum is over time among feasible strategies when one
    exists (bounds on time stay valid for the feasible subset)."""
    cm = cost_model if cost_model is not None else CostModel(machine)
    space = _Space(graph, machine, candidates)
    bound = _Bound(graph, machine, space, cm)
    sim = _simulator(graph, machine, cm, optimizer)
    n = len(space.reps)
    best = {"key": None, "s": None, "res": None}
    scale = [None]

    def consider(s, res):
        if scale[0] is None:
            scale[0] = res.iteration_time
        k = (0 if res.feasible else 1, _penalised(res, machine, scale[0]))
        if _better(k, best["key"]):
            best.update(key=k, s=s, res=res)

    starts = [incumbent] if incumbent is not None else []
    starts += [Strategy.data_parallel(graph, machine), Strategy.expert(graph, machine),
               Strategy.model_parallel(graph, machine)]
    for s in starts:
        if space.contains(s):
            consider(s, sim.simulate(s, incremental=False))
    explored = 0
    cur = [space.random(0, "exhaustive")]
    assign: list[int] = []

    def visit(gi: int):
        nonlocal explored
        explored += 1
        if explored > max_states:
            raise SearchError(f"exhaustive search gave up after max_states={max_states} states; "
                              f"restrict the candidates or raise max_states")
        if gi == n:
            consider(cur[0], sim.simulate(cur[0], incremental=True))
            return
        children = []
        for j in range(len(space.cands[gi])):
            assign.append(j)
            children.append((bound(assign), j))  # visit the most promising first
            assign.pop()
        children.sort()
        for b, j in children:
            key = best["key"]
            if key is not None and key[0] == 0 and b >= key[1] * (1.0 - _REL):
                break  # this child and the rest cannot beat the best
            assign.append(j)
            prev = cur[0]
            cur[0] = prev.replace(space.reps[gi], space.cands[gi][j])
            visit(gi + 1)
            cur[0] = prev
            assign.pop()

    visit(0)
    s = Strategy(graph, dict(best["s"]), machine, name="exhaustive")
    return s, best["res"], explored
