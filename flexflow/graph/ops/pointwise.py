"""Element-wise ops (unary, binary with broadcasting) and row-wise ops
(softmax, layer norm, reductions) that keep some axes whole."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..ir import Dim, Op
from .base import (
    Block,
    Rule,
    batch_dim,
    bind_template,
    call_template,
    out_region,
    reduced_axis,
    region_shape,
    register,
    sample_dims,
)

__all__ = ["broadcast_region"]


def broadcast_region(out, out_shape, in_shape):
    """Region of an input broadcast to ``out_shape`` that an output region reads."""
    r, R = len(in_shape), len(out_shape)
    region = []
    for i in range(r):
        oi = R - r + i
        if in_shape[i] == 1 and out_shape[oi] != 1:
            region.append(slice(0, 1))
        else:
            region.append(out[oi])
    return tuple(region)


@register("pointwise")
class Pointwise(Rule):
    """Every output axis splits; each input reads the same region, broadcast."""

    separable = True  # see Rule.separable

    def dims(self, op: Op, batch):
        return sample_dims(op.output_shape, batch)

    def regions(self, op: Op, block: Block):
        out = out_region(op, block)
        ps = {n: broadcast_region(out, op.output_shape, s) for n, s in op.param_shapes.items()}
        return [broadcast_region(out, op.output_shape, s) for s in op.input_shapes], ps

    def bind(self, op, block):
        if op.attrs.get("expand"):
            shape = region_shape(out_region(op, block))
            return lambda inputs, params: inputs[0].expand(shape)
        return bind_template(op) or super().bind(op, block)

    def compute(self, op, block, inputs, params):
        if op.attrs.get("expand"):  # the literal sizes are the whole output's
            return inputs[0].expand(region_shape(out_region(op, block)))
        return call_template(op, inputs, params)

    def backward_factor(self, op):
        return 1.0


@register("rowwise")
class Rowwise(Rule):
    """Softmax, log-softmax, layer norm: the axes in ``attrs['whole_axes']``
    stay whole; others split as for element-wise ops.  Parameters whole."""

    separable = True  # see Rule.separable

    def dims(self, op: Op, batch):
        whole = set(op.attrs.get("whole_axes", ()))
        return [d for d in sample_dims(op.output_shape, batch) if d.axis not in whole]

    def regions(self, op: Op, block: Block):
        out = out_region(op, block)
        ins = [broadcast_region(out, op.output_shape, s) for s in op.input_shapes]
        ps = {n: tuple(slice(0, s) for s in shp) for n, shp in op.param_shapes.items()}
        return ins, ps

    def bind(self, op, block):
        if op.kind == "layer_norm" and op.call_kind == "call_module":
            return super().bind(op, block)
        return bind_template(op) or super().bind(op, block)

    def compute(self, op, block, inputs, params):
        if op.kind == "layer_norm" and op.call_kind == "call_module":
            mod = op.target  # direct call: no functional_call indirection
            return F.layer_norm(inputs[0], tuple(mod.normalized_shape), params.get("weight"),
                                params.get("bias"), mod.eps)
        return call_template(op, inputs, params)

    def flops(self, op, block):
        return 5.0 * math.prod(s.stop - s.start for s in out_region(op, block))


@register("reduce")
class Reduce(Rule):
    """sum / mean / amax over some axes: ``attrs['axis_map']`` gives, for each
    output axis, the input axis it indexes (None for a kept size-1 axis).
    The kept axes split as the output's; a sum or mean (``attrs['reduced']``
    set) also splits along the axes it reduces, the batch axis being the sample
    dim: those partitions hold partial sums (a mean's divided by the whole
    count), which add up to the result -- ``((y - t) ** 2).mean()`` is then
    computed where its samples are."""

    separable = True  # see Rule.separable

    def dims(self, op: Op, batch):
        amap = op.attrs["axis_map"]
        dims = [d for d in sample_dims(op.output_shape, batch) if amap[d.axis] is not None]
        taken = {d.name for d in dims}
        for ia in op.attrs.get("reduced", ()):
            size = op.input_shapes[0][ia]
            if size <= 1:
                continue
            d = batch_dim(None, size, batch) if ia == 0 else None
            if d is None or d.name in taken:
                d = Dim(f"k{ia}", "attribute", None, size)  # ("r" is the replicas' dim)
            dims.append(d)
        return dims

    @staticmethod
    def _reduced_ranges(op: Op, block: Block) -> dict:
        """input axis -> [start, stop) of this block along the reduced axes it splits."""
        out = {}
        for d in op.dims:
            if d.axis is None and d.name in block:
                out[reduced_axis(d.name)] = block[d.name]
        return out

    def regions(self, op: Op, block: Block):
        out = out_region(op, block)
        shape = op.input_shapes[0]
        region = [slice(0, s) for s in shape]
        for oa, ia in enumerate(op.attrs["axis_map"]):
            if ia is not None:
                region[ia] = out[oa]
        for ia, (a, b) in self._reduced_ranges(op, block).items():
            region[ia] = slice(a, b)
        ins = [tuple(region)] + [tuple(slice(0, s) for s in sh) for sh in op.input_shapes[1:]]
        return ins, {}

    def _partial(self, op, block):
        """The partition's function when it splits a reduced axis (a partial sum), else None."""
        split = self._reduced_ranges(op, block)
        if not any(b - a < op.input_shapes[0][ia] for ia, (a, b) in split.items()):
            return None  # the reduced axes whole: as the module computes it
        axes = tuple(op.attrs["reduced"])
        keep = bool(op.attrs.get("keepdim"))
        if op.kind == "mean":
            count = math.prod(op.input_shapes[0][ia] for ia in axes)
            return lambda inputs, params: torch.sum(inputs[0], dim=axes, keepdim=keep) / count
        return lambda inputs, params: torch.sum(inputs[0], dim=axes, keepdim=keep)

    def compute(self, op, block, inputs, params):
        fn = self._partial(op, block)
        return fn(inputs, params) if fn is not None else call_template(op, inputs, params)

    def bind(self, op, block):
        return self._partial(op, block) or bind_template(op) or super().bind(op, block)

    def flops(self, op, block):
        return float(math.prod(op.input_shapes[0]))

    def backward_factor(self, op):
        return 1.0
