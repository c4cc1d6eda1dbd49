"""``parallelize`` and ``launch``: the user-facing entry points of the executor.

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
import pickle
import shutil
import socket
import tempfile
import time
import traceback
import warnings
from collections import OrderedDict

import torch
import torch.distributed as dist
import torch.nn as nn

from .execute import BUCKET_CAP_MB, REDUCE_OUTPUTS, Runtime, tensor_of
from .machine import Machine
from .memory import optimizer_state_copies
from .program import check_programs, describe
from .strategy import Strategy, StrategyError
from .trace import trace

__all__ = ["parallelize", "launch", "ParallelModule", "LaunchError", "default_timeout_s"]

DEFAULT_TIMEOUT_S = 300.0


def default_timeout_s() -> float:
    """$FLEXFLOW_TIMEOUT_S, else 300 s: how long a rank waits for a peer before failing."""
    env = os.environ.get("FLEXFLOW_TIMEOUT_S")
    if env:
        try:
            value = float(env)
        except ValueError:
            raise ValueError(f"FLEXFLOW_TIMEOUT_S must be a number of seconds, got {env!r}") from None
        if value > 0:
            return value
    return DEFAULT_TIMEOUT_S


# --------------------------------------------------------------------------- the module
class ParallelModule(nn.Module):
    """The module returned by :func:`parallelize`.

    ``forward`` takes the global inputs (the same on every rank) and returns
    the module's outputs in full on every rank.  ``parameters()`` are this
    rank's shards, named like the original's parameters (a top-level name
    that clashes with an attribute of this class gets a trailing ``_``; a
    rank holding no block has one empty parameter, ``_no_shard``, so that
    optimizers accept the list).  ``state_dict()`` gathers full tensors keyed
    like the original module's state_dict (every rank gets them;
    collective); ``load_state_dict()`` takes such a dict on every rank and
    keeps each rank's blocks.  ``train()``/``eval()`` also switch the
    original module, whose Dropout and BatchNorm the ops read.
    """

    def __init__(self, module: nn.Module, runtime: Runtime):
        super().__init__()
        object.__setattr__(self, "_module", module)  # not a submodule: its tensors are not ours
        object.__setattr__(self, "_runtime", runtime)
        for qual, p in runtime.params.items():
            owner, name = self._owner(qual)
            owner.register_parameter(name, p)
        for qual, b in runtime.buffers.items():
            owner, name = self._owner(qual)
            owner.register_buffer(name, b)
        if not runtime.params:
            # A rank that holds no parameter block still gets a (0-element) parameter,
            # so that ``torch.optim.X(model.parameters())`` works on every rank.
            self.register_parameter("_no_shard", nn.Parameter(torch.empty(0, device=runtime.device)))
        self.train(module.training)

    def _owner(self, qual: str):
        *path, name = qual.split(".")
        owner = self
        if path and hasattr(type(self), path[0]) or not path and hasattr(type(self), name):
            if path:
                path[0] += "_"
            else:
                name += "_"
        for part in path:
            if part not in owner._modules:
                owner.add_module(part, nn.Module())
            owner = owner._modules[part]
        return owner, name

    @property
    def original_module(self) -> nn.Module:
        """The module given to parallelize (its parameters are not updated by
        training: ``original_module.load_state_dict(model.state_dict())``)."""
        return self._module

    @property
    def runtime(self) -> Runtime:
        return self._runtime

    @property
    def strategy(self) -> Strategy:
        return self._runtime.strategy

    @property
    def graph(self):
        return self._runtime.graph

    def program(self) -> str:
        """This rank's program in words: what it runs, sends, waits for and reduces, in order."""
        return describe(self._runtime)

    def forward(self, *inputs, **kwargs):
        return self._runtime.run(self._runtime.graph.flat_inputs(inputs, kwargs))

    def train(self, mode: bool = True):
        super().train(mode)
        self._module.train(mode)
        return self

    def state_dict(self, *args, destination=None, prefix="", keep_vars=False):
        """Full tensors keyed like the original module's state_dict (collective)."""
        if args:  # the deprecated positional form (destination, prefix, keep_vars)
            destination = args[0]
            prefix = args[1] if len(args) > 1 else prefix
        fulls = self._runtime.full_tensors()
        by_id = {id(tensor_of(self._module, q)): q for q in fulls}
        out = OrderedDict() if destination is None else destination
        for key, t in self._module.state_dict(keep_vars=True).items():
            q = by_id.get(id(t))
            value = fulls[q].reshape(t.shape) if q is not None else t.detach()
            out[prefix + key] = value.clone()
        return out

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Load full tensors (the original module's keys) and keep this rank's blocks."""
        result = self._module.load_state_dict(state_dict, strict=strict)
        self._runtime.load_from_module()
        return result

    def extra_repr(self) -> str:
        rt = self._runtime
        return (f"strategy={rt.strategy.name!r}, rank={rt.rank}, devices={rt.ranks}, "
                f"exchanges={rt.num_exchanges}")


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
        m = Machine.detect()
        if m.num_devices >= n and m.spec.backend == ("nccl" if nccl else "gloo"):
            return m.with_devices(n)
    m = Machine.preset("cpu")
    if n > m.num_devices:  # more local processes than the preset counts: one node of n
        m = dataclasses.replace(m, num_nodes=1, devices_per_node=n, num_devices=None)
    return m.with_devices(n)


# The searched strategy replaces data parallelism only when the simulator
# predicts at least this gain: predictions carry errors of tens of percent on
# a shared CPU host, and a near-tie is not worth a riskier plan.
MIN_PREDICTED_GAIN = 0.05


# At most this share of the search budget goes to measuring op partitions on
# this host before the search (only what the profile cache lacks).
PROFILE_SHARE = 1 / 3


def host_cost_model(graph, machine, device="cpu", seconds: float = 10.0):
    """(cost model, profile report or None) for searching ``graph`` on ``machine``
    from this host.  When ``device`` is of the machine's device kind (the cpu
    machine and this CPU, an H100 machine and this H100), the op partitions the
    search may choose are measured there first, data parallelism's and
    everything-on-one-device's first, then every candidate config's, for at most
    ``seconds`` (what the profile cache holds costs nothing); the analytic model,
    fitted to those measurements, prices what is left.  Otherwise the machine's
    profile where one exists (:meth:`CostModel.for_machine`)."""
    from .cost import CostModel
    from .profile import profile_graph
    from .profiledb import ProfileDB, device_kind_of, device_name
    from .strategy import candidate_configs
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
                           budget_s=seconds)
    left = seconds - (time.perf_counter() - t0)
    if left > 0 and not report.skipped:
        rest = profile_graph(graph, device, configs={op.name: candidate_configs(op, machine)
                                                     for op in graph.compute_ops}, db=db, budget_s=left)
        report.measured += rest.measured
        report.skipped += rest.skipped
        report.errors += rest.errors
    report.seconds = time.perf_counter() - t0
    return CostModel.for_machine(machine), report


def _search_strategy(graph, machine, budget: float, optimizer: str = "sgd", device=None,
                     reduce_outputs: str = "with_gradients") -> Strategy:
    """Rank 0's choice: the searched strategy, unless it is predicted less than
    ``MIN_PREDICTED_GAIN`` faster than data parallelism (then data parallelism).
    With ``device``, the ops are profiled there first (:func:`host_cost_model`,
    within ``PROFILE_SHARE`` of the budget) and the search gets the rest;
    without, the search uses whatever profile of the machine is cached."""
    from .search import search  # the module's function (flexflow.search is the function too)
    from .cost import CostModel
    t0 = time.perf_counter()
    if device is None:
        cm = CostModel.for_machine(machine)
    else:
        cm, _ = host_cost_model(graph, machine, device, budget * PROFILE_SHARE)
    left = max(budget - (time.perf_counter() - t0), budget * (1 - PROFILE_SHARE))
    found = search(graph, machine, budget=left, optimizer=optimizer, cost_model=cm, reduce_outputs=reduce_outputs)
    dp = found.baselines.get("data_parallel")
    if (dp is not None and dp.feasible and found.result.feasible
            and found.result.iteration_time > dp.iteration_time * (1 - MIN_PREDICTED_GAIN)):
        return Strategy.data_parallel(graph, machine)
    return found.strategy


def _trace_clean(module: nn.Module, example_inputs, example_kwargs=None):
    """trace() leaves the module's buffers and attributes as they were."""
    return trace(module, example_inputs, example_kwargs)


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
            rebound = Strategy(graph, dict(strategy.items()), name=strategy.name)
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
                profile: bool = True) -> ParallelModule:
    """Run ``module`` on the devices of the process group with a SOAP strategy.

    Collective: every rank of the default process group calls it with the
    same module (structure), inputs shapes and arguments.  ``devices`` is
    None (every rank), a count (ranks 0..n-1) or a list of ranks; device k
    of the strategy runs on ``ranks[k]``; the other ranks hold nothing but
    still return the outputs.  ``example_inputs`` fix every shape (required;
    keyword inputs go in ``example_kwargs`` and the module is then called
    with the same keywords).
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
    """
    if example_inputs is None and example_kwargs:
        example_inputs = ()
    optimizer_state_copies(optimizer)  # a clear error for an unknown kind, on every rank
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
    machine_given = machine is not None
    try:
        ranks = _resolve_devices(devices, world)
        if machine is None:
            machine = _default_machine(len(ranks), nccl, searching=strategy is None and rank == 0
                                       and len(ranks) > 1)
        elif machine.num_devices != len(ranks):
            raise ValueError(f"machine {machine.name!r} has {machine.num_devices} devices but "
                             f"{len(ranks)} ranks take part ({ranks})")
        graph = ((None if example_kwargs else _reuse_graph(strategy, module, example_inputs))
                 or _trace_clean(module, example_inputs, example_kwargs))
    except Exception as e:  # noqa: BLE001 - reported on every rank by _agree
        if not distributed:
            raise
        error = f"{type(e).__name__}: {e}"
    # strategy: given (validated on every rank), or searched on rank 0 and broadcast
    if strategy is None:
        payload = [None]
        if rank == 0:
            try:
                if error is not None:
                    raise RuntimeError(error)
                found = (_search_strategy(graph, machine, budget, optimizer, device if profile else None,
                                          reduce_outputs)
                         if len(ranks) > 1
                         else Strategy.data_parallel(graph, machine))
                payload = [("ok", found.to_json())]
            except Exception as e:  # noqa: BLE001 - every rank must hear about it
                payload = [("error", f"rank 0 could not choose a strategy: {type(e).__name__}: {e}")]
        if distributed:
            dist.broadcast_object_list(payload, src=0)
        kind, text = payload[0]
        if kind == "error":
            error = error or text
        else:
            strategy = text
    if error is None:
        try:
            chosen = _as_strategy(strategy, graph, machine, ranks, machine_given)
        except (StrategyError, TypeError, ValueError) as e:
            error = str(e)
    _agree(error, graph.fingerprint() if graph is not None else None, distributed)

    if distributed and world > 1 and broadcast_state:
        _broadcast_state(module, device)
    runtime = Runtime(graph, chosen, module, ranks, device=device, timeout_s=timeout_s,
                      bucket_cap_mb=bucket_cap_mb, reduce_outputs=reduce_outputs)
    check_programs(runtime)  # a mismatch between ranks is an error now, not a hang at the first step
    return ParallelModule(module, runtime)


