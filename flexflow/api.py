"""``parallelize``: the user-facing entry point of the executor (``launch`` is in launch.py).

    def train(rank):
        module, batch = flexflow.models.get("alexnet", batch_size=64, size="small")
        model = flexflow.parallelize(module, example_inputs=batch)  # every rank
        opt = torch.optim.SGD(model.parameters(), lr=0.1)           # this rank's shards
        for _ in range(10):
            opt.zero_grad()
            loss = model(*batch)        # the same global batch on every rank
            loss.backward()
            opt.step()

    flexflow.launch(train, 2)

``parallelize`` is collective: every rank of the process group calls it
(it traces, agrees on a strategy, and creates process groups).  Calls of the
returned module's ``forward``/``backward``/``state_dict`` are collective too.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn

from . import settings
from .graph.trace import trace
from .hardware.machine import Machine
from .plan import (
    FINALIST_SHARE,
    FINALIST_STEPS,
    FINALISTS,
    MIN_PREDICTED_GAIN,
    Plan,
    check_finalists,
    measure_plan,
    searched_plan,
)
from .runtime.module import ParallelModule
from .runtime.pipeline import runtime_for
from .runtime.plan import BUCKET_CAP_MB, REDUCE_OUTPUTS, RUN_PRECISIONS, _precision_error
from .runtime.program import check_programs
from .sim.memory import optimizer_state_copies
from .strategy.config import StrategyError
from .strategy.shapecheck import check_partition_shapes
from .strategy.strategy import Strategy

__all__ = ["parallelize", "ParallelModule", "default_timeout_s", "host_cost_model", "PROFILE_SHARE"]


DEFAULT_TIMEOUT_S = 300.0


def default_timeout_s() -> float:
    """$FLEXFLOW_TIMEOUT_S, else 300 s: how long a rank waits for a peer before failing."""
    return settings.timeout_s()


# --------------------------------------------------------------------------- parallelize
def _resolve_devices(devices, world: int) -> list[int]:
    if devices is None:
        return list(range(world))
    if isinstance(devices, bool):
        raise TypeError(f"devices must be None, a count or a list of ranks, got {devices!r}")
    if isinstance(devices, int):
        if not 1 <= devices <= world:
            raise ValueError(f"devices={devices} but the process group has {world} rank(s)")
        return list(range(devices))
    ranks = [int(d) for d in devices]
    if not ranks or len(set(ranks)) != len(ranks) or any(not 0 <= r < world for r in ranks):
        raise ValueError(f"devices={list(devices)} must be distinct ranks of the process group (0..{world - 1})")
    return ranks


def _maybe_init_from_env(timeout_s: float) -> None:
    """Under torchrun (RANK / WORLD_SIZE set) initialise the default group if the user has not."""
    if dist.is_initialized() or "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return
    if int(os.environ["WORLD_SIZE"]) <= 1:
        return
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))


def _default_machine(n: int, nccl: bool, searching: bool = False) -> Machine:
    """The GPUs of this host under NCCL, else this host's (calibrated) cpu machine,
    with exactly n devices.  Only the rank that searches calibrates a new host
    (``searching``); the others read the cached figures."""
    if nccl or searching:
        if searching and not nccl:
            from .calibrate.host import ensure_calibrated
            ensure_calibrated()
        m = Machine.detect()
        if m.num_devices >= n and m.spec.backend == ("nccl" if nccl else "gloo"):
            return m.with_devices(n)
    m = Machine.preset("cpu")
    if n > m.num_devices:  # more local processes than the preset counts: one node of n
        m = dataclasses.replace(m, num_nodes=1, devices_per_node=n, num_devices=None)
    return m.with_devices(n)


# At most this share of the search budget goes to measuring op partitions on
# this host before the search (only what the profile cache lacks).
PROFILE_SHARE = 1 / 3


def host_cost_model(graph, machine, device="cpu", seconds: float = 10.0, precision: str = "32-true"):
    """(cost model, profile report or None) for searching ``graph`` on ``machine``
    from this host.  When ``device`` is of the machine's device kind (the cpu
    machine and this CPU, an H100 machine and this H100), the op partitions the
    search may choose are measured there first, data parallelism's and
    everything-on-one-device's first, then every candidate config's, for at most
    ``seconds`` (what the profile cache holds costs nothing); the analytic model,
    fitted to those measurements, prices what is left.  Otherwise the machine's
    profile where one exists (:meth:`CostModel.for_machine`).  ``precision``: the ops are
    measured as they run under it (:func:`flexflow.cost.profile.profile_graph`)."""
    from .cost.model import CostModel
    from .cost.profile import profile_graph
    from .cost.profiledb import ProfileDB, device_kind_of, device_name
    from .strategy.candidates import candidate_configs
    try:
        same = device_kind_of(device) == machine.spec.kind
    except RuntimeError:  # cuda asked for where there is none
        same = False
    if not same or seconds <= 0:
        return CostModel.for_machine(machine), None
    t0 = time.perf_counter()
    db = ProfileDB.load(device_name(device), device_kind=device_kind_of(device))  # read once for both passes
    first = Strategy.single_device(graph, machine)
    report = profile_graph(graph, device, strategy=Strategy.data_parallel(graph, machine),
                           configs={op.name: first[op.name] for op in graph.compute_ops}, db=db,
                           budget_s=seconds, precision=precision)
    left = seconds - (time.perf_counter() - t0)
    if left > 0 and not report.skipped:
        rest = profile_graph(graph, device, configs={op.name: candidate_configs(op, machine)
                                                     for op in graph.compute_ops}, db=db, budget_s=left,
                               precision=precision)
        report.measured += rest.measured
        report.skipped += rest.skipped
        report.errors += rest.errors
    report.seconds = time.perf_counter() - t0
    return CostModel.for_machine(machine), report


def _search_plan(graph, machine, budget: float, optimizer: str = "sgd", device=None,
                 reduce_outputs: str = "with_gradients", min_gain: float = MIN_PREDICTED_GAIN,
                 finalists: int = FINALISTS, cost_model=None, precision: str = "32-true") -> Plan:
    """Rank 0's plan: the searched strategy, unless it is predicted less than ``min_gain``
    faster than data parallelism (then data parallelism), with the finalists to measure.
    With ``device``, the ops are profiled there first (:func:`host_cost_model`,
    within ``PROFILE_SHARE`` of the budget) and the search gets the rest, less the share
    kept for measuring the finalists (``FINALIST_SHARE``, when there are any); without,
    the search uses whatever profile of the machine is cached.  The host's cost model
    searches under the corrections its finalists taught it before
    (:mod:`flexflow.cost.corrections`) and learns from these (``_learn``); a given
    ``cost_model`` neither."""
    from .cost.corrections import load_corrections
    from .cost.model import CostModel
    t0 = time.perf_counter()
    if cost_model is not None:
        cm = cost_model
    elif device is None:
        cm = CostModel.for_machine(machine)
    else:
        cm, _ = host_cost_model(graph, machine, device, budget * PROFILE_SHARE, precision)
    keep = FINALIST_SHARE if finalists > 1 else 0.0
    left = max(budget * (1 - keep) - (time.perf_counter() - t0), budget * (1 - PROFILE_SHARE - keep))
    used = load_corrections(machine, graph.fingerprint()) if cost_model is None else None
    # shard levels and recomputation are levers where data parallelism does not fit (search())
    found = searched_plan(graph, machine, cost_model=cm, corrections=used, budget=left, optimizer=optimizer,
                          reduce_outputs=reduce_outputs, min_gain=min_gain, shard=True, finalists=finalists,
                          precision=precision, t0=t0)
    if cost_model is None:
        found._learn = (machine, cm, used)
    return found


def _trace_clean(module: nn.Module, example_inputs, example_kwargs=None, batch_dim=None):
    """trace() leaves the module's buffers and attributes as they were."""
    return trace(module, example_inputs, example_kwargs, batch_dim=batch_dim)


