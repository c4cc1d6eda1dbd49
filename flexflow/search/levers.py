"""Memory levers in the search space: shard levels (``ParallelConfig.shard``, the ZeRO stages)
and recomputation (``ParallelConfig.recompute``).

Neither changes where an op runs, so they are kept apart from the SOAP candidates of
:class:`flexflow.search.common._Space` instead of multiplying them: a config is a *base*
(degrees and devices, one of the group's candidates) plus its levers.  A proposal that changes
a group's base carries the group's levers over (:meth:`Levers.carry`: its recomputation, and
its shard level where the new base still has parameter replicas), and lever moves change the
levers alone -- of one group, or of every group of the same op kind at once (every GELU,
every linear layer) -- so that one proposal can take a whole model from "does not fit" to
"fits".

Which groups take which lever:

- recomputation: groups whose output (or what they save besides: dropout masks, a loss's
  log-softmax) lives from the forward into the backward and is large -- at least 1/32 of
  the largest such group (``Liveness.kept_for_backward``), and every op of a repeated block
  (recomputed together, a block's ops are one checkpoint that keeps only the block's inputs);
  recomputing anything else costs its forward again and saves (almost) nothing;
- shard levels: groups with parameters, under a base whose partitions hold replicas of a
  parameter region (:func:`flexflow.strategy.regions.has_param_replicas`).

The search turns them on only where memory binds (a baseline does not fit; see ``mcmc.py``),
and never under ``shard=False`` / ``recompute=False``."""
from __future__ import annotations

import random

from ..strategy.config import SHARD_LEVELS, ParallelConfig
from ..strategy.regions import has_param_replicas
from ..strategy.strategy import Strategy

__all__ = ["LEVER_MOVE", "Levers"]

LEVER_MOVE = 0.25  # probability that a proposal is a lever move (when the levers are on)
_SMALL = 32  # a group whose kept-for-backward bytes are below 1/_SMALL of the largest is not recomputed
_BLOCK = 0.5  # probability that a lever move takes every group of the op kind


