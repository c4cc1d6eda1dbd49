"""Planning apart from running: ``plan()`` traces, searches and predicts; a :class:`Plan`
is what it found, as a value that can be printed, saved as JSON, carried to the devices
and run there with ``parallelize(module, devices, example_inputs, plan=plan)``.

A laptop can plan for a cluster: a module built on the ``meta`` device traces without
memory, and the machine is a preset or a description of the cluster.
"""
from __future__ import annotations

import dataclasses
import json
import time

from .graph.trace import trace
from .hardware.machine import Machine
from .search import search
from .sim.simulate import SimResult
from .strategy.config import StrategyError
from .strategy.strategy import Strategy

__all__ = ["Plan", "plan", "MIN_PREDICTED_GAIN"]

# The searched strategy replaces data parallelism only when the simulator predicts at least
# this gain: predictions carry errors of tens of percent on a shared CPU host, and a near-tie
# is not worth a riskier plan.
MIN_PREDICTED_GAIN = 0.05

FORMAT, VERSION = "flexflow-plan", 1

_GiB = 2**30


def _result_dict(r: SimResult) -> dict:
    return {f.name: getattr(r, f.name) for f in dataclasses.fields(r) if not f.name.startswith("_")}


def _result_of(d: dict) -> SimResult:
    names = {f.name for f in dataclasses.fields(SimResult) if not f.name.startswith("_")}
    return SimResult(**{k: v for k, v in d.items() if k in names})


