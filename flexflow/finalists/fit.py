"""What the finalists measured, turned into corrections of the simulator's inputs
(:class:`flexflow.cost.corrections.Corrections`): the factors on the graph's op times, on
its messages and on its collectives under which the simulator predicts the measured steps
best.

The fit is a regularised least squares on log step times, relative to the corrections the
search used: minimise ``sum_i (log predicted_i - log measured_i)^2 + REG * |x|^2`` over
``x`` = the logs of the three further factors (compute, message, sync), by a few
Gauss-Newton steps with the Jacobian taken by finite differences (each point a simulation
of every measured finalist; a factor at the edge of its range is differentiated inwards,
and held there when the step would push it out: :func:`_bounded_step`).
The regularisation keeps a factor the finalists say nothing about (no message in any of
them) where it was.

The points are this call's finalists and those of the earlier fits of the same graph on
the host that kept their strategies (``Corrections.history``, the latest ``_HISTORY``): a
plan measured in several calls counts once per measurement, at the mean of its log step
times.  With only the latest call's finalists -- three plans, three factors -- every fit
passed through its own points, and one noisy measurement swung a factor to the edge of
its range; the earlier calls' measurements average the host's moments out.
"""
from __future__ import annotations

import base64
import math
import time
import zlib

import numpy as np

from ..cost.corrections import FACTOR_RANGE, Corrections
from ..sim.simulate import Simulator
from ..strategy.strategy import Strategy
from .select import Finalist

__all__ = ["REG", "fit_corrections"]

REG = 0.01  # weight of |x|^2 (x: log factors) against the squared log errors
_H = 0.25  # finite-difference step, in log factor
_ITERATIONS = 3


def _free(strategy: Strategy) -> Strategy:
    """The strategy's configs with no machine recorded (it is simulated on corrected copies)."""
    pipe = strategy.pipeline
    return Strategy(strategy.graph, dict(strategy.items()), name=strategy.name,
                    pipeline=pipe.to_dict() if pipe is not None else None)


def _packed(strategy_json: str) -> str:
    """A strategy's JSON as the corrections history keeps it (compressed: a large model's
    plan repeats one config over thousands of ops)."""
    return base64.b64encode(zlib.compress(strategy_json.encode(), 9)).decode("ascii")


def _unpacked(text: str) -> str:
    return zlib.decompress(base64.b64decode(text.encode("ascii"))).decode()


def _points(graph, done: list[Finalist], history: list) -> tuple[list, list, np.ndarray, np.ndarray]:
    """(strategy JSON texts, strategies, mean log measured step, measurements) per distinct
    plan: this call's measured finalists, then the plans earlier fits of this graph measured
    (history rows that kept their strategy: ``[name, predicted_s, measured_s, refit_s,
    packed strategy]``)."""
    fp = graph.fingerprint()
    logs: dict[str, list] = {}
    plans: dict[str, Strategy] = {}
    for f in done:
        key = f.strategy_json
        logs.setdefault(key, []).append(math.log(f.measured_s))
        plans.setdefault(key, _free(f.bind(graph)))
    for entry in history:
        if not isinstance(entry, dict) or entry.get("graph") != fp:
            continue
        for row in entry.get("finalists", ()):
            if not isinstance(row, list) or len(row) < 5 or not isinstance(row[2], (int, float)) or row[2] <= 0:
                continue
            try:
                key = _unpacked(row[4])
                if key not in plans:
                    plans[key] = _free(Strategy.from_json(key, graph))
            except Exception:  # noqa: BLE001 - a row this graph cannot read teaches nothing
                continue
            logs.setdefault(key, []).append(math.log(row[2]))
    keys = list(plans)
    return (keys, [plans[k] for k in keys], np.array([float(np.mean(logs[k])) for k in keys]),
            np.array([len(logs[k]) for k in keys], float))


