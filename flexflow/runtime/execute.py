"""Per-rank runtime: run a strategy for real with torch.distributed.

Each rank walks the OpGraph in order and computes the partitions placed on
it (``config.devices[k]`` is global rank ``ranks[k]``).  :class:`Runtime`
composes the parts, one module each:

- :mod:`.plan`: the rank's program, planned once at setup with no process
  group (parameter shards, exchange steps, gradient buckets, outputs);
- :mod:`.compute`: each step's computation, compiled once;
- :mod:`.comm`: process groups, point-to-point messages and waits;
- :mod:`.autograd`: the Functions on the token chain (exchanges, gradient
  gates, outputs);
- :mod:`.sync`: the bucketed gradient all-reduce and the outputs riding in it;
- :mod:`.state`: full tensors gathered from the shards, and loaded into them;
- :mod:`.shutdown`: closing a runtime's communication;
- :mod:`.gloo`: gloo's event-loop threads under ``SCHED_BATCH``.

BatchNorm split along samples or space normalises with per-replica batch
statistics and keeps per-replica running statistics, as DistributedDataParallel
does (``state_dict`` reports those of the first rank of each shard); a
channel split is exact.  Dropout draws per partition.

Contract with the caller: every rank runs every forward with the same
global inputs, and calls backward on the same outputs (the runtime's
Functions communicate in both directions).  Gradients flow to parameters,
not to the graph inputs.  The shapes are those of the traced example.
"""
from __future__ import annotations

import contextlib
import datetime

import torch
import torch.distributed as dist

from ..graph.ir import OpGraph
from ..cost.precision import LOWERED_RULES
from ..graph.ops import RULES
from ..sim.memory import RECV_AHEAD
from ..strategy.layout import Reordering
from ..strategy.localrun import constant_value_of, fill_outputs
from ..strategy.strategy import Strategy
from . import shutdown
from .autograd import _ExchangeFn, _GateFn, _OutputFn
from .comm import Comm
from .compute import _compute, _Stacked, _tensor, compile_program
from .pending import Once, pending
from .collex import Regather, plan_regathers
from .plan import BUCKET_CAP_MB, ExecutorError, Plan
from .recompute import Recomputing
from .shard import Gathering
from .state import State
from .sync import Riding, _GradSync, _Rider

__all__ = ["Runtime"]


