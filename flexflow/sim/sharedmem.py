"""Reads of one tensor that several ops share, in the memory model (mixed into ``Liveness``).

Where several ops read the same tensor with the same reads (:func:`input_reads`: the same
regions on the same devices -- the query, key and value projections reading one
normalized input, the MLP's gate and up projections), the executor receives a region that
crosses devices once and hands the same tensor to every reader, and under autocast casts it
once and shares the copy (unless a reader is recomputed: its checkpoint casts again).  So
the first reader of a group holds the received region (and the cast) for all of them, from
its forward to the last reader's need of it, and the others hold none."""
from __future__ import annotations

from ..strategy.collective import regatherable
from ..strategy.regions import input_reads

__all__ = ["SharedReads"]


class SharedReads:
    """Who shares a read with whom; ``Liveness`` sets ``view``, ``relaid`` and ``ctx`` first."""

    def _shared_setup(self, ctx) -> None:
        n = self.n
        # producer -> its readers that may share a read: (consumer, input index), graph order;
        # views own no storage and ops everywhere read what every device holds
        self.readers: list[list] = [[] for _ in range(n)]
        for u in ctx.compute:
            if ctx.everywhere[u] or ctx.ops[u].kind == "input":
                continue
            rs = sorted((v, j) for v, j in ctx.cons[u] if not self.view[v] and not ctx.everywhere[v])
            if len({v for v, _ in rs}) > 1:
                self.readers[u] = rs
        sibs: list[set] = [set() for _ in range(n)]
        for rs in self.readers:
            for v, _ in rs:
                sibs[v].update(w for w, _ in rs if w != v)
        self.sibs = [sorted(s) for s in sibs]

    def read_group(self, o: int, j: int, cfg: list) -> list | None:
        """The readers [(op, input)] of op o's input j that read it as o does (o among them),
        in graph order; None where o reads it alone."""
        rs = self.readers[self.ctx.inputs[o][j]]
        if not rs:
            return None
        ops = self.ctx.ops
        mine = input_reads(ops[o], cfg[o], j)
        if not mine:
            return None
        group = [(v, jj) for v, jj in rs if input_reads(ops[v], cfg[v], jj) == mine]
        return group if len(group) > 1 else None

    def _rc(self, v: int, cfg: list) -> bool:
        return cfg[v].recompute and (self.rc_real[v] or self._chained(v, cfg))

    def _read_end(self, v: int, j: int, cfg: list, saves) -> int:
        """The last position reader v needs its input j as read (not its own copy of it)."""
        w = self._owner[self.ctx.inputs[v][j]]
        if self.rg[v] and saves(v, j) and not self.copies(v, j, w):
            return 2 * self.n - 1 - v
        return self.rc_pos[v] if self._rc(v, cfg) else v

    def regather_group(self, o: int, j: int, cfg: list) -> list | None:
        """The readers [(op, input)] sharing o's read of input j (o alone: [(o, j)]) where that
        input is all-gathered and gathered again in their backward rather than kept
        (:func:`flexflow.strategy.collective.regatherable`, as the executor decides), else None."""
        ctx = self.ctx
        u = ctx.inputs[o][j]
        if u < 0 or ctx.everywhere[u] or ctx.edge_plan(u, o, j, cfg[u], cfg[o]).coll != "gather":
            return None
        g = self.read_group(o, j, cfg) or [(o, j)]
        return g if all(regatherable(ctx.ops[v], cfg[v]) for v, _ in g) else None

    def _regather_live(self, group: list, row, live, cfg: list, copies: bool = False) -> None:
        """A re-gathered input (``row``: its bytes per device; ``copies``: the readers' shared
        cast of it): from the first reader's forward to the last reader's; then from the first
        backward that gathers it again (a saving reader's backward, a recomputed reader's
        recomputation) to the last reader's backward that needs it (the cache lives until every
        recipe of it is gone).  Where readers save only casts of it, the gathered input is a
        transient where each gathers it (gathered, then cast)."""
        n, ctx = self.n, self.ctx
        live(group[0][0], max(v for v, _ in group), row)
        w = self._owner[ctx.inputs[group[0][0]][group[0][1]]]
        spans = []
        for v, jj in group:
            if not (self.rg[v] and self._saves_input(v, jj)):
                continue
            start = self.rc_pos[v] if self._rc(v, cfg) else 2 * n - 1 - v
            if copies or not self.copies(v, jj, w):
                spans.append((start, 2 * n - 1 - v))
            else:
                live(start, start, row)
        if spans:
            live(min(a for a, _ in spans), max(b for _, b in spans), row)

    def shared_recv(self, o: int, j: int, cfg: list, saves) -> int | None:
        """Where o's received input j is shared: -1 when another reader holds it, else the
        last position any reader of the group needs it; None where o receives it alone."""
        g = self.read_group(o, j, cfg)
        if g is None:
            return None
        if g[0] != (o, j):
            return -1
        return max(self._read_end(v, jj, cfg, saves) for v, jj in g)

    def shared_cast(self, o: int, j: int, cfg: list, saves) -> int | None:
        """Where o's cast of input j is one copy shared by readers casting it alike (none of
        them recomputed): -1 when another reader holds it, else the last position any of them
        needs it; None where o casts for itself."""
        if cfg[o].recompute or self.ctx.ops[o].kind == "matmul":
            return None
        g = self.read_group(o, j, cfg)
        if g is None:
            return None
        ctx = self.ctx
        w = self._owner[ctx.inputs[o][j]]
        dt = ctx.cops[o].input_dtypes[j]
        g = [(v, jj) for v, jj in g if not cfg[v].recompute and ctx.ops[v].kind != "matmul"
             and self.casts(v, jj, w) and ctx.cops[v].input_dtypes[jj] == dt]
        if len(g) < 2:
            return None
        if g[0] != (o, j):
            return -1
        return max((2 * self.n - 1 - v) if self.rg[v] and saves(v, jj) else v for v, jj in g)
