"""Registry of partition rules, one per op family, and the helpers they share.

A rule answers four questions about an op:

- ``dims(op)``: the dims it can split (with their SOAP kind),
- ``regions(op, block)``: for one partition (a block: dim -> [start, stop)),
  the region of each tensor input and of each parameter it needs,
- ``compute(op, block, inputs, params)``: that partition's output slice from
  those input and parameter regions,
- ``flops(op, block)``: forward FLOPs of the partition (analytic cost).

Everything else (simulator, memory estimate, executor) builds on these via
``flexflow.strategy.partitions``.
"""
from __future__ import annotations

import math

import torch
from torch.fx.node import map_aggregate

from ..ir import Dim, InputRef, Op, ParamRef

__all__ = ["Rule", "RULES", "register", "Block", "Region", "full_region", "out_region",
           "block_range", "call_template", "region_shape", "region_numel", "sample_dims", "batch_dim", "flatten"]

Block = dict  # dim name -> (start, stop)
Region = tuple  # tuple of slices, one per tensor axis

RULES: dict[str, "Rule"] = {}


def register(name: str):
    """Class decorator: register a rule under ``name``."""
    def deco(cls):
        rule = cls()
        rule.name = name
        RULES[name] = rule
        return cls
    return deco


def full_region(shape) -> Region:
    return tuple(slice(0, s) for s in shape)


def region_shape(region: Region) -> tuple[int, ...]:
    return tuple(max(0, s.stop - s.start) for s in region)


def region_numel(region: Region) -> int:
    return math.prod(region_shape(region))


def block_range(op: Op, block: Block, name: str) -> tuple[int, int]:
    """The [start, stop) of dim ``name`` in the block (whole dim when unsplit)."""
    if name in block:
        return block[name]
    return (0, op.dim(name).size)


def out_region(op: Op, block: Block) -> Region:
    """Output region of a partition: split axes sliced, others whole."""
    held = op.__dict__.get("_out_axes")
    if held is None or held[0] is not op.dims or held[1] is not op.output_shape:  # (once per op)
        held = op.__dict__["_out_axes"] = (op.dims, op.output_shape,
                                          tuple(slice(0, s) for s in op.output_shape),
                                          tuple((d.name, d.axis) for d in op.dims if d.axis is not None))
    if not block:
        return held[2]
    region = list(held[2])
    for name, axis in held[3]:
        r = block.get(name)
        if r is not None:
            region[axis] = slice(r[0], r[1])
    return tuple(region)


def reduced_axis(name: str) -> int:
    """The input axis of a dim with no output axis (a reduction dim), from its name:
    ``n``/``d0`` the batch axis, ``s`` axis 1, else the digits after its letter
    (``e2``, ``k3``, ``s2``)."""
    return 0 if name in ("n", "d0") else 1 if name == "s" else int(name[1:])


def batch_dim(axis: int | None, size: int, batch: int | None) -> Dim:
    """The dim along a tensor's batch position: the sample dim ``n`` when its
    size is the batch, else an attribute dim ``d0``."""
    if batch is not None and size == batch:
        return Dim("n", "sample", axis, size)
    return Dim("d0", "attribute", axis, size)


def sample_dims(shape, batch: int | None, names_by_rank=None) -> list[Dim]:
    """Generic dims of a tensor: axis 0 is the sample dim when it is the batch,
    every other axis an attribute dim.  Size-1 axes are not splittable."""
    rank = len(shape)
    default = {1: ["n"], 2: ["n", "c"], 3: ["n", "s", "c"], 4: ["n", "c", "h", "w"],
               5: ["n", "c", "d", "h", "w"]}
    names = (names_by_rank or default).get(rank) or ["n"] + [f"d{i}" for i in range(1, rank)]
    dims = []
    for axis, (name, size) in enumerate(zip(names, shape)):
        if size <= 1:
            continue
        dims.append(batch_dim(0, size, batch) if axis == 0 else Dim(name, "attribute", axis, size))
    return dims


