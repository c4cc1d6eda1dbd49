"""Gradient sync: the static buckets' all-reduce, and the outputs that ride in one.

A parameter shard held by several ranks (``ParamShard.devices``) has its
gradient all-reduced (SUM: the loss's partial sums already carry the global
1/N, so each replica holds a partial of the true gradient) among exactly those
ranks, in one process group per distinct set of ranks (created once, by every
rank, in the same order).  The buckets are planned statically
(:meth:`flexflow.runtime.plan.Plan._plan_buckets`).  A gate's backward runs
after the backward of every use of its shards (all come later in forward
order), so it holds the bucket's complete local gradients and launches the
bucket's all-reduce asynchronously (:meth:`_GradSync.add`); the rest of the
backward overlaps with it.  An engine callback at the end of the backward
waits for every handle and adds the reduced gradients to ``param.grad``
(:meth:`_GradSync.finish`: the gate gives the parameter itself no gradient;
accumulation over several backward calls works as usual).  Shards held by one
rank use plain AccumulateGrad.  Every shard's gradient is a
:class:`~flexflow.runtime.gradnorm.ShardGrad` (the global norm for torch's
clipping utilities).

``ParallelModule.no_sync()`` sets :attr:`_GradSync.skip` for the forwards
inside it: their backward all-reduces no bucket (the outputs riding in one
are all-reduced alone), and each replicated shard keeps its local gradient --
in ``param.grad`` where that held nothing synchronized, else aside -- which
the bucket of the next synchronized backward adds to its own gradient
(:meth:`_GradSync._local_part`), as one process accumulating the same
micro-batches would.

Under ``reduce_outputs="with_gradients"`` the graph outputs ride in one of
these buckets (:class:`_Rider`); :class:`Riding` covers an output read before
the backward.
"""
from __future__ import annotations

import weakref

import torch

from .comm import _all_reduce, _reduce_scatter
from .gradnorm import NormScope, install_hooks, shard_grad
from .plan import _Gate

__all__ = ["Riding"]

RS_IN_FLIGHT = 2  # reduce-scatters a backward keeps in flight (each holds a unit's full gradients)


class _Rider:
    """An output all-reduced inside a gradient bucket (reduce_outputs="with_gradients")."""

    WAITING, SENT, DONE = 0, 1, 2
    __slots__ = ("name", "full", "state")

    def __init__(self, name: str, full: torch.Tensor):
        self.name, self.full, self.state = name, full, _Rider.WAITING


class Riding:
    """Outputs riding on the gradient all-reduce, read on a rank (a mixin of
    :class:`~flexflow.runtime.execute.Runtime`)."""

    def _read_rider(self, job: _Rider) -> None:
        """An output riding on the gradient all-reduce, at its first read (or at
        the next step): already there after the backward; read before it, the
        ride bucket is all-reduced now (see ``_early_ride``)."""
        if job.state == _Rider.WAITING:
            self._early_ride()
        elif job.state == _Rider.SENT:  # read during the backward
            self.sync.finish()

    def _early_ride(self) -> None:
        """The outputs read before the backward, on this rank: it takes its part
        in the ride bucket's all-reduce now, with zeros for its gradients and a
        1 in the bucket's last element, which counts the ranks that did so.  The
        other ranks need not know: they launch the bucket in their backward as
        always, and the sum gives every output's full value.  Every rank then
        learns from the count that gradients are missing from it, and at the end
        of the backward every rank makes one more all-reduce of the bucket's
        gradients (``_GradSync.finish``): these ranks with theirs, the others
        with zeros.  A read on some ranks only, before the backward, thus costs
        one collective and never waits for a peer that will not come."""
        riders, self._riders = self._riders, []
        # under no_sync the bucket carries the outputs alone (_GradSync.add does the same)
        pieces = [] if self.sync.skip else [torch.zeros(self.ride_numel, dtype=self.ride_dtype, device=self.device)]
        pieces += [job.full.reshape(-1) for job in riders]
        pieces.append(torch.ones(1, dtype=self.ride_dtype, device=self.device))
        flat = torch.cat(pieces)
        work = _all_reduce(flat, self.ride_group)
        self.wait([work], lambda: f"all_reduce of outputs {[j.name for j in riders]} among all {self.world} "
                                  f"ranks, read before backward()")
        _copy_riders(riders, flat, 0 if self.sync.skip else self.ride_numel)
        self._early.append(flat)


