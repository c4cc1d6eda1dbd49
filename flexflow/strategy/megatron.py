"""Megatron-style tensor parallelism found from the graph itself (``Strategy.megatron``).

Nothing here knows a model by name: the plan is read off the traced graph.

Pairs.  A linear layer whose input is computed, through ops without parameters, from the
outputs of other linear layers only (no normalization, embedding or graph input on the
way) is the second layer of a pair: Megatron's row-parallel layer, split by its inputs
(dim ``k``: each partition reads a slice of the input features and of the weight's
columns and leaves a partial sum, which its consumers add up).  The layers it reads from
are the first layers of the pair, split by their outputs (dim ``c``, column-parallel).
In a transformer block that finds the attention (query, key and value projections, then
the output projection) and the MLP (the up projection(s), then the down projection),
whatever the module is called.  Layers are paired in graph order; a layer that is already
the second of a pair is not the first of another.

Axes.  Which axis of each op carries the tokens, and which the features a first layer
split, is followed forward from the graph inputs through the partition regions (the one
source of truth: splitting a dim of an op in two shows which input axis it slices), and
across reshapes by their shapes (a width split into heads keeps the split on the heads).
Between the two layers of a pair every op that can split along the feature axis (heads,
hidden units) does; the rest of the graph (embeddings, norms, residual adds, the loss)
splits along the tokens (sequence parallelism), so the tensor-parallel group all-gathers
before a first layer and reduce-scatters after a second one, as Megatron-LM with
sequence parallelism does.  The samples are split across the tensor-parallel groups
(data parallelism).

What the SOAP space cannot say, and what stands for it:

- a reshape splits only the axes it keeps whole, so the view that makes heads out of a
  projection's width runs token-split: the tokens cross the group once there (an
  all-to-all of 1/tp of the tensor) before the attention splits by heads again;
- an op that cannot split its feature axis (a fused attention whose keys have fewer heads
  than its queries) splits along the tokens, else runs as under data parallelism;
- the output layer and the loss run token-split with the output weight whole on each
  device (Megatron's vocabulary-parallel cross-entropy needs a loss that splits along the
  classes); an embedding splits its embedding dim.
"""
from __future__ import annotations

import itertools
import math

from ..graph.ir import Op, OpGraph
from .config import REPLICA, ParallelConfig, StrategyError
from .regions import has_param_replicas, partitions

__all__ = ["linear_pairs", "megatron_configs"]

_LINEAR = ("linear", "linear_t")
TOKENS = "tokens"


def _is_linear(op: Op) -> bool:
    return op.rule in _LINEAR and "weight" in op.params


def _data_ops(graph: OpGraph) -> set[str]:
    """Ops computed from the graph's inputs (not from constants alone)."""
    out: set[str] = set()
    for op in graph.ops:
        if op.kind == "input" or any(i in out for i in op.inputs):
            out.add(op.name)
    return out


def linear_pairs(graph: OpGraph) -> list[tuple[list[str], str, list[str]]]:
    """(first layers, second layer, ops between them) for each pair, in graph order.

    The second layer's input must come, through ops without parameters, from the first
    layers' outputs alone; the ops between are those on the way (constants aside)."""
    data = _data_ops(graph)
    role: dict[str, str] = {}
    out = []
    for op in graph.compute_ops:
        if not _is_linear(op) or not op.inputs or op.inputs[0] not in data:
            continue
        firsts, inner, ok = [], [], True
        seen, todo = set(), [op.inputs[0]]
        while todo and ok:
            name = todo.pop()
            if name in seen or name not in data:
                continue
            seen.add(name)
            u = graph.op(name)
            if _is_linear(u):
                firsts.append(name)
            elif u.params or u.everywhere or not u.inputs:
                ok = False  # a norm, an embedding, a graph input: the trunk
            else:
                inner.append(name)
                todo.extend(u.inputs)
        if not ok or not firsts or any(role.get(f) == "second" for f in firsts):
            continue
        for f in firsts:
            role[f] = "first"
        role[op.name] = "second"
        order = graph.index
        out.append((sorted(set(firsts), key=order.__getitem__), op.name, sorted(inner, key=order.__getitem__)))
    return out


