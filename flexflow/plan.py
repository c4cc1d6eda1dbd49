"""Planning apart from running: ``plan()`` traces, searches and predicts; a :class:`Plan`
is what it found, as a value that can be printed, saved as JSON, carried to the devices
and run there with ``parallelize(module, devices, example_inputs, plan=plan)``.

A laptop can plan for a cluster: a module built on the ``meta`` device traces without
memory, and the machine is a preset or a description of the cluster.
"""
from __future__ import annotations

import dataclasses
import json
import sys
import time
import warnings

from .cost.corrections import Corrections
from .finalists.select import Finalist, pick_finalists, rebind, result_dict, result_of
from .graph.trace import trace
from .hardware.machine import Machine
from .search import search
from .sim.simulate import SimResult
from .strategy.config import StrategyError
from .strategy.strategy import Strategy

__all__ = ["FINALISTS", "FINALIST_SHARE", "FINALIST_STEPS", "MIN_PREDICTED_GAIN", "Plan", "plan"]

# The searched strategy replaces data parallelism only when the simulator predicts at least
# this gain: predictions carry errors of tens of percent on a shared CPU host, and a near-tie
# is not worth a riskier plan.
MIN_PREDICTED_GAIN = 0.05
# With the devices at hand, this many of the search's best distinct strategies (data
# parallelism among them) run FINALIST_STEPS timed training steps each, and the fastest
# measured is kept; FINALIST_SHARE of the budget is kept for that and for the corrections.
FINALISTS = 3
FINALIST_STEPS = 6
FINALIST_SHARE = 0.25

FORMAT, VERSION = "flexflow-plan", 1

_GiB = 2**30


