"""Per-device memory of one training step, by liveness.

Every device runs the ops it holds partitions of in one global order: the forward in
topological order, the backward in reverse, then the optimizer step.  Position ``o`` is op
o's forward, ``2n - 1 - o`` its backward, ``2n`` the update (n = ops in the graph).  A tensor
lives over an inclusive range of positions; a device's peak is the largest sum of what lives
at one position.  What lives (bytes are sizes of the regions :func:`partitions` gives):

- parameters and buffers of the shards a device holds, and optimizer state (``sgd``: none,
  ``momentum``: one copy, ``adam``: two copies of every trainable shard), the whole step;
  at a shard level (``ParallelConfig.shard``) the n replicas of a shard keep a 1/n slice of
  its optimizer state (level 1), of its gradient too (2), of the parameter too (3); at
  level 3 the full parameter also lives over its users' forward and over their backward;
- the graph's inputs, whole on every device (every rank holds the global batch it hands
  the module), and the constants a device reads, the whole step;
- an op's output, from its forward to its last use: the last forward that reads it, or the
  backward of the last op that saves it (``saves.py``: which inputs each op kind keeps for its
  backward, whether it keeps its output, and what more it keeps -- max-pool indices, dropout
  masks, the log-softmax of a loss, an LSTM cell's gates).  Views (flatten, getitem,
  transpose, view) own no storage: they keep their source alive as long as they are used;
- input regions received from other devices, like an output of the receiving op;
- recomputation (``ParallelConfig.recompute``, the unit is one op): the op's output and its
  saved extras are dropped after the forward (after the last forward read) and made again at
  the op's recompute position ``rc_pos`` -- the earliest backward that needs the output (the
  backward of the last consumer that saves it, else the op's own) -- living from there to
  the last backward that needs them; what a recomputation reads is kept until it runs (as
  ``torch.utils.checkpoint`` keeps a segment's inputs): its producers' outputs and its
  received input regions, so recomputing an op whose input is saved anyway (GELU, a
  linear layer's output before GELU) saves its output, and one that saves only its output
  (ReLU) saves nothing.  A recomputed op that a recomputed consumer reads stays kept until
  that consumer's backward (its checkpoint holds its inputs) -- unless both are of one
  repeated block (:func:`flexflow.graph.ir.repeated_block`): then the consumer keeps a recipe
  and the op is made again where the first of its block's readers is (``chain_pos``, taken
  as if every reader in the block were recomputed), kept to the last of their backwards; so
  recomputing every op of a transformer block keeps what comes into the block, as block
  checkpointing does.  A recomputed op of a block holds its other inputs to its backward.
  An autocast or re-laid copy a recomputed op saves is made again in its backward instead.  The time is the template's (``plans.py``: a
  recomputed partition's backward lasts its forward plus its backward);
- the gradient of an op's output, from the backward of its last consumer to its own
  backward; every other consumer's contribution is a transient at that consumer's backward;
- parameter gradients, from the backward of the parameters' last user to the update;
- communication buffers: the executor flattens a bucket of replicated gradients into one
  buffer for the all-reduce and, as DDP does, keeps it from step to step (the synced
  gradients are views of it): the whole step; autograd's gradients of those shards live
  until the bucket is complete.  A reduce-scatter's input (levels 2-3) is a transient where
  its bucket is complete;
- copies an op makes of an input and keeps in its place: autocast's in another dtype
  (``*-mixed``), and torch's ``matmul``'s of an operand whose batch dims cannot be
  flattened as a view (a head-split projection transposed to (batch, heads, seq, dim));
  on CPU devices an RMSNorm's x * rstd (torch runs it unfused there);
- transients inside an op (an LSTM cell's two gate products before they are added, the
  gradient of a loss's log-softmax) and the optimizer step's temporaries (Adam: two
  copies of the largest shard, one at a time, on CPUs; one copy of every shard at once where
  the optimizer runs multi-tensor kernels, on GPUs).

Dtypes follow the simulator's precision (:mod:`flexflow.cost.precision`): activations (outputs,
saved and received tensors, activation gradients) in the compute dtype (``Context.cops``),
parameters, gradients and optimizer state in the parameter dtype, the all-reduce bucket in the
reduce dtype, level 3's gathered parameters in the all-gather dtype; under ``*-mixed`` below
level 3 the compute-dtype copies autocast makes of the parameters live from their first
user's forward to its backward (autocast caches them for the forward, and ops such as linear
save them for their backward).

Everything here is a function of the strategy alone, never of the schedule, so a delta
simulation and a full one give the same figures.
"""
from __future__ import annotations