def _dim_input_axes(op: Op, dim: str) -> list[tuple[int, int]]:
    """(input index, input axis) pairs that splitting ``dim`` in two slices."""
    try:
        p0, p1 = partitions(op, ParallelConfig({dim: 2}, (0, 1)))
    except StrategyError:
        return []
    out = []
    for i, (a, b) in enumerate(zip(p0.inputs, p1.inputs)):
        if a is None or b is None or a == b:
            continue
        diff = [ax for ax, (x, y) in enumerate(zip(a, b)) if x != y]
        if len(diff) == 1:
            out.append((i, diff[0]))
    return out


def _reshape_tags(op: Op, tags_in: dict[int, object]) -> dict[int, object]:
    """Output-axis tags of a reshape: an input axis goes to the output axis that begins at
    the same place in row-major order (the outer factor when a width becomes heads x
    head size, the merged axis when heads x head size becomes a width)."""
    ins, outs = op.input_shapes[0], op.output_shape
    out = {}
    for ia, tag in tags_in.items():
        before = math.prod(ins[:ia])
        for oa in range(len(outs)):
            if math.prod(outs[:oa]) == before and outs[oa] > 1:
                out[oa] = tag
                break
    return out


def _axis_tags(graph: OpGraph, firsts: dict[str, object]) -> dict[str, dict[str, object]]:
    """op name -> {dim name: tag} for the dims that follow a tagged axis: ``TOKENS`` (axis
    1 of a graph input of 2 or 3 axes whose axis 0 is the batch) or the key of the pair
    whose first layer split that feature axis (``firsts``: first layer -> pair key)."""
    out_tags: dict[str, dict[int, object]] = {}
    dim_tags: dict[str, dict[str, object]] = {}
    for op in graph.ops:
        if op.kind == "input":
            shape = op.output_shape
            out_tags[op.name] = {1: TOKENS} if len(shape) in (2, 3) and graph.batch_size \
                and shape[0] == graph.batch_size else {}
            continue
        tags: dict[str, object] = {}
        axes: dict[int, object] = {}
        if op.rule == "reshape" and op.inputs:
            axes = _reshape_tags(op, out_tags.get(op.inputs[0], {}))
        for d in op.dims:
            if d.name == "n":
                continue
            for i, ia in _dim_input_axes(op, d.name):
                tag = out_tags.get(op.inputs[i], {}).get(ia)
                if tag is not None:
                    tags[d.name] = tag
                    if d.axis is not None:
                        axes[d.axis] = tag
                    break
        if op.inputs and op.rule != "reshape":
            # an axis no dim splits keeps its input's tag where the shapes line up (the
            # query rows of a fused causal attention, which splits only by heads)
            covered = {d.axis for d in op.dims}
            shape_in, src = op.input_shapes[0], out_tags.get(op.inputs[0], {})
            for a, tag in src.items():
                if a not in covered and a not in axes and len(shape_in) == len(op.output_shape) \
                        and shape_in[a] == op.output_shape[a]:
                    axes[a] = tag
        if op.name in firsts and "c" in op.parallel_dims:
            tags["c"] = firsts[op.name]
            axes[op.dim("c").axis] = firsts[op.name]
        out_tags[op.name] = axes
        dim_tags[op.name] = tags
    return dim_tags