@dataclasses.dataclass
class Plan:
    """A strategy for one graph on one machine, with what the simulator predicted for it and
    for the baselines it was chosen over.

    ``strategy`` is the chosen :class:`Strategy` (bound to the traced graph; a plan read from
    JSON binds it when it is run, :meth:`bind`); ``chosen``: "search", or the baseline it
    is ("data_parallel" also when the searched one was predicted less than ``min_gain``
    faster).  ``graph_fingerprint`` and ``machine`` say what it was made for.

    ``finalists``: the search's best few distinct strategies (:class:`Finalist`: predicted,
    and measured when the devices were at hand); ``simulator_choice``: what the simulator
    chose; when the finalists were measured, ``chosen`` is the fastest measured (which
    ``predicted`` then describes), ``measure_seconds`` what measuring and fitting took, and
    ``corrections`` the factors the search used (``"used"``) and those fitted to the
    measurements (``"fitted"``; :mod:`flexflow.cost.corrections`)."""

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
    finalists: list = dataclasses.field(default_factory=list)
    simulator_choice: str = ""
    measure_seconds: float = 0.0
    corrections: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if not self.strategy_json and self.strategy is not None:
            self.strategy_json = self.strategy.to_json()
        self.simulator_choice = self.simulator_choice or self.chosen

    @property
    def measured(self) -> bool:
        """Whether the chosen strategy was measured against the other finalists."""
        return any(f.measured_s is not None for f in self.finalists)

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

    def native(self, graph=None) -> dict:
        """The plan in torch's terms (FSDP2, DTensor tensor parallelism, checkpointing on one
        device mesh): :func:`flexflow.native.native_plan`.  ``graph``: a trace of the module,
        for a plan read from JSON.  A plan outside that family is a :class:`StrategyError`
        naming the first op that does not map and why."""
        from .native import native_plan
        strategy = self.strategy if graph is None else self.bind(graph)
        if strategy is None:
            raise ValueError("this plan was read from JSON: give its graph, plan.native(ff.trace(model, inputs))")
        return native_plan(strategy.graph, strategy, self.precision)

    def parallelize_fn(self, graph=None):
        """``fn(model, device_mesh) -> model`` applying :meth:`native` with torch's engines (the
        signature of Lightning's ``ModelParallelStrategy`` and torchtitan's parallelize
        functions); the mesh has the shape and dim names of ``native()["mesh"]``."""
        from .native import parallelize_fn
        return parallelize_fn(self.native(graph))

    def pipeline(self, model, device_mesh, loss_fn=None, graph=None):
        """This rank's ``PipelineStage`` and the ``torch.distributed.pipelining`` schedule of a
        pipelined plan (:func:`flexflow.native.pipe.pipeline`): ``stage, schedule =
        plan.pipeline(model, mesh)``; the result's ``step(*inputs)`` runs one step.
        ``loss_fn(output, target)`` only for a module that returns no loss."""
        from .native.pipe import pipeline
        return pipeline(self.native(graph), model, device_mesh, loss_fn=loss_fn)

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
        if self.finalists:
            took = f" (measured in {self.measure_seconds:.1f} s)" if self.measured else ""
            lines.append(f"  finalists{took}: step ms predicted, measured")
            for f in self.finalists:
                got = f"{f.measured_s * 1e3:10.2f}" if f.measured_s is not None else f"{'-':>10}"
                tags = [t for t, on in (("chosen", f.name == self.chosen and self.measured),
                                        ("simulator's choice", f.name == self.simulator_choice)) if on]
                if f.dropped:
                    tags.append(f"dropped: {f.dropped}")
                lines.append(f"  {f.name:<22} {f.predicted_s * 1e3:10.2f} {got}  {', '.join(tags)}".rstrip())
        return "\n".join(lines)

    def finalists_line(self) -> str:
        """One line: every finalist's predicted and measured step, and the choice."""
        parts = []
        for f in self.finalists:
            got = (f"{f.measured_s * 1e3:.2f} measured" if f.measured_s is not None
                   else f"dropped ({f.dropped})" if f.dropped else "not run")
            parts.append(f"{f.name} {f.predicted_s * 1e3:.2f} ms predicted, {got}")
        fitted = self.corrections.get("fitted")
        fit = "" if not fitted else (f"; corrections now compute x{fitted['compute']:.2f}, message "
                                     f"x{fitted['message']:.2f}, sync x{fitted['sync']:.2f}")
        return (f"finalists on {self.machine.num_devices} devices, measured in {self.measure_seconds:.1f} s: "
                + "; ".join(parts) + f" -> {self.chosen} (the simulator's choice: {self.simulator_choice}){fit}")

    def __str__(self) -> str:
        return self.summary()

    # ---- JSON ------------------------------------------------------------------------------
    def to_json(self) -> str:
        """The plan as JSON: the strategy, the predictions, the baselines, the finalists, the
        machine and the graph's fingerprint."""
        return json.dumps({
            "format": FORMAT, "version": VERSION, "chosen": self.chosen, "optimizer": self.optimizer,
            "precision": self.precision, "min_gain": self.min_gain, "search_seconds": self.search_seconds,
            "evaluations": self.evaluations, "graph": self.graph_fingerprint,
            "machine": self.machine.to_dict(), "predicted": result_dict(self.predicted),
            "baselines": {k: result_dict(r) for k, r in self.baselines.items()},
            "strategy": json.loads(self.strategy_json), "finalists": [f.to_dict() for f in self.finalists],
            "simulator_choice": self.simulator_choice, "measure_seconds": self.measure_seconds,
            "corrections": self.corrections}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        """A plan from ``to_json``'s text (its strategy is bound to a graph when it is run:
        :meth:`bind`)."""
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise StrategyError(f"plan file is not valid JSON: {e}") from None
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise StrategyError(f"not a flexflow plan (missing \"format\": \"{FORMAT}\")")
        if d.get("version") != VERSION:
            raise StrategyError(f"plan format version {d.get('version')!r}; this flexflow reads {VERSION}")
        try:
            return cls(None, result_of(d["predicted"]), {k: result_of(v) for k, v in d["baselines"].items()},
                       Machine.from_dict(d["machine"]), d["graph"], d["chosen"], d.get("optimizer", "sgd"),
                       d.get("precision", "32-true"), d.get("min_gain", MIN_PREDICTED_GAIN),
                       d.get("search_seconds", 0.0), d.get("evaluations", 0), json.dumps(d["strategy"]),
                       [Finalist.from_dict(f) for f in d.get("finalists", [])], d.get("simulator_choice", ""),
                       d.get("measure_seconds", 0.0), d.get("corrections") or {})
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


def given_plan(graph, machine: Machine, strategy, *, cost_model=None, optimizer: str = "sgd",
               precision: str = "32-true", t0: float | None = None) -> Plan:
    """The :class:`Plan` of a given strategy on ``graph``: it and the baselines simulated."""
    from .search.baselines import baseline_strategies
    from .search.common import _simulator
    t0 = time.perf_counter() if t0 is None else t0
    text = strategy if isinstance(strategy, str) else strategy.to_json()
    bound = Strategy.from_json(text, graph, machine)
    name = getattr(strategy, "name", None) or "given"
    sim = _simulator(graph, machine, cost_model, optimizer, precision=precision)
    baselines = {k: sim.simulate(b, incremental=False)
                 for k, b in baseline_strategies(graph, machine, cost_model).items()}
    predicted = sim.simulate(bound, incremental=False)
    return Plan(rebind(bound, machine), predicted, baselines, machine, graph.fingerprint(), name, optimizer,
                precision, 0.0, time.perf_counter() - t0, 0)


def searched_plan(graph, machine: Machine, *, cost_model=None, corrections: Corrections | None = None,
                  budget: float = 30.0, seed: int = 0, evaluations: int | None = None, optimizer: str = "sgd",
                  precision: str = "32-true", reduce_outputs: str = "with_gradients",
                  min_gain: float = MIN_PREDICTED_GAIN, shard: bool = True, finalists: int = FINALISTS,
                  t0: float | None = None) -> Plan:
    """Search ``graph`` for ``machine`` (the simulator's inputs under ``corrections``): the
    plan of the simulator's choice (:func:`choose`), with the finalists to measure
    (:func:`flexflow.finalists.pick_finalists`; none when ``finalists`` < 2), every
    strategy recorded as made for ``machine`` itself.  ``cost_model`` None: the search's
    default (the analytic model)."""
    t0 = time.perf_counter() if t0 is None else t0
    corr = corrections if corrections is not None else Corrections()
    m = corr.machine(machine)
    cm = None if cost_model is None else corr.cost_model(cost_model)
    found = search(graph, m, budget=budget, seed=seed, cost_model=cm, evaluations=evaluations, optimizer=optimizer,
                   shard=shard, recompute=shard, precision=precision, reduce_outputs=reduce_outputs)
    strategy, predicted, chosen = choose(found, min_gain)
    picked, notes = [], []
    if finalists > 1 and machine.num_devices > 1:
        from .sim.simulate import Simulator
        one = Strategy.single_device(graph, m)
        sim = Simulator(graph, m, cm, optimizer=optimizer, reduce_outputs=reduce_outputs, precision=precision)
        picked, notes = pick_finalists(found, finalists, chosen, machine, precision,
                                       {"single_device": (one, sim.simulate(one))})
    out = Plan(rebind(strategy, machine), predicted, dict(found.baselines), machine, graph.fingerprint(), chosen,
               optimizer, precision, min_gain, time.perf_counter() - t0, found.evaluations, finalists=picked)
    out._skipped = notes  # candidates the executor cannot run yet (warned when measuring)
    if not corr.identity:
        out.corrections = {"used": corr.factors()}
    return out


def _distributed() -> bool:
    import torch.distributed as dist
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _rank() -> int:
    import torch.distributed as dist
    return dist.get_rank() if _distributed() else 0


def _from_rank0(obj):
    """Rank 0's ``obj`` on every rank (pickled; itself without a process group)."""
    if not _distributed():
        return obj
    import torch.distributed as dist
    box = [obj if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _emit(text: str) -> None:
    """One line for the user: through logging ("flexflow") where it is configured, else on stderr."""
    import logging
    log = logging.getLogger("flexflow")
    if log.hasHandlers():
        log.info(text)
    else:
        print(f"flexflow: {text}", file=sys.stderr, flush=True)


def measure_plan(p: Plan, graph, module, inputs, kwargs=None, ranks=None, *, device=None, timeout_s: float = 60.0,
                 steps: int = FINALIST_STEPS, seconds: float = float("inf"), bucket_cap_mb: float = 25.0,
                 reduce_outputs: str = "with_gradients") -> Plan:
    """Collective (every rank, the same plan): run the plan's finalists on the devices
    (:func:`flexflow.finalists.measure.measure`) and choose the fastest measured.  On rank 0,
    a plan that carries its search's cost model (``_learn``: machine, host cost model,
    corrections used) fits the corrections to the measurements and stores them
    (:mod:`flexflow.cost.corrections`).  Returns rank 0's plan on every rank, strategies bound
    to ``graph``; rank 0 writes one line about it (:meth:`Plan.finalists_line`)."""
    from .finalists.measure import fastest, measure
    t0 = time.perf_counter()
    for f in p.finalists:
        f.bind(graph)
    rank = _rank()
    if rank == 0:
        for note in getattr(p, "_skipped", ()):
            warnings.warn(f"not measured as a finalist: {note}", stacklevel=2)
    measure(p.finalists, graph, module, inputs, kwargs, ranks, device=device, timeout_s=timeout_s, steps=steps,
            seconds=seconds, bucket_cap_mb=bucket_cap_mb, reduce_outputs=reduce_outputs, optimizer=p.optimizer,
            precision=p.precision)
    best = fastest(p.finalists)
    if best is None:
        if rank == 0:
            warnings.warn("no finalist could be measured: the simulator's choice is kept", stacklevel=2)
    else:
        p.chosen, p.predicted, p.strategy_json, p.strategy = best.name, best.predicted, best.strategy_json, best.strategy
    learn = getattr(p, "_learn", None)
    if rank == 0 and learn is not None and best is not None:
        from .cost.corrections import save_corrections
        from .finalists.fit import fit_corrections
        machine, cost_model, used = learn
        try:
            fitted, refit = fit_corrections(graph, machine, cost_model, used or Corrections(), p.finalists,
                                            optimizer=p.optimizer, reduce_outputs=reduce_outputs,
                                            precision=p.precision, seconds=max(0.5, seconds - (time.perf_counter() - t0)))
            for f in p.finalists:
                f.refit_s = refit.get(f.name)
            path = save_corrections(machine, graph.fingerprint(), fitted)
            p.corrections = {**p.corrections, "fitted": fitted.factors(), "samples": fitted.samples,
                             "path": str(path)}
        except Exception as e:  # noqa: BLE001 - a failed fit costs the lesson, not the run
            warnings.warn(f"could not fit corrections to the finalists: {type(e).__name__}: {e}", stacklevel=2)
    p.measure_seconds = time.perf_counter() - t0
    text = _from_rank0(p.to_json() if rank == 0 else None)
    if rank != 0:
        p = Plan.from_json(text)
        for f in p.finalists:
            f.bind(graph)
        match = next((f for f in p.finalists if f.name == p.chosen), None)
        p.strategy = match.strategy if match is not None else p.bind(graph)
    else:
        _emit(p.finalists_line())
    return p


def _devices_at_hand(machine: Machine, module):
    """The torch device this rank would train ``machine``'s device on, when a process group
    of at least its device count runs here on devices of its kind and the module holds real
    tensors; else None."""
    import itertools

    import torch
    import torch.distributed as dist

    from .cost.profiledb import device_kind_of
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < machine.num_devices:
        return None
    if any(t.is_meta for t in itertools.chain(module.parameters(), module.buffers())):
        return None
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" \
        else torch.device("cpu")
    try:
        return device if device_kind_of(device) == machine.spec.kind else None
    except (RuntimeError, ValueError):
        return None


def check_finalists(finalists, finalist_steps) -> None:
    """A clear error for a bad ``finalists`` or ``finalist_steps``."""
    if isinstance(finalists, bool) or not isinstance(finalists, int) or finalists < 0:
        raise ValueError(f"finalists must be a non-negative integer (0 or 1: no measurement), got {finalists!r}")
    if isinstance(finalist_steps, bool) or not isinstance(finalist_steps, int) or finalist_steps < 1:
        raise ValueError(f"finalist_steps must be a positive integer, got {finalist_steps!r}")


def plan(module, machine: Machine, example_inputs=None, *, example_kwargs=None, budget: float = 30.0,
         optimizer: str = "sgd", precision: str = "32-true", seed: int = 0, evaluations: int | None = None,
         min_gain: float = MIN_PREDICTED_GAIN, cost_model=None, shard: bool = True, finalists: int = FINALISTS,
         finalist_steps: int = FINALIST_STEPS, batch_dim=None, measure: bool = False,
         strategy=None) -> Plan:
    """Trace ``module`` on ``example_inputs`` and search a strategy for ``machine``
    (:func:`flexflow.search` for ``budget`` seconds, or ``evaluations``): a :class:`Plan`.

    ``min_gain``: the searched strategy is kept only when the simulator predicts it at least
    this much faster than data parallelism (default 5%); else the plan is data parallelism.
    ``shard``: whether shard levels and recomputation may be chosen (the search's levers:
    :func:`flexflow.search`'s ``shard`` and ``recompute``).

    ``finalists``: the plan lists the search's best few distinct strategies with their
    predictions (data parallelism among them).  With ``measure=True`` and the devices at hand
    -- called on every rank of a process group of at least ``machine.num_devices`` ranks on devices of the
    machine's kind, with a module of real tensors -- the call is collective: rank 0 searches
    (its host's cost model and corrections unless ``cost_model`` is given), every finalist
    runs ``finalist_steps`` timed training steps on ranks 0..n-1, the fastest measured is
    the plan (:func:`measure_plan`), and within ``budget`` (a quarter kept for measuring).
    ``finalists`` 0 or 1: no finalists, no measurement.

    ``measure``: planning joins no collective unless asked.  With ``measure=True``, called
    on every rank of a process group with the devices at hand (as above), the finalists are
    measured as :func:`flexflow.parallelize` measures them; without it the plan is the
    simulator's, whatever process group is running (rank 0 may plan alone and broadcast).

    ``strategy``: the plan of this strategy (a :class:`Strategy` of a trace of ``module``, or
    its JSON), simulated with the baselines; no search, no measurement.

    ``batch_dim``: which dim of each input is the batch (:func:`flexflow.trace`; default:
    inferred from the graph)."""
    if example_inputs is None and example_kwargs:
        example_inputs = ()
    if example_inputs is None:
        raise ValueError("plan() needs example_inputs: a batch with the shapes and dtypes of the real inputs")
    if not isinstance(example_inputs, (tuple, list)):
        example_inputs = (example_inputs,)
    if not 0 <= min_gain < 1:
        raise ValueError(f"min_gain must be in [0, 1), got {min_gain!r}")
    check_finalists(finalists, finalist_steps)
    t0 = time.perf_counter()
    graph = trace(module, example_inputs, example_kwargs, batch_dim=batch_dim)
    if strategy is not None:
        return given_plan(graph, machine, strategy, cost_model=cost_model, optimizer=optimizer,
                          precision=precision, t0=t0)
    from .finalists import not_runnable
    if not isinstance(measure, bool):
        raise TypeError(f"measure must be True or False, got {measure!r}")
    at_hand = measure and finalists > 1 and not_runnable(None, precision) is None
    device = _devices_at_hand(machine, module) if at_hand else None
    if measure and finalists > 1 and device is None:
        raise ValueError(
            f"plan(measure=True) measures the finalists on the devices: call it on every rank of a process "
            f"group of at least {machine.num_devices} ranks on {machine.spec.kind} devices, with a module of "
            f"real tensors (not on the meta device){'' if not_runnable(None, precision) is None else ', in a precision the executor runs'}")
    args = {"budget": budget, "seed": seed, "evaluations": evaluations, "optimizer": optimizer,
            "precision": precision, "min_gain": min_gain, "shard": shard, "finalists": finalists}
    if device is None:
        return searched_plan(graph, machine, cost_model=cost_model, t0=t0, **args)
    from . import settings
    from .cost.corrections import load_corrections
    from .cost.model import CostModel
    got = None
    if _rank() == 0:
        try:
            base = cost_model if cost_model is not None else CostModel.for_machine(machine)
            used = load_corrections(machine, graph.fingerprint()) if cost_model is None else None
            args["budget"] = budget * (1 - FINALIST_SHARE)
            got = searched_plan(graph, machine, cost_model=base, corrections=used, t0=t0, **args)
            if cost_model is None:
                got._learn = (machine, base, used)
            box = ("plan", got.to_json(), max(budget - (time.perf_counter() - t0), budget * FINALIST_SHARE))
        except Exception as e:  # noqa: BLE001 - every rank must hear about it
            box = ("error", f"rank 0 could not plan: {type(e).__name__}: {e}", 0.0)
    else:
        box = None
    kind, text, left = _from_rank0(box)
    if kind == "error":
        raise StrategyError(text)
    p = got if got is not None else Plan.from_json(text)
    return measure_plan(p, graph, module, example_inputs, example_kwargs, list(range(machine.num_devices)),
                        device=device, timeout_s=settings.timeout_s(), steps=finalist_steps, seconds=left)
