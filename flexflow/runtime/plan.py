"""A rank's program: its parameter shards, its steps and what it moves, as a pure value.

:class:`Plan` is built from the graph, the strategy, the module (the values of
the shards) and the rank's place in the world, without any process group or
call to torch.distributed: every rank builds its own at setup (the runtime is
a plan that also communicates), and a test can build every rank's plan in one
process and check that they match (:mod:`flexflow.runtime.program`).
Everything it moves comes from :func:`flexflow.strategy.partitions`,
:func:`overlap` and :func:`param_placement`:

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

Gradient buckets
    A parameter shard held by several ranks (``ParamShard.devices``) has its
    gradient all-reduced among exactly those ranks.  Buckets are static: a
    rank's replicated shards, in the order their gradients complete in the
    backward (latest first use first), packed per (group, dtype) up to
    ``bucket_cap_mb``.  Each bucket's shards pass, at the earliest first use
    among them, through a *gate* (:class:`_Gate`) on the token chain.  Every
    member of a group holds the same shards, forms the same buckets and meets
    the gates in the same chain order, so launches match across members.

Outputs
    Each graph output not computed everywhere is assembled on every rank
    (:class:`_Output`: this rank's block of it); under
    ``reduce_outputs="with_gradients"`` the outputs ride in one gradient
    bucket that spans every rank (:meth:`Plan._plan_ride`).
"""
from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from ..cost.model import GRAD_BUCKET_BYTES
from ..cost.precision import PRECISIONS, gathers_in_compute, lowered_outputs
from ..graph.ir import Op, OpGraph, dtype_bytes
from ..graph.ops import RULES
from ..graph.ops.base import region_shape
from ..strategy.localrun import whole_config
from ..strategy.regions import (
    Partition,
    canonical_partitions,
    overlap,
    param_placement,
    partitions,
    pick_replica,
)
from ..strategy.strategy import Strategy
from .collex import _wire, _wire_dtype, plan_collective  # noqa: F401 (the wire dtypes: imported from here)
from .shardplan import Slice, group_units, plan_units, shard_levels, slice_of
from .shared import SharedInputs

__all__ = ["Plan", "Piece", "Exchange", "ExecutorError", "tensor_of", "BUCKET_CAP_MB", "REDUCE_OUTPUTS"]

BUCKET_CAP_MB = GRAD_BUCKET_BYTES / 2**20  # shared with the simulator's sync model
REDUCE_OUTPUTS = ("eager", "with_gradients")


class ExecutorError(RuntimeError):
    """The runtime cannot run a graph/strategy as given."""


# the precisions the runtime runs: the module's own dtypes, or bfloat16 / float16 autocast with
# the parameters, gradients and optimizer state in float32 (messages between ranks in the
# compute dtype where autocast surely computes them so); float16's loss scaling is the
# training loop's (torch's ShardedGradScaler agrees on skipped steps across the ranks)
RUN_PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "bf16-params")


def _precision_error(precision) -> str:
    if precision == "bf16-true":
        return ("precision 'bf16-true' is the module in bfloat16: convert it (module.to(torch.bfloat16)) "
                "and parallelize it with precision='32-true' (its own dtypes)")
    return f"precision must be one of {list(RUN_PRECISIONS)}, got {precision!r}"


# --------------------------------------------------------------------------- records
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
    coll: object = None  # run as a collective over a group (collex.Collective), else point-to-point


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
    # compiled at setup (flexflow.runtime.compute) for a step that reads only local values
    # and has no gate: vals, pvals -> the output (None: the general path of Runtime._run)
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