def _config(op: Op, want: dict[str, int], tp: int, batch: int | None,
            strides: dict[str, int] | None = None) -> ParallelConfig | None:
    """``want`` (dim -> degree, ``n`` the data-parallel degree, the other the tensor-
    parallel one) as a config, partition on device node * tp + rank in its group; None when
    the op lacks a dim or one is too small.  ``strides`` (dim -> device stride) places the
    blocks otherwise: device = sum of block index x stride (``n`` and ``d0`` by their own)."""
    dims = {d.name: d for d in op.dims}
    first = op.dims[0] if op.dims else None
    if "n" not in dims and first is not None and first.name == "d0" and first.axis == 0 and first.size == batch:
        want = {("d0" if k == "n" else k): v for k, v in want.items()}  # a batch axis not named so
        if strides and "n" in strides:
            strides = {("d0" if k == "n" else k): v for k, v in strides.items()}
    want = {k: v for k, v in want.items() if v > 1}
    if any(k not in dims or dims[k].blocks < v for k, v in want.items()):
        return None
    order = [d.name for d in op.dims if d.name in want]
    devices = []
    for idx in itertools.product(*(range(want[k]) for k in order)):
        at = dict(zip(order, idx))
        if strides is not None:
            devices.append(sum(v * strides.get(k, 1) for k, v in at.items()))
        else:
            devices.append(at.get("n", at.get("d0", 0)) * tp + sum(v for k, v in at.items() if k not in ("n", "d0")))
    return ParallelConfig(want, devices)


def megatron_configs(graph: OpGraph, num_devices: int, tp: int, shard: int,
                     fallback: dict[str, ParallelConfig], cp: int = 1,
                     sequence_parallel: bool = True, cp_balance: bool | None = None) -> dict[str, ParallelConfig]:
    """Op name -> config of the Megatron plan (see the module's docstring); ``fallback``:
    the data-parallel config of each op, for ops that have no dim to split as the plan
    says.  ``cp > 1``: context parallelism, every op split along the tokens ``cp`` ways
    besides (device ``t + tp * (c + cp * d)``: tensor rank t of sequence chunk c of
    replica d), a causal attention by its query rows (each chunk reading the keys and
    values before it), or with ``cp_balance`` head-tail (:mod:`flexflow.strategy.layout`:
    each block two chunks, all the keys and values gathered; ``None``: where the graph can
    run in that token order).  ``sequence_parallel=False`` (one group: ``tp`` the devices): the ops
    the plan would split along the tokens are replicated on the group instead, the pairs'
    partial sums all-reduced into them."""
    if cp > 1:
        if cp_balance is not False:
            try:
                return _balanced(graph, _context_configs(graph, num_devices, tp, cp, shard, fallback))
            except StrategyError:
                if cp_balance:
                    raise
        return _context_configs(graph, num_devices, tp, cp, shard, fallback)
    dp = num_devices // tp
    pairs = linear_pairs(graph)
    firsts = {f: k for k, (fs, _, _) in enumerate(pairs) for f in fs}
    role: dict[str, tuple] = {}
    for k, (fs, second, inner) in enumerate(pairs):
        for f in fs:
            role[f] = ("first", k)
        role[second] = ("second", k)
        for name in inner:
            role.setdefault(name, ("inner", k))
    tags = _axis_tags(graph, firsts)
    configs: dict[str, ParallelConfig] = {}
    for members in graph.groups.values():
        op = graph.op(members[0])
        kind, pair = role.get(op.name, ("trunk", None))
        t = tags.get(op.name, {})
        tokens = next((d for d, tag in t.items() if tag == TOKENS), None)
        tries = []
        if kind == "first":
            tries.append({"n": dp, "c": tp})
        elif kind == "second":
            tries.append({"n": dp, "k": tp})
        elif kind == "inner":
            tries += [{"n": dp, d: tp} for d, tag in t.items() if tag == pair]
        elif op.rule == "embedding" and "e" in op.parallel_dims and "n" in op.parallel_dims:
            tries.append({"n": dp, "e": tp})
        if tokens is not None and sequence_parallel:
            tries.append({"n": dp, tokens: tp})
        cfg = None
        for want in tries:
            cfg = _config(op, want, tp, graph.batch_size)
            if cfg is not None:
                break
        if cfg is None and not sequence_parallel:  # kept whole in the group (one group: dp is 1)
            cfg = ParallelConfig({REPLICA: tp}, range(tp))
        if cfg is None:
            cfg = fallback[op.name]
        configs[op.name] = _with_shard(graph, members, cfg, shard)
    return configs


