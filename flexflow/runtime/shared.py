"""Reads of one tensor that several ops share, in the executor.

Ops that read one tensor with the same reads (:func:`flexflow.strategy.regions.input_reads`:
the same regions on the same devices -- the query, key and value projections of one
normalized input, an MLP's gate and up projections) take it as one tensor: where it crosses
ranks, the first reader's exchange receives it and the others read what it received (one
message each way, the readers' gradients added up by autograd before the exchange sends them
back); under autocast, the readers that would each cast it to the compute dtype (none of
them recomputed: a checkpoint casts again in its backward) share one cast.  The memory model
(``flexflow/sim/sharedmem.py``) and the task graph (``flexflow/sim/taskgraph.py``) count the
same: a rule both sides read from :func:`shared_groups`."""
from __future__ import annotations

import torch

from ..cost.precision import precision as as_precision, priced_ops
from ..sim.memory import VIEWS
from ..strategy.regions import input_reads

__all__ = ["shared_groups", "SharedInputs"]


def _is_view(op) -> bool:
    return op.kind in VIEWS and not op.everywhere and len(op.inputs) >= 1


def shared_groups(graph, strategy) -> list:
    """[(producer, [(reader, input index), ...])] for each tensor that several ops read with
    the same reads, the readers in graph order (the first one holds the read)."""
    out = []
    readers: dict = {}
    for op in graph.compute_ops:
        if op.everywhere or _is_view(op):
            continue
        for i, src in enumerate(op.inputs):
            p = graph.op(src)
            if p.everywhere or p.kind == "input":
                continue
            reads = input_reads(op, strategy[op.name], i)
            if reads:
                readers.setdefault((src, reads), []).append((op.name, i))
    for (src, _), rs in readers.items():
        if len({r for r, _ in rs}) > 1:
            out.append((src, rs))
    return out


class SharedInputs:
    """Mixed into the runtime's plan: ``share_src`` (reader, input) -> the first reader whose
    input entry it takes, ``cast_share`` (reader, input) -> (key, dtype) of a shared cast,
    and the number of readers of each key (the held tensor is dropped after the last)."""

    def _plan_shared(self) -> None:
        g, s = self.graph, self.strategy
        self.share_src: dict = {}
        self.cast_share: dict = {}
        self.share_uses: dict = {}
        groups = shared_groups(g, s)
        if not groups:
            return
        cops = None
        if self.precision.mixed and self.precision.autocast_lists:  # (bf16-params: inputs already cast)
            prec = as_precision(self.precision, where=self.device)
            cops = dict(zip((op.name for op in g.ops), priced_ops(g, prec)))
        for src, rs in groups:
            first = rs[0]
            seg = self.segments.get(first[0], 0)
            for r in rs[1:]:
                if self.segments.get(r[0], 0) == seg:
                    self.share_src[r] = first
            if cops is None:
                continue
            pd = cops[src].dtype
            casting = [(n, i) for n, i in rs if not s[n].recompute and g.op(n).kind != "matmul"
                       and i < len(cops[n].input_dtypes) and cops[n].input_dtypes[i] != pd
                       and cops[n].input_dtypes[i].is_floating_point]
            for dt in {cops[n].input_dtypes[i] for n, i in casting}:
                same = [r for r in casting if cops[r[0]].input_dtypes[r[1]] == dt]
                if len(same) > 1:
                    for r in same:
                        self.cast_share[r] = (same[0], dt)
                    self.share_uses[("cast", same[0])] = len(same)

    def _shared_entry(self, key: tuple, entries: dict):
        """The input entry of a reader that shares the read of ``self.share_src[key]``, or
        None where it plans its own (the first reader's read did not cross ranks)."""
        first = self.share_src.get(key)
        if first is None or first not in self._crossed:
            return None
        e = entries.get(first)
        if e is not None and e[0] == "xchg":
            if e[2].out_shape is None:
                return ("none",)
            self.share_uses[("recv", first)] = self.share_uses.get(("recv", first), 1) + 1
            return ("shared", e[1], first)
        return ("same", e)

    def _take(self, state: dict, kind: str, key: tuple, make):
        """The tensor held for ``key`` (made by ``make`` at its first reader), dropped from
        the step's state after its last reader."""
        held = state.setdefault("shared", {})
        k = (kind, key)
        hit = held.get(k)
        if hit is None:
            hit = [make(), self.share_uses[k]]
            held[k] = hit
        hit[1] -= 1
        if hit[1] <= 0:
            del held[k]
        return hit[0]

    def shared_input(self, state: dict, op_name: str, i: int, x):
        """What reader ``(op_name, i)`` computes with: the received tensor it shares, cast once
        where readers share the cast."""
        c = self.cast_share.get((op_name, i))
        if c is None:
            return x
        first, dt = c
        return self._take(state, "cast", first, lambda: x.to(dt) if x.dtype != dt else x)