def _copy_riders(riders, flat: torch.Tensor, off: int) -> None:
    """The outputs riding in ``flat`` from ``off`` on, copied into their jobs."""
    with torch.no_grad():
        for job in riders:
            n = job.full.numel()
            job.full.copy_(flat[off:off + n].view_as(job.full))
            off += n
            job.state = _Rider.DONE


def _uses(t: torch.Tensor) -> int | None:
    """How many tensors and views hold ``t``'s storage (None where this torch
    does not say: then no buffer is reused)."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    return None if count is None else count(t.untyped_storage()._cdata)


class _Job:
    """A bucket's all-reduce in flight (``work`` None: this rank took its part early,
    its gradients ``mine`` go in the repair); ``whole``: per shard, whether the sum
    replaces ``param.grad`` (which held only this rank's unsynchronized gradient)."""

    __slots__ = ("work", "flat", "quals", "params", "key", "riders", "ride", "mine", "whole", "scatter")

    def __init__(self, work, flat, quals, params, key, riders, ride, mine, whole, scatter=None):
        self.work, self.flat, self.quals, self.params, self.key = work, flat, quals, params, key
        self.riders, self.ride, self.mine, self.whole = riders, ride, mine, whole
        self.scatter = scatter  # reduce-scattered bucket: each region's offset in this rank's slice


class _GradSync:
    """Asynchronous all-reduce of the static gradient buckets, waited at the end of backward."""

    def __init__(self, rt):
        self.rt = rt
        self.works: list = []
        self.armed = False
        # (gate op, bucket position) -> (flat buffer, its storage's use count when
        # nothing else views it).  A bucket's buffer is kept from step to step, as
        # DDP keeps its buckets: allocating a large bucket afresh every step costs a
        # page fault per page (tens of ms per 64 MB on a VM).  The gradients are
        # handed out as views of it, so a buffer is reused only once nothing views
        # it any more (zero_grad() dropped the gradients and no one kept them).
        self.buffers: dict = {}
        self.skip = False  # the last forward with autograd ran under no_sync(): no bucket is all-reduced
        # qual -> (weak reference to the param.grad it belongs to, the gradient kept aside or
        # None where param.grad itself holds it): a replicated shard's local, unsynchronized
        # gradient from backward passes under no_sync()
        self.local: dict = {}
        self.local_full: dict = {}  # sharded qual -> its full-region gradient kept under no_sync
        self.scope = NormScope(rt)
        install_hooks(rt.params, self.scope)

    def add(self, gate: _Gate, grads) -> None:
        """Launch the gate's buckets (called from its backward, in chain order)."""
        rt = self.rt
        if not self.armed:
            torch.autograd.Variable._execution_engine.queue_callback(self.finish)
            self.armed = True
        by_qual = dict(zip(gate.quals, grads))
        if self.skip:
            self._keep_local(by_qual)
            for pos, (key, quals) in enumerate(gate.buckets):
                if rt.ride == (gate.op, pos):
                    self._ride_alone(key)
            return
        for pos, (key, quals) in enumerate(gate.buckets):
            if rt.shard_level.get(quals[0], 0) >= 2:
                self._reduce_scatter(key, quals, by_qual)
                continue
            params = [rt.compute_tensor(q) for q in quals]
            pieces, whole = [], []
            for q, p in zip(quals, params):
                g, replaces = self._local_part(q, rt.params[q], by_qual[q])
                dt = rt.params[q].dtype  # (a region gathered in bfloat16 reduces in its own dtype)
                pieces.append((g.to(dt) if g is not None else torch.zeros(p.shape, dtype=dt, device=p.device))
                              .reshape(-1))
                whole.append(replaces)
            riders, ride = [], rt.ride == (gate.op, pos)
            if ride and rt._early:  # this rank took its part early (Runtime._early_ride): repaired at the end
                early = rt._early.pop(0)
                self.works.append(_Job(None, early, quals, params, key, riders, True, torch.cat(pieces), whole))
                continue
            if ride:  # the outputs ride along (every rank, every step), and a 0: no gradient missing here
                riders, rt._riders = rt._riders, []
                pieces += [job.full.reshape(-1) for job in riders]
                pieces.append(torch.zeros(1, dtype=pieces[0].dtype, device=pieces[0].device))
            flat = self._flat((gate.op, pos), pieces)
            work = _all_reduce(flat, rt.ride_group if ride else rt.groups[key])
            for job in riders:
                job.state = _Rider.SENT
            self.works.append(_Job(work, flat, quals, params, key, riders, ride, None, whole))

    # -- no_sync ------------------------------------------------------------
    def _keep_local(self, by_qual) -> None:
        """Under no_sync: each replicated shard's gradient stays on this rank, added to
        ``param.grad`` where that holds only such gradients, else kept aside."""
        for q, g in by_qual.items():
            if g is None:
                continue
            if q in self.rt.full:  # a sharded region's full gradient waits aside (not its slice's grad),
                kept = self.local_full.get(q)  # summed in the parameter's own dtype
                self.local_full[q] = (g.to(self.rt.params[q].dtype, memory_format=torch.contiguous_format, copy=True)
                                      if kept is None else kept.add_(g))
                continue
            p = self.rt.params[q]
            held, entry = p.grad, self.local.get(q)
            if held is not None and entry is not None and entry[0]() is held:
                (entry[1] if entry[1] is not None else held).add_(g)
            elif held is None:
                p.grad = shard_grad(g.clone(memory_format=torch.contiguous_format), self.scope,
                                    self.scope.owner[q])
                self.local[q] = (weakref.ref(p.grad), None)
            else:  # param.grad holds synchronized gradients: this one waits aside
                self.local[q] = (weakref.ref(held), g.clone(memory_format=torch.contiguous_format))

    def _local_part(self, q: str, p, g):
        """The gradient this rank gives to shard ``q``'s all-reduce: ``g`` plus what the
        backward passes under no_sync left (unless zero_grad() dropped it since), and
        whether the sum replaces ``param.grad`` (it held that part alone)."""
        if q in self.rt.full:
            kept = self.local_full.pop(q, None)
            return (g if kept is None else kept if g is None else g + kept), False
        entry = self.local.pop(q, None)
        if entry is None or p.grad is None or entry[0]() is not p.grad:
            return g, False
        kept = (entry[1] if entry[1] is not None else p.grad).as_subclass(torch.Tensor)
        return (kept if g is None else g + kept), entry[1] is None

    def _ride_alone(self, key) -> None:
        """Under no_sync, the outputs riding in this bucket are all-reduced without its
        gradients (``Runtime._early_ride`` sends the same shape)."""
        rt = self.rt
        if rt._early:  # this rank's part was taken at the read
            rt._early.pop(0)
            return
        riders, rt._riders = rt._riders, []
        flat = torch.cat([job.full.reshape(-1) for job in riders]
                         + [torch.zeros(1, dtype=rt.ride_dtype, device=rt.device)])
        work = _all_reduce(flat, rt.ride_group)
        for job in riders:
            job.state = _Rider.SENT
        self.works.append(_Job(work, flat, [], [], key, riders, False, None, []))

    # -- sharded regions (levels 2 and 3) -------------------------------------
    def _reduce_scatter(self, key, quals, by_qual) -> None:
        """Launch a sharded bucket's reduce-scatter: every region's gradient padded to
        n equal chunks, laid out rank-major (rank j's chunks of every region, then
        rank j+1's), so that rank j receives the sum of its slices.  Level-3 regions
        are freed: their users' backward is done."""
        rt = self.rt
        n = len(key)
        cols, offsets, off = [], [], 0
        for q in quals:
            full, sl = rt.full[q], rt.slices[q]
            g, _ = self._local_part(q, None, by_qual[q])
            dt = rt.params[q].dtype  # reduced in the parameter's dtype (a bfloat16 gather's gradient too)
            g = torch.zeros(full.numel(), dtype=dt, device=full.device) if g is None else g.reshape(-1).to(dt)
            if sl.chunk * n != sl.numel:
                g = torch.nn.functional.pad(g, (0, sl.chunk * n - sl.numel))
            cols.append(g.view(n, sl.chunk))
            offsets.append(off)
            off += sl.chunk
        send = cols[0].reshape(-1) if len(cols) == 1 else torch.cat(cols, dim=1).reshape(-1)
        del cols, g
        out = torch.empty(off, dtype=send.dtype, device=send.device)
        self._drain_scatters(RS_IN_FLIGHT - 1)
        work = _reduce_scatter(out, send, rt.groups[key])
        rt.free_full(quals)
        self.works.append(_Job(work, out, list(quals), [], key, [], False, send, [], offsets))

    def _drain_scatters(self, keep: int) -> None:
        """Finish all but the ``keep`` latest reduce-scatters in flight: their slices go
        to the gradients now and their inputs (a unit's full gradients) are freed, so the
        backward holds a few units' full gradients, not every unit's."""
        flying = [job for job in self.works if job.scatter is not None and job.mine is not None]
        for job in flying[:max(len(flying) - keep, 0)]:
            self.rt.wait([job.work], lambda: f"gradient reduce-scatter among ranks {list(job.key)}")
            self._give_slices(job, job.flat)
            # done: finish() skips it; the work is dropped too (a gloo work holds its input,
            # the unit's full gradients, for as long as it lives)
            job.mine = job.work = None

    def _give_slices(self, job: _Job, out: torch.Tensor) -> None:
        """A reduce-scattered bucket's slices into the flat parameters' gradients."""
        rt = self.rt
        for q, off in zip(job.quals, job.scatter):
            sl, p = rt.slices[q], rt.params[q]
            g = out[off:off + sl.hi - sl.lo]
            if p.grad is None:
                p.grad = shard_grad(g, self.scope, True)
            else:
                p.grad.add_(g)

    # -- end of backward ----------------------------------------------------
    def _flat(self, slot, pieces) -> torch.Tensor:
        """The pieces concatenated into the slot's buffer (a new one when it is
        missing, of another size or dtype, or still viewed by someone)."""
        n = sum(x.numel() for x in pieces)
        held = self.buffers.get(slot)
        if held is not None:
            buf, alone = held
            if buf.numel() == n and all(x.dtype == buf.dtype for x in pieces) and _uses(buf) == alone:
                return torch.cat(pieces, out=buf)
        buf = torch.cat(pieces)
        alone = _uses(buf)
        if alone is not None:
            self.buffers[slot] = (buf, alone)
        return buf

    def finish(self) -> None:
        try:
            works, self.works = self.works, []
            owner = self.scope.owner
            for job in works:
                flat = job.flat
                if job.scatter is not None and job.mine is None:  # finished early (_drain_scatters)
                    continue
                if job.work is None:  # this rank's part was early: its gradients (mine) come in the repair
                    self._repair(flat, job.mine.numel(), job.mine)
                else:
                    self.rt.wait([job.work], lambda: f"gradient all-reduce among ranks {list(job.key)} "
                                                     f"(end of backward)")
                    if job.ride and flat[-1].item() > 0:  # some rank took its part early
                        self._repair(flat, sum(p.numel() for p in job.params), None)
                if job.scatter is not None:  # reduce-scattered: each region's slice
                    self._give_slices(job, flat)
                    continue
                off = 0
                for q, p, whole in zip(job.quals, job.params, job.whole):
                    n = p.numel()
                    g = flat[off:off + n].view_as(p)
                    off += n
                    sl = self.rt.slices.get(q)
                    if sl is not None:  # level 1: the all-reduced gradient cut to this rank's slice
                        g, p = g.reshape(-1)[sl.lo:sl.hi], self.rt.params[q]
                    if p.grad is None or whole:
                        p.grad = shard_grad(g, self.scope, owner[q])
                    else:
                        p.grad.add_(g)
                _copy_riders(job.riders, flat, off)
        finally:
            self.reset()

    def _repair(self, flat: torch.Tensor, n: int, mine) -> None:
        """The ride bucket's gradients that ranks reading the outputs early left
        out (``Runtime._early_ride``): one more all-reduce on the ride group, in
        which those ranks give theirs (``mine``) and the others zeros; added to
        the first ``n`` elements of ``flat`` (the bucket's sum so far)."""
        rt = self.rt
        extra = mine if mine is not None else torch.zeros(n, dtype=flat.dtype, device=flat.device)
        work = _all_reduce(extra, rt.ride_group)
        rt.wait([work], lambda: "gradients of the ride bucket, after an output was read before backward() "
                                "on some rank")
        flat[:n] += extra

    def reset(self) -> None:
        self.works, self.armed = [], False
