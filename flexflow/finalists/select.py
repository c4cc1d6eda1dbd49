"""Which strategies of a search are measured: the finalists, and their record in a plan."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from ..sim.simulate import SimResult
from ..strategy.strategy import Strategy

__all__ = ["Finalist", "not_runnable", "pick_finalists", "rebind", "result_dict", "result_of"]


def result_dict(r: SimResult) -> dict:
    """A SimResult as JSON-ready figures (its timeline left out)."""
    return {f.name: getattr(r, f.name) for f in dataclasses.fields(r) if not f.name.startswith("_")}


def result_of(d: dict) -> SimResult:
    names = {f.name for f in dataclasses.fields(SimResult) if not f.name.startswith("_")}
    return SimResult(**{k: v for k, v in d.items() if k in names})


@dataclass
class Finalist:
    """One strategy measured before the choice: where it comes from (``name``: "search" or
    the baseline it is), what the simulator predicted for it and what it measured.

    ``measured_s``: seconds per training step (median over rounds, each round at its
    slowest rank); None when it was not run (``dropped`` says why).  ``rounds_s``: the
    seconds per step of each round.  ``refit_s``: its prediction under the corrections
    fitted to this measurement (None when none were fitted)."""

    name: str
    strategy_json: str
    predicted: SimResult
    measured_s: float | None = None
    rounds_s: list = dataclasses.field(default_factory=list)
    dropped: str | None = None
    refit_s: float | None = None
    strategy: Strategy | None = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def predicted_s(self) -> float:
        return self.predicted.iteration_time

    @property
    def error(self) -> float | None:
        """(predicted - measured) / measured, or None when not measured."""
        if self.measured_s is None or self.measured_s <= 0:
            return None
        return (self.predicted_s - self.measured_s) / self.measured_s

    def bind(self, graph) -> Strategy:
        if self.strategy is None or self.strategy.graph is not graph:
            self.strategy = Strategy.from_json(self.strategy_json, graph)
        return self.strategy

    def to_dict(self) -> dict:
        return {"name": self.name, "predicted": result_dict(self.predicted), "measured_s": self.measured_s,
                "rounds_s": list(self.rounds_s), "dropped": self.dropped, "refit_s": self.refit_s,
                "strategy": json.loads(self.strategy_json)}

    @classmethod
    def from_dict(cls, d: dict) -> Finalist:
        return cls(str(d["name"]), json.dumps(d["strategy"]), result_of(d["predicted"]), d.get("measured_s"),
                   list(d.get("rounds_s") or []), d.get("dropped"), d.get("refit_s"))


def not_runnable(strategy: Strategy, precision: str = "32-true") -> str | None:
    """Why the executor cannot run ``strategy`` under ``precision`` (None when it can): the
    one place that says what a finalist may be (the executor runs shard levels and
    recomputation; of the precisions, those of ``RUN_PRECISIONS``)."""
    from ..runtime.plan import RUN_PRECISIONS
    if precision not in RUN_PRECISIONS:
        return f"precision {precision!r}: the executor runs {', '.join(RUN_PRECISIONS)}"
    pipe = getattr(strategy, "pipeline", None)
    if pipe is not None and pipe.interleave > 1 and any(c.shard for c in strategy.values()):
        return "the interleaved schedule runs without shard levels"
    return None


def rebind(strategy: Strategy, machine) -> Strategy:
    """The same configs, recorded as made for ``machine`` (a search on a corrected copy of the
    machine made them; the plan runs them on the machine itself)."""
    pipe = strategy.pipeline
    return Strategy(strategy.graph, dict(strategy.items()), machine, name=strategy.name,
                    pipeline=pipe.to_dict() if pipe is not None else None)


def pick_finalists(found, count: int, first: str, machine, precision: str = "32-true",
                   extra: dict | None = None) -> tuple[list[Finalist], list[str]]:
    """The finalists of a search result ``found`` (a :class:`flexflow.SearchResult`): at most
    ``count`` distinct strategies, ``first`` (the simulator's choice: "search" or a baseline
    name) first, data parallelism always among them (unless predicted not to fit), then the
    rest of the searched strategy and the baselines (and ``extra``: name -> (Strategy,
    SimResult)) fastest predicted first; strategies predicted not to fit memory are left out.
    Returns (finalists, notes): a note for each candidate left out because the executor
    cannot run it (:func:`not_runnable`).  Each finalist's strategy is rebound to
    ``machine``."""
    pool: dict[str, tuple[Strategy, SimResult]] = {}
    if found.source == "search":
        pool["search"] = (found.strategy, found.result)
    for name, res in found.baselines.items():
        if name in found.baseline_strategies:
            pool[name] = (found.baseline_strategies[name], res)
    for name, (s, res) in (extra or {}).items():
        pool.setdefault(name, (s, res))
    order = [first] if first in pool else []
    if "data_parallel" in pool and "data_parallel" not in order:
        order.append("data_parallel")
    order += sorted((k for k in pool if k not in order), key=lambda k: pool[k][1].iteration_time)
    out: list[Finalist] = []
    notes: list[str] = []
    for name in order:
        s, res = pool[name]
        if len(out) >= max(count, 1):
            break
        if any(s == f.strategy for f in out) or (not res.feasible and name != first):
            continue
        why = not_runnable(s, precision)
        if why is not None:
            notes.append(f"{name}: {why}")
            continue
        s = rebind(s, machine)
        out.append(Finalist(name, s.to_json(), res, strategy=s))
    return out, notes