# --------------------------------------------------------------------------- launch
class LaunchError(RuntimeError):
    """One or more ranks of :func:`launch` failed; the message holds every rank's traceback."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch_entry(rank, nprocs, tmp, backend, timeout_s, port, fn, args):
    """One rank of :func:`launch`.  It never reaches interpreter finalisation
    (where a live gloo group can abort the process): on success it shuts
    communication down cleanly and leaves with ``os._exit(0)``; on failure it
    writes its traceback, drops its work objects without waiting on peers
    that may be dead, and leaves with ``os._exit(1)``."""
    import sys

    from . import shutdown

    _die_with_parent()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(nprocs), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(nprocs), GROUP_RANK="0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(port))
    os.environ["FLEXFLOW_TIMEOUT_S"] = str(timeout_s)
    code = 0
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, init_method=f"file://{tmp}/rendezvous", rank=rank,
                                world_size=nprocs, timeout=datetime.timedelta(seconds=timeout_s))
        result = fn(rank, *args)
        try:
            data = pickle.dumps(result)
        except Exception:  # noqa: BLE001 - results are a convenience
            data = pickle.dumps(None)
        _write_atomic(os.path.join(tmp, f"rank{rank}.result"), data)
        shutdown.shutdown()
    except BaseException:  # noqa: BLE001 - reported to the parent
        code = 1
        try:
            _write_atomic(os.path.join(tmp, f"rank{rank}.error"), traceback.format_exc().encode())
        finally:
            shutdown.abandon()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass
    os._exit(code)


def _die_with_parent() -> None:
    """Linux: this process gets SIGKILL when the launching process dies, so a
    killed launcher leaves no orphan ranks behind (elsewhere: nothing)."""
    try:
        import ctypes
        import signal
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 - best effort
        pass


def _write_atomic(path: str, data: bytes) -> None:
    with open(path + ".tmp", "wb") as f:
        f.write(data)
    os.replace(path + ".tmp", path)


def launch(fn, nprocs: int, *args, timeout_s: float | None = None, backend: str | None = None,
           grace_s: float | None = None):
    """Spawn ``nprocs`` local processes with a process group and run ``fn(rank, *args)`` in each.

    gloo on CPU, NCCL (one GPU per rank) when CUDA has enough GPUs.  The
    rendezvous is a fresh ``file://`` in a temporary folder.  Returns the
    list of each rank's return value (None where it cannot be pickled).
    When a rank fails, the others get ``grace_s`` (default 30 s, or
    $FLEXFLOW_LAUNCH_GRACE_S) to fail or finish before they are stopped;
    then :class:`LaunchError` is raised with every failed rank's traceback
    (the first rank to fail is often not the one at fault).
    ``fn`` must be importable (defined at module level): spawn pickles it.
    """
    import multiprocessing.connection
    import torch.multiprocessing as mp

    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"nprocs must be a positive int, got {nprocs!r}")
    timeout_s = float(timeout_s) if timeout_s is not None else default_timeout_s()
    if grace_s is None:
        grace_s = float(os.environ.get("FLEXFLOW_LAUNCH_GRACE_S", 30.0))
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= nprocs else "gloo"
    tmp = tempfile.mkdtemp(prefix="flexflow-launch-")
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = []
    try:
        for rank in range(nprocs):
            p = ctx.Process(target=_launch_entry, name=f"flexflow-rank{rank}",
                            args=(rank, nprocs, tmp, backend, timeout_s, port, fn, args))
            p.start()
            procs.append(p)
        failed_at, stopped = None, []
        while True:
            alive = [p for p in procs if p.is_alive()]
            if not alive:
                break
            if failed_at is None and any(p.exitcode not in (None, 0) for p in procs):
                failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() - failed_at > grace_s:
                for p in alive:
                    stopped.append(procs.index(p))
                    p.terminate()
                for p in alive:
                    p.join(5)
                    if p.is_alive():
                        p.kill()
                        p.join()
                break
            multiprocessing.connection.wait([p.sentinel for p in alive], timeout=0.2)
        results, reports = [], []
        for rank, p in enumerate(procs):
            p.join()
            err_path = os.path.join(tmp, f"rank{rank}.error")
            res_path = os.path.join(tmp, f"rank{rank}.result")
            if os.path.exists(err_path):
                with open(err_path) as f:
                    reports.append(f"--- rank {rank} failed:\n{f.read().rstrip()}")
            elif rank in stopped:
                reports.append(f"--- rank {rank} was stopped: still running {grace_s:g} s after another "
                               f"rank failed")
            elif p.exitcode != 0:
                reports.append(f"--- rank {rank} exited with code {p.exitcode} without a Python traceback")
            result = None
            if os.path.exists(res_path):
                with open(res_path, "rb") as f:
                    try:
                        result = pickle.load(f)
                    except Exception:  # noqa: BLE001
                        result = None
            results.append(result)
        if reports:
            failed = [r for r in range(nprocs) if os.path.exists(os.path.join(tmp, f"rank{r}.error"))]
            head = (f"{len(reports)} of {nprocs} ranks failed"
                    + (f" (tracebacks from ranks {failed})" if failed else ""))
            raise LaunchError(head + "\n" + "\n".join(reports))
        return results
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        shutil.rmtree(tmp, ignore_errors=True)
