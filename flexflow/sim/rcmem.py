"""Memory events of recomputation (``ParallelConfig.recompute``), a mixin of
:class:`flexflow.sim.memory.Liveness`: which consumers save an op's output for their
backward, where a recomputed op is made again, and what it keeps -- as
:mod:`flexflow.runtime.recompute` runs it, recomputed ops of one repeated block chained into
one checkpoint (:func:`flexflow.graph.ir.repeated_block`)."""
from __future__ import annotations

import numpy as np

from ..graph.ir import dtype_bytes, repeated_block
from .saves import _saves

__all__ = ["RecomputeEvents"]


class RecomputeEvents:
    """Reads the Liveness's ``ctx``, ``n``, ``view``, ``rg``, ``uses``, ``rows`` and
    ``copies``; sets ``savers``, ``rc_pos``, ``rc_real``, ``block`` and ``chain_pos``."""

    def _recompute_setup(self, ctx) -> None:
        ops, n = ctx.ops, self.n
        # recomputation (``ParallelConfig.recompute``): the consumers that save an owner's
        # output for their backward (static), the position where a recomputed op runs again
        # (the earliest backward that needs its output: the backward of its last saving
        # consumer, or its own) and whether recomputing it drops anything at all
        self.savers: list[list] = [[] for _ in ops]
        self.rc_pos = [2 * n - 1 - o for o in range(n)]
        self.rc_real = [False] * n
        for o in ctx.compute:
            if self.view[o]:
                continue
            sv = _saves(ops[o])
            for v, j in self.uses[o]:
                s = _saves(ops[v])
                if self.rg[v] and not self.view[v] and (s.inputs == "all" or j in s.inputs) \
                        and not self.copies(v, j, o):
                    self.savers[o].append(v)
            if self.savers[o]:
                self.rc_pos[o] = 2 * n - 1 - max(self.savers[o])
            self.rc_real[o] = bool(self.savers[o]) or (self.rg[o] and (sv.output or bool(sv.extra[0])))
        # recomputed ops of one repeated block chain (one checkpoint a block): where a
        # recomputed op is first made again when its block's readers are all recomputed too --
        # the earliest remaking of any reader in its block (a reader's remaking makes its
        # inputs again first), else its own ``rc_pos``
        self.block = [repeated_block(op.module_path) for op in ops]
        self.chain_pos = list(self.rc_pos)
        for o in reversed(ctx.compute):
            if self.block[o] and not self.view[o]:
                for v, _ in self.uses[o]:
                    if not self.view[v] and self.block[v] == self.block[o]:
                        self.chain_pos[o] = min(self.chain_pos[o], self.chain_pos[v])

    def _chained(self, o: int, cfg: list) -> bool:
        """Whether a recomputed reader of op o's block makes o again (one checkpoint)."""
        b = self.block[o]
        return bool(b) and any(cfg[v].recompute and self.block[v] == b and not self.view[v]
                               for v, _ in self.uses[o])

    def _holds(self, v: int, cfg: list) -> bool:
        """Whether recomputed op v keeps its inputs (those not of its block's recomputed ops)
        to its backward: its checkpoint does where it saves anything, and so does the recipe
        of an op of a repeated block (its block's readers make it again from them)."""
        return cfg[v].recompute and not self.view[v] and (self.rc_real[v] or bool(self.block[v]))

    def _recomputed(self, o: int, cfg: list, sv, out, on, last_f: int, live) -> None:
        """The output events of an op o recomputed in the backward (``cfg[o].recompute``):
        kept from its forward to its last forward read, and further to the backward of a
        recomputed consumer of another block (``torch.utils.checkpoint`` holds a segment's
        inputs until its backward), a copy that the recomputation does not reuse; made again
        at ``rc_pos[o]`` (the earliest backward that needs it) -- or earlier, at the remaking
        of a recomputed consumer of its block (``chain_pos``) -- and kept to the last backward
        that needs it on each device (its saving consumers', a chained consumer's, its own
        where it saves its output); a transient at ``rc_pos[o]`` on a device where none of
        those runs."""
        n, D, ops = self.n, self.ctx.D, self.ctx.ops
        R, B = self.rc_pos[o], 2 * n - 1 - o
        kept = np.full(D, last_f, np.int64)
        until = np.full(D, R, np.int64)
        again = np.zeros(D, bool)  # devices where a reader needs the output made again
        if sv.output and self.rg[o]:
            until[:] = B
            again[:] = True
        for v, j in self.uses[o]:
            if self._holds(v, cfg):
                _, _, _, von = self.rows(v, cfg[v])
                if self.block[o] and self.block[v] == self.block[o] and not self.view[v]:
                    # one checkpoint: v keeps a recipe, and its remaking (or its backward's
                    # recomputation) makes o again first, kept while v's checkpoint lives
                    np.maximum(until, np.where(von, 2 * n - 1 - v, 0), out=until)
                    again |= von
                    R = min(R, self.chain_pos[v])
                else:  # its checkpoint holds its inputs to its backward
                    np.maximum(kept, np.where(von, 2 * n - 1 - v, 0), out=kept)
                continue
            if v in self.savers[o]:
                s = _saves(ops[v])
                if s.inputs == "all" or j in s.inputs:
                    _, _, _, von = self.rows(v, cfg[v])
                    np.maximum(until, np.where(von, 2 * n - 1 - v, 0), out=until)
                    again |= von
        for k, e, a in sorted(set(zip(kept[on].tolist(), until[on].tolist(), again[on].tolist()))):
            row = np.where(on & (kept == k) & (until == e) & (again == a), out, 0)
            live(o, k, row)
            if a:
                live(R, e, row)

    def kept_for_backward(self, o: int) -> int:
        """Bytes of op o's output and saved extras (whole op, compute dtype) that live from its
        forward into the backward and that recomputing o drops: what ``recompute=True`` on o
        can save (0 where it saves nothing)."""
        if self.view[o] or not self.rc_real[o]:
            return 0
        op, cop = self.ctx.ops[o], self.ctx.cops[o]
        bpe = dtype_bytes(cop.dtype)
        numel = 1
        for x in op.output_shape:
            numel *= int(x)
        sv = _saves(op)
        total = numel * bpe if (self.savers[o] or (sv.output and self.rg[o])) and self.uses[o] else 0
        if sv.extra[0]:
            if sv.extra[1] == "in0" and op.input_shapes:
                numel = 1
                for x in op.input_shapes[0]:
                    numel *= int(x)
            total += int(numel * sv.extra[0] * (sv.itemsize or bpe))
        return total

