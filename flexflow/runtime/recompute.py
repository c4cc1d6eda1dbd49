"""Recomputation at run time: an op's output freed after the forward and made again in the backward.

An op whose config has ``recompute=True`` runs under
``torch.utils.checkpoint`` (non-reentrant): its forward keeps only its
inputs, its backward computes what it needs again.  Its output is not kept either: while
the forward runs, a ``saved_tensors_hooks`` pack hook replaces any tensor a
later op saves for its backward that lives in such an output (the output or a
view of it) by a recipe; the unpack hook, in the backward, recomputes the
output once (the same inputs, parameters, random state and autocast state)
and hands out the view.  So the output lives from the op's forward to its
last forward reader, and again from the first backward that needs it, as
the simulator assumes (:mod:`flexflow.sim.memory`); a recomputed op read by
another recomputed op stays until that one's backward (its checkpoint holds
its inputs) -- unless both ran in one repeated block
(:func:`flexflow.graph.ir.repeated_block`): then the checkpoint keeps a recipe for the input
instead of the input, and the backward makes it again first, so the recomputed ops of a
transformer block keep only what comes into the block, as checkpointing the whole block
does.  A sharded level-3 parameter the recomputation reads is gathered again first.
"""
from __future__ import annotations

import weakref

import torch
from torch.utils.checkpoint import checkpoint

from ..graph.ir import repeated_block
from .compute import _compute

__all__ = ["Recomputing"]


class _Recipe:
    """How to make a recomputed output again, and the view of it a reader saved."""

    __slots__ = ("source", "offset", "size", "stride")

    def __init__(self, source, offset, size, stride):
        self.source, self.offset, self.size, self.stride = source, offset, size, stride


class _Source:
    """One recomputed output: its op, inputs, parameters, random and autocast state."""

    __slots__ = ("op", "block", "ins", "params", "rng", "autocast", "base_offset", "cache", "quals")

    def __init__(self, op, block, ins, params, rng, autocast, base_offset, quals):
        self.op, self.block, self.ins, self.params = op, block, ins, params
        self.rng, self.autocast, self.base_offset, self.quals = rng, autocast, base_offset, quals
        self.cache = None


class _Lazy:
    """A checkpointed op's input that is the output of a recomputed op of its block: the
    tensor during the forward, a recipe afterwards (the checkpoint does not keep it)."""

    __slots__ = ("t", "recipe", "grad")

    def __init__(self, t, recipe):
        self.t, self.recipe, self.grad = t, recipe, t.requires_grad


def _remake(rt, op, block, ins, params, rng, auto, quals):
    """The partition computed again as in its forward (random and autocast state);
    level-3 parameters it reads gathered again first, inputs that are recipes (recomputed
    outputs of the op's block) made again first."""
    ins = [rt._rc_unpack(x) if isinstance(x, _Recipe) else x for x in ins]
    if rt.units and quals:
        for ui, u in enumerate(rt.units):
            if any(q in rt._freed for q in u.quals if q in quals):
                rt._regather(ui)
    enabled, dtype = auto
    with torch.random.fork_rng(devices=[]), torch.autocast(rt.device.type, dtype=dtype, enabled=enabled):
        torch.set_rng_state(rng)
        return _compute(op, block, ins, params)