@dataclasses.dataclass
class Plan:
    """A strategy for one graph on one machine, with what the simulator predicted for it and
    for the baselines it was chosen over.

    ``strategy`` is the chosen :class:`Strategy` (bound to the traced graph; a plan read from
    JSON binds it when it is run, :meth:`bind`); ``chosen``: "search", or the baseline it
    is ("data_parallel" also when the searched one was predicted less than ``min_gain``
    faster).  ``graph_fingerprint`` and ``machine`` say what it was made for."""

    strategy: Strategy | None
    predicted: SimResult
    baselines: dict
    machine: Machine
    graph_fingerprint: str
    chosen: str
    optimizer: str = "sgd"
    precision: str = "32-true"
    min_gain: float = MIN_PREDICTED_GAIN
    search_seconds: float = 0.0
    evaluations: int = 0
    strategy_json: str = ""

    def __post_init__(self):
        if not self.strategy_json and self.strategy is not None:
            self.strategy_json = self.strategy.to_json()

    # ---- use ------------------------------------------------------------------------------
    def bind(self, graph) -> Strategy:
        """The plan's strategy on ``graph`` (a trace of the module it is run with); a
        :class:`StrategyError` with the reason when the graph is another one."""
        if graph.fingerprint() != self.graph_fingerprint:
            raise StrategyError(f"plan was made for another graph (fingerprint {self.graph_fingerprint}, "
                                f"this graph {graph.fingerprint()}): trace the same model with the same "
                                "batch shapes and dtypes")
        if self.strategy is not None and self.strategy.graph is graph:
            return self.strategy
        return Strategy.from_json(self.strategy_json, graph)

    def check_devices(self, machine: Machine | None, num_devices: int) -> None:
        """Refuse to run on another number of devices, or on devices of another kind than the
        plan's machine (a cpu plan on GPUs, an H100 plan on A100s)."""
        if num_devices != self.machine.num_devices:
            raise StrategyError(f"plan was made for {self.machine.num_devices} devices of machine "
                                f"{self.machine.name!r}, and {num_devices} take part here")
        if machine is not None and machine.spec.kind != self.machine.spec.kind:
            raise StrategyError(f"plan was made for {self.machine.spec.kind} devices (machine "
                                f"{self.machine.name!r}), and this machine has {machine.spec.kind}")

    # ---- words -----------------------------------------------------------------------------
    def summary(self) -> str:
        """The chosen strategy against the baselines: step time, the ratio to data
        parallelism, peak memory per device, whether it fits."""
        dp = self.baselines.get("data_parallel")
        rows = [(k, r) for k, r in self.baselines.items()] + [(f"chosen ({self.chosen})", self.predicted)]
        lines = [f"plan for {self.machine.num_devices} x {self.machine.spec.kind} ({self.machine.name}), "
                 f"optimizer {self.optimizer}, precision {self.precision}; search {self.search_seconds:.1f} s, "
                 f"{self.evaluations} evaluations",
                 f"  {'strategy':<22} {'step ms':>10} {'x data par.':>11} {'peak GiB':>9}  fits"]
        for name, r in rows:
            ratio = f"{dp.iteration_time / r.iteration_time:.2f}x" if dp is not None and r.iteration_time > 0 else "-"
            lines.append(f"  {name:<22} {r.iteration_time * 1e3:10.2f} {ratio:>11} "
                         f"{max(r.peak_memory) / _GiB:9.2f}  {'yes' if r.feasible else 'no'}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()

    # ---- JSON ------------------------------------------------------------------------------
    def to_json(self) -> str:
        return json.dumps({
            "format": FORMAT, "version": VERSION, "chosen": self.chosen, "optimizer": self.optimizer,
            "precision": self.precision, "min_gain": self.min_gain, "search_seconds": self.search_seconds,
            "evaluations": self.evaluations, "graph": self.graph_fingerprint,
            "machine": self.machine.to_dict(), "predicted": _result_dict(self.predicted),
            "baselines": {k: _result_dict(r) for k, r in self.baselines.items()},
            "strategy": json.loads(self.strategy_json)}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise StrategyError(f"plan file is not valid JSON: {e}") from None
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise StrategyError(f"not a flexflow plan (missing \"format\": \"{FORMAT}\")")
        if d.get("version") != VERSION:
            raise StrategyError(f"plan format version {d.get('version')!r}; this flexflow reads {VERSION}")
        try:
            return cls(None, _result_of(d["predicted"]), {k: _result_of(v) for k, v in d["baselines"].items()},
                       Machine.from_dict(d["machine"]), d["graph"], d["chosen"], d.get("optimizer", "sgd"),
                       d.get("precision", "32-true"), d.get("min_gain", MIN_PREDICTED_GAIN),
                       d.get("search_seconds", 0.0), d.get("evaluations", 0), json.dumps(d["strategy"]))
        except (KeyError, TypeError) as e:
            raise StrategyError(f"plan file lacks or garbles {e}") from None


def choose(found, min_gain: float) -> tuple[Strategy, SimResult, str]:
    """The searched strategy, unless it is predicted less than ``min_gain`` faster than data
    parallelism (then data parallelism): (strategy, its prediction, what it is)."""
    dp = found.baselines.get("data_parallel")
    if (dp is not None and dp.feasible and found.result.feasible
            and found.result.iteration_time > dp.iteration_time * (1 - min_gain)):
        return found.baseline_strategies["data_parallel"], dp, "data_parallel"
    return found.strategy, found.result, found.source


def plan(module, machine: Machine, example_inputs=None, *, example_kwargs=None, budget: float = 30.0,
         optimizer: str = "sgd", precision: str = "32-true", seed: int = 0, evaluations: int | None = None,
         min_gain: float = MIN_PREDICTED_GAIN, cost_model=None, shard: bool = True) -> Plan:
    """Trace ``module`` on ``example_inputs`` and search a strategy for ``machine``
    (:func:`flexflow.search` for ``budget`` seconds, or ``evaluations``): a :class:`Plan`.

    ``min_gain``: the searched strategy is kept only when the simulator predicts it at least
    this much faster than data parallelism (default 5%); else the plan is data parallelism.
    ``shard``: whether shard levels and recomputation may be chosen (the search's levers:
    :func:`flexflow.search`'s ``shard`` and ``recompute``)."""
    if example_inputs is None and example_kwargs:
        example_inputs = ()
    if example_inputs is None:
        raise ValueError("plan() needs example_inputs: a batch with the shapes and dtypes of the real inputs")
    if not isinstance(example_inputs, (tuple, list)):
        example_inputs = (example_inputs,)
    if not 0 <= min_gain < 1:
        raise ValueError(f"min_gain must be in [0, 1), got {min_gain!r}")
    t0 = time.perf_counter()
    graph = trace(module, example_inputs, example_kwargs)
    found = search(graph, machine, budget=budget, seed=seed, cost_model=cost_model, evaluations=evaluations,
                   optimizer=optimizer, shard=shard, recompute=shard, precision=precision)
    strategy, predicted, chosen = choose(found, min_gain)
    return Plan(strategy, predicted, dict(found.baselines), machine, graph.fingerprint(), chosen, optimizer,
                precision, min_gain, time.perf_counter() - t0, found.evaluations)
