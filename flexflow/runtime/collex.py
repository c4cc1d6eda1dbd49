"""Exchanges that run as one collective over a group instead of point-to-point messages.

Where an exchange's messages between ranks are, group by group, every ordered pair of
members once (:func:`flexflow.strategy.collective.clique_groups`, which the simulator
asks too) and the pieces fit a collective's layout, the exchange runs as:

``gather``
    every member's consumer reads every member's piece, and a member sends the same
    piece of its block to everyone (a sequence-parallel norm read by a
    column-parallel linear): the forward is one ``all_gather_into_tensor`` of the
    pieces, the backward one ``reduce_scatter_tensor`` of their gradients;
``scatter``
    the producers hold partial sums and each member reads its own block of the sum
    from everyone (a row-parallel linear read by a sequence-parallel residual add):
    the forward is one ``reduce_scatter_tensor``, the backward one
    ``all_gather_into_tensor`` of the gradient blocks;
``reduce``
    the producers hold partial sums that every member reads whole (a row-parallel
    linear read by ops kept whole in the group): one ``all_reduce``, forward and
    backward.

Pieces must have one shape (the collectives move equal blocks).  Every rank decides
from the whole exchange (all ranks' pieces), so all decide alike; the groups get their
own process groups, created by every rank in the same order
(:meth:`flexflow.runtime.comm.Comm._make_groups`).  Members meet an exchange's
collective in the program's order, forward and backward (the token chain), as they
meet its point-to-point steps.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..strategy.collective import clique_groups, regatherable

__all__ = ["Collective", "plan_collective", "collective_forward", "collective_backward", "plan_regathers", "Regather"]


@dataclass(frozen=True)
class Collective:
    """This rank's part in an exchange run as a collective."""

    kind: str  # "gather" | "scatter" | "reduce"
    group: tuple  # the member ranks, sorted (slot j of a buffer is group[j]'s)
    shape: tuple  # every member's piece
    region: tuple  # gather: this rank's piece in its block; scatter: where its block of the sum goes
    slots: tuple  # gather: where member j's piece goes in this rank's input (None: nowhere);
    #               scatter: member j's piece in this rank's block


def plan_collective(pieces: list, me: int, partial: bool, blocks: dict):
    """(every group, this rank's :class:`Collective` or None) when the exchange of these
    pieces (:class:`flexflow.runtime.plan.Piece`, every rank's) runs as collectives, else None.
    ``blocks``: each sending rank's block shape (a gather sends whole blocks, as the
    simulator prices it: :func:`flexflow.sim.collective.collective_seconds`)."""
    groups = clique_groups((p.src, p.dst) for p in pieces if p.src != p.dst)
    if groups is None or len({tuple(p.shape) for p in pieces}) != 1:
        return None
    if not partial and any(tuple(p.shape) != tuple(blocks[p.src]) for p in pieces):
        return None
    member = {r: g for g in groups for r in g}
    if any(p.src in member and p.dst not in member for p in pieces):
        return None
    # partial sums that every member reads alike (one region of each sender's block): an all-reduce
    alike = partial and all(len({_key(p.src_region) for p in pieces if p.src == r}) == 1 for r in member)
    kind = "gather" if not partial else "reduce" if alike else "scatter"
    mine = None
    for g in groups:
        for r in g:
            # gather: the pieces r sends (one to each member, itself included or not) are one
            # region of its block; scatter: those r receives (one from each, its own included)
            # go to one region of its input
            own = [p for p in pieces if (p.dst if partial else p.src) == r]
            ends = {p.src if partial else p.dst for p in own}
            same = {_key(p.dst_region if partial else p.src_region) for p in own}
            if len(ends) != len(own) or len(same) != 1 or (partial and r not in ends):
                return None
            if r != me:
                continue
            slots = []
            for j in g:
                src, dst = (r, j) if partial else (j, r)
                p = next((p for p in pieces if p.src == src and p.dst == dst), None)
                slots.append(None if p is None else (p.src_region if partial else p.dst_region))
            mine = Collective(kind, g, tuple(pieces[0].shape),
                              own[0].dst_region if partial else own[0].src_region, tuple(slots))
    return groups, mine


def _key(region: tuple) -> tuple:
    return tuple((s.start, s.stop) for s in region)


def _group(rt, c: Collective):
    return rt.groups[("exchange", *c.group)]