class Recomputing:
    """The recomputed ops of a runtime (a mixin)."""

    def _recompute_setup(self) -> None:
        self.recomputed = {op.name for op in self.graph.compute_ops if self.strategy[op.name].recompute}
        # recomputed op -> its repeated block ("" outside one): readers of its block chain to it
        self._rc_block = {op.name: repeated_block(op.module_path) for op in self.graph.compute_ops
                          if op.name in self.recomputed}
        self._rc_live: dict[int, tuple] = {}  # storage address -> (weak ref to the output, source)

    def _rc_hooks(self):
        """The pack/unpack hooks for one forward (a context manager)."""
        return torch.autograd.graph.saved_tensors_hooks(self._rc_pack, self._rc_unpack)

    def _rc_compute(self, step, ins: list, params: dict):
        """Op ``step.op``'s partition, recomputed in the backward (under autograd), or
        plainly computed (without)."""
        op, block = step.op, step.part.block
        if not torch.is_grad_enabled():
            return _compute(op, block, ins, params)
        keys = list(params)
        auto = (torch.is_autocast_enabled(self.device.type), torch.get_autocast_dtype(self.device.type))
        quals = [q for _, q, *_ in step.params]
        rng = torch.get_rng_state()
        n = len(ins)
        # inputs made by recomputed ops of this op's block, and gathered inputs gathered again
        # (collex.Regather): recipes, not kept
        here = self._rc_block[op.name]
        args, kept = [], []
        for t in ins:
            src = self._rc_source(t) if here or self.regathered else None
            if src is not None and (src.op is None or here and self._rc_block.get(src.op.name) == here):
                lazy = _Lazy(t, self._rc_pack(t))
                args.append(lazy)
                kept.append(lazy.recipe)
            else:
                args.append(t)
                kept.append(t)

        def fn(*a):
            return _compute(op, block, [self._rc_take(x) for x in a[:n]], dict(zip(keys, a[n:])))
        out = checkpoint(fn, *args, *[params[k] for k in keys], use_reentrant=False, preserve_rng_state=True)
        for x in args:
            if isinstance(x, _Lazy):
                x.t = None
        if isinstance(out, torch.Tensor) and out.untyped_storage().data_ptr():
            # the tensor that owns the output's storage (a linear on 3-d inputs returns a
            # view of its 2-d result, and readers' views, split pieces, hold that one) holds
            # the source, and a reader's recipe too: nothing else does
            root = out if out._base is None else out._base
            root._ff_rc_source = _Source(op, block, kept, dict(params), rng, auto, out.storage_offset(), quals)
            self._rc_live[out.untyped_storage().data_ptr()] = weakref.ref(root)
        return out

    def _rc_take(self, x):
        """A checkpoint's input: itself, or a :class:`_Lazy`'s tensor (in the forward) or its
        recipe made again (in the backward's recomputation, as the forward saw it)."""
        if not isinstance(x, _Lazy):
            return x
        if x.t is not None:
            return x.t
        t = self._rc_unpack(x.recipe).detach()
        return t.requires_grad_(x.grad) if x.grad else t

    def _rc_source(self, t):
        """The source of the recomputed output ``t`` lives in (None: it is no such thing)."""
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return None
        ptr = t.untyped_storage().data_ptr()
        ref = self._rc_live.get(ptr)
        out = None if ref is None else ref()
        if out is None or out.untyped_storage().data_ptr() != ptr:
            return None
        return out._ff_rc_source

    def _rc_pack(self, t):
        src = self._rc_source(t)
        if src is None:
            return t
        return _Recipe(src, t.storage_offset() - src.base_offset, tuple(t.size()), tuple(t.stride()))

    def _rc_unpack(self, x):
        if not isinstance(x, _Recipe):
            return x
        src = x.source
        if src.cache is None:
            self._rc_fill(src)
        full = src.cache
        return full.as_strided(x.size, x.stride, full.storage_offset() + x.offset)

    def _rc_fill(self, src) -> None:
        """Make ``src``'s output again, and first those of the recipes among its inputs
        (a block's chain, earliest first: a loop, not a recursion as deep as the chain --
        an RNN layer's steps are one block)."""
        order, stack, seen = [], [(src, False)], {id(src)}
        while stack:
            s, expanded = stack.pop()
            if expanded:
                order.append(s)
                continue
            stack.append((s, True))
            for x in s.ins:
                if isinstance(x, _Recipe) and x.source.cache is None and id(x.source) not in seen:
                    seen.add(id(x.source))
                    stack.append((x.source, False))
        with torch.no_grad():
            for s in order:
                if s.cache is None and s.op is None:  # a gathered input: gathered again (collex.Regather)
                    s.cache = s.remake(self)
                elif s.cache is None:
                    s.cache = _remake(self, s.op, s.block, s.ins, s.params, s.rng, s.autocast, s.quals)

    def _rc_register(self, t: torch.Tensor, source) -> None:
        """Readers that save ``t`` (or a view of it) save a recipe of ``source`` instead."""
        root = t if t._base is None else t._base
        root._ff_rc_source = source
        self._rc_live[t.untyped_storage().data_ptr()] = weakref.ref(root)

    def _rc_begin_forward(self) -> None:
        """Drop the entries of outputs already freed (their addresses may be reused)."""
        self._rc_live = {k: v for k, v in self._rc_live.items() if v() is not None}