import itertools

import numpy as np

from ..graph.ir import dtype_bytes
from ..graph.ops.base import region_numel
from ..strategy.regions import partitions
from .rcmem import RecomputeEvents
from .saves import _saves
from .sharedmem import SharedReads
from .unitmem import UnitEvents

# the executor posts a forward receive when the program comes within this many ops of the op
# that reads it (flexflow.runtime.comm): its buffers live from then to that op's forward
RECV_AHEAD = 24

__all__ = ["OPTIMIZERS", "UPDATE_TRAFFIC", "optimizer_state_copies", "Liveness"]

# optimizer kind -> optimizer-state copies per trainable parameter
OPTIMIZERS = {"sgd": 0, "momentum": 1, "adam": 2}
# optimizer kind -> bytes torch's update moves per byte of trainable parameter: its passes
# over parameter-sized tensors, each read and written (the same passes in its foreach and
# single-tensor kernels).  SGD: p.add_(g), 3.  Momentum: b.mul_(m), b.add_(g), p.add_(b), 8.
# Adam: m.lerp_(g), v.mul_(b2), v.addcmul_(g, g), s = v.sqrt(), s.div_(c2), s.add_(eps),
# p.addcdiv_(m, s), 18 (on an H200, 26.2 ms for LLaMA-1B's 1.24 G parameters: 22 bytes per
# byte at the datasheet's bandwidth, benchmarks/results/gpu_breakdown-H200.md).
UPDATE_TRAFFIC = {"sgd": 3, "momentum": 8, "adam": 18}

VIEWS = frozenset({"flatten", "view", "reshape", "transpose", "permute", "getitem", "squeeze",
                   "unsqueeze", "expand", "unflatten", "narrow", "select"})


def optimizer_state_copies(optimizer: str) -> int:
    """Optimizer-state copies per trainable parameter; a clear error for an unknown kind."""
    try:
        return OPTIMIZERS[optimizer]
    except (KeyError, TypeError):
        raise ValueError(f"unknown optimizer {optimizer!r}: expected one of "
                         f"{', '.join(OPTIMIZERS)}") from None


def _contiguous(shape: tuple) -> tuple:
    st, acc = [], 1
    for x in reversed(shape):
        st.append(acc)
        acc *= max(x, 1)
    return tuple(reversed(st))


def _flattens(shape: tuple, strides: tuple) -> bool:
    """Whether dims ``shape`` with ``strides`` merge into one as a view (size-1 dims aside)."""
    dims = [(x, s) for x, s in zip(shape, strides) if x != 1]
    return all(s0 == x1 * s1 for (_, s0), (x1, s1) in itertools.pairwise(dims))