def call_template(op: Op, inputs, params: dict, args=None, kwargs=None):
    """Call the op's original target with markers replaced by real tensors."""
    args = op.args if args is None else args
    kwargs = op.kwargs if kwargs is None else kwargs

    def fill(x):
        if isinstance(x, InputRef):
            return inputs[x.index]
        if isinstance(x, ParamRef):
            return params[x.name]
        return x
    a = map_aggregate(args, fill)
    k = map_aggregate(kwargs, fill)
    if op.call_kind == "call_method":
        return getattr(a[0], op.target)(*a[1:], **k)
    if op.call_kind == "call_module":
        from torch.func import functional_call
        mod = op.target
        own = {n: params[n] for n in op.params if n in params}
        own.update({n: params[n] for n in op.buffers if n in params})
        if own:
            return functional_call(mod, own, tuple(a), k)
        return mod(*a, **k)
    return op.target(*a, **k)


def bind_template(op: Op):
    """``call_template`` for ``op`` as a function of (inputs, params), with the markers'
    places found once: the executor calls it every step.  Its arguments must hold their
    markers at the top level (else None: call ``call_template``)."""
    def nested(v):
        found = []
        map_aggregate(v, lambda x: found.append(x) if isinstance(x, (InputRef, ParamRef)) else None)
        return bool(found)
    args, kwargs = tuple(op.args), dict(op.kwargs)
    if any(isinstance(v, (list, tuple, dict)) and nested(v) for v in (*args, *kwargs.values())):
        return None
    arefs = [(i, v) for i, v in enumerate(args) if isinstance(v, (InputRef, ParamRef))]
    krefs = [(n, v) for n, v in kwargs.items() if isinstance(v, (InputRef, ParamRef))]

    def fill(inputs, params):
        a = list(args)
        for i, v in arefs:
            a[i] = inputs[v.index] if isinstance(v, InputRef) else params[v.name]
        k = kwargs
        if krefs:
            k = dict(kwargs)
            for n, v in krefs:
                k[n] = inputs[v.index] if isinstance(v, InputRef) else params[v.name]
        return a, k
    if op.call_kind == "call_method":
        name = op.target

        def call(inputs, params):
            a, k = fill(inputs, params)
            return getattr(a[0], name)(*a[1:], **k)
        return call
    if op.call_kind == "call_module" and (op.params or op.buffers):
        return None  # functional_call swaps the module's own tensors: the general path
    target = op.target

    def call(inputs, params):
        a, k = fill(inputs, params)
        return target(*a, **k)
    return call


class Rule:
    """Base rule: an op that can only run whole on one device."""

    name = "base"
    # Whether ``regions`` is separable: in the regions it returns, every axis, and whether
    # an input is needed at all (None), depends on the range of at most one parallel dim
    # of the block.  Fast paths (``flexflow.strategy.boxes``) then assemble a config's
    # regions from one dim split at a time; declare it only where the code guarantees it
    # (a subclass that overrides ``regions`` must check it anew).
    separable = False

    def dims(self, op: Op, batch: int | None) -> list[Dim]:
        return []

    def regions(self, op: Op, block: Block):
        ins = [full_region(s) for s in op.input_shapes]
        ps = {n: full_region(op.param_views.get(n, op.param_shapes[n])) for n in op.param_shapes}
        ps.update({n: full_region(op.buffer_shapes[n]) for n in op.buffers})
        return ins, ps

    def compute(self, op: Op, block: Block, inputs: list, params: dict) -> torch.Tensor:
        return call_template(op, inputs, params)

    def bind(self, op: Op, block: Block):
        """``compute`` for one partition, as a function of (inputs, params) only:
        the executor calls it every step, so a rule may work out here, once,
        what ``compute`` would derive from ``op`` and ``block`` at every call."""
        compute = self.compute
        if type(self).compute is Rule.compute:  # the op's own call: its template, bound once
            fast = bind_template(op)
            if fast is not None:
                return fast
        return lambda inputs, params: compute(op, block, inputs, params)

    def flops(self, op: Op, block: Block) -> float:
        return float(math.prod(_block_shape(op, block)))

    def backward_factor(self, op: Op) -> float:
        """Backward FLOPs as a multiple of forward FLOPs."""
        return 2.0 if op.params else 1.0


def _block_shape(op: Op, block: Block) -> tuple[int, ...]:
    return region_shape(out_region(op, block))


RULES["base"] = Rule()


def leaves(x):
    """The leaves of nested tuples, lists and dicts (dict values), in order."""
    if isinstance(x, (tuple, list)):
        for y in x:
            yield from leaves(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from leaves(y)
    else:
        yield x


def flatten(x):
    """The leaves of a (nested) tuple or list, in order (a non-sequence is its own leaf)."""
    if isinstance(x, (tuple, list)):
        for y in x:
            yield from flatten(y)
    else:
        yield x
