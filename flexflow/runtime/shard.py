"""Sharded parameters at run time: gathering the full regions from the ranks' slices.

What is sharded and how is planned in :mod:`.shardplan` (pure); this mixin of
:class:`~flexflow.runtime.execute.Runtime` moves the data:

- forward: every unit whose slices changed since its last gather (the
  optimizer stepped, a state dict was loaded) or that was freed is
  all-gathered asynchronously, in unit order, :data:`PREFETCH` units ahead
  of the ops; each is waited for just before its first user runs, so the
  gathers overlap the ops before it;
- level 3: after the last forward user of a unit its full regions are freed
  (their storage resized to nothing: autograd's saved references to them
  stay valid, as FSDP does it), and a hook on every user's output gathers
  them again before that user's backward; each such gather also starts the
  next one the backward will need (prefetch).  The gradient's
  reduce-scatter frees them again (:mod:`.sync`).

Every gather runs on a process group of its own per group of ranks (one
stream of collectives, issued in the same order by every member: units in
program order in the forward, in descending order of their last user in the
backward), apart from the gradient buckets' groups.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .gloo import batched_gloo_loops

__all__ = ["Gathering"]

PREFETCH = 1  # units whose gathers are in flight ahead of the forward


class Gathering:
    """The all-gathers of a runtime's sharded regions (a mixin)."""

    def _make_gather_groups(self) -> None:
        """A process group per group of ranks sharing a sharded region (every rank
        creates them, in the same order, after the runtime's other groups)."""
        self.gather_groups: dict[tuple, object] = {}
        self._seen = {q: None for q in self.full}  # flat slice's version at its region's last gather
        self._freed: set[str] = set()
        self._inflight: dict[int, tuple] = {}  # unit -> (work, receive buffer, send buffer)
        self._first_at: dict[int, list] = {}  # program position -> units first read there
        self._users_at: dict[int, list] = {}  # program position -> level-3 units read there
        self._bwd_order: dict[tuple, list] = {}  # key -> level-3 units, last user descending
        self._bwd_next: dict[tuple, int] = {}
        for ui, u in enumerate(self.units):
            self._first_at.setdefault(u.first, []).append(ui)
            if u.level >= 3:
                for pos in u.users:
                    self._users_at.setdefault(pos, []).append(ui)
                self._bwd_order.setdefault(u.key, []).append(ui)
        for key, order in self._bwd_order.items():
            order.sort(key=lambda ui: -self.units[ui].last)
        if not self.shard_keys or not self.distributed or self.world == 1:
            return
        with batched_gloo_loops() as moved:
            for key in sorted(self.shard_keys):
                self.gather_groups[key] = dist.new_group(list(key), timeout=self.timeout)
        self.batch_threads.extend(moved)

    # -- gathers ----------------------------------------------------------------
    def _stale(self, ui: int) -> bool:
        return any(q in self._freed or self._seen[q] != self.params[q]._version for q in self.units[ui].quals)

    def _launch_gather(self, ui: int) -> None:
        if ui in self._inflight:
            return
        u = self.units[ui]
        q0 = self.full[u.quals[0]]
        send = torch.zeros(u.chunk, dtype=q0.dtype, device=self.device)
        with torch.no_grad():
            for q, off in zip(u.quals, u.offsets):
                flat = self.params[q].detach()
                send[off:off + flat.numel()] = flat
        n = len(u.key)
        if len(u.quals) == 1 and u.chunk * n == q0.numel():  # straight into the region's own storage
            recv = self._alias(q0)
        else:
            recv = torch.empty(n * u.chunk, dtype=q0.dtype, device=self.device)
        work = dist.all_gather_single(recv, send, group=self.gather_groups[u.key], async_op=True)
        self._inflight[ui] = (work, recv, send, [self.params[q]._version for q in u.quals])

    @staticmethod
    def _alias(full: torch.Tensor) -> torch.Tensor:
        """A flat tensor on ``full``'s storage (restored to its size where freed) with a
        version counter of its own: writing it is no in-place change autograd sees."""
        storage = full.untyped_storage()
        need = (full.storage_offset() + full.numel()) * full.element_size()
        if storage.nbytes() < need:
            storage.resize_(need)
        alias = torch.empty(0, dtype=full.dtype, device=full.device)
        return alias.set_(storage, full.storage_offset(), (full.numel(),))

    def _finish_gather(self, ui: int) -> None:
        """Wait for unit ``ui``'s gather and write the full regions (storage restored
        where freed, written through an alias so autograd sees no in-place change)."""
        u = self.units[ui]
        work, recv, _, versions = self._inflight.pop(ui)
        self.wait([work], lambda: f"all-gather of sharded parameters {u.quals} among ranks {list(u.key)}")
        rows = recv.view(len(u.key), u.chunk)
        with torch.no_grad():
            for q, off, version in zip(u.quals, u.offsets, versions):
                full, sl = self.full[q], self.slices[q]
                if recv.untyped_storage().data_ptr() != full.untyped_storage().data_ptr():
                    self._alias(full).copy_(rows[:, off:off + sl.chunk].reshape(-1)[:sl.numel])
                self._seen[q] = version
                self._freed.discard(q)

    def free_full(self, quals) -> None:
        """Release the full regions of level-3 ``quals`` (gathered again when needed)."""
        for q in quals:
            if self.shard_level.get(q, 0) >= 3 and q not in self._freed:
                self.full[q].untyped_storage().resize_(0)
                self._freed.add(q)

    def gather_all(self) -> list:
        """Every stale unit gathered now (collective over each unit's ranks, in unit
        order); returns the level-3 units it gathered (to free them again)."""
        stale = [ui for ui in range(len(self.units)) if self._stale(ui)]
        for ui in stale:
            self._launch_gather(ui)
        for ui in stale:
            self._finish_gather(ui)
        return [ui for ui in stale if self.units[ui].level >= 3]

    # -- in the forward -----------------------------------------------------------
    def _gather_begin(self) -> None:
        """At the start of a forward: the stale units' gathers, in unit order."""
        for key in self._bwd_order:
            self._bwd_next[key] = 0
        for ui in list(self._inflight):  # prefetched by the last backward, never read
            self._finish_gather(ui)
        self._fwd_next = 0
        self._prefetch(PREFETCH)

    def _prefetch(self, ahead: int) -> None:
        """Launch the gathers of the next stale units in unit order until ``ahead``
        are in flight (every member of a group launches its units in that order)."""
        while self._fwd_next < len(self.units) and len(self._inflight) < ahead:
            ui = self._fwd_next
            self._fwd_next += 1
            if self._stale(ui):
                self._launch_gather(ui)

    def _gather_before(self, pos: int) -> None:
        for ui in self._first_at.get(pos, ()):
            while self._fwd_next <= ui:  # (not yet launched: this one and those before it)
                self._prefetch(len(self._inflight) + 1)
            if ui in self._inflight:
                self._finish_gather(ui)
            self._prefetch(PREFETCH)

    def _gather_after(self, pos: int, out, grad: bool) -> None:
        """After program position ``pos``: level-3 units read there hook the output
        (gathered again before its backward), and are freed after their last user."""
        for ui in self._users_at.get(pos, ()):
            u = self.units[ui]
            if grad:
                if not (isinstance(out, torch.Tensor) and out.requires_grad):
                    u.keep = True  # this user's backward could not gather them: kept to the end
                    continue
                out.register_hook(lambda g, ui=ui: self._regather(ui))
            if pos == u.last and not (grad and u.keep):
                self.free_full(u.quals)

    def _regather(self, ui: int) -> None:
        """Before a backward that reads level-3 unit ``ui``: it and every unit of its
        group the backward needs earlier (descending last user) gathered; the next
        one started."""
        u = self.units[ui]
        order = self._bwd_order[u.key]
        i = self._bwd_next.get(u.key, 0)
        while i < len(order) and self.units[order[i]].last >= u.last:
            vi = order[i]
            if self._stale(vi) and vi not in self._inflight:
                self._launch_gather(vi)
            if vi in self._inflight:
                self._finish_gather(vi)
            i += 1
        self._bwd_next[u.key] = i
        if i < len(order) and self._stale(order[i]):
            self._launch_gather(order[i])  # prefetch