class Liveness(UnitEvents, RecomputeEvents, SharedReads):
    """Static liveness structure of a graph and the memory events of ops and clusters.

    ``op_events(o, cfg)`` -> (positions, rows): +row at each allocation, -row one position
    after each last use; cached per (op, the configs it depends on).  ``dependents[v]``: ops
    whose events depend on v's config (v, its consumers, the ops it reads through views)."""

    def __init__(self, ctx, optimizer: str):
        self.ctx = ctx
        self.optimizer = optimizer
        self.state_copies = optimizer_state_copies(optimizer)
        ops, n = ctx.ops, len(ctx.ops)
        self.n = n
        self.npos = 2 * n + 2
        self.update_pos = 2 * n
        self.view = [op.kind in VIEWS and not op.everywhere and len(ctx.inputs[o]) >= 1
                     for o, op in enumerate(ops)]
        self.rg = [False] * n  # output requires grad
        for o, op in enumerate(ops):
            if not op.everywhere:
                self.rg[o] = bool(op.params) or any(self.rg[u] for u in ctx.inputs[o])
        # uses of each storage owner: (consumer, input index, consumer reads the owner
        # directly or through views) reached through chains of views
        self.uses: list[list] = [[] for _ in ops]
        for o in ctx.compute:
            if self.view[o]:
                continue
            stack = [o]
            while stack:
                x = stack.pop()
                for v, j in ctx.cons[x]:
                    self.uses[o].append((v, j))
                    if self.view[v]:
                        stack.append(v)
        self._layout_copies(ctx)
        self._recompute_setup(ctx)
        self._owner = list(range(n))  # op -> the op whose output storage it views (itself)
        for o in range(n):
            if self.view[o]:
                u = ctx.inputs[o][0]
                self._owner[o] = self._owner[u] if u < o else u
        self._shared_setup(ctx)
        self.dependents = [{v} for v in range(n)]
        for o in ctx.compute:
            self.dependents[o].update(self.sibs[o])  # (shared reads: sibling readers' events)
            for u in ctx.producers[o]:
                self.dependents[u].add(o)
            for v, _ in self.uses[o]:
                self.dependents[v].add(o)
        self.dependents = [sorted(x) for x in self.dependents]
        self.use_ops = [sorted({v for v, _ in us}) for us in self.uses]
        self._rows: dict = {}
        self._rowkey = [(o,) if ctx.kind[o] < 0 else
                        (ctx.kind[o],) + tuple((ctx.everywhere[u] and ops[u].kind != "input", str(ops[u].dtype))
                                               for u in ctx.inputs[o])
                        for o in range(n)]
        self._ev: dict = {}
        self._gev: dict = {}  # (shard group, its clusters' plans) -> events (plans live in ctx._cluster)
        self._foreach = [d.spec.kind.lower() != "cpu" for d in ctx.machine.devices]
        self._cpu = ~np.array(self._foreach, bool)
        # the graph's inputs: every rank holds the whole global batch (a ParallelModule's
        # forward takes the same global inputs on every rank), the whole step
        self.input_bytes = sum(int(np.prod(op.output_shape, dtype=np.int64)) * dtype_bytes(op.dtype)
                               for op in ops if op.kind == "input")

    # ---- per-device byte rows of one op under one config --------------------------------
    def rows(self, o: int, cfg):
        """(output, input-0 region, graph inputs read) bytes per device; devices mask.
        Cached per (the op's geometry kind, which of its inputs are graph inputs and their
        element types, config): the ops of one kind share them (the steps of an unrolled
        recurrence, the blocks of a stack)."""
        key = (self._rowkey[o], cfg)
        r = self._rows.get(key)
        if r is not None:
            return r
        ctx, D = self.ctx, self.ctx.D
        op, cop = ctx.ops[o], ctx.cops[o]  # (traced, priced under the precision)
        out, in0, gin = np.zeros(D, np.int64), np.zeros(D, np.int64), np.zeros(D, np.int64)
        on = np.zeros(D, bool)
        bpe = dtype_bytes(cop.dtype)
        # input 0 as the op works on it: in its producer's dtype, or under a precision in the
        # op's own (a loss autocast to float32 keeps a float32 copy of its logits)
        in0_bpe = None if ctx.precision.native or not cop.input_dtypes else dtype_bytes(cop.input_dtypes[0])
        for p in partitions(op, cfg):
            d = p.device
            on[d] = True
            out[d] += region_numel(p.output) * bpe
            for j, reg in enumerate(p.inputs):
                if reg is None:
                    continue
                u = ctx.inputs[o][j]
                nb = region_numel(reg) * dtype_bytes(ctx.cops[u].dtype)
                if j == 0:
                    in0[d] += nb if in0_bpe is None else region_numel(reg) * in0_bpe
                if ctx.everywhere[u] and ctx.ops[u].kind != "input":
                    gin[d] += nb
        r = self._rows[key] = (out, in0, gin, on)
        return r

    def _layout_copies(self, ctx) -> None:
        """``self.relaid``: the (op, input) pairs where torch's ``matmul`` copies its input
        into a new layout before the product (and saves that copy): an operand of three or
        more dims whose batch dims cannot be flattened as a view, such as a head-split
        projection transposed to (batch, heads, seq, dim).  The strides follow the views
        (transpose and permute reorder them; a view of a contiguous tensor is contiguous;
        anything else is taken as needing no copy)."""
        ops = ctx.ops
        strides: list = [None] * len(ops)
        for o, op in enumerate(ops):
            shape = tuple(int(x) for x in op.output_shape)
            if not self.view[o]:
                strides[o] = _contiguous(shape)
                continue
            src = strides[ctx.inputs[o][0]]
            if src is None:
                continue
            perm = op.attrs.get("perm") if op.kind in ("transpose", "permute") else None
            if perm is not None and len(perm) == len(src):
                strides[o] = tuple(src[i] for i in perm)
            elif op.kind in ("view", "reshape", "flatten", "unflatten", "squeeze", "unsqueeze") \
                    and src == _contiguous(tuple(int(x) for x in ops[ctx.inputs[o][0]].output_shape)):
                strides[o] = _contiguous(shape)
        self.relaid = set()
        for v, op in enumerate(ops):
            if op.kind != "matmul" or len(ctx.inputs[v]) != 2:
                continue
            a, b = (tuple(int(x) for x in ops[u].output_shape) for u in ctx.inputs[v])
            if len(a) < 3:
                continue
            for j, u in enumerate(ctx.inputs[v]):
                shape, st = (a, b)[j], strides[u]
                # batched: each operand's batch dims flattened; one batched operand by a
                # matrix: the first's every dim but the last
                keep = len(shape) - 2 if len(b) >= 3 else len(shape) - 1
                if st is not None and len(shape) >= 3 and not _flattens(shape[:keep], st[:keep]):
                    self.relaid.add((v, j))

    def copies(self, v: int, j: int, o: int) -> bool:
        """Op v reads its input j (op o's output or a view of it) as a copy of its own, which
        it keeps in o's place: a cast (:meth:`casts`) or a new layout (``relaid``)."""
        return (v, j) in self.relaid or self.casts(v, j, o)

    def casts(self, v: int, j: int, o: int) -> bool:
        """Under ``*-mixed``: op v reads input j (op o's output, or a view of it) as a copy
        in another dtype (autocast casts a lowered op's float32 input to the compute dtype;
        a loss casts its logits to float32): v keeps that copy, not o's output."""
        ctx = self.ctx
        if not ctx.precision.mixed:
            return False
        ins = ctx.cops[v].input_dtypes
        return j < len(ins) and ins[j] != ctx.cops[o].dtype and ins[j].is_floating_point

    def cast_bytes(self, v: int, cfg, j: int) -> np.ndarray:
        """Bytes per device of op v's copy of its input j in the dtype it reads it in."""
        key = ("cast", self._rowkey[v], cfg, j)
        r = self._rows.get(key)
        if r is None:
            r = np.zeros(self.ctx.D, np.int64)
            ins = self.ctx.cops[v].input_dtypes
            bpe = dtype_bytes(ins[j] if j < len(ins) else self.ctx.cops[self.ctx.inputs[v][j]].dtype)
            for p in partitions(self.ctx.ops[v], cfg):
                if p.inputs[j] is not None:
                    r[p.device] += region_numel(p.inputs[j]) * bpe
            self._rows[key] = r
        return r

    # ---- events -------------------------------------------------------------------------
    def op_events(self, o: int, cfg: list):
        """Memory events of op o; ``cfg``: op index -> config."""
        ctx = self.ctx
        key = (o, cfg[o]) + tuple(cfg[u] for u in ctx.producers[o]) + tuple(cfg[v] for v in self.use_ops[o]) \
            + tuple(cfg[v] for v in self.sibs[o])
        ev = self._ev.get(key)
        if ev is not None:
            return ev
        ops, n = ctx.ops, self.n
        op = ops[o]
        sv = _saves(op)
        out, in0, gin, on = self.rows(o, cfg[o])
        unit = {"out": out, "in0": in0}
        F, B = o, 2 * n - 1 - o
        pos, rows = [], []

        def live(a, b, row):  # row lives over positions a..b (inclusive)
            if row.any():
                pos.append(a)
                rows.append(row)
                pos.append(b + 1)
                rows.append(-row)

        live(0, self.update_pos, gin)
        rg = self.rg
        # recomputed in the backward (see _recomputed): where that drops something, or where a
        # recomputed reader of its block makes it again rather than keep it
        rc = cfg[o].recompute and (self.rc_real[o] or self._chained(o, cfg))
        if not self.view[o]:
            # the output (storage owner): its last forward read, its last saving backward
            last_f = max([F] + [v for v, _ in self.uses[o]])
            keep = np.full(ctx.D, last_f, np.int64)
            if not self.uses[o]:
                keep[:] = B  # the loss: kept until the backward starts from it
            if rc and self.uses[o]:
                self._recomputed(o, cfg, sv, out, on, last_f, live)
            else:
                if sv.output and rg[o]:
                    np.maximum(keep, B, out=keep)
                for v, j in self.uses[o]:
                    s = _saves(ops[v])
                    if rg[v] and not self.view[v] and (s.inputs == "all" or j in s.inputs) and not self.copies(v, j, o):
                        _, _, _, von = self.rows(v, cfg[v])
                        np.maximum(keep, np.where(von, 2 * n - 1 - v, 0), out=keep)
                    elif self._holds(v, cfg):  # v's checkpoint holds its inputs to its backward
                        _, _, _, von = self.rows(v, cfg[v])
                        np.maximum(keep, np.where(von, 2 * n - 1 - v, 0), out=keep)
                for f in sorted(set(keep[on].tolist())):
                    live(F, f, np.where(on & (keep == f), out, 0))
            if sv.extra[0]:
                x = unit[sv.extra[1]] * sv.extra[0]
                if sv.itemsize:
                    x = x * sv.itemsize / dtype_bytes(ctx.cops[o].dtype)
                x = x.astype(np.int64)
                if rc:  # made in the forward and dropped, made again by the recomputation
                    live(F, F, x)
                    live(self.rc_pos[o], B, x)
                else:
                    live(F, B, x)
            if rg[o] and self.uses[o]:
                # gradient of the output: from the first backward that produces it
                grads = sorted({v for v, _ in self.uses[o] if not self.view[v]}, reverse=True)
                if grads:
                    live(2 * n - 1 - grads[0], B, out)
                    for v in grads[1:]:
                        live(2 * n - 1 - v, 2 * n - 1 - v, out)
        if op.kind == "rms_norm" and rg[o] and not self.view[o]:
            # on a CPU torch runs it unfused and saves x * rstd (an output-sized tensor) for
            # the backward; the fused GPU kernel keeps only rstd
            x = np.where(self._cpu, out, 0)
            if rc:
                live(F, F, x)
                live(self.rc_pos[o], B, x)
            else:
                live(F, B, x)
        if sv.fwd_temp[0]:
            live(F, F, (unit[sv.fwd_temp[1]] * sv.fwd_temp[0]).astype(np.int64))
            if rc:  # the recomputation's forward has them too
                live(self.rc_pos[o], self.rc_pos[o], (unit[sv.fwd_temp[1]] * sv.fwd_temp[0]).astype(np.int64))
        if sv.bwd_temp[0] and rg[o]:
            live(B, B, (unit[sv.bwd_temp[1]] * sv.bwd_temp[0]).astype(np.int64))
        # the op's own copies of inputs (autocast's in another dtype, matmul's in a new
        # layout): saved ones to the backward, the others for the op's forward
        if (ctx.precision.mixed or self.relaid) and not self.view[o]:
            for j, u in enumerate(ctx.inputs[o]):  # (the graph's inputs too: a first conv's batch)
                w = self._owner[u]
                if w >= 0 and self.copies(o, j, w):
                    saved = rg[o] and (sv.inputs == "all" or j in sv.inputs)
                    end = self.shared_cast(o, j, cfg, self._saves_input) if self.readers[u] else None
                    rgg = self.regather_group(o, j, cfg)
                    if rgg is not None:  # gathered again (and cast) in the backward: not kept; one
                        if rgg[0] == (o, j):  # cast for every reader (the executor shares it)
                            self._regather_live(rgg, self.cast_bytes(o, cfg[o], j), live, cfg, copies=True)
                    elif end is not None:  # one copy for the readers casting it alike
                        if end >= 0:
                            live(F, end, self.cast_bytes(o, cfg[o], j))
                    elif saved and rc:  # the checkpoint keeps the input, not the copy: made again
                        live(F, F, self.cast_bytes(o, cfg[o], j))
                        live(B, B, self.cast_bytes(o, cfg[o], j))
                    else:
                        live(F, B if saved else F, self.cast_bytes(o, cfg[o], j))
        # input regions received from other devices (and their gradients, sent back)
        saved_in = sv.inputs
        for j in ctx.ext_inputs[o]:
            u = ctx.inputs[o][j]
            e = ctx.edge_plan(u, o, j, cfg[u], cfg[o])
            recv = e.recv
            if not recv.any():
                continue
            end = self.shared_recv(o, j, cfg, self._saves_input) if self.readers[u] else None
            # a collective's buffers are the op's (not posted ahead); an all-gather its linear
            # readers gather again in the backward is not kept for it
            ahead = RECV_AHEAD if e.coll is None else 0
            rgg = self.regather_group(o, j, cfg) if e.coll == "gather" else None
            if rgg is not None:
                if end is None or end >= 0:
                    live(F, F, recv)
                    self._regather_live(rgg, np.where(recv > 0, self.in_bytes(o, cfg[o], j), 0), live, cfg)
            else:
                if end is None:
                    # kept for the backward unless the op keeps its own copy (a cast) instead; a
                    # recomputed op reads its inputs again: received regions are kept until then
                    keeps = rg[o] and not self.view[o] and (saved_in == "all" or j in saved_in) \
                        and not self.copies(o, j, self._owner[u])
                    end = B if keeps else (self.rc_pos[o] if rc else F)
                if end >= 0:  # (-1: a reader before o received it for both)
                    # the pieces received (posted ahead), then the region they make (partial
                    # sums added up)
                    live(max(0, F - ahead), F, recv)
                    live(F, end, np.where(recv > 0, self.in_bytes(o, cfg[o], j), 0))
            if rg[u]:  # (the gradient's pieces: posted ahead of o's backward)
                live(B - ahead if B - ahead > n else n, B, recv)
        ev = (np.array(pos, np.int64), np.stack(rows) if rows else np.zeros((0, ctx.D), np.int64))
        self._ev[key] = ev
        return ev

    def in_bytes(self, v: int, cfg, j: int) -> np.ndarray:
        """Bytes per device of op v's input j regions, in the dtype its producer sends."""
        key = ("in", self._rowkey[v], cfg, j)
        r = self._rows.get(key)
        if r is None:
            r = np.zeros(self.ctx.D, np.int64)
            bpe = dtype_bytes(self.ctx.cops[self.ctx.inputs[v][j]].dtype)
            for p in partitions(self.ctx.ops[v], cfg):
                if p.inputs[j] is not None:
                    r[p.device] += region_numel(p.inputs[j]) * bpe
            self._rows[key] = r
        return r

    def _saves_input(self, v: int, j: int) -> bool:
        s = _saves(self.ctx.ops[v]).inputs
        return not self.view[v] and (s == "all" or j in s)

    def cluster_events(self, c: int, cp):
        """Events of a parameter cluster's plan ``cp``: parameters, buffers and optimizer
        state the whole step, and the all-reduce buckets (kept from step to step, as the
        executor and DDP keep them; the synced gradients are views of them); gradients
        from the last user's backward, to the update, or for all-reduced ones to the
        first user's backward (where they are copied into the bucket).  What sharded
        replicas gather and reduce-scatter is their gather unit's (:meth:`group_events`,
        :mod:`.unitmem`)."""
        n = self.n
        us, _ = self.ctx.clusters[c]
        pos, rows = [0, self.npos - 1], [cp.mem + cp.kept, -(cp.mem + cp.kept)]
        g0 = 2 * n - 1 - max(us)
        b = 2 * n - 1 - min(us)
        own = cp.grad - cp.ar_grad  # gradients not all-reduced: to the update
        if cp.level >= 2:
            own = own - cp.sl  # (the reduce-scattered slices: the unit's)
        pos += [g0, self.npos - 1, g0, b + 1]
        rows += [own, -own, cp.ar_grad, -cp.ar_grad]
        if cp.cast.any():  # *-mixed: autocast's compute-dtype copies of the parameters, cached
            pos += [min(us), b + 1]  # from the first use and saved for the backward (linear's
            rows += [cp.cast, -cp.cast]  # weight) until the first user's backward
        return np.array(pos, np.int64), np.stack(rows)

    def update_temp(self, maxshard: np.ndarray, train: np.ndarray) -> np.ndarray:
        """Temporaries of the optimizer step per device, from per-cluster rows of the largest
        trainable shard and the trainable bytes (each (clusters, devices))."""
        D = self.ctx.D
        if self.optimizer != "adam" or not len(maxshard):
            return np.zeros(D, np.int64)
        single = 2 * maxshard.max(0)
        multi = train.sum(0)
        return np.where(self._foreach, multi, single)


_GiB = 2**30


def out_of_memory(peak: list, cap: list) -> str:
    """The one-line error of a step whose per-device ``peak`` exceeds ``cap`` somewhere
    (the worst device, then how many more), or "" where it fits."""
    over = [(peak[d] - cap[d], d) for d in range(len(peak)) if peak[d] > cap[d]]
    if not over:
        return ""
    excess, d = max(over)
    msg = (f"out of memory on device {d}: needs {peak[d]:,} bytes ({peak[d] / _GiB:.2f} GiB), "
           f"capacity {cap[d]:,} bytes ({cap[d] / _GiB:.2f} GiB), {excess:,} bytes "
           f"({excess / _GiB:.2f} GiB) too many")
    others = sorted(x for _, x in over if x != d)
    if others:
        msg += f"; {len(others)} more device(s) over capacity: {', '.join(map(str, others))}"
    return msg