def _reuse_graph(strategy, module, example_inputs):
    """The graph a Strategy object was made on, when it is a trace of this very
    module with these input shapes (saves tracing again)."""
    g = getattr(strategy, "graph", None)
    if g is None or g.module is not module:
        return None
    tensors = [x for x in example_inputs if isinstance(x, torch.Tensor)]
    ins = [op for op in g.ops if op.kind == "input"]
    if len(ins) != len(tensors) or any(tuple(op.output_shape) != tuple(x.shape) or op.dtype != x.dtype
                                       for op, x in zip(ins, tensors)):
        return None
    return g


def _as_strategy(strategy, graph, machine, ranks, machine_given: bool) -> Strategy:
    """Bind a user strategy to this rank's graph and check it fits; raises StrategyError."""
    if isinstance(strategy, Strategy):
        if strategy.graph is not graph:
            if strategy.graph.fingerprint() != graph.fingerprint():
                raise StrategyError(f"strategy {strategy.name!r} was made for another graph (fingerprint "
                                    f"{strategy.graph.fingerprint()}, this graph {graph.fingerprint()}): "
                                    "trace the same model with the same batch and dtype")
            rebound = Strategy(graph, dict(strategy.items()), name=strategy.name,
                               pipeline=strategy.pipeline.to_dict() if strategy.pipeline is not None else None)
            rebound.machine_fingerprint, rebound.num_devices = strategy.machine_fingerprint, strategy.num_devices
            strategy = rebound
    elif isinstance(strategy, (str, bytes)):
        strategy = Strategy.from_json(strategy, graph)
    else:
        raise TypeError(f"strategy must be a flexflow Strategy or its JSON text, got {type(strategy).__name__}")
    used = strategy.devices_used()
    if used and max(used) >= len(ranks):
        bad = next(op for op in graph.compute_ops if max(strategy[op.name].devices) >= len(ranks))
        raise StrategyError(f"strategy {strategy.name!r} places {bad.describe()} on device "
                            f"{max(strategy[bad.name].devices)} but only {len(ranks)} devices "
                            f"(ranks {ranks}) take part")
    if machine_given:
        strategy.check(machine)
    return strategy