# --------------------------------------------------------------------------- the plan
class Plan(SharedInputs):
    """One rank's program for (graph, strategy): its parameter shards (copied from
    ``module`` to ``device``), its steps, exchanges, gradient buckets and outputs.
    ``ranks[k]`` is the global rank of the strategy's device k; this rank is
    ``rank`` of ``world``.  Building it needs no process group."""

    def __init__(self, graph: OpGraph, strategy: Strategy, module: torch.nn.Module, ranks,
                 *, rank: int = 0, world: int = 1, device=None, bucket_cap_mb: float = BUCKET_CAP_MB,
                 reduce_outputs: str = "with_gradients", precision: str = "32-true",
                 segments: dict | None = None):
        self.graph, self.strategy, self.module = graph, strategy, module
        # op name -> the pipeline chunk it runs in (interleaving): no gradient bucket spans two,
        # so each chunk's backward completes its own buckets
        self.segments = dict(segments or {})
        if precision not in RUN_PRECISIONS:
            raise ExecutorError(_precision_error(precision))
        self.precision = PRECISIONS[precision]
        # bf16-params: parameters (and floating inputs) cast to this for compute, no autocast
        self.params_cast = None if self.precision.autocast_lists or not self.precision.mixed else self.precision.compute
        self.ranks = [int(r) for r in ranks]  # device k of the strategy -> global rank
        self.rank, self.world = int(rank), int(world)
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.bucket_cap_bytes = int(bucket_cap_mb * 2**20)
        if reduce_outputs not in REDUCE_OUTPUTS:
            raise ExecutorError(f"reduce_outputs must be one of {REDUCE_OUTPUTS}, got {reduce_outputs!r}")
        self.reduce_outputs = reduce_outputs
        if len(set(self.ranks)) != len(self.ranks) or any(not 0 <= r < self.world for r in self.ranks):
            raise ExecutorError(f"devices {self.ranks} must be distinct ranks of the world (0..{self.world - 1})")
        used = max(strategy.devices_used(), default=0)
        if used >= len(self.ranks):
            raise ExecutorError(f"strategy {strategy.name!r} uses device {used} but only "
                                f"{len(self.ranks)} devices (ranks {self.ranks}) are given")
        self.placement = param_placement(graph, strategy)
        self._make_shards()
        self._plan_shard_levels()
        self._plan_shared()
        self._make_program()
        self._make_flat()

    # -- setup --------------------------------------------------------------
    def _parts(self, op: Op) -> list[Partition]:
        return partitions(op, self.strategy[op.name])

    def _mine(self, parts) -> Partition | None:
        for p in parts:
            if self.ranks[p.device] == self.rank:
                return p
        return None

    def part_of(self, op: Op) -> Partition | None:
        """This rank's partition of ``op`` (None: it computes none)."""
        return self._mine(self._parts(op))

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

    def _plan_shard_levels(self) -> None:
        """Shard levels (:mod:`.shardplan`): ``shard_level`` of this rank's replicated
        trainable regions, and ``shard_keys``, every group of ranks that shares a
        sharded region anywhere (every rank makes their gather groups)."""
        levels = shard_levels(self.graph, self.strategy)
        self.shard_level: dict[str, int] = {}
        self.shard_keys: set = set()
        for qual, level in levels.items():
            _, shards, trainable = self.placement[qual]
            if not trainable:
                continue
            for s in shards:
                ranks = tuple(sorted(self.ranks[d] for d in s.devices))
                if len(ranks) > 1:
                    self.shard_keys.add(ranks)
            if qual in self.params and self.params[qual].requires_grad and len(self.shards[qual][2]) > 1:
                self.shard_level[qual] = level
        self.gather_dtype = self._gather_dtypes()
        self.unit_quals = group_units(self.graph, self.shard_level, self.shards, self.gather_dtype)

    def _gather_dtypes(self) -> dict:
        """qual -> the dtype its full region is gathered in and held as: under ``*-mixed``
        the compute dtype for a parameter only lowered ops read (autocast would cast it so
        for them anyway: the same values, half the bytes, as FSDP2's
        ``param_dtype=bfloat16``), else its own (norm weights, embedding tables)."""
        pr = self.precision
        readers: dict[str, set] = {}
        for op in self.graph.compute_ops:
            for q in op.params.values():
                readers.setdefault(q, set()).add(op.rule)
        out = {}
        for q in self.shard_level:
            own = self.params[q].dtype
            low = own.is_floating_point and gathers_in_compute(pr, readers.get(q, ()))
            out[q] = pr.compute if low else own
        return out

    def _make_flat(self) -> None:
        """Sharded regions: ``full[qual]`` holds the values the ops read, and
        ``params[qual]`` becomes this rank's flat slice (what its optimizer updates)."""
        self.full: dict[str, torch.Tensor] = {}
        self.slices: dict[str, Slice] = {}
        for qual in self.shard_level:
            own = self.params[qual].detach()
            full = own.to(self.gather_dtype[qual]).requires_grad_(True)
            sl = self.slices[qual] = slice_of(full.numel(), self.shards[qual][2], self.rank)
            self.full[qual] = full
            self.params[qual] = torch.nn.Parameter(own.reshape(-1)[sl.lo:sl.hi].clone())
        self.units = plan_units(self.program, self.unit_quals, self.shard_level, self.shards, self.slices)

    def message_dtype(self, prod: Op, partial: bool = False) -> torch.dtype:
        """The dtype ``prod``'s output moves between ranks in: the traced one, or under
        ``*-mixed`` the compute dtype where autocast surely computes it in that dtype
        (:func:`lowered_outputs`), so that the consumer sees the values and dtype one
        process would.  Where unsure, the traced dtype: an exact upcast of whatever the
        producer computed.  Partial sums travel in the traced dtype (one process rounds
        the whole sum once)."""
        pr = self.precision
        if not pr.mixed or not prod.dtype.is_floating_point:
            return prod.dtype
        if not pr.autocast_lists:  # bf16-params: every activation in the compute dtype
            return pr.compute
        if partial:
            return prod.dtype
        lowered = self.__dict__.get("_lowered")
        if lowered is None:
            lowered = self._lowered = lowered_outputs(self.graph)
        return pr.compute if prod.name in lowered else prod.dtype

    def compute_tensor(self, qual: str) -> torch.Tensor:
        """The tensor the ops read of parameter ``qual`` (its full region where sharded)."""
        t = self.full.get(qual)
        return self.params[qual] if t is None else t

    def _make_program(self) -> None:
        """This rank's steps (with their exchanges and gates), its outputs, the ride
        bucket, and the values it can drop after each step."""
        g = self.graph
        first_use: dict[str, int] = {}
        for op in g.compute_ops:
            for qual in op.params.values():
                first_use.setdefault(qual, g.index[op.name])
        gates = self._plan_buckets(first_use)
        needs_grad: set[str] = set()
        self.program: list[_Step] = []
        self.exchanges: list[Exchange] = []  # this rank's exchange steps
        self.num_exchanges, self.coll_groups = 0, set()  # (groups of the exchanges run as collectives)
        self.last_exchange_op = -1  # forward position of the last op that takes an input from another rank
        self.comm_bytes = 0  # activation bytes moved per forward, all ranks together
        self._crossed: set = set()  # (op, input) whose read crosses ranks somewhere
        entries: dict = {}  # (op, input) -> its input entry
        for op in g.ops:
            if op.everywhere:
                self.program.append(_Step(op, partitions(op, whole_config(op))[0], everywhere=True))
                continue
            if any(self.placement[q][2] for q in op.params.values()) or any(s in needs_grad for s in op.inputs):
                needs_grad.add(op.name)
            parts = self._parts(op)
            step = _Step(op, self._mine(parts))
            for i, src in enumerate(op.inputs):
                e = self._shared_entry((op.name, i), entries) if (op.name, i) in self.share_src else None
                if e is None:
                    e = self._plan_input(op, parts, step.part, i, src, src in needs_grad)
                else:  # (another reader's read: its received tensor, or the same local slice)
                    e = None if e[0] == "none" else e[1] if e[0] == "same" else e
                entries[(op.name, i)] = e
                step.inputs.append(e)
            buckets = gates.get(g.index[op.name])
            if buckets:
                step.gate = _Gate(op.name, buckets, [q for _, qs in buckets for q in qs])
            if step.part is not None:
                step.params = self._param_access(op, step.part)
            self.program.append(step)
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
            if ex.sends and ex.coll is None:
                self.sends_after.setdefault(ex.producer, []).append(ex)
        self.fwd_recv_ex = [ex for ex in self.exchanges if ex.recvs and ex.coll is None]
        self.bwd_recv_ex = [ex for ex in self.exchanges if ex.grad and ex.sends and ex.coll is None]
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
        backward without waiting on another, which the runtime's ``_early_ride``
        relies on.  (A runtime without torch.distributed has a world of 1.)"""
        if self.reduce_outputs != "with_gradients" or not self.outputs or self.world == 1:
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
                if tuple(key) == every and self.params[quals[0]].dtype in dtypes and \
                        self.shard_level.get(quals[0], 0) < 2:  # an all-reduce bucket
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
                        if len(ranks) > 1 and q in self.params and self.params[q].requires_grad
                        and self.shard_level.get(q, 0) < 2),
                       key=lambda q: -first_use[q])
        open_: dict = {}  # (group key, dtype) -> [quals, bytes]
        done = []
        for q in ready:
            p = self.params[q]
            seg = self.segments.get(self.graph.ops[first_use[q]].name, 0)
            k = (self.shards[q][2], p.dtype, self.shard_level.get(q, 0) >= 2, seg)  # reduce-scattered apart
            b = open_.setdefault(k, [[], 0])
            b[0].append(q)
            b[1] += p.numel() * p.element_size()
            if b[1] >= self.bucket_cap_bytes:
                done.append((k, open_.pop(k)[0]))
        done += [(k, v[0]) for k, v in sorted(open_.items(),
                                              key=lambda kv: (kv[0][0], str(kv[0][1]), kv[0][2], kv[0][3]))]
        for quals in self.unit_quals:  # levels 2-3: a gather unit is reduce-scattered as one bucket
            if self.shard_level[quals[0]] >= 2:
                done.append(((self.shards[quals[0]][2], self.params[quals[0]].dtype, True, 0), list(quals)))
        gates: dict[int, list] = {}
        for (key, _, _, _), quals in done:
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
        index = coll = None
        if remote:
            coll = plan_collective(pieces, self.rank, pparts[0].partial,
                                   {self.ranks[q.device]: region_shape(q.output) for q in pparts})
            self.coll_groups.update(() if coll is None else coll[0])
            self._crossed.add((op.name, i))
            index = self.num_exchanges
            self.num_exchanges += 1
            self.last_exchange_op = self.graph.index[op.name]
            self.comm_bytes += sum(math.prod(p.shape) for p in remote) * dtype_bytes(
                self.message_dtype(prod, pparts[0].partial))
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
        ex = Exchange(index, op.name, i, src, pparts[0].partial, self.message_dtype(prod, pparts[0].partial),
                      grad and prod.dtype.is_floating_point,
                      region_shape(mine.inputs[i]) if need else None,
                      None if qm is None else region_shape(qm.output),
                      sends, recvs, [p for p in pieces if p.src == p.dst == me], coll and coll[1])
        self.exchanges.append(ex)
        return ("xchg", src, ex)

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