class Levers:
    """Which share groups of ``space`` take which lever; ``ctx``: a simulator context
    (``flexflow.sim.plans.Context``) of the graph, for the bytes each op keeps for its
    backward."""

    def __init__(self, space, ctx, shard: bool, recompute: bool):
        self.space = space
        graph = space.graph
        self.members = [graph.groups[k] for k in space.keys]
        self.recompute, self.shard = [], []
        if recompute:
            live, idx = ctx.live, graph.index
            kept = [max(live.kept_for_backward(idx[m]) for m in ms) for ms in self.members]
            top = max(kept, default=0)
            big = {gi for gi, b in enumerate(kept) if b > 0 and b * _SMALL >= top}
            # every op of a repeated block too: recomputed together they are one checkpoint a
            # block (flexflow.graph.ir.repeated_block), which keeps only what enters the block
            blocky = {gi for gi, ms in enumerate(self.members)
                      if all(live.block[idx[m]] and not live.view[idx[m]] for m in ms)}
            self.recompute = sorted(big | blocky)
        if shard:
            self.shard = [gi for gi, ms in enumerate(self.members) if all(graph.op(m).params for m in ms)]
        kind = [graph.op(r).kind for r in space.reps]
        self.rc_kind = _by(self.recompute, kind)
        self.sh_kind = _by(self.shard, kind)
        self._rc = set(self.recompute)
        self._sh = set(self.shard)
        self._replicas: dict = {}
        self._base: dict = {}

    def __bool__(self) -> bool:
        return bool(self.recompute or self.shard)

    # ---- configs ----------------------------------------------------------------------
    def base(self, cfg: ParallelConfig) -> ParallelConfig:
        """``cfg`` without its levers (shard level 0, no recomputation)."""
        if not cfg.shard and not cfg.recompute:
            return cfg
        b = self._base.get(cfg)
        if b is None:
            b = self._base[cfg] = ParallelConfig(cfg.degrees, cfg.devices)
        return b

    def shardable(self, gi: int, cfg: ParallelConfig) -> bool:
        """Whether group gi may take a shard level under ``cfg``'s base."""
        if gi not in self._sh:
            return False
        b = self.base(cfg)
        key = (gi, b)
        ok = self._replicas.get(key)
        if ok is None:
            graph = self.space.graph
            ok = self._replicas[key] = all(has_param_replicas(graph.op(m), b) for m in self.members[gi])
        return ok

    def carry(self, gi: int, new: ParallelConfig, cur: ParallelConfig) -> ParallelConfig:
        """``new`` (a base) with the levers of ``cur`` that it can take."""
        rc = cur.recompute and gi in self._rc
        level = cur.shard if cur.shard and self.shardable(gi, new) else 0
        if not rc and not level:
            return new
        return ParallelConfig(new.degrees, new.devices, level, rc)

    def variants(self, gi: int, cur: ParallelConfig) -> list[ParallelConfig]:
        """``cur`` with other levers: recomputation toggled, other shard levels."""
        out = []
        if gi in self._rc:
            out.append(cur.with_recompute(not cur.recompute))
        if self.shardable(gi, cur):
            out += [cur.with_shard(s) for s in SHARD_LEVELS if s != cur.shard]
        return out

    # ---- moves ------------------------------------------------------------------------
    def propose(self, rng: random.Random, cur: Strategy):
        """A lever move from ``cur``: (strategy, changed groups), or None when the drawn
        group cannot take one (a shard level under a base without replicas)."""
        reps = self.space.reps
        use_rc = bool(self.recompute) and (not self.shard or rng.random() < 0.5)
        pool = self.recompute if use_rc else self.shard
        gi = pool[rng.randrange(len(pool))]
        block = rng.random() < _BLOCK
        c0 = cur[reps[gi]]
        if use_rc:
            value = not c0.recompute
            targets = self.rc_kind[gi] if block else [gi]
            change = lambda h, c: c.with_recompute(value) if c.recompute != value else None
        else:
            if not self.shardable(gi, c0):
                return None
            level = rng.choice([s for s in SHARD_LEVELS if s != c0.shard])
            targets = self.sh_kind[gi] if block else [gi]
            change = lambda h, c: c.with_shard(level) if c.shard != level and self.shardable(h, c) else None
        return self.apply(cur, targets, change)

    def apply(self, cur: Strategy, targets, change):
        """``cur`` with ``change(group, config)`` (a config, or None: unchanged) applied to
        each of ``targets``: (strategy, changed groups), or None when nothing changed."""
        new, groups, reps = cur, [], self.space.reps
        for h in targets:
            c = change(h, new[reps[h]])
            if c is not None:
                new = new.replace(reps[h], c)
                groups.append(h)
        return (new, groups) if groups else None

    def block_moves(self, cur: Strategy) -> list:
        """The descent's lever moves on whole op kinds: recomputation on and off, each
        shard level, for every kind (strategy, groups), those that change something."""
        out = []
        for gs in {tuple(v) for v in self.rc_kind.values()}:
            for value in (True, False):
                out.append(self.apply(cur, gs, lambda h, c, v=value: c.with_recompute(v) if c.recompute != v else None))
        for gs in {tuple(v) for v in self.sh_kind.values()}:
            for level in SHARD_LEVELS:
                out.append(self.apply(cur, gs, lambda h, c, s=level: c.with_shard(s)
                                      if c.shard != s and self.shardable(h, c) else None))
        return sorted((m for m in out if m is not None), key=lambda m: m[1])

    def starts(self, base: dict) -> list[tuple[str, Strategy]]:
        """Chain starts with the levers on: data parallelism with every recomputable group
        recomputed, ZeRO-2 and FSDP (FSDP with the same too) where there are shard levels, and the tensor-
        parallel baselines with the same (``megatron_rc``, ``fsdp_tp_rc``)."""
        out = []
        on = lambda h, c: c.with_recompute() if not c.recompute else None
        dp = base.get("data_parallel")
        if dp is not None and self.recompute:
            m = self.apply(dp, self.recompute, on)
            if m is not None:
                out.append(("data_parallel_rc", m[0]))
        for k in ("zero2",):  # (a start between data parallelism and fsdp)
            if base.get(k) is not None and self.shard:
                out.append((k, base[k]))
        fsdp = base.get("fsdp")
        if fsdp is not None and self.shard:
            out.append(("fsdp", fsdp))
            if self.recompute:
                m = self.apply(fsdp, self.recompute, on)
                if m is not None:
                    out.append(("fsdp_rc", m[0]))
        for k in ("megatron", "fsdp_tp"):
            if base.get(k) is not None and self.recompute:
                m = self.apply(base[k], self.recompute, on)
                if m is not None:
                    out.append((k + "_rc", m[0]))
        for name, s in out:
            s.name = name
        return out


def _by(groups: list[int], kind: list[str]) -> dict[int, list[int]]:
    """group -> the groups (of ``groups``) of its op kind, in order."""
    same: dict[str, list[int]] = {}
    for gi in groups:
        same.setdefault(kind[gi], []).append(gi)
    return {gi: same[kind[gi]] for gi in groups}
