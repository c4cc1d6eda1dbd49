"""The runtime's communication: its process groups, point-to-point messages and waits.

Point-to-point is asynchronous: a rank's sends leave as soon as their producer
is computed, its receives are posted ahead (forward: at the start of the step;
backward: at its first exchange) and waited on at first use.  Every wait names
the rank, the step and what it waited on when it fails (:meth:`Comm.wait`).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .gloo import batched_gloo_loops
from .plan import Exchange, ExecutorError, _wire, _wire_dtype

__all__ = ["Comm"]


def _all_reduce(t: torch.Tensor, group):
    """Start summing ``t`` over ``group``; its work.  Straight to the process group's
    own call: ``dist.all_reduce``'s checks cost tens of microseconds a call, which a
    step of small buckets pays every time (DDP's reducer calls the group directly too)."""
    if isinstance(group, dist.ProcessGroup):
        return group.allreduce([t])
    return dist.all_reduce(t, group=group, async_op=True)


def _as(x, dtype):
    """``x`` in the message dtype (cast only where it differs: under ``*-mixed``)."""
    return x if x.dtype == dtype else x.to(dtype)


def _reduce_scatter(out: torch.Tensor, t: torch.Tensor, group):
    """Start summing ``t`` over ``group`` with each member receiving its equal
    part of the sum (rank order) into ``out``; its work."""
    return dist.reduce_scatter_single(out, t, group=group, async_op=True)


class Comm:
    """The communication of a :class:`~flexflow.runtime.execute.Runtime` (a mixin:
    it reads the runtime's plan, timeout and backend, and keeps the works in flight)."""

    # -- setup --------------------------------------------------------------
    def _make_groups(self) -> None:
        """Process groups, created by every rank in the same order."""
        self.groups: dict[tuple, object] = {}
        self.p2p_group = self.coll_group = self.ride_group = None
        self.batch_threads: list[int] = []  # gloo loop threads moved to SCHED_BATCH
        if not self.distributed or self.world == 1:
            return
        every = list(range(self.world))
        keys = set()
        for view, shards, trainable in self.placement.values():
            if trainable:
                for s in shards:
                    ranks = tuple(sorted(self.ranks[d] for d in s.devices))
                    if len(ranks) > 1:
                        keys.add(ranks)
        with batched_gloo_loops() as self.batch_threads:  # (gloo's: see batch_gloo_loops)
            self.p2p_group = dist.new_group(every, timeout=self.timeout)
            self.coll_group = dist.new_group(every, timeout=self.timeout)
            if self.ride is not None:  # the ride bucket and its repairs only (see _GradSync)
                self.ride_group = dist.new_group(every, timeout=self.timeout)
            for key in sorted(keys):
                self.groups[key] = dist.new_group(list(key), timeout=self.timeout)
            for g in sorted(self.coll_groups):  # exchanges run as collectives (collex): groups of their own
                self.groups[("exchange", *g)] = dist.new_group(list(g), timeout=self.timeout)
            # one collective on each new group first (NCCL batched p2p needs it)
            flag = torch.zeros(1, device=self.device)
            for group in (self.p2p_group, self.coll_group, self.ride_group):
                if group is not None:
                    dist.all_reduce(flag, group=group)

    # -- communication ------------------------------------------------------
    def p2p(self, ops) -> list:
        """Post (is_send, tensor, peer, tag) operations; returns the works."""
        if not ops:
            return []
        if self.nccl:
            return dist.batch_isend_irecv([
                dist.P2POp(dist.isend if s else dist.irecv, t, peer, self.p2p_group, tag)
                for s, t, peer, tag in ops])
        g = self.p2p_group  # spans every rank: its ranks are the global ones
        if isinstance(g, dist.ProcessGroup):  # straight to the group (dist.isend's checks cost tens of us)
            return [(g.send if s else g.recv)([t], peer, tag) for s, t, peer, tag in ops]
        return [(dist.isend if s else dist.irecv)(t, peer, group=g, tag=tag) for s, t, peer, tag in ops]

    def wait(self, works, what=None) -> None:
        """Wait for works; a failure names this rank, the step and ``what()``
        (the exchange or collective, and the peers it waits on)."""
        try:
            for w in works:
                if w is not None:
                    w.wait(self.timeout) if not self.nccl else w.wait()
        except Exception as e:  # noqa: BLE001 - re-raised with where it happened
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            where = what() if what is not None else "communication"
            raise ExecutorError(f"rank {self.rank}, step {self.step}: {where}: {first} "
                                f"(timeout {self.timeout.total_seconds():g} s)") from e

    def settle(self) -> None:
        """Wait for everything the previous step left in flight (outputs being
        all-reduced, forward sends)."""
        while self._pending:
            self._pending.pop()()
        if self._sends:
            works, self._sends = [w for ws, _ in self._sends for w in ws], []
            self.wait(works, lambda: "forward sends of the previous step")

    def _post_forward_recvs(self, upto: int | None = None) -> None:
        """Post the forward's receives: those of the exchanges whose reader is at most at
        program position ``upto`` and not posted yet in this pass (every one left with
        ``upto`` None: a pipeline's chunks, which post theirs at once)."""
        if upto is not None:
            order, k = self.fwd_recv_order, self._recv_next
            while k < len(order) and order[k][0] <= upto:
                ex = order[k][1]
                if ex.index not in self._recv:
                    self._post_recv(ex)
                k += 1
            self._recv_next = k
            return
        for ex in self.fwd_recv_ex:
            if ex.index not in self._recv:
                self._post_recv(ex)

    def _post_recv(self, ex) -> None:
        wire = _wire_dtype(ex.dtype)
        bufs = [torch.empty(p.shape, dtype=wire, device=self.device) for p in ex.recvs]
        works = self.p2p([(False, b, p.src, 2 * ex.index) for p, b in zip(ex.recvs, bufs)])
        self._recv[ex.index] = (works, bufs)

    def _post_sends(self, name: str, x: torch.Tensor) -> None:
        x = x.detach()
        for ex in self.sends_after[name]:
            ops = [(True, _wire(_as(x[p.src_region], ex.dtype)).contiguous(), p.dst, 2 * ex.index) for p in ex.sends]
            works = self.p2p(ops)
            self._sends.append((works, [t for _, t, _, _ in ops]))

    def _arm_backward(self, pos: int | None = None) -> None:
        """At the first exchange of a backward pass: post every gradient receive
        of this rank, and wait for the gradient sends at the end of the pass."""
        window = pos is not None and not getattr(self, "defer_waits", False)
        if not self._bwd_armed:
            self._bwd_armed = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
            if not window:  # (a pipeline's micro-batch: every one at once)
                for ex in self.bwd_recv_ex:
                    if ex.index not in self._bwd_recv:
                        self._bwd_recv[ex.index] = self._post_bwd_recvs(ex)
                return
            self._bwd_recv_next, self._bwd_done = 0, set()
        if window:  # those whose reader is within RECV_AHEAD ops of this backward's position
            order, k = self.bwd_recv_order, self._bwd_recv_next
            while k < len(order) and order[k][0] >= pos - self.recv_ahead:
                ex = order[k][1]
                if ex.index not in self._bwd_recv and ex.index not in self._bwd_done:
                    self._bwd_recv[ex.index] = self._post_bwd_recvs(ex)
                k += 1
            self._bwd_recv_next = k

    def _post_bwd_recvs(self, ex: Exchange):
        bufs = [torch.empty(p.shape, dtype=ex.dtype, device=self.device) for p in ex.sends]
        return self.p2p([(False, b, p.dst, 2 * ex.index + 1) for p, b in zip(ex.sends, bufs)]), bufs

    def _end_backward(self) -> None:
        self._bwd_armed = False
        if getattr(self, "defer_waits", False):  # a pipeline: waited for at the end of its step
            self._sends.extend(self._bwd_sends)
            self._bwd_sends = []
            return
        works, self._bwd_sends = [w for ws, _ in self._bwd_sends for w in ws], []
        self.wait(works, lambda: "gradient sends (end of backward)")