def _agree(local_error: str | None, fingerprint: str, distributed: bool) -> None:
    """Every rank learns every rank's verdict, so all raise together (no hang)."""
    if not distributed:
        if local_error:
            raise StrategyError(local_error)
        return
    verdicts = [None] * dist.get_world_size()
    dist.all_gather_object(verdicts, (local_error, fingerprint))
    fps = {fp for _, fp in verdicts if fp is not None}
    errors = [(r, e) for r, (e, _) in enumerate(verdicts) if e]
    if len(fps) > 1:
        errors.append((None, "ranks traced different graphs (fingerprints "
                             + ", ".join(f"rank {r}: {fp}" for r, (_, fp) in enumerate(verdicts)) + ")"))
    if errors:
        me = dist.get_rank()
        own = next((e for r, e in errors if r == me), None)
        msg = own or "; ".join(f"rank {r}: {e}" if r is not None else e for r, e in errors)
        raise StrategyError(f"strategy refused: {msg}")


def _broadcast_state(module: nn.Module, device) -> None:
    """Rank 0's parameters and buffers on every rank (as DistributedDataParallel does)."""
    seen, by_dtype = set(), {}
    for t in module.state_dict(keep_vars=True).values():
        if id(t) in seen or t.dtype == torch.bool:
            continue
        seen.add(id(t))
        by_dtype.setdefault(t.dtype, []).append(t)
    with torch.no_grad():
        for dtype in sorted(by_dtype, key=str):
            ts = by_dtype[dtype]
            flat = torch.cat([t.detach().reshape(-1).to(device) for t in ts])
            dist.broadcast(flat, src=0)
            off = 0
            for t in ts:
                t.copy_(flat[off:off + t.numel()].view(t.shape))
                off += t.numel()


