"""The head-tail token layout of balanced context parallelism.

A causal attention split along its query rows in contiguous blocks loads the last block
most (it reads every key).  Balanced context parallelism (Llama 3's) lays the sequence
out head-tail instead: cut into 2c chunks, block i of c holds chunks i and 2c - 1 - i,
so every block computes the same share of the causal triangle.  In the SOAP space that
is a split of the attention's rows (dim ``z``, :mod:`flexflow.graph.ops.attention`)
over a graph whose tokens run in the head-tail order: every op other than the causal
attention treats the tokens one by one (a norm, a projection, a residual add, the
loss's mean), so it computes the same in any token order, and a contiguous block of the
reordered sequence is the chunk pair.

This module checks that a graph is such a graph and says what the executor reorders:
the graph inputs that carry the tokens (token ids, targets), the position tables made of
constants (rotary tables, position ids) where the tokens meet them, and the graph
outputs that carry the tokens (put back in sequence order).  An op that mixes the
tokens (a shift of the logits, a cumulative sum, an explicit mask) makes the layout
unusable: :func:`token_layout` raises a :class:`StrategyError` naming it.

A token coordinate is held as ``(stride, length)``: in a tensor's row-major element
index f, the token is ``(f // stride) % length`` (a view that merges the batch and the
tokens keeps it).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..graph.ir import Op, OpGraph
from ..graph.ops.attention import balanced, head_tail_order, sequence_order
from .config import ParallelConfig, StrategyError

__all__ = ["TokenLayout", "Reordering", "layout_blocks", "token_layout", "reorder"]

_INVARIANT_REDUCE = ("sum", "mean", "amax", "amin", "max", "min")


@dataclass(frozen=True)
class TokenLayout:
    """What a head-tail layout of ``blocks`` blocks reorders: ``values`` (op name -> token
    coordinate) are graph inputs and constant tables reordered where they are made;
    ``outputs`` the graph outputs put back in sequence order."""
    blocks: int
    length: int
    values: dict
    outputs: dict

    @property
    def order(self) -> list[int]:
        """The sequence position of each position of the layout."""
        return head_tail_order(self.length, self.blocks)


def layout_blocks(graph: OpGraph, configs) -> int:
    """The number of head-tail blocks of a strategy's token layout (1: the sequence order),
    or a StrategyError when its causal attentions disagree: every one must split its rows
    head-tail the same number of ways, or none."""
    found: dict[int, str] = {}
    ops = graph.__dict__.get("_causal_attentions")
    if ops is None:  # (once per graph: the search asks at every move of an attention)
        ops = graph.__dict__["_causal_attentions"] = [op for op in graph.compute_ops if balanced(op)]
    for op in ops:
        found.setdefault(configs[op.name].degree("z"), op.name)
    if len(found) > 1:
        desc = ", ".join(f"{graph.op(n).describe()}: {k}" for k, n in found.items())
        raise StrategyError(f"the causal attentions split their rows head-tail different ways ({desc}); the "
                            f"layout is one token order for the whole graph: give every one the same z degree")
    return next(iter(found), 1)


def _axis(shape, coord) -> int | None:
    """The axis that holds the token coordinate whole, or None."""
    stride, length = coord
    inner = 1  # the element stride of the axis
    for ax in range(len(shape) - 1, -1, -1):
        span = inner * shape[ax]
        if stride % inner == 0 and span % (stride * length) == 0:
            return ax
        inner = span
    return None


def _coord_on(shape, ax: int, inner: int, length: int) -> tuple[int, int] | None:
    """The coordinate of a token carried on axis ``ax`` with ``inner`` elements of the axis a
    token (a merged axis), or None when the axis cannot hold it."""
    size = shape[ax]
    if size % (inner * length):
        return None
    return (inner * math.prod(shape[ax + 1:]), length)


def _split_axes(op: Op, dim: str):
    """(output range, [input ranges]) of the two halves of ``dim``: per partition, the
    output region and the input regions (None: not read)."""
    from .regions import partitions
    try:
        return [(p.output, p.inputs) for p in partitions(op, ParallelConfig({dim: 2}, (0, 1)))]
    except StrategyError:
        return None


def _split_alike(op: Op, halves, axis: int, inner: int, length: int):
    """(input index, the token coordinate it holds or None) of each input the two ``halves``
    (:func:`_split_axes`) slice: None where its slices are not the output's along ``axis``
    or its axis cannot hold the tokens."""
    (o0, in0), (o1, in1) = halves
    for j, (r0, r1) in enumerate(zip(in0, in1)):
        if r0 is None or r1 is None or r0 == r1:
            continue
        ja = next(a for a, (x, y) in enumerate(zip(r0, r1)) if x != y)
        c = _coord_on(op.input_shapes[j], ja, inner, length)
        yield j, (c if (r0[ja], r1[ja]) == (o0[axis], o1[axis]) else None)


def _follow(op: Op, tagged: dict[int, tuple]) -> tuple[tuple | None, dict[int, tuple]]:
    """(output coordinate or None, {untagged input index: coordinate it must take}) of
    ``op`` given its tagged inputs (index -> coordinate); raises StrategyError when the op
    mixes the tokens."""
    shapes = op.input_shapes
    axes = {i: _axis(shapes[i], c) for i, c in tagged.items()}
    if any(a is None for a in axes.values()):
        raise StrategyError(f"{op.describe()}: its input's tokens are spread over several axes")
    if op.rule == "reshape":
        c = tagged[0]
        if _axis(op.output_shape, c) is None:
            raise StrategyError(f"{op.describe()}: the reshape spreads the tokens over several axes")
        return c, {}
    if op.rule == "attention":
        q = op.attrs["query"]
        if op.attrs.get("mask") is not None and op.attrs["mask"] in tagged:
            raise StrategyError(f"{op.describe()}: an explicit attention mask over the tokens")
        others = [i for i in tagged if i != q]
        if q not in tagged or len(others) != len(op.inputs) - 1 - (op.attrs.get("mask") is not None):
            raise StrategyError(f"{op.describe()}: its queries, keys and values must all run in the token layout")
        if any(axes[i] != 2 for i in tagged):
            raise StrategyError(f"{op.describe()}: the tokens must be the sequence axis of its queries and keys")
        return tagged[q], {}
    out_coord, need = None, {}
    for d in op.dims:
        halves = _split_axes(op, d.name)
        if halves is None:
            continue
        (o0, in0), (o1, in1) = halves
        hit = [i for i in tagged if in0[i] is not None and in1[i] is not None and in0[i][axes[i]] != in1[i][axes[i]]]
        if not hit:
            continue
        if d.axis is None:
            continue  # a reduction dim: the invariant reductions below
        if any(in0[i][axes[i]] != o0[d.axis] or in1[i][axes[i]] != o1[d.axis] for i in hit):
            raise StrategyError(f"{op.describe()}: it moves the tokens along the sequence (a shift or a slice)")
        i = hit[0]
        inner = tagged[i][0] // math.prod(shapes[i][axes[i] + 1:])
        out_coord = _coord_on(op.output_shape, d.axis, inner, tagged[i][1])
        if out_coord is None:
            raise StrategyError(f"{op.describe()}: it changes the sequence's length (a shift or a slice)")
        if any(i not in hit for i in tagged):
            raise StrategyError(f"{op.describe()}: its inputs' tokens do not line up with its output's")
        for j, c in _split_alike(op, halves, d.axis, inner, tagged[i][1]):  # not tagged: tables
            if j in tagged:
                continue
            if c is None:
                raise StrategyError(f"{op.describe()}: input {j} is split with the tokens but is no position table")
            need[j] = c
        return out_coord, need
    if (op.rule == "reduce" and op.kind in _INVARIANT_REDUCE and all(a in op.attrs.get("reduced", ()) for a in axes.values())) \
            or (op.rule in ("loss", "pointwise_loss") and math.prod(op.output_shape) == 1):
        return None, {}  # a sum, mean or maximum over the tokens: the same in any order
    raise StrategyError(f"{op.describe()}: it mixes the tokens (nothing splits them alike in its output)")


def token_layout(graph: OpGraph, blocks: int) -> TokenLayout:
    """The reorderings of the head-tail layout of ``blocks`` blocks (cached on the graph);
    a StrategyError names the first op that cannot run in it."""
    cache = graph.__dict__.setdefault("_token_layouts", {})
    if blocks in cache:
        hit = cache[blocks]
        if isinstance(hit, StrategyError):
            raise hit
        return hit
    try:
        cache[blocks] = _analyse(graph, blocks)
    except StrategyError as e:
        cache[blocks] = e
        raise
    return cache[blocks]


def _analyse(graph: OpGraph, blocks: int) -> TokenLayout:
    lengths = {op.output_shape[2] for op in graph.compute_ops if balanced(op)}
    if len(lengths) != 1:
        raise StrategyError(f"a head-tail token layout needs causal attentions over one sequence length, "
                            f"found {sorted(lengths) or 'none'}")
    L = lengths.pop()
    if L % (2 * blocks):
        raise StrategyError(f"a head-tail layout of {blocks} blocks needs the sequence length ({L}) divisible "
                            f"by {2 * blocks}")
    sources: dict[str, tuple] = {}
    for op in graph.ops:
        s = op.output_shape
        if op.kind == "input" and len(s) in (2, 3) and graph.batch_size and s[0] == graph.batch_size and s[1] == L:
            sources[op.name] = (math.prod(s[2:]), L)
    for _ in range(8):
        tags, found = dict(sources), {}
        for op in graph.ops:
            if op.name in sources or not op.inputs:
                continue
            tagged = {i: tags[u] for i, u in enumerate(op.inputs) if u in tags}
            if not tagged:
                continue
            coord, need = _follow(op, tagged)
            if coord is not None:
                tags[op.name] = coord
            for j, c in need.items():
                found[op.inputs[j]] = c
        new = {}
        for name, c in found.items():  # a table's order is set where it is made
            new.update(_table_source(graph, name, c))
        if all(sources.get(k) == c for k, c in new.items()):
            _check_tables(graph, sources)
            outputs = {n: tags[n] for n in graph.output_names() if n in tags}
            return TokenLayout(blocks, L, sources, outputs)
        for k, c in new.items():
            if k in sources and sources[k] != c:
                raise StrategyError(f"{graph.op(k).describe()}: read as a position table two ways")
            sources[k] = c
    raise StrategyError("the position tables of the token layout did not settle")


def _check_tables(graph: OpGraph, sources: dict) -> None:
    """Refuse a position table made from another one the layout reorders (the second would
    be reordered twice)."""
    for name in sources:
        op = graph.op(name)
        if op.kind == "input":
            continue
        todo, seen = list(op.inputs), set()
        while todo:
            u = todo.pop()
            if u in seen:
                continue
            seen.add(u)
            if u in sources and graph.op(u).kind != "input":
                raise StrategyError(f"{op.describe()}: a position table made from another the tokens meet "
                                    f"({graph.op(u).describe()})")
            if graph.op(u).everywhere:
                todo.extend(graph.op(u).inputs)


def _table_source(graph: OpGraph, name: str, coord) -> dict:
    """Where a position table the tokens meet gets its order: the op itself when it is made
    on every device from constants, else (a module over position ids) its input."""
    op = graph.op(name)
    if op.everywhere:
        return {name: coord}
    ax = _axis(op.output_shape, coord)
    for d in op.dims:
        if d.axis != ax:
            continue
        halves = _split_axes(op, d.name)
        if halves is None:
            continue
        inner = coord[0] // math.prod(op.output_shape[ax + 1:])
        for j, c in _split_alike(op, halves, ax, inner, coord[1]):
            if c is not None:
                return _table_source(graph, op.inputs[j], c)
    raise StrategyError(f"{op.describe()}: a position table that is not made from constants")


def reorder(x, coord, order):
    """``x`` with its token coordinate taken in ``order`` (a LongTensor of positions)."""
    stride, length = coord
    shape = x.shape
    return x.reshape(-1, length, stride).index_select(1, order.to(x.device)).reshape(shape)


class Reordering:
    """A strategy's token layout as the values reordered on the way in and out (None when
    the strategy keeps the sequence order)."""

    def __init__(self, layout: TokenLayout):
        import torch
        self.layout = layout
        self.order = torch.tensor(layout.order, dtype=torch.long)
        self.inverse = sequence_order(layout.length, layout.blocks)

    @classmethod
    def of(cls, graph: OpGraph, configs) -> "Reordering | None":
        blocks = layout_blocks(graph, configs)
        return cls(token_layout(graph, blocks)) if blocks > 1 else None

    def value(self, name: str, x):
        """``x`` (the value of op ``name``) in the layout's token order where it is reordered."""
        coord = self.layout.values.get(name)
        return x if coord is None or x is None else reorder(x, coord, self.order)

    def output(self, name: str, x):
        """Graph output ``name`` back in sequence order."""
        coord = self.layout.outputs.get(name)
        return x if coord is None or x is None else reorder(x, coord, self.inverse)