def _context_configs(graph: OpGraph, num_devices: int, tp: int, cp: int, shard: int,
                     fallback: dict[str, ParallelConfig]) -> dict[str, ParallelConfig]:
    """:func:`megatron_configs` with context parallelism (``cp`` sequence chunks): each op's
    tensor-parallel split as there, and its token dim split ``cp`` ways besides (an op the
    plan splits along the tokens by ``tp`` already: ``tp * cp`` ways, chunk-major)."""
    dp = num_devices // (tp * cp)
    flat = megatron_configs(graph, num_devices // cp, tp, 0, fallback)
    tags = _axis_tags(graph, {f: k for k, (fs, _, _) in enumerate(linear_pairs(graph)) for f in fs})
    configs: dict[str, ParallelConfig] = {}
    for members in graph.groups.values():
        op = graph.op(members[0])
        t = tags.get(op.name, {})
        tokens = next((d for d, tag in t.items() if tag == TOKENS), None)
        base = flat[op.name]
        want = {k: v for k, v in base.degrees.items()}
        batch_key = "n" if "n" in want or "n" in {d.name for d in op.dims} else "d0"
        have_dp = want.get(batch_key, 1) == dp
        cfg = None
        if tokens is not None and have_dp:
            tensor = [k for k in want if k != batch_key]
            strides = {batch_key: tp * cp}
            if tokens in tensor:  # split along the tokens by tp already (sequence parallelism)
                want[tokens] *= cp
                strides[tokens] = 1
            else:
                want[tokens] = cp
                strides[tokens] = tp
                for k in tensor:
                    strides[k] = 1
            cfg = _config(op, want, tp, graph.batch_size, strides)
        if cfg is None:  # no token dim: as the data-parallel replicas, whole in each chunk group
            cfg = _config(op, {batch_key: dp}, tp, graph.batch_size, {batch_key: tp * cp}) \
                if dp > 1 else ParallelConfig({}, (0,))
            if cfg is None:
                cfg = fallback[op.name]
        configs[op.name] = _with_shard(graph, members, cfg, shard)
    return configs


def _balanced(graph: OpGraph, configs: dict[str, ParallelConfig]) -> dict[str, ParallelConfig]:
    """``configs`` with every causal attention's contiguous split of its rows made head-tail
    (the same degree), checked against the graph's token layout; a StrategyError says why
    it cannot be."""
    from ..graph.ops.attention import balanced
    from .layout import layout_blocks, token_layout
    out = dict(configs)
    for name, cfg in configs.items():
        op = graph.op(name)
        if balanced(op):
            if cfg.degree("l") < 2:
                raise StrategyError(f"{op.describe()}: its rows are not split along the sequence")
            degs = cfg.degrees
            out[name] = ParallelConfig({("z" if k == "l" else k): v for k, v in degs.items()}, cfg.devices,
                                       cfg.shard, cfg.recompute)
    blocks = layout_blocks(graph, out)
    try:
        token_layout(graph, blocks)
    except StrategyError as e:
        raise StrategyError(f"balanced context parallelism runs the graph in a head-tail token order, and {e} "
                            f"(cp_balance=False splits the sequence contiguously)") from None
    return out


def _with_shard(graph: OpGraph, members, cfg: ParallelConfig, shard: int) -> ParallelConfig:
    """``cfg`` at shard level ``shard`` where every op of the group has parameter replicas."""
    if shard and all(graph.op(m).params and has_param_replicas(graph.op(m), cfg) for m in members):
        return cfg.with_shard(shard)
    return cfg
