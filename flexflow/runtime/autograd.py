"""The runtime's autograd Functions: exchange steps, gradient gates and outputs.

Token chain
    A scalar token (requires_grad) is threaded through every autograd
    Function of the runtime in forward order (exchange steps, gradient
    gates, output steps): each takes the token and returns a new one.
    The backward therefore runs them in exactly the reverse order on every
    rank, and a rank that only sends in a step still has its backward
    (which receives the gradient pieces) called.

Outputs
    Each graph output is summed over the world with one all_reduce (a
    rank adds its partition's block; partial blocks add up, disjoint blocks
    tile), so every rank returns the full value.  Its backward needs no
    communication: every rank calls backward with the same loss, so each
    takes the gradient of its own block.

Each Function's first argument is the :class:`~flexflow.runtime.execute.Runtime`.
"""
from __future__ import annotations

import torch

from .collex import collective_backward, collective_forward
from .comm import _all_reduce
from .plan import Exchange, _Gate, _Output, _wire, _wire_dtype
from .sync import _Rider

__all__ = ["_ExchangeFn", "_GateFn", "_OutputFn"]


def _describe(ex: Exchange, phase: str) -> str:
    """An exchange step in words, for errors: the ops, and the peers waited on."""
    send_to = sorted({p.dst for p in ex.sends})
    recv_from = sorted({p.src for p in ex.recvs})
    if phase == "backward":  # gradients travel the other way
        send_to, recv_from = recv_from, send_to
    if ex.coll is not None:
        op = {("gather", "forward"): "all-gather", ("scatter", "backward"): "all-gather"}.get(
            (ex.coll.kind, phase), "all-reduce" if ex.coll.kind == "reduce" else "reduce-scatter")
        return (f"{phase} exchange {ex.index} ({ex.producer} -> {ex.consumer}, input {ex.input}), "
                f"{op} among ranks {list(ex.coll.group)}")
    peers = []
    if recv_from:
        peers.append(f"receiving from rank(s) {recv_from}")
    if send_to:
        peers.append(f"sending to rank(s) {send_to}")
    return (f"{phase} exchange {ex.index} ({ex.producer} -> {ex.consumer}, input {ex.input}), "
            + " and ".join(peers))


class _ExchangeFn(torch.autograd.Function):
    """One exchange step: token, this rank's producer block -> token, its consumer region."""

    @staticmethod
    def forward(ctx, rt, ex: Exchange, token, x):
        ctx.rt, ctx.ex = rt, ex
        if ex.coll is not None:  # one collective over the group (collex)
            out = collective_forward(rt, ex, x, lambda: _describe(ex, "forward"))
            if out is not None and not ex.grad:
                ctx.mark_non_differentiable(out)
            return token.clone(), out
        # this rank's sends left when the producer was computed (Runtime._post_sends);
        # its receives were posted at the start of the step
        works, bufs = rt._recv.pop(ex.index, ((), ()))
        out = None
        single = (len(bufs) == 1 and not ex.local and not ex.partial and ex.out_shape is not None
                  and tuple(ex.recvs[0].shape) == tuple(ex.out_shape))
        if ex.out_shape is not None and not single:
            out = (torch.zeros if ex.partial else torch.empty)(ex.out_shape, dtype=ex.dtype, device=rt.device)
            for p in ex.local:
                if ex.partial:
                    out[p.dst_region] += x[p.src_region]
                else:
                    out[p.dst_region] = x[p.src_region]
        rt.wait(works, lambda: _describe(ex, "forward"))
        if single:
            out = bufs[0].to(ex.dtype)
        elif out is not None:
            for p, b in zip(ex.recvs, bufs):
                if ex.partial:
                    out[p.dst_region] += b.to(ex.dtype)
                else:
                    out[p.dst_region] = b.to(ex.dtype)
        if out is not None and not ex.grad:  # integers, or values no parameter feeds
            ctx.mark_non_differentiable(out)
        return token.clone(), out

    @staticmethod
    def backward(ctx, g_token, g_out):
        rt, ex = ctx.rt, ctx.ex
        gx = None
        if ex.grad and ex.coll is not None:
            rt._arm_backward(rt.fwd_pos[ex.index])
            if g_out is None:
                g_out = torch.zeros(ex.out_shape, dtype=ex.dtype, device=rt.device)
            gx = collective_backward(rt, ex, g_out, lambda: _describe(ex, "backward"))
        elif ex.grad:
            tag = 2 * ex.index + 1
            if ex.in_shape is not None:
                gx = torch.zeros(ex.in_shape, dtype=ex.dtype, device=rt.device)
            if ex.out_shape is not None and g_out is None:
                g_out = torch.zeros(ex.out_shape, dtype=ex.dtype, device=rt.device)
            rt._arm_backward(rt.fwd_pos[ex.index])
            works, bufs = rt._bwd_recv.pop(ex.index, None) or rt._post_bwd_recvs(ex)
            rt._bwd_done.add(ex.index)
            ops = [(True, g_out[p.dst_region].contiguous(), p.src, tag) for p in ex.recvs]
            sent = rt.p2p(ops)  # waited for at the end of the backward
            rt._bwd_sends.append((sent, [t for _, t, _, _ in ops]))
            for p in ex.local:
                gx[p.src_region] += g_out[p.dst_region]
            rt.wait(works, lambda: _describe(ex, "backward"))
            for p, b in zip(ex.sends, bufs):
                gx[p.src_region] += b
        return None, None, g_token, gx


class _GateFn(torch.autograd.Function):
    """Marks where a replicated shard's gradient is complete: its backward
    hands the gradients to the bucketed all-reduce."""

    @staticmethod
    def forward(ctx, rt, gate: _Gate, token, *params):
        ctx.rt, ctx.gate = rt, gate
        # new tensors on the parameters' storage: cheaper for autograd than handing
        # the inputs back as they are (which it turns into views of them, one by one)
        return (token.clone(), *[p.detach() for p in params])

    @staticmethod
    def backward(ctx, g_token, *grads):
        ctx.rt.sync.add(ctx.gate, grads)
        return (None, None, g_token) + (None,) * len(grads)


class _OutputFn(torch.autograd.Function):
    """A graph output assembled on every rank with one all_reduce."""

    @staticmethod
    def forward(ctx, rt, out: _Output, token, x):
        ctx.rt, ctx.out = rt, out
        if out.whole:  # (in the traced dtype: a bf16-params loss is returned, and summed, in float32)
            full = _wire(x).to(_wire_dtype(out.dtype), copy=True)
        else:
            full = torch.zeros(out.shape, dtype=_wire_dtype(out.dtype), device=rt.device)
            if out.region is not None:
                full[out.region] += _wire(x)
        if rt.distributed and rt.world > 1:
            if rt._riding:  # all-reduced with the gradients (the ride bucket)
                out.work = job = _Rider(out.name, full)
                rt._riders.append(job)
                return full
            work = _all_reduce(full, rt.coll_group)
            # waited at first read (Runtime._run wraps the output)
            if full.dtype == out.dtype and out.dtype.is_floating_point:
                out.work = work
                return full
            rt.wait([work], lambda: f"all_reduce of output {out.name!r} among all {rt.world} ranks")
        full = full.to(out.dtype)
        if not out.dtype.is_floating_point:
            ctx.mark_non_differentiable(full)
        return full

    @staticmethod
    def backward(ctx, g):
        out = ctx.out
        gx = None
        if out.region is not None and g is not None:
            gx = g[out.region]
        return None, None, torch.zeros((), device=ctx.rt.device), gx
