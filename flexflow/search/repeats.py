"""Repeated layers: moves that change the same op of every block at once.

A transformer is one block repeated 12 to 80 times; a proposal that changes one op of one
block must be found again for every other block before the whole model gains, so the
chain drifts through a long valley.  Ops are the same op of different blocks when they ran
in modules whose qualified names differ only in their indices (``layers.3.attention`` and
``layers.17.attention``), have the same kind and source line and come at the same place
among such ops of their module.  A repeat move gives every one of them one config: a
candidate drawn for all (the same split everywhere), or the config one of them has now
(a block's change carried to the others)."""
from __future__ import annotations

import random
import re

from ..strategy.config import StrategyError
from ..strategy.strategy import Strategy

__all__ = ["REPEAT_MOVE", "Repeats"]

REPEAT_MOVE = 0.2  # probability that a proposal is a repeat move (where the graph has repeats)
_INDEX = re.compile(r"(?<![^.])\d+(?![^.])")  # a path component that is a number


def role_key(op, ordinal: int) -> tuple | None:
    """What an op of a repeated block shares with its repeats; None outside repeated modules."""
    path = op.module_path
    if not path or not _INDEX.search(path):
        return None
    return (_INDEX.sub("#", path), op.kind, op.source, tuple(op.output_shape), ordinal)


class Repeats:
    """The sets of share groups of ``space`` that are the same op of different blocks."""

    def __init__(self, space):
        self.space = space
        graph = space.graph
        ordinal: dict = {}
        by_role: dict = {}
        for gi, rep in enumerate(space.reps):
            op = graph.op(rep)
            k = (op.module_path, op.kind, op.source)
            n = ordinal[k] = ordinal.get(k, -1) + 1
            role = role_key(op, n)
            if role is not None and gi in space.movable:
                by_role.setdefault(role, []).append(gi)
        self.sets = [gs for gs in by_role.values() if len(gs) > 1]

    def __bool__(self) -> bool:
        return bool(self.sets)

    def _apply(self, cur: Strategy, groups, cfg, levers):
        new, changed, reps = cur, [], self.space.reps
        for h in groups:
            c = cfg  # (the members of a set have the same dims: one config fits them all)
            if levers is not None:
                c = levers.carry(h, c, new[reps[h]])
            if new[reps[h]] != c:
                try:
                    new = new.replace(reps[h], c)
                except StrategyError:  # (a member that differs after all: left as it is)
                    continue
                changed.append(h)
        return (new, changed) if changed else None

    def propose(self, rng: random.Random, cur: Strategy, levers=None):
        """A repeat move from ``cur``: (strategy, changed groups), or None when it changes
        nothing.  Half the time a candidate drawn for the whole set, else the config one
        member has now."""
        gs = self.sets[rng.randrange(len(self.sets))]
        if rng.random() < 0.5:
            cs = self.space.cands[gs[0]]
            cfg = cs[rng.randrange(len(cs))]
        else:
            cfg = cur[self.space.reps[gs[rng.randrange(len(gs))]]]
            cfg = levers.base(cfg) if levers is not None else cfg
        return self._apply(cur, gs, cfg, levers)

    def align_moves(self, cur: Strategy, levers=None) -> list:
        """The descent's repeat moves: for each set, each config one of its members has now
        given to all of them (strategy, changed groups), those that change something."""
        out = []
        for gs in self.sets:
            seen = set()
            for h in gs:
                cfg = cur[self.space.reps[h]]
                cfg = levers.base(cfg) if levers is not None else cfg
                if cfg in seen:
                    continue
                seen.add(cfg)
                m = self._apply(cur, gs, cfg, levers)
                if m is not None:
                    out.append(m)
        return out
