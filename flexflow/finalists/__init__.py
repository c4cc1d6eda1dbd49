"""The search's finalists, measured on the devices before one is chosen.

The simulator can be wrong where a search looks hardest (it finds where the simulator is
optimistic), so a search with the devices at hand keeps its best few distinct strategies,
data parallelism always among them (:func:`pick_finalists`), runs each for a few real
training steps on the ranks that will train (:func:`flexflow.finalists.measure.measure`),
and keeps the fastest measured.  What they measured corrects the simulator's inputs for
the next search on that host (:func:`flexflow.finalists.fit.fit_corrections`, stored by
:mod:`flexflow.cost.corrections`).

Modules: ``select`` (the finalists and their record), ``measure`` (running them:
collective, imports the runtime), ``fit`` (the corrections).
"""
from .select import Finalist, not_runnable, pick_finalists, rebind

__all__ = ["Finalist", "not_runnable", "pick_finalists", "rebind"]