class Runtime(Plan, Comm, Riding, State, Gathering, Recomputing):
    """One rank's share of a (graph, strategy): its parameter shards, its
    program and the static communication plan (a :class:`Plan` of this rank
    that also communicates).  Build it on every rank of the world with the
    same arguments (it creates process groups)."""

    def __init__(self, graph: OpGraph, strategy: Strategy, module: torch.nn.Module, ranks,
                 *, device=None, timeout_s: float = 300.0, bucket_cap_mb: float = BUCKET_CAP_MB,
                 reduce_outputs: str = "with_gradients", precision: str = "32-true", segments: dict | None = None):
        self.distributed = dist.is_available() and dist.is_initialized()
        rank = dist.get_rank() if self.distributed else 0
        world = dist.get_world_size() if self.distributed else 1
        self.timeout = datetime.timedelta(seconds=float(timeout_s))
        super().__init__(graph, strategy, module, ranks, rank=rank, world=world, device=device,
                         bucket_cap_mb=bucket_cap_mb, reduce_outputs=reduce_outputs, precision=precision,
                         segments=segments)
        self.nccl = self.distributed and dist.get_backend() == "nccl"
        self.step = 0  # forward passes run so far (error messages name the step)
        self.closed = False
        self.defer_waits = False  # a pipeline's driver: messages waited for at the end of its step
        compile_program(self)
        self._recv: dict = {}  # exchange index -> (works, buffers), forward
        # the forward's receives by their reader's program position, posted RECV_AHEAD ops ahead
        where = {op.name: i for i, op in enumerate(self.graph.ops)}
        self.fwd_recv_order = sorted(((where[ex.consumer], ex) for ex in self.fwd_recv_ex), key=lambda t: t[0])
        self._recv_next = 0
        # the backward's, by the same positions from the last down (posted RECV_AHEAD ops ahead)
        self.fwd_pos = {ex.index: where[ex.consumer] for ex in self.exchanges}
        self.bwd_recv_order = sorted(((where[ex.consumer], ex) for ex in self.bwd_recv_ex), key=lambda t: -t[0])
        self._bwd_recv_next, self._bwd_done = 0, set()
        self.recv_ahead = RECV_AHEAD
        self._sends: list = []  # (works, tensors) of this step's forward sends, kept alive until waited
        self._bwd_recv: dict = {}
        self._bwd_sends: list = []
        self._bwd_armed = False
        self._pending: list = []  # Once waits of outputs still being all-reduced
        self._riding = False  # this forward's outputs ride on the gradient all-reduce
        self._riders: list = []  # their jobs not yet launched, in graph order
        self._early: list = []  # results of ride buckets this rank all-reduced early (read before backward)
        self.broken: str | None = None
        self._make_groups()
        self._make_gather_groups()
        self._recompute_setup()
        self.regathered = plan_regathers(self)  # gathered inputs made again in the backward (collex)
        self.reorder = Reordering.of(self.graph, self.strategy)  # a head-tail token layout, or None
        self.sync = _GradSync(self)
        shutdown.register(self)

    def close(self, wait_s: float = 10.0, destroy_groups: bool = True) -> None:
        """End this runtime's communication: wait at most ``wait_s`` for
        outstanding gradient all-reduces, drop every work object, destroy the
        process groups it created (:func:`flexflow.runtime.shutdown.close`).
        The module cannot run afterwards."""
        shutdown.close(self, wait_s, destroy_groups)

    # -- forward --------------------------------------------------------------
    def run(self, inputs):
        """The graph's outputs (full values on every rank) for the global inputs."""
        state = self.start(inputs)
        return self.advance(state, 0, len(self.program), finish=True)

    def start(self, inputs) -> dict:
        """Begin a forward on the global inputs: the state that :meth:`advance` carries
        through the program (a pipeline runs it a chunk at a time)."""
        tensors = [x for x in inputs if isinstance(x, torch.Tensor)]
        input_ops = [op for op in self.graph.ops if op.kind == "input"]
        if len(tensors) != len(input_ops):
            raise ExecutorError(f"the model was traced with {len(input_ops)} tensor inputs, got {len(tensors)}")
        if self.closed:
            raise ExecutorError("this parallel module's runtime was shut down (flexflow.runtime.shutdown); "
                                "call parallelize() again")
        if self.broken:
            raise ExecutorError(f"rank {self.rank}: this parallel module cannot run again after a failed "
                                f"step ({self.broken}); call parallelize() again")
        if self.defer_waits:  # a pipeline waits for its messages at the end of the step
            self._sends = [(ws, ts) for ws, ts in self._sends if not all(w.is_completed() for w in ws)]
        else:
            self.settle()
        self.step += 1
        return {"inputs": inputs, "tensors": tensors, "input_ops": input_ops, "vals": None}

    def advance(self, state: dict, lo: int, hi: int, finish: bool):
        """Run program positions ``lo`` to ``hi`` of the forward ``state`` (:meth:`start`);
        with ``finish``, the outputs."""
        try:
            with contextlib.ExitStack() as stack:
                if self.precision.mixed and self.precision.autocast_lists:  # as under torch.autocast in one process
                    stack.enter_context(torch.autocast(self.device.type, dtype=self.precision.compute))
                if (self.recomputed or self.regathered) and torch.is_grad_enabled():  # readers save recipes
                    self._rc_begin_forward()
                    stack.enter_context(self._rc_hooks())
                if state["vals"] is None:
                    self._begin(state)  # (posts the forward's receives)
                else:  # a later chunk: the receives its exchanges popped since
                    self._post_forward_recvs()
                self._steps(state, lo, hi)
                return self._outputs(state) if finish else None
        except BaseException as e:
            self.broken = f"step {self.step}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            raise

    def _begin(self, state: dict) -> None:
        grad = state["grad"] = torch.is_grad_enabled()
        self._riding = grad and self.ride is not None
        self._early = []  # (a backward takes the early rides of the forwards since the last one)
        self._recv_next = 0
        self._post_forward_recvs(None if self.defer_waits else RECV_AHEAD)
        state["token"] = torch.zeros((), device=self.device, requires_grad=grad) if self.chain_length else None
        vals: dict[str, torch.Tensor] = {}
        for op, x in zip(state["input_ops"], state["tensors"]):
            if tuple(x.shape) != tuple(op.output_shape):
                raise ExecutorError(f"input {op.name!r} has shape {tuple(x.shape)} but the model was traced "
                                    f"(example_inputs) with {tuple(op.output_shape)}; the graph has fixed shapes")
            vals[op.name] = x if x.device == self.device else x.to(self.device)
            if self.params_cast is not None and x.is_floating_point():  # (bf16-params: as FSDP2 casts inputs)
                vals[op.name] = vals[op.name].to(self.params_cast)
            if self.reorder is not None:
                vals[op.name] = self.reorder.value(op.name, vals[op.name])
        state["vals"] = vals
        pvals: dict[str, torch.Tensor] = dict(self.params)
        pvals.update(self.buffers)
        state["sharded"] = bool(self.units)
        if state["sharded"]:  # the full regions the ops read, gathered from the slices (.shard)
            pvals.update(self.full)
            self._gather_begin()
        state["pvals"] = pvals
        if grad and self.sync.armed:  # a previous backward failed before its end
            self.sync.reset()

    def _steps(self, state: dict, lo: int, hi: int) -> None:
        vals, pvals, token, grad, sharded = state["vals"], state["pvals"], state["token"], state["grad"], \
            state["sharded"]
        # under torch.profiler each partition's compute is a range named as the
        # simulator names its task ("<op> fwd"), so the two timelines line up
        profiling = torch.autograd.profiler._is_profiler_enabled
        ahead = not self.defer_waits  # (a pipeline's chunks post theirs at once)
        for pos in range(lo, hi):
            step, free = self.program[pos], self.free_before[pos]
            if ahead:
                self._post_forward_recvs(pos + RECV_AHEAD)
            if sharded:
                if pos:
                    self._gather_after(pos - 1, vals.get(self.program[pos - 1].op.name), grad)
                self._gather_before(pos)
            for name in free:
                vals.pop(name, None)
            op = step.op
            if step.run is not None:
                if profiling:
                    with torch.profiler.record_function(f"{op.name} fwd"):
                        out = step.run(vals, pvals)
                else:
                    out = step.run(vals, pvals)
                vals[op.name] = out
                if op.name in self.sends_after:
                    self._post_sends(op.name, out)
                continue
            if step.everywhere:
                if op.kind == "constant":
                    v = constant_value_of(op, self.module).to(self.device)
                    # (bf16-params: a module's floating constants, rotary tables, in bfloat16 as well)
                    vals[op.name] = v.to(self.params_cast) if self.params_cast is not None and \
                        v.is_floating_point() else v
                elif op.kind != "input":
                    ins = [None if r is None else vals[s][r] for s, r in zip(op.inputs, step.part.inputs)]
                    vals[op.name] = RULES[op.rule].compute(op, step.part.block, ins, {})
                if self.reorder is not None and op.kind != "input":  # a position table
                    vals[op.name] = self.reorder.value(op.name, vals[op.name])
                continue
            ins = []
            for entry in step.inputs:
                if entry is None:
                    ins.append(None)
                    continue
                mode, src, data = entry
                if mode == "xchg":
                    token, x = _ExchangeFn.apply(self, data, token, _tensor(vals, src))
                    if data.index in self.regathered and x is not None and torch.is_grad_enabled():
                        state.setdefault("rg", {})[(op.name, len(ins))] = self._regather_source(
                            data, _tensor(vals, src), x)
                    if ("recv", (op.name, len(ins))) in self.share_uses:  # other readers share it
                        x = self._take(state, "recv", (op.name, len(ins)), lambda: x)
                    y = x if not self.cast_share else self.shared_input(state, op.name, len(ins), x)
                    ins.append(self._regather_read(state, op, (op.name, len(ins)), x, y))
                elif mode == "shared":  # what another reader received
                    x = self._take(state, "recv", data, None)
                    y = x if not self.cast_share else self.shared_input(state, op.name, len(ins), x)
                    ins.append(self._regather_read(state, op, data, x, y))
                else:
                    x = vals[src]
                    if data is not None:
                        x = x[data]
                    if isinstance(x, _Stacked) and op.rule != "index":
                        x = x.stack()
                    ins.append(x if not self.cast_share else self.shared_input(state, op.name, len(ins), x))
            if step.gate is not None and grad:
                quals = step.gate.quals
                token, *gated = _GateFn.apply(self, step.gate, token, *[pvals[q] for q in quals])
                pvals.update(zip(quals, gated))
            if step.part is None:
                continue
            params = {local: read(pvals) for local, read in step.param_readers}
            if op.name in self.recomputed:
                vals[op.name] = self._rc_compute(step, ins, params)
            elif profiling:
                with torch.profiler.record_function(f"{op.name} fwd"):
                    vals[op.name] = _compute(op, step.part.block, ins, params)
            else:
                vals[op.name] = _compute(op, step.part.block, ins, params)
            if op.name in self.sends_after:
                self._post_sends(op.name, vals[op.name])
        state["token"] = token

    def _regather_source(self, ex, block, x):
        """Register the gathered input ``x`` of exchange ``ex`` as made again in the backward
        from this rank's piece of its producer ``block`` (collex.Regather); the source."""
        src = Regather(ex, block[ex.coll.region].detach(), None, x.storage_offset())
        self._rc_register(x, src)
        return src

    def _regather_read(self, state: dict, op, key, x, y):
        """What a reader of a re-gathered input computes with: ``y`` (``x`` or the cast of it
        the readers share), under autocast cast here rather than inside the op, so that what
        the op saves is the registered copy, made again in the backward."""
        src = state.get("rg", {}).get(key)
        if src is None or y is None:
            return y
        casts = state.setdefault("rg_cast", {})  # one cast for every reader, recomputed ones too
        if y is x and self.precision.mixed and self.precision.autocast_lists and op.rule in LOWERED_RULES \
                and x.dtype.is_floating_point and x.dtype != self.precision.compute:
            y = casts.get(id(src))
            y = x.to(self.precision.compute) if y is None else y  # (what autocast would do in the op)
        if y is not x and self._rc_source(y) is None:
            self._rc_register(y, Regather(src.ex, src.piece, y.dtype, y.storage_offset()))
        if y is not x:
            casts.setdefault(id(src), y)
        return y

    def _outputs(self, state: dict):
        vals, token = state["vals"], state["token"]
        if state["sharded"] and self.program:
            self._gather_after(len(self.program) - 1, vals.get(self.program[-1].op.name), state["grad"])
        results = {}
        for name in self.graph.output_names():
            if name in self.outputs:
                out = self.outputs[name]
                res = _OutputFn.apply(self, out, token, _tensor(vals, name))
                work = getattr(out, "work", None)
                if work is not None:  # still being all-reduced: wait at first read
                    out.work = None
                    if isinstance(work, _Rider):
                        once = Once(lambda j=work: self._read_rider(j))
                    else:
                        once = Once(lambda w=work, o=out: self.wait([w], lambda: f"all_reduce of output {o.name!r} "
                                                                                 f"among all {self.world} ranks"))
                    self._pending.append(once)
                    res = pending(res, once)
                # back in sequence order (an output still being all-reduced waits for it here)
                results[name] = res if self.reorder is None else self.reorder.output(name, res)
            elif name in vals:
                results[name] = _tensor(vals, name) if self.reorder is None else \
                    self.reorder.output(name, _tensor(vals, name))
        return fill_outputs(self.graph.outputs, results)