def _bounded_step(a: np.ndarray, b: np.ndarray, now: dict) -> np.ndarray:
    """The Gauss-Newton step ``a @ step = b`` in the log factors, with a factor at the edge of
    its range that the step would push further out held there (and the others solved
    without it): a clamped factor does not move, so a step that counts on it moving is no
    step at all."""
    lo, hi = FACTOR_RANGE
    free = np.ones(len(b), bool)
    step = np.zeros(len(b))
    for _ in range(len(b)):
        idx = np.flatnonzero(free)
        step[:] = 0.0
        if len(idx):
            step[idx] = np.linalg.solve(a[np.ix_(idx, idx)], b[idx])
        out = [j for j, k in enumerate(("compute", "message", "sync")) if free[j] and (
            (now[k] <= lo * (1 + 1e-9) and step[j] < 0) or (now[k] >= hi * (1 - 1e-9) and step[j] > 0))]
        if not out:
            break
        free[out] = False
    return step


def fit_corrections(graph, machine, cost_model, current: Corrections, finalists: list[Finalist], *,
                    optimizer: str = "sgd", reduce_outputs: str = "with_gradients", precision: str = "32-true",
                    seconds: float = math.inf) -> tuple[Corrections, dict]:
    """(corrections, name -> refitted prediction in seconds) for the measured ``finalists``
    of ``graph`` (their strategies bound to it) on ``machine``.  ``cost_model`` and
    ``machine`` are the host's own, uncorrected; ``current``: the corrections the search
    used, which the result multiplies further.  Stops after ``seconds`` once one step is
    taken.  With no measured finalist: ``current`` and no predictions."""
    t0 = time.perf_counter()
    done = [f for f in finalists if f.measured_s is not None and f.measured_s > 0]
    if not done:
        return current, {}
    keys, strategies, target, weight = _points(graph, done, current.history)
    lo, hi = (math.log(b) for b in FACTOR_RANGE)

    def corrections(x) -> Corrections:
        return current.scaled(math.exp(x[0]), math.exp(x[1]), math.exp(x[2]))

    def predict(x) -> np.ndarray:
        c = corrections(x)
        sim = Simulator(graph, c.machine(machine), c.cost_model(cost_model), optimizer=optimizer,
                        reduce_outputs=reduce_outputs, precision=precision)
        return np.array([sim.simulate(s, incremental=False).iteration_time for s in strategies])

    def loss(p, x) -> float:
        return float((weight * (np.log(p) - target) ** 2).sum() + REG * (x ** 2).sum())

    x = np.zeros(3)
    p = predict(x)
    best = loss(p, x)
    for it in range(_ITERATIONS):
        if it and time.perf_counter() - t0 > seconds:
            break
        r = np.log(p) - target
        jac = np.empty((len(strategies), 3))
        now = corrections(x).factors()
        for j, key in enumerate(("compute", "message", "sync")):
            h = -_H if now[key] * math.exp(_H) > FACTOR_RANGE[1] else _H  # inwards at the top edge
            e = np.zeros(3)
            e[j] = h
            jac[:, j] = (np.log(predict(x + e)) - np.log(p)) / h
        wj = jac * weight[:, None]
        step = _bounded_step(wj.T @ jac + REG * np.eye(3), -(wj.T @ r + REG * x), now)
        for _ in range(3):  # the step, or shorter ones while it does not help
            cand = np.clip(x + step, lo, hi)
            q = predict(cand)
            value = loss(q, cand)
            if value < best:
                x, p, best = cand, q, value
                break
            step = step / 2
        else:
            break
    out = corrections(x)
    at = {k: i for i, k in enumerate(keys)}
    refit = {f.name: float(p[at[f.strategy_json]]) for f in done}
    out.samples = current.samples + len(done)
    out.history = list(current.history) + [{
        "graph": graph.fingerprint(),
        "finalists": [[f.name, f.predicted_s, f.measured_s, refit[f.name], _packed(f.strategy_json)] for f in done],
        "points": len(strategies),
        "factors": {"compute": math.exp(x[0]), "message": math.exp(x[1]), "sync": math.exp(x[2])}}]
    return out, refit
