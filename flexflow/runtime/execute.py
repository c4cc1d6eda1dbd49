"""Per-rank runtime: run a strategy for real with torch.distributed.

Each rank walks the OpGraph in order and computes the partitions placed on
it (``config.devices[k]`` is global rank ``ranks[k]``).  Everything it moves
comes from :func:`flexflow.strategy.partitions`, :func:`overlap` and
:func:`param_placement`, planned once at setup:

Exchange plan
    For input i of op C fed by producer P, every consumer partition c needs
    ``c.inputs[i]``; the piece it gets from producer partition q is
    ``overlap(c.inputs[i], q.output)`` (summed over q when P is partial).
    A piece whose two ends are on the same rank is a local slice.  An input
    with at least one cross-rank piece anywhere becomes an *exchange step*,
    numbered in graph order; every rank with a cross-rank piece in it runs
    the step's isend/irecv (tag = 2 × step, backward 2 × step + 1) and waits
    for all of them before moving on.  All ranks take part in the steps in
    the same global order, so the forward cannot deadlock.

Token chain
    A scalar token (requires_grad) is threaded through every autograd
    Function of the runtime in forward order (exchange steps, gradient
    gates, output steps): each takes the token and returns a new one.
    The backward therefore runs them in exactly the reverse order on every
    rank, and a rank that only sends in a step still has its backward
    (which receives the gradient pieces) called.

Outputs
    Each graph output is summed over the world with one all_reduce (a
    rank adds its partition's block; partial blocks add up, disjoint blocks
    tile), so every rank returns the full value.  Its backward needs no
    communication: every rank calls backward with the same loss, so each
    takes the gradient of its own block.

Gradient sync
    A parameter shard held by several ranks (``ParamShard.devices``) has its
    gradient all-reduced (SUM: the loss's partial sums already carry the
    global 1/N, so each replica holds a partial of the true gradient) among
    exactly those ranks, in one process group per distinct set of ranks
    (created once, by every rank, in the same order).  Buckets are static:
    a rank's replicated shards, in the order their gradients complete in the
    backward (latest first use first), packed per (group, dtype) up to
    ``bucket_cap_mb``.  Each bucket's shards pass, at the earliest first use
    among them, through a *gate* Function on the token chain; later uses
    read the gated tensors.  The gate's backward runs after the backward of
    every use (all come later in forward order), so it holds the bucket's
    complete local gradients and launches the bucket's all-reduce
    asynchronously; the rest of the backward overlaps with it.  Every member
    of a group holds the same shards, forms the same buckets and meets the
    gates in the same chain order, so launches match across members.  An
    engine callback at the end of the backward waits for every handle and
    adds the reduced gradients to ``param.grad`` (the gate gives the
    parameter itself no gradient; accumulation over several backward calls
    works as usual).  Shards held by one rank use plain AccumulateGrad.

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
import math
import operator
import os
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .. import settings
from ..cost.model import GRAD_BUCKET_BYTES
from ..graph.ir import Op, OpGraph, dtype_bytes
from ..graph.ops import RULES, picks_stacked_part
from ..graph.ops.base import region_shape
from ..strategy.localrun import constant_value_of, fill_outputs, whole_config
from ..strategy.regions import (
    Partition,
    canonical_partitions,
    overlap,
    param_placement,
    partitions,
    pick_replica,
)
from ..strategy.strategy import Strategy
from . import shutdown
from .pending import Once, pending

__all__ = ["Runtime", "Piece", "Exchange", "ExecutorError", "tensor_of", "BUCKET_CAP_MB"]

BUCKET_CAP_MB = GRAD_BUCKET_BYTES / 2**20  # shared with the simulator's sync model


class ExecutorError(RuntimeError):
    """The runtime cannot run a graph/strategy as given."""


# --------------------------------------------------------------------------- the plan
@dataclass(frozen=True)
class Piece:
    """One block moving from a producer partition to a consumer partition."""

    src: int  # global rank holding the producer partition
    dst: int  # global rank of the consumer partition
    src_region: tuple  # within the producer partition's output block
    dst_region: tuple  # within the consumer partition's input region
    shape: tuple


@dataclass
class Exchange:
    """An input of an op that moves data between ranks (this rank's view of it)."""

    index: int  # position among the exchange steps of the graph: tags 2i / 2i+1
    consumer: str
    input: int
    producer: str
    partial: bool  # producer partitions hold partial sums: pieces add up
    dtype: torch.dtype
    grad: bool  # gradients flow back to the producer
    out_shape: tuple | None  # this rank's consumer input region (None: consumes nothing)
    in_shape: tuple | None  # this rank's producer block (None: holds none)
    sends: list = field(default_factory=list)
    recvs: list = field(default_factory=list)
    local: list = field(default_factory=list)


@dataclass
class _Gate:
    """Gradient buckets that are complete once the backward passes this op."""

    op: str
    buckets: list  # [(group key, [qual, ...])], in launch order
    quals: list  # every qual of the buckets, in order


@dataclass
class _Output:
    name: str
    shape: tuple
    dtype: torch.dtype
    partial: bool
    region: tuple | None  # this rank's block of the output
    work: object = None  # its all-reduce, between the forward and Runtime._run
    whole: bool = field(init=False)  # the block is all of the output (or a partial sum of all of it)

    def __post_init__(self):
        self.whole = self.region is not None and _is_full(self.region, self.shape)


REDUCE_OUTPUTS = ("eager", "with_gradients")


class _Rider:
    """An output all-reduced inside a gradient bucket (reduce_outputs="with_gradients")."""

    WAITING, SENT, DONE = 0, 1, 2
    __slots__ = ("name", "full", "state")

    def __init__(self, name: str, full: torch.Tensor):
        self.name, self.full, self.state = name, full, _Rider.WAITING


@dataclass
class _Step:
    """What this rank does for one op of the graph."""

    op: Op
    part: Partition | None
    everywhere: bool = False
    inputs: list = field(default_factory=list)  # per input: None | (mode, src, data)
    gate: _Gate | None = None
    params: list = field(default_factory=list)  # (local, qual, reshape_to, region)
    param_readers: tuple = ()  # (local, pvals -> the tensor the rule reads) per entry of params
    # compiled at setup for a step that reads only local values and has no gate:
    # vals, pvals -> the output (None: the general path of Runtime._run)
    run: object = None


def tensor_of(module: torch.nn.Module, qual: str) -> torch.Tensor:
    """A parameter or buffer of ``module`` by qualified name."""
    try:
        return module.get_parameter(qual)
    except AttributeError:
        return module.get_buffer(qual)


def _rel(region: tuple, base: tuple) -> tuple:
    return tuple(slice(r.start - b.start, r.stop - b.start) for r, b in zip(region, base))


def _is_full(region: tuple, shape) -> bool:
    return all(s.start == 0 and s.stop == n for s, n in zip(region, shape))


def _wire(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.uint8) if t.dtype == torch.bool else t


def _wire_dtype(dtype):
    return torch.uint8 if dtype == torch.bool else dtype


# --------------------------------------------------------------------------- runtime
class Runtime:
    """One rank's share of a (graph, strategy): its parameter shards, its
    program and the static communication plan.  Build it on every rank of
    the world with the same arguments (it creates process groups)."""

    def __init__(self, graph: OpGraph, strategy: Strategy, module: torch.nn.Module, ranks,
                 *, device=None, timeout_s: float = 300.0, bucket_cap_mb: float = BUCKET_CAP_MB,
                 reduce_outputs: str = "with_gradients"):
        self.graph, self.strategy, self.module = graph, strategy, module
        self.ranks = [int(r) for r in ranks]  # device k of the strategy -> global rank
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world = dist.get_world_size() if self.distributed else 1
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.timeout = datetime.timedelta(seconds=float(timeout_s))
        self.bucket_cap_bytes = int(bucket_cap_mb * 2**20)
        if reduce_outputs not in REDUCE_OUTPUTS:
            raise ExecutorError(f"reduce_outputs must be one of {REDUCE_OUTPUTS}, got {reduce_outputs!r}")
        self.reduce_outputs = reduce_outputs
        self.nccl = self.distributed and dist.get_backend() == "nccl"
        if len(set(self.ranks)) != len(self.ranks) or any(not 0 <= r < self.world for r in self.ranks):
            raise ExecutorError(f"devices {self.ranks} must be distinct ranks of the world (0..{self.world - 1})")
        used = max(strategy.devices_used(), default=0)
        if used >= len(self.ranks):
            raise ExecutorError(f"strategy {strategy.name!r} uses device {used} but only "
                                f"{len(self.ranks)} devices (ranks {self.ranks}) are given")
        self.step = 0  # forward passes run so far (error messages name the step)
        self.closed = False
        self.placement = param_placement(graph, strategy)
        self._make_shards()
        self._make_program()
        self._make_groups()
        self.sync = _GradSync(self)
        shutdown.register(self)

    # -- setup --------------------------------------------------------------
    def _parts(self, op: Op) -> list[Partition]:
        return partitions(op, self.strategy[op.name])

    def _mine(self, parts) -> Partition | None:
        for p in parts:
            if self.ranks[p.device] == self.rank:
                return p
        return None

    def _make_shards(self) -> None:
        """This rank's block of every parameter and buffer it reads."""
        self.params: dict[str, torch.nn.Parameter] = OrderedDict()
        self.buffers: dict[str, torch.Tensor] = OrderedDict()
        self.shards: dict[str, tuple] = {}  # qual -> (view, region, ranks of the shard)
        for qual, (view, shards, trainable) in self.placement.items():
            for s in shards:
                ranks = tuple(sorted(self.ranks[d] for d in s.devices))
                if self.rank in ranks:
                    self.shards[qual] = (view, s.region, ranks)
            if qual not in self.shards:
                continue
            view, region, ranks = self.shards[qual]
            src = tensor_of(self.module, qual)
            native = tuple(src.shape)
            if tuple(view) != native and _is_full(region, view):
                # a whole parameter read in a logical view (an LSTM cell's (4, H, .)
                # gates) is held in its own shape, as the module holds it: rules that
                # take it so (LSTMCell) read it without a reshape per use
                view, region = native, tuple(slice(0, n) for n in native)
                self.shards[qual] = (view, region, ranks)
            t = src.detach().reshape(view)[region].clone().to(self.device)
            if trainable:
                self.params[qual] = torch.nn.Parameter(t, requires_grad=src.requires_grad)
            else:
                self.buffers[qual] = t

    def _make_program(self) -> None:
        g = self.graph
        first_use: dict[str, int] = {}
        for op in g.compute_ops:
            for qual in op.params.values():
                first_use.setdefault(qual, g.index[op.name])
        gates = self._plan_buckets(first_use)
        needs_grad: set[str] = set()
        self.program: list[_Step] = []
        self.exchanges: list[Exchange] = []  # this rank's exchange steps
        self.num_exchanges = 0
        self.last_exchange_op = -1  # forward position of the last op that takes an input from another rank
        self.comm_bytes = 0  # activation bytes moved per forward, all ranks together
        for op in g.ops:
            if op.everywhere:
                self.program.append(_Step(op, partitions(op, whole_config(op))[0], everywhere=True))
                continue
            if any(self.placement[q][2] for q in op.params.values()) or any(s in needs_grad for s in op.inputs):
                needs_grad.add(op.name)
            parts = self._parts(op)
            step = _Step(op, self._mine(parts))
            for i, src in enumerate(op.inputs):
                step.inputs.append(self._plan_input(op, parts, step.part, i, src, src in needs_grad))
            buckets = gates.get(g.index[op.name])
            if buckets:
                step.gate = _Gate(op.name, buckets, [q for _, qs in buckets for q in qs])
            if step.part is not None:
                step.params = self._param_access(op, step.part)
                step.param_readers = tuple((local, _param_reader(qual, reshape_to, region))
                                           for local, qual, reshape_to, region in step.params)
            self.program.append(step)
        for step in self.program:
            step.run = self._compile(step)
        self.outputs: dict[str, _Output] = {}  # outputs assembled across ranks
        for name in g.output_names():
            op = g.op(name)
            if op.everywhere or name in self.outputs or self.world == 1:
                continue
            parts = self._parts(op)
            mine = self._mine(canonical_partitions(parts))  # one copy of replicated blocks counts
            self.outputs[name] = _Output(name, tuple(op.output_shape), op.dtype, parts[0].partial,
                                         None if mine is None else mine.output)
        self.ride = self._plan_ride(gates)
        self.chain_length = self.num_exchanges + len(gates) + len(self.outputs)
        # asynchronous point-to-point: sends leave as soon as their producer is computed,
        # receives are posted ahead (forward: at the start of the step; backward: at its
        # first exchange) and waited on at first use
        self.sends_after: dict[str, list] = {}  # producer op -> exchanges this rank sends in
        for ex in self.exchanges:
            if ex.sends:
                self.sends_after.setdefault(ex.producer, []).append(ex)
        self.fwd_recv_ex = [ex for ex in self.exchanges if ex.recvs]
        self.bwd_recv_ex = [ex for ex in self.exchanges if ex.grad and ex.sends]
        self._recv: dict = {}  # exchange index -> (works, buffers), forward
        self._sends: list = []  # (works, tensors) of this step's forward sends, kept alive until waited
        self._bwd_recv: dict = {}
        self._bwd_sends: list = []
        self._bwd_armed = False
        self._pending: list = []  # Once waits of outputs still being all-reduced
        self._riding = False  # this forward's outputs ride on the gradient all-reduce
        self._riders: list = []  # their jobs not yet launched, in graph order
        self._early: list = []  # results of ride buckets this rank all-reduced early (read before backward)
        self.broken: str | None = None
        # values this rank can drop after each step (autograd keeps what backward needs)
        last: dict[str, int] = {}
        for i, step in enumerate(self.program):
            for src, entry in zip(step.op.inputs, step.inputs if not step.everywhere else step.op.inputs):
                if entry is not None:
                    last[src] = i
        keep = set(g.output_names())
        self.free_before: list[list[str]] = [[] for _ in self.program]
        for name, i in last.items():
            if name not in keep and i + 1 < len(self.program):
                self.free_before[i + 1].append(name)

    def _plan_ride(self, gates: dict):
        """(gate op, bucket position): the gradient bucket that also carries the
        outputs under ``reduce_outputs="with_gradients"``, or None.  It must
        span every rank and hold the outputs' dtype; all ranks pick the same one
        (the latest gate in forward order with such a bucket: the first to launch
        in the backward, usually).  Its gate must come after every exchange step
        in the forward: the token chain then has every rank reach it in the
        backward without waiting on another, which ``_early_ride`` relies on."""
        if self.reduce_outputs != "with_gradients" or not self.outputs or not self.distributed \
                or self.world == 1:
            return None
        dtypes = {out.dtype for out in self.outputs.values()}
        if len(dtypes) != 1 or not next(iter(dtypes)).is_floating_point or \
                any(_wire_dtype(d) != d for d in dtypes):
            return None
        every = tuple(range(self.world))
        for gi in sorted(gates, reverse=True):
            if gi < self.last_exchange_op:
                break
            for pos, (key, quals) in enumerate(gates[gi]):
                if tuple(key) == every and self.params[quals[0]].dtype in dtypes:
                    self.ride_numel = sum(self.params[q].numel() for q in quals)
                    self.ride_dtype = self.params[quals[0]].dtype
                    return (self.graph.ops[gi].name, pos)
        return None

    def _plan_buckets(self, first_use: dict) -> dict[int, list]:
        """Static gradient buckets of this rank's replicated shards.

        Shards in the order their gradients complete in the backward (last
        first use first), packed per (group, dtype) into buckets of at most
        ``bucket_cap_bytes``; a bucket's gate sits at the earliest first use of
        its shards.  Every member of a group holds the same shards, so every
        member forms the same buckets and launches them in the same order."""
        ready = sorted((q for q, (_, _, ranks) in self.shards.items()
                        if len(ranks) > 1 and q in self.params and self.params[q].requires_grad),
                       key=lambda q: -first_use[q])
        open_: dict = {}  # (group key, dtype) -> [quals, bytes]
        done = []
        for q in ready:
            p = self.params[q]
            k = (self.shards[q][2], p.dtype)
            b = open_.setdefault(k, [[], 0])
            b[0].append(q)
            b[1] += p.numel() * p.element_size()
            if b[1] >= self.bucket_cap_bytes:
                done.append((k, open_.pop(k)[0]))
        done += [(k, v[0]) for k, v in sorted(open_.items(), key=lambda kv: (kv[0][0], str(kv[0][1])))]
        gates: dict[int, list] = {}
        for (key, _), quals in done:
            gates.setdefault(min(first_use[q] for q in quals), []).append((key, quals))
        return gates

    def _plan_input(self, op: Op, parts, mine, i: int, src: str, grad: bool):
        prod = self.graph.op(src)
        need = mine is not None and mine.inputs[i] is not None
        if prod.everywhere:
            if not need:
                return None
            r = mine.inputs[i]
            return ("whole", src, None if _is_full(r, prod.output_shape) else r)
        pparts = self._parts(prod)
        same: dict[tuple, list[int]] = {}  # output region -> producer partitions (replicas share one)
        for qi, q in enumerate(pparts):  # (partial sums are all read and added up)
            key = (qi,) if q.partial else tuple((s.start, s.stop) for s in q.output)
            same.setdefault(key, []).append(qi)
        pieces = []
        for c in parts:
            r = c.inputs[i]
            if r is None:
                continue
            for qs in same.values():
                q = pparts[pick_replica(qs, pparts, c.device, c.index)]
                ov = overlap(r, q.output)
                if ov is not None:
                    pieces.append(Piece(self.ranks[q.device], self.ranks[c.device], _rel(ov, q.output),
                                        _rel(ov, r), region_shape(ov)))
        remote = [p for p in pieces if p.src != p.dst]
        index = None
        if remote:
            index = self.num_exchanges
            self.num_exchanges += 1
            self.last_exchange_op = self.graph.index[op.name]
            self.comm_bytes += sum(math.prod(p.shape) for p in remote) * dtype_bytes(prod.dtype)
        me = self.rank
        sends = [p for p in remote if p.src == me]
        recvs = [p for p in remote if p.dst == me]
        if not sends and not recvs:  # nothing crosses this rank: a local slice
            if not need:
                return None
            local = [p for p in pieces if p.dst == me]
            if len(local) != 1 or pparts[0].partial or not _is_full(local[0].dst_region, local[0].shape):
                raise ExecutorError(f"{op.describe()}: input {i} from {src} is not one local block")
            q = self._mine(pparts)
            return ("slice", src, None if _is_full(local[0].src_region, region_shape(q.output))
                    else local[0].src_region)
        qm = self._mine(pparts)
        ex = Exchange(index, op.name, i, src, pparts[0].partial, prod.dtype,
                      grad and prod.dtype.is_floating_point,
                      region_shape(mine.inputs[i]) if need else None,
                      None if qm is None else region_shape(qm.output),
                      sends, recvs, [p for p in pieces if p.src == p.dst == me])
        self.exchanges.append(ex)
        return ("xchg", src, ex)

    def _compile(self, step: _Step):
        """The step as one function of (vals, pvals), with every choice the general
        loop makes per step (how each input and parameter is read, the rule, the
        stacking of the output) made here once; None for steps that exchange,
        gate parameters or run everywhere."""
        op = step.op
        if step.everywhere or step.part is None or step.gate is not None or \
                any(e is not None and e[0] == "xchg" for e in step.inputs):
            return None
        stacked_in = {s for s in op.inputs if self.graph.op(s).attrs.get("stacked")
                      and hasattr(RULES[self.graph.op(s).rule], "compute_parts")}
        if op.rule == "index" and len(step.inputs) == 1 and step.inputs[0] is not None \
                and step.inputs[0][1] in stacked_in:
            k = self._stacked_item(op, step.inputs[0])
            if k is not None:  # h or c of a cell: the part itself, no op at all
                src = step.inputs[0][1]
                return lambda vals, pvals: vals[src].parts[k]
        rule, block = RULES[op.rule], step.part.block
        if op.rule == "index" and len(step.inputs) == 1 and step.inputs[0] is not None \
                and step.inputs[0][2] is not None and step.inputs[0][1] not in stacked_in:
            _, src, data = step.inputs[0]  # the region read and the index as one index
            fn = rule.bind(op, block, within=data)
            return lambda vals, pvals: fn([vals[src]], None)
        getters = []
        for entry in step.inputs:
            if entry is None:
                getters.append(lambda vals: None)
                continue
            _, src, data = entry
            if src in stacked_in:
                def get(vals, src=src, data=data, whole=op.rule != "index"):
                    x = vals[src] if data is None else vals[src][data]
                    return x.stack() if whole and isinstance(x, _Stacked) else x
            elif data is None:
                get = operator.itemgetter(src)
            else:
                def get(vals, src=src, data=data):
                    return vals[src][data]
            getters.append(get)
        pgetters = step.param_readers
        if op.attrs.get("stacked") and hasattr(rule, "compute_parts"):  # (h, c) kept apart
            def fn(ins, params):
                return _Stacked(rule.compute_parts(op, block, ins, params))
        else:
            fn = rule.bind(op, block)
        getters = tuple(getters)
        if len(getters) == 1:
            get0 = getters[0]
            return lambda vals, pvals: fn([get0(vals)], {k: g(pvals) for k, g in pgetters})
        return lambda vals, pvals: fn([g(vals) for g in getters], {k: g(pvals) for k, g in pgetters})

    def _stacked_item(self, op: Op, entry) -> int | None:
        """The part k when the index op ``op`` reads exactly part k of its stacked
        input (as an LSTM cell's h = out[0]), else None."""
        _, src, data = entry
        if not picks_stacked_part(op, self.graph.op(src)):
            return None
        held = self._mine(self._parts(self.graph.op(src)))
        if held is None:
            return None
        shape = region_shape(held.output)
        if data is None:
            return 0
        first = data[0]
        if first.step not in (None, 1) or not _is_full(data[1:], shape[1:]):
            return None
        return first.start

    def _param_access(self, op: Op, part: Partition) -> list:
        out = []
        for local, qual in list(op.params.items()) + list(op.buffers.items()):
            view = (op.param_views.get(local, op.param_shapes[local]) if local in op.params
                    else op.buffer_shapes[local])
            pview, box, _ = self.shards[qual]
            region = part.params[local]
            if (tuple(view) != tuple(pview) and getattr(RULES[op.rule], "native_params", False)
                    and _is_full(region, view) and _is_full(box, pview)):
                out.append((local, qual, None, None))  # the whole tensor, in its own shape
            elif tuple(view) == tuple(pview):
                rel = _rel(region, box)
                out.append((local, qual, None, None if _is_full(rel, region_shape(box)) else rel))
            else:  # held whole in another view (a parameter read in two shapes)
                out.append((local, qual, tuple(view), None if _is_full(region, view) else region))
        return out

    def _make_groups(self) -> None:
        """Process groups, created by every rank in the same order."""
        self.groups: dict[tuple, object] = {}
        self.p2p_group = self.coll_group = self.ride_group = None
        self.batch_threads: list[int] = []  # gloo loop threads moved to SCHED_BATCH
        if not self.distributed or self.world == 1:
            return
        every = list(range(self.world))
        keys = set()
        for view, shards, trainable in self.placement.values():
            if trainable:
                for s in shards:
                    ranks = tuple(sorted(self.ranks[d] for d in s.devices))
                    if len(ranks) > 1:
                        keys.add(ranks)
        with batched_gloo_loops() as self.batch_threads:  # (gloo's: see batch_gloo_loops)
            self.p2p_group = dist.new_group(every, timeout=self.timeout)
            self.coll_group = dist.new_group(every, timeout=self.timeout)
            if self.ride is not None:  # the ride bucket and its repairs only (see _GradSync)
                self.ride_group = dist.new_group(every, timeout=self.timeout)
            for key in sorted(keys):
                self.groups[key] = dist.new_group(list(key), timeout=self.timeout)
            # one collective on each new group first (NCCL batched p2p needs it)
            flag = torch.zeros(1, device=self.device)
            for group in (self.p2p_group, self.coll_group, self.ride_group):
                if group is not None:
                    dist.all_reduce(flag, group=group)

    # -- communication ------------------------------------------------------
    def p2p(self, ops) -> list:
        """Post (is_send, tensor, peer, tag) operations; returns the works."""
        if not ops:
            return []
        if self.nccl:
            return dist.batch_isend_irecv([
                dist.P2POp(dist.isend if s else dist.irecv, t, peer, self.p2p_group, tag)
                for s, t, peer, tag in ops])
        g = self.p2p_group  # spans every rank: its ranks are the global ones
        if isinstance(g, dist.ProcessGroup):  # straight to the group (dist.isend's checks cost tens of us)
            return [(g.send if s else g.recv)([t], peer, tag) for s, t, peer, tag in ops]
        return [(dist.isend if s else dist.irecv)(t, peer, group=g, tag=tag) for s, t, peer, tag in ops]

    def _read_rider(self, job: "_Rider") -> None:
        """An output riding on the gradient all-reduce, at its first read (or at
        the next step): already there after the backward; read before it, the
        ride bucket is all-reduced now (see ``_early_ride``)."""
        if job.state == _Rider.WAITING:
            self._early_ride()
        elif job.state == _Rider.SENT:  # read during the backward
            self.sync.finish()

    def _early_ride(self) -> None:
        """The outputs read before the backward, on this rank: it takes its part
        in the ride bucket's all-reduce now, with zeros for its gradients and a
        1 in the bucket's last element, which counts the ranks that did so.  The
        other ranks need not know: they launch the bucket in their backward as
        always, and the sum gives every output's full value.  Every rank then
        learns from the count that gradients are missing from it, and at the end
        of the backward every rank makes one more all-reduce of the bucket's
        gradients (``_GradSync.finish``): these ranks with theirs, the others
        with zeros.  A read on some ranks only, before the backward, thus costs
        one collective and never waits for a peer that will not come."""
        riders, self._riders = self._riders, []
        pieces = [torch.zeros(self.ride_numel, dtype=self.ride_dtype, device=self.device)]
        pieces += [job.full.reshape(-1) for job in riders]
        pieces.append(torch.ones(1, dtype=self.ride_dtype, device=self.device))
        flat = torch.cat(pieces)
        work = _all_reduce(flat, self.ride_group)
        self.wait([work], lambda: f"all_reduce of outputs {[j.name for j in riders]} among all {self.world} "
                                  f"ranks, read before backward()")
        _copy_riders(riders, flat, self.ride_numel)
        self._early.append(flat)

    def wait(self, works, what=None) -> None:
        """Wait for works; a failure names this rank, the step and ``what()``
        (the exchange or collective, and the peers it waits on)."""
        try:
            for w in works:
                if w is not None:
                    w.wait(self.timeout) if not self.nccl else w.wait()
        except Exception as e:  # noqa: BLE001 - re-raised with where it happened
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            where = what() if what is not None else "communication"
            raise ExecutorError(f"rank {self.rank}, step {self.step}: {where}: {first} "
                                f"(timeout {self.timeout.total_seconds():g} s)") from e

    def close(self, wait_s: float = 10.0, destroy_groups: bool = True) -> None:
        """End this runtime's communication: wait at most ``wait_s`` for
        outstanding gradient all-reduces, drop every work object, destroy the
        process groups it created.  The module cannot run afterwards."""
        if self.closed:
            return
        self.closed = True
        works = [w for w, *_ in self.sync.works]
        works += [w for ws, _ in self._sends + self._bwd_sends for w in ws]
        self.sync.reset()
        self._pending, self._sends, self._bwd_sends, self._recv, self._bwd_recv = [], [], [], {}, {}
        self._riders, self._early = [], []
        works = [w for w in works if w is not None]
        if wait_s > 0 and works and not self.nccl:
            for w in works:
                try:
                    w.wait(datetime.timedelta(seconds=wait_s))
                except Exception:  # noqa: BLE001 - a dead peer: nothing left to wait for
                    break
        del works
        groups = [g for g in [self.p2p_group, self.coll_group, self.ride_group, *self.groups.values()]
                  if g is not None]
        self.groups, self.p2p_group, self.coll_group, self.ride_group = {}, None, None, None
        if destroy_groups and dist.is_available() and dist.is_initialized():
            for g in groups:
                try:
                    dist.destroy_process_group(g)
                except Exception:  # noqa: BLE001
                    pass

    # -- forward --------------------------------------------------------------
    def run(self, inputs):
        """The graph's outputs (full values on every rank) for the global inputs."""
        tensors = [x for x in inputs if isinstance(x, torch.Tensor)]
        input_ops = [op for op in self.graph.ops if op.kind == "input"]
        if len(tensors) != len(input_ops):
            raise ExecutorError(f"the model was traced with {len(input_ops)} tensor inputs, got {len(tensors)}")
        if self.closed:
            raise ExecutorError("this parallel module's runtime was shut down (flexflow.shutdown); "
                                "call parallelize() again")
        if self.broken:
            raise ExecutorError(f"rank {self.rank}: this parallel module cannot run again after a failed "
                                f"step ({self.broken}); call parallelize() again")
        self.settle()
        self.step += 1
        try:
            return self._run(inputs, tensors, input_ops)
        except BaseException as e:
            self.broken = f"step {self.step}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            raise

    def settle(self) -> None:
        """Wait for everything the previous step left in flight (outputs being
        all-reduced, forward sends)."""
        while self._pending:
            self._pending.pop()()
        if self._sends:
            works, self._sends = [w for ws, _ in self._sends for w in ws], []
            self.wait(works, lambda: "forward sends of the previous step")

    def _post_forward_recvs(self) -> None:
        for ex in self.fwd_recv_ex:
            if ex.index not in self._recv:
                wire = _wire_dtype(ex.dtype)
                bufs = [torch.empty(p.shape, dtype=wire, device=self.device) for p in ex.recvs]
                works = self.p2p([(False, b, p.src, 2 * ex.index) for p, b in zip(ex.recvs, bufs)])
                self._recv[ex.index] = (works, bufs)

    def _post_sends(self, name: str, x: torch.Tensor) -> None:
        x = x.detach()
        for ex in self.sends_after[name]:
            ops = [(True, _wire(x[p.src_region]).contiguous(), p.dst, 2 * ex.index) for p in ex.sends]
            works = self.p2p(ops)
            self._sends.append((works, [t for _, t, _, _ in ops]))

    def _arm_backward(self) -> None:
        """At the first exchange of a backward pass: post every gradient receive
        of this rank, and wait for the gradient sends at the end of the pass."""
        if self._bwd_armed:
            return
        self._bwd_armed = True
        torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        for ex in self.bwd_recv_ex:
            if ex.index not in self._bwd_recv:
                self._bwd_recv[ex.index] = self._post_bwd_recvs(ex)

    def _post_bwd_recvs(self, ex: Exchange):
        bufs = [torch.empty(p.shape, dtype=ex.dtype, device=self.device) for p in ex.sends]
        return self.p2p([(False, b, p.dst, 2 * ex.index + 1) for p, b in zip(ex.sends, bufs)]), bufs

    def _end_backward(self) -> None:
        self._bwd_armed = False
        works, self._bwd_sends = [w for ws, _ in self._bwd_sends for w in ws], []
        self.wait(works, lambda: "gradient sends (end of backward)")

    def _run(self, inputs, tensors, input_ops):
        grad = torch.is_grad_enabled()
        self._riding = grad and self.ride is not None
        self._early = []  # (a backward takes the early rides of the forwards since the last one)
        self._post_forward_recvs()
        token = torch.zeros((), device=self.device, requires_grad=grad) if self.chain_length else None
        vals: dict[str, torch.Tensor] = {}
        for op, x in zip(input_ops, tensors):
            if tuple(x.shape) != tuple(op.output_shape):
                raise ExecutorError(f"input {op.name!r} has shape {tuple(x.shape)} but the model was traced "
                                    f"(example_inputs) with {tuple(op.output_shape)}; the graph has fixed shapes")
            vals[op.name] = x if x.device == self.device else x.to(self.device)
        pvals: dict[str, torch.Tensor] = dict(self.params)
        pvals.update(self.buffers)
        if grad and self.sync.armed:  # a previous backward failed before its end
            self.sync.reset()
        # under torch.profiler each partition's compute is a range named as the
        # simulator names its task ("<op> fwd"), so the two timelines line up
        profiling = torch.autograd.profiler._is_profiler_enabled
        for step, free in zip(self.program, self.free_before):
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
                    vals[op.name] = constant_value_of(op, self.module).to(self.device)
                elif op.kind != "input":
                    ins = [None if r is None else vals[s][r] for s, r in zip(op.inputs, step.part.inputs)]
                    vals[op.name] = RULES[op.rule].compute(op, step.part.block, ins, {})
                continue
            ins = []
            for entry in step.inputs:
                if entry is None:
                    ins.append(None)
                    continue
                mode, src, data = entry
                if mode == "xchg":
                    token, x = _ExchangeFn.apply(self, data, token, _tensor(vals, src))
                    ins.append(x)
                else:
                    x = vals[src]
                    if data is not None:
                        x = x[data]
                    if isinstance(x, _Stacked) and op.rule != "index":
                        x = x.stack()
                    ins.append(x)
            if step.gate is not None and grad:
                quals = step.gate.quals
                token, *gated = _GateFn.apply(self, step.gate, token, *[pvals[q] for q in quals])
                pvals.update(zip(quals, gated))
            if step.part is None:
                continue
            params = {local: read(pvals) for local, read in step.param_readers}
            if profiling:
                with torch.profiler.record_function(f"{op.name} fwd"):
                    vals[op.name] = _compute(op, step.part.block, ins, params)
            else:
                vals[op.name] = _compute(op, step.part.block, ins, params)
            if op.name in self.sends_after:
                self._post_sends(op.name, vals[op.name])
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
                results[name] = res
            elif name in vals:
                results[name] = _tensor(vals, name)
        return fill_outputs(self.graph.outputs, results)

    # -- state ----------------------------------------------------------------
    def full_tensors(self) -> dict[str, torch.Tensor]:
        """qual -> full tensor (in its view shape) of every placed parameter and
        buffer, gathered on every rank: the first rank of each shard contributes."""
        fulls = OrderedDict()
        for qual, (view, shards, trainable) in self.placement.items():
            src = tensor_of(self.module, qual)
            full = torch.zeros(view, dtype=src.dtype, device=self.device)
            if qual in self.shards:
                held, region, ranks = self.shards[qual]
                if ranks[0] == self.rank:
                    mine = self.params[qual] if qual in self.params else self.buffers[qual]
                    full.view(held)[region] = mine.detach()  # held whole in its own shape, or a block of the view
            fulls[qual] = full
        if self.distributed and self.world > 1:
            by_dtype: dict = {}
            for qual, t in fulls.items():
                by_dtype.setdefault(t.dtype, []).append(qual)
            for dtype in sorted(by_dtype, key=str):
                quals = by_dtype[dtype]
                flat = torch.cat([_wire(fulls[q]).reshape(-1) for q in quals])
                dist.all_reduce(flat, group=self.coll_group)
                off = 0
                for q in quals:
                    n = fulls[q].numel()
                    fulls[q] = flat[off:off + n].view(fulls[q].shape).to(dtype)
                    off += n
        return fulls

    def load_from_module(self) -> None:
        """Copy this rank's blocks from the (full) tensors of the module."""
        with torch.no_grad():
            for qual, (view, region, _) in self.shards.items():
                dst = self.params[qual] if qual in self.params else self.buffers[qual]
                dst.copy_(tensor_of(self.module, qual).detach().reshape(view)[region])


# --------------------------------------------------------------------------- stacked outputs
class _Stacked:
    """The value of an op whose outputs are stacked (an LSTM cell's (h, c)),
    kept as its parts: indexing one part returns it without the stack and the
    select, whose backward would allocate and add full-size zeros for every
    use.  Anything else gets the stacked tensor (:meth:`stack`, made once)."""

    __slots__ = ("parts", "_whole")

    def __init__(self, parts):
        self.parts, self._whole = list(parts), None

    def stack(self) -> torch.Tensor:
        if self._whole is None:
            self._whole = torch.stack(self.parts)
        return self._whole

    @property
    def dtype(self):
        return self.parts[0].dtype

    def dim(self) -> int:
        return self.parts[0].dim() + 1

    def detach(self) -> "_Stacked":
        return _Stacked([p.detach() for p in self.parts])

    def contiguous(self) -> torch.Tensor:
        return self.stack().contiguous()

    def __getitem__(self, idx):
        if not isinstance(idx, tuple):
            idx = (idx,)
        first, rest = idx[0], idx[1:]
        shape = self.parts[0].shape
        full = all(isinstance(r, slice) and r.step in (None, 1) and (r.start or 0) == 0
                   and (r.stop is None or r.stop >= n) for r, n in zip(rest, shape))
        if isinstance(first, int):
            part = self.parts[first]
            return part if full else part[rest]
        if isinstance(first, slice) and first.step in (None, 1):
            sub = self.parts[first]
            return _Stacked(sub if full else [p[rest] for p in sub])
        return self.stack()[idx]


def _param_reader(qual: str, reshape_to, region):
    """pvals -> what a partition reads of parameter ``qual``: the tensor, reshaped to the
    op's view, then its region (see ``Runtime._param_access``)."""
    if reshape_to is None and region is None:
        return operator.itemgetter(qual)

    def read(pvals):
        t = pvals[qual]
        if reshape_to is not None:
            t = t.reshape(reshape_to)
        return t if region is None else t[region]
    return read


def _compute(op: Op, block, ins: list, params: dict):
    """One partition of ``op`` by its rule; an LSTM cell's (h, c) kept apart."""
    rule = RULES[op.rule]
    if op.attrs.get("stacked") and hasattr(rule, "compute_parts"):
        return _Stacked(rule.compute_parts(op, block, ins, params))
    return rule.compute(op, block, ins, params)


def _tensor(vals: dict, name: str):
    """vals[name] as a tensor (a stacked value stacked, once: :meth:`_Stacked.stack`
    keeps it, and readers of one part still read the part); None when absent."""
    v = vals.get(name)
    return v.stack() if isinstance(v, _Stacked) else v


# --------------------------------------------------------------------------- autograd
def _describe(ex: Exchange, phase: str) -> str:
    """An exchange step in words, for errors: the ops, and the peers waited on."""
    send_to = sorted({p.dst for p in ex.sends})
    recv_from = sorted({p.src for p in ex.recvs})
    if phase == "backward":  # gradients travel the other way
        send_to, recv_from = recv_from, send_to
    peers = []
    if recv_from:
        peers.append(f"receiving from rank(s) {recv_from}")
    if send_to:
        peers.append(f"sending to rank(s) {send_to}")
    return (f"{phase} exchange {ex.index} ({ex.producer} -> {ex.consumer}, input {ex.input}), "
            + " and ".join(peers))


class _ExchangeFn(torch.autograd.Function):
    """One exchange step: token, this rank's producer block -> token, its consumer region."""

    @staticmethod
    def forward(ctx, rt: Runtime, ex: Exchange, token, x):
        ctx.rt, ctx.ex = rt, ex
        # this rank's sends left when the producer was computed (Runtime._post_sends);
        # its receives were posted at the start of the step
        works, bufs = rt._recv.pop(ex.index, ((), ()))
        out = None
        single = (len(bufs) == 1 and not ex.local and not ex.partial and ex.out_shape is not None
                  and tuple(ex.recvs[0].shape) == tuple(ex.out_shape))
        if ex.out_shape is not None and not single:
            out = (torch.zeros if ex.partial else torch.empty)(ex.out_shape, dtype=ex.dtype, device=rt.device)
            for p in ex.local:
                if ex.partial:
                    out[p.dst_region] += x[p.src_region]
                else:
                    out[p.dst_region] = x[p.src_region]
        rt.wait(works, lambda: _describe(ex, "forward"))
        if single:
            out = bufs[0].to(ex.dtype)
        elif out is not None:
            for p, b in zip(ex.recvs, bufs):
                if ex.partial:
                    out[p.dst_region] += b.to(ex.dtype)
                else:
                    out[p.dst_region] = b.to(ex.dtype)
        if out is not None and not ex.grad:  # integers, or values no parameter feeds
            ctx.mark_non_differentiable(out)
        return token.clone(), out

    @staticmethod
    def backward(ctx, g_token, g_out):
        rt, ex = ctx.rt, ctx.ex
        gx = None
        if ex.grad:
            tag = 2 * ex.index + 1
            if ex.in_shape is not None:
                gx = torch.zeros(ex.in_shape, dtype=ex.dtype, device=rt.device)
            if ex.out_shape is not None and g_out is None:
                g_out = torch.zeros(ex.out_shape, dtype=ex.dtype, device=rt.device)
            rt._arm_backward()
            works, bufs = rt._bwd_recv.pop(ex.index, None) or rt._post_bwd_recvs(ex)
            ops = [(True, g_out[p.dst_region].contiguous(), p.src, tag) for p in ex.recvs]
            sent = rt.p2p(ops)  # waited for at the end of the backward
            rt._bwd_sends.append((sent, [t for _, t, _, _ in ops]))
            for p in ex.local:
                gx[p.src_region] += g_out[p.dst_region]
            rt.wait(works, lambda: _describe(ex, "backward"))
            for p, b in zip(ex.sends, bufs):
                gx[p.src_region] += b
        return None, None, g_token, gx


class _GateFn(torch.autograd.Function):
    """Marks where a replicated shard's gradient is complete: its backward
    hands the gradients to the bucketed all-reduce."""

    @staticmethod
    def forward(ctx, rt: Runtime, gate: _Gate, token, *params):
        ctx.rt, ctx.gate = rt, gate
        # new tensors on the parameters' storage: cheaper for autograd than handing
        # the inputs back as they are (which it turns into views of them, one by one)
        return (token.clone(), *[p.detach() for p in params])

    @staticmethod
    def backward(ctx, g_token, *grads):
        ctx.rt.sync.add(ctx.gate, grads)
        return (None, None, g_token) + (None,) * len(grads)


class _OutputFn(torch.autograd.Function):
    """A graph output assembled on every rank with one all_reduce."""

    @staticmethod
    def forward(ctx, rt: Runtime, out: _Output, token, x):
        ctx.rt, ctx.out = rt, out
        if out.whole:
            full = _wire(x).clone()
        else:
            full = torch.zeros(out.shape, dtype=_wire_dtype(out.dtype), device=rt.device)
            if out.region is not None:
                full[out.region] += _wire(x)
        if rt.distributed and rt.world > 1:
            if rt._riding:  # all-reduced with the gradients (the ride bucket)
                out.work = job = _Rider(out.name, full)
                rt._riders.append(job)
                return full
            work = _all_reduce(full, rt.coll_group)
            if full.dtype == out.dtype and out.dtype.is_floating_point:  # waited at first read (Runtime._run wraps the output)
                out.work = work
                return full
            rt.wait([work], lambda: f"all_reduce of output {out.name!r} among all {rt.world} ranks")
        full = full.to(out.dtype)
        if not out.dtype.is_floating_point:
            ctx.mark_non_differentiable(full)
        return full

    @staticmethod
    def backward(ctx, g):
        out = ctx.out
        gx = None
        if out.region is not None and g is not None:
            gx = g[out.region]
        return None, None, torch.zeros((), device=ctx.rt.device), gx


GLOO_LOOP_THREAD = "gloo_tcp_loop"  # the name gloo's TCP transport gives its event-loop threads


def _threads() -> set:
    """This process's thread ids (Linux; empty elsewhere)."""
    try:
        return {int(t) for t in os.listdir("/proc/self/task")}
    except OSError:
        return set()


def batch_gloo_loops(tids) -> list:
    """Move gloo's TCP event-loop threads among ``tids`` to ``SCHED_BATCH``; returns the
    thread ids moved.

    A loop thread woken by a socket event preempts the thread that is running on its
    core.  When that is this rank's main thread inside a send, holding the pair's lock,
    the loop thread fails its ``try_lock``, returns to ``epoll_wait``, which reports the
    same event again, and spins so for the rest of its time slice: the send comes back
    milliseconds late.  Where ranks share cores (2 ranks on 2 cores: one main thread and
    several loop threads each) one send in ten did so, and message-heavy strategies ran
    2-3x slower than their compute and messages add up to.  Under ``SCHED_BATCH`` a
    woken thread does not preempt; it runs on an idle core, when the running thread
    blocks (a rank waiting for its data does) or at the next tick.  Only the threads of
    the groups this runtime creates are moved; ``FLEXFLOW_GLOO_LOOP=normal`` leaves
    them alone."""
    if not settings.batch_gloo_loops() or not hasattr(os, "SCHED_BATCH"):
        return []
    moved = []
    for tid in sorted(tids):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() != GLOO_LOOP_THREAD:
                    continue
            os.sched_setscheduler(tid, os.SCHED_BATCH, os.sched_param(0))
            moved.append(tid)
        except OSError:  # gone, or not permitted: leave it as it is
            continue
    return moved


@contextlib.contextmanager
def batched_gloo_loops():
    """Create process groups within it: at its end, the gloo event-loop threads that
    appeared meanwhile are moved to ``SCHED_BATCH`` (:func:`batch_gloo_loops`); it
    yields the list their ids go to."""
    before = _threads()
    moved: list = []
    yield moved
    moved.extend(batch_gloo_loops(_threads() - before))


def _all_reduce(t: torch.Tensor, group):
    """Start summing ``t`` over ``group``; its work.  Straight to the process group's
    own call: ``dist.all_reduce``'s checks cost tens of microseconds a call, which a
    step of small buckets pays every time (DDP's reducer calls the group directly too)."""
    if isinstance(group, dist.ProcessGroup):
        return group.allreduce([t])
    return dist.all_reduce(t, group=group, async_op=True)


def _copy_riders(riders, flat: torch.Tensor, off: int) -> None:
    """The outputs riding in ``flat`` from ``off`` on, copied into their jobs."""
    with torch.no_grad():
        for job in riders:
            n = job.full.numel()
            job.full.copy_(flat[off:off + n].view_as(job.full))
            off += n
            job.state = _Rider.DONE


def _uses(t: torch.Tensor) -> int | None:
    """How many tensors and views hold ``t``'s storage (None where this torch
    does not say: then no buffer is reused)."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    return None if count is None else count(t.untyped_storage()._cdata)


class _GradSync:
    """Asynchronous all-reduce of the static gradient buckets, waited at the end of backward."""

    def __init__(self, rt: Runtime):
        self.rt = rt
        self.works: list = []
        self.armed = False
        # (gate op, bucket position) -> (flat buffer, its storage's use count when
        # nothing else views it).  A bucket's buffer is kept from step to step, as
        # DDP keeps its buckets: allocating a large bucket afresh every step costs a
        # page fault per page (tens of ms per 64 MB on a VM).  The gradients are
        # handed out as views of it, so a buffer is reused only once nothing views
        # it any more (zero_grad() dropped the gradients and no one kept them).
        self.buffers: dict = {}

    def add(self, gate: _Gate, grads) -> None:
        """Launch the gate's buckets (called from its backward, in chain order)."""
        rt = self.rt
        if not self.armed:
            torch.autograd.Variable._execution_engine.queue_callback(self.finish)
            self.armed = True
        by_qual = dict(zip(gate.quals, grads))
        for pos, (key, quals) in enumerate(gate.buckets):
            params = [rt.params[q] for q in quals]
            pieces = [(by_qual[q] if by_qual[q] is not None else torch.zeros_like(p)).reshape(-1)
                      for q, p in zip(quals, params)]
            riders, ride = [], rt.ride == (gate.op, pos)
            if ride and rt._early:  # this rank took its part early (Runtime._early_ride): repaired at the end
                early = rt._early.pop(0)
                self.works.append((None, early, params, key, riders, True, torch.cat(pieces)))
                continue
            if ride:  # the outputs ride along (every rank, every step), and a 0: no gradient missing here
                riders, rt._riders = rt._riders, []
                pieces += [job.full.reshape(-1) for job in riders]
                pieces.append(torch.zeros(1, dtype=pieces[0].dtype, device=pieces[0].device))
            flat = self._flat((gate.op, pos), pieces)
            work = _all_reduce(flat, rt.ride_group if ride else rt.groups[key])
            for job in riders:
                job.state = _Rider.SENT
            self.works.append((work, flat, params, key, riders, ride, None))

    def _flat(self, slot, pieces) -> torch.Tensor:
        """The pieces concatenated into the slot's buffer (a new one when it is
        missing, of another size or dtype, or still viewed by someone)."""
        n = sum(x.numel() for x in pieces)
        held = self.buffers.get(slot)
        if held is not None:
            buf, alone = held
            if buf.numel() == n and all(x.dtype == buf.dtype for x in pieces) and _uses(buf) == alone:
                return torch.cat(pieces, out=buf)
        buf = torch.cat(pieces)
        alone = _uses(buf)
        if alone is not None:
            self.buffers[slot] = (buf, alone)
        return buf

    def finish(self) -> None:
        try:
            works, self.works = self.works, []
            for work, flat, params, key, riders, ride, mine in works:
                if work is None:  # this rank's part was early: its gradients (mine) come in the repair
                    self._repair(flat, mine.numel(), mine)
                else:
                    self.rt.wait([work], lambda: f"gradient all-reduce among ranks {list(key)} (end of backward)")
                    if ride and flat[-1].item() > 0:  # some rank took its part early
                        self._repair(flat, sum(p.numel() for p in params), None)
                off = 0
                for p in params:
                    n = p.numel()
                    g = flat[off:off + n].view_as(p)
                    off += n
                    if p.grad is None:
                        p.grad = g
                    else:
                        p.grad.add_(g)
                _copy_riders(riders, flat, off)
        finally:
            self.reset()

    def _repair(self, flat: torch.Tensor, n: int, mine) -> None:
        """The ride bucket's gradients that ranks reading the outputs early left
        out (``Runtime._early_ride``): one more all-reduce on the ride group, in
        which those ranks give theirs (``mine``) and the others zeros; added to
        the first ``n`` elements of ``flat`` (the bucket's sum so far)."""
        rt = self.rt
        extra = mine if mine is not None else torch.zeros(n, dtype=flat.dtype, device=flat.device)
        work = _all_reduce(extra, rt.ride_group)
        rt.wait([work], lambda: f"gradients of the ride bucket, after an output was read before backward() "
                                f"on some rank")
        flat[:n] += extra

    def reset(self) -> None:
        self.works, self.armed = [], False