def parallelize(module: nn.Module, devices=None, example_inputs=None, *, example_kwargs=None,
                strategy=None, budget: float = 30.0,
                machine: Machine | None = None, timeout_s: float | None = None,
                bucket_cap_mb: float = BUCKET_CAP_MB, broadcast_state: bool = True,
                optimizer: str = "sgd", reduce_outputs: str = "with_gradients",
                profile: bool = True, plan: Plan | str | None = None,
                min_gain: float = MIN_PREDICTED_GAIN, finalists: int = FINALISTS,
                finalist_steps: int = FINALIST_STEPS, cost_model=None,
                precision: str = "32-true", batch_dim=None) -> ParallelModule:
    """Run ``module`` on the devices of the process group with a SOAP strategy.

    Collective: every rank of the default process group calls it with the
    same module (structure), inputs shapes and arguments.  ``devices`` is
    None (every rank), a count (ranks 0..n-1) or a list of ranks; device k
    of the strategy runs on ``ranks[k]``; the other ranks hold nothing but
    still return the outputs.  ``example_inputs`` fix every shape (required;
    keyword inputs go in ``example_kwargs`` and the module is then called
    with the same keywords).  ``batch_dim``: which dim of each input is the
    batch (:func:`flexflow.trace`; default: inferred).
    Without ``strategy``, rank 0 searches for ``budget`` seconds and
    broadcasts the result.  ``timeout_s`` (default $FLEXFLOW_TIMEOUT_S or
    300) bounds every wait on a peer.  Rank 0's parameters and buffers are
    copied to every rank first (``broadcast_state``), as DDP does.
    ``optimizer`` ("sgd", "momentum", "adam"): the optimizer the caller will
    use, whose state counts in the memory the searched strategy must fit.
    ``reduce_outputs``: how every rank gets the full outputs (the global loss).
    "with_gradients" (default): the outputs ride at the end of a gradient
    bucket that spans every rank, so a training step has no collective beyond
    DDP's; the values are there once ``backward()`` has run.  Read before the
    backward, on any or all ranks, that bucket is all-reduced at the read,
    carrying zeros for the reader's gradients, which one more all-reduce of
    the bucket adds at the end of the backward (two collectives that step,
    never a wait for a peer that does not read).  Where no such bucket exists
    (model parallelism) or the forward runs without autograd, outputs are
    reduced eagerly.  "eager": one all-reduce per output, started at the end
    of the forward and waited on at the first read (on a 2-core host it costs
    0.5-1 ms a step more).
    ``profile``: before searching, rank 0 measures the op partitions the search
    may choose on its own device, when that device is of the machine's kind
    (the detected host), within a third of ``budget``; the measurements are
    cached on disk, so a later call on the same host profiles nothing again.
    False: search on the analytic cost model (and any profile already cached).
    ``plan``: a :class:`flexflow.Plan` (or its JSON) made by :func:`flexflow.plan`, run as
    it is (no search); refused, with the reason, when it was made for another graph, another
    number of devices or another kind of device.  ``min_gain``: the searched strategy
    replaces data parallelism only when predicted at least this much faster.
    ``finalists``: after the search, its best few distinct strategies (this many, data
    parallelism always among them) each run ``finalist_steps`` timed training steps on
    the ranks, more when steps are short (``flexflow.finalists.measure.TIMED_S``):
    forward, backward, sync, optimizer step; the module's parameters, buffers and random
    state are left as they were.  The fastest measured is the one
    returned; a finalist that fails is dropped with a warning.  Measuring takes part of
    ``budget`` (a quarter is kept for it), and what the finalists measured corrects the
    host's cost model for the next search (:mod:`flexflow.cost.corrections`).  0 or 1:
    the simulator's choice, unmeasured.  ``cost_model``: the cost model rank 0 searches
    with (default: this host's, profiled and corrected).
    The returned module's ``plan`` is the plan it runs (searched or given; None for a
    ``strategy``): with the finalists' predicted and measured step times
    (``plan.finalists``, ``plan.summary()``), and rank 0 writes them in one line.
    """
    if plan is not None and strategy is not None:
        raise ValueError("parallelize() takes a plan or a strategy, not both")
    if isinstance(plan, (str, bytes)):
        plan = Plan.from_json(plan)
    elif plan is not None and not isinstance(plan, Plan):
        raise TypeError(f"plan must be a flexflow Plan or its JSON text, got {type(plan).__name__}")
    if example_inputs is None and example_kwargs:
        example_inputs = ()
    optimizer_state_copies(optimizer)  # a clear error for an unknown kind, on every rank
    check_finalists(finalists, finalist_steps)
    if precision not in RUN_PRECISIONS:
        raise ValueError(_precision_error(precision))
    if reduce_outputs not in REDUCE_OUTPUTS:
        raise ValueError(f"reduce_outputs must be one of {', '.join(map(repr, REDUCE_OUTPUTS))}, "
                         f"got {reduce_outputs!r}")
    if example_inputs is None:
        raise ValueError("parallelize() needs example_inputs: a batch with the shapes and dtypes of the "
                         "real inputs (they fix every op's shape), e.g. "
                         "parallelize(model, devices, example_inputs=(x, y))")
    if not isinstance(module, nn.Module):
        raise TypeError(f"parallelize() needs an nn.Module, got {type(module).__name__}")
    if not isinstance(example_inputs, (tuple, list)):
        example_inputs = (example_inputs,)
    timeout_s = float(timeout_s) if timeout_s is not None else default_timeout_s()
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s}")
    _maybe_init_from_env(timeout_s)
    distributed = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size() if distributed else 1
    rank = dist.get_rank() if distributed else 0
    nccl = distributed and dist.get_backend() == "nccl"
    device = torch.device("cpu")
    if nccl:  # one GPU per rank
        local_rank = int(os.environ.get("LOCAL_RANK", rank % max(1, torch.cuda.device_count())))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    # Local checks first; every error is shared through the collectives below, so a
    # rank that refuses never leaves the others waiting in a collective.
    error, graph, ranks, chosen = None, None, None, None
    measure_s = None  # seconds left to measure the finalists of a search
    machine_given = machine is not None
    try:
        ranks = _resolve_devices(devices, world)
        if machine is None:
            machine = _default_machine(len(ranks), nccl, searching=strategy is None and plan is None
                                       and rank == 0 and len(ranks) > 1)
        elif machine.num_devices != len(ranks):
            raise ValueError(f"machine {machine.name!r} has {machine.num_devices} devices but "
                             f"{len(ranks)} ranks take part ({ranks})")
        graph = ((None if example_kwargs or batch_dim is not None else _reuse_graph(strategy, module, example_inputs))
                 or _trace_clean(module, example_inputs, example_kwargs, batch_dim))
    except Exception as e:  # noqa: BLE001 - reported on every rank by _agree
        if not distributed:
            raise
        error = f"{type(e).__name__}: {e}"
    # strategy: given (validated on every rank), a plan's, or searched on rank 0 and broadcast
    if plan is not None and error is None:
        try:
            plan.check_devices(machine, len(ranks))
            if plan.precision != precision:
                raise StrategyError(f"plan was made for precision {plan.precision!r}, not {precision!r} "
                                    "(parallelize's precision=)")
            strategy = plan.bind(graph)
        except StrategyError as e:
            error = str(e)
    elif strategy is None:
        payload, found = [None], None
        if rank == 0:
            try:
                if error is not None:
                    raise RuntimeError(error)
                if len(ranks) > 1:
                    found = _search_plan(graph, machine, budget, optimizer, device if profile else None,
                                         reduce_outputs, min_gain, finalists, cost_model, precision)
                    payload = [("plan", found.to_json(),
                                max(budget - found.search_seconds, budget * FINALIST_SHARE))]
                else:
                    payload = [("ok", Strategy.data_parallel(graph, machine).to_json(), None)]
            except Exception as e:  # noqa: BLE001 - every rank must hear about it
                payload = [("error", f"rank 0 could not choose a strategy: {type(e).__name__}: {e}", None)]
        if distributed:
            dist.broadcast_object_list(payload, src=0)
        kind, text, left_s = payload[0]
        if kind == "error":
            error = error or text
        elif kind == "plan":
            plan = found if found is not None else Plan.from_json(text)
            strategy = plan.strategy_json
            measure_s = left_s if len(plan.finalists) > 1 else None
        else:
            strategy = text
    if error is None:
        try:
            chosen = _as_strategy(strategy, graph, machine, ranks, machine_given)
            check_partition_shapes(graph, chosen)  # refused now, not a receive that waits for the timeout
        except (StrategyError, TypeError, ValueError) as e:
            error = str(e)
    _agree(error, graph.fingerprint() if graph is not None else None, distributed)

    if distributed and world > 1 and broadcast_state:
        _broadcast_state(module, device)
    if measure_s is not None:  # every rank: the finalists run, the fastest measured is kept
        plan = measure_plan(plan, graph, module, example_inputs, example_kwargs, ranks, device=device,
                            timeout_s=timeout_s, steps=finalist_steps, seconds=measure_s,
                            bucket_cap_mb=bucket_cap_mb, reduce_outputs=reduce_outputs)
        chosen = _as_strategy(plan.strategy, graph, machine, ranks, machine_given)
    # a pipelined strategy: a runtime of one micro-batch and the driver of its schedule
    runtime, driver = runtime_for(graph, chosen, module, ranks, device=device, timeout_s=timeout_s,
                                  bucket_cap_mb=bucket_cap_mb, reduce_outputs=reduce_outputs, precision=precision)
    check_programs(runtime)  # a mismatch between ranks is an error now, not a hang at the first step
    par = ParallelModule(module, runtime, pipeline=driver, strategy=chosen)
    if plan is not None and plan.strategy is None:
        plan.strategy = chosen
    par.plan = plan
    return par