def collective_forward(rt, ex, x, describe, whole_block: bool = True) -> torch.Tensor:
    """The exchange's forward as its collective: this rank's consumer input (``x``: this
    rank's producer block, or with ``whole_block`` False its piece alone)."""
    c = ex.coll
    wire = _wire_dtype(ex.dtype)
    if c.kind == "gather":
        buf = _all_gather(rt, c, (x[c.region] if whole_block else x).to(wire), describe)
        if ex.out_shape is None:
            return None
        out = torch.empty(ex.out_shape, dtype=ex.dtype, device=rt.device)
        for j, r in enumerate(c.slots):
            if r is not None:
                out[r] = buf[j]
        return out
    if c.kind == "reduce":
        piece = x[c.slots[0]].to(wire, copy=True).contiguous()
        rt.wait([dist.all_reduce(piece, group=_group(rt, c), async_op=True)], describe)
    else:
        piece = _reduce_scatter(rt, c, [x[r] for r in c.slots], wire, describe)
    if tuple(c.shape) == tuple(ex.out_shape):
        return piece.to(ex.dtype)
    out = torch.zeros(ex.out_shape, dtype=ex.dtype, device=rt.device)
    out[c.region] = piece
    return out


def collective_backward(rt, ex, g_out, describe) -> torch.Tensor:
    """The exchange's backward as the other collective: the gradient of this rank's block."""
    c = ex.coll
    gx = torch.zeros(ex.in_shape, dtype=ex.dtype, device=rt.device)
    if c.kind == "gather":
        gx[c.region] += _reduce_scatter(rt, c, [None if r is None else g_out[r] for r in c.slots], ex.dtype,
                                        describe)
        return gx
    if c.kind == "reduce":
        g = g_out[c.region].contiguous().clone()
        rt.wait([dist.all_reduce(g, group=_group(rt, c), async_op=True)], describe)
        gx[c.slots[0]] += g
        return gx
    buf = _all_gather(rt, c, g_out[c.region], describe)
    for j, r in enumerate(c.slots):
        gx[r] += buf[j]
    return gx


def _all_gather(rt, c: Collective, mine: torch.Tensor, describe) -> torch.Tensor:
    """Every member's ``mine`` (of ``c.shape``), stacked in group order."""
    buf = torch.empty(len(c.group) * mine.numel(), dtype=mine.dtype, device=rt.device)
    rt.wait([dist.all_gather_single(buf, mine.reshape(-1), group=_group(rt, c), async_op=True)], describe)
    return buf.view(len(c.group), *c.shape)


def _reduce_scatter(rt, c: Collective, parts: list, dtype, describe) -> torch.Tensor:
    """The sum over the members of their part for this rank (``parts[j]``: for member j; None:
    zeros), of ``c.shape``."""
    send = torch.empty((len(c.group), *c.shape), dtype=dtype, device=rt.device)
    for j, p in enumerate(parts):
        if p is None:
            send[j].zero_()
        else:
            send[j] = p
    piece = torch.empty(c.shape, dtype=dtype, device=rt.device)
    rt.wait([dist.reduce_scatter_single(piece.view(-1), send.view(-1), group=_group(rt, c), async_op=True)],
            describe)
    return piece


def _wire(t: torch.Tensor) -> torch.Tensor:
    """``t`` as messages carry it (booleans as bytes)."""
    return t.to(torch.uint8) if t.dtype == torch.bool else t


def _wire_dtype(dtype):
    """The dtype messages carry ``dtype`` in (booleans as bytes)."""
    return torch.uint8 if dtype == torch.bool else dtype


# --------------------------------------------------------------------------- re-gathered in the backward
def plan_regathers(plan) -> set:
    """Indices of this rank's gather exchanges whose gathered input is not kept for the backward
    but gathered again there (Megatron's sequence parallelism keeps the 1/n shard, not the
    gathered input): those whose readers (the consumer, and the readers sharing what it
    received) are all linear layers.  The memory model counts the same (``flexflow.sim.memory``)."""
    readers: dict = {}
    for r, first in plan.share_src.items():
        readers.setdefault(first, []).append(r)
    out = set()
    for ex in plan.exchanges:
        if ex.coll is None or ex.coll.kind != "gather" or ex.out_shape is None:
            continue
        rs = [(ex.consumer, ex.input), *readers.get((ex.consumer, ex.input), ())]
        if all(regatherable(plan.graph.op(n), plan.strategy[n]) for n, _ in rs):
            out.add(ex.index)
    return out


class Regather:
    """The recipe source of a gathered input (:mod:`flexflow.runtime.recompute`'s ``_Source``
    protocol): this rank's piece, kept; the whole made again by the same all-gather."""

    __slots__ = ("op", "ex", "piece", "dtype", "base_offset", "cache", "ins")

    def __init__(self, ex, piece: torch.Tensor, dtype, base_offset: int):
        self.op, self.ex, self.piece, self.dtype, self.base_offset = None, ex, piece, dtype, base_offset
        self.cache, self.ins = None, ()

    def remake(self, rt) -> torch.Tensor:
        ex = self.ex
        out = collective_forward(rt, ex, self.piece, lambda: _regather_words(ex), whole_block=False)
        return out if self.dtype is None or out.dtype == self.dtype else out.to(self.dtype)


def _regather_words(ex) -> str:
    return (f"backward re-gather of exchange {ex.index} ({ex.producer} -> {ex.consumer}, input {ex.input}), "
            f"all-gather among ranks {list(ex.coll.group)}")
