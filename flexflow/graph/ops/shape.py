"""Structural ops: reshape/view/flatten, transpose/permute, indexing
(slices, select, narrow, chunk/split/unbind pieces, tuple items), concat /
stack, and unpacking of ops with several outputs of different shapes."""
from __future__ import annotations

import math

import torch

from ..ir import Op
from .base import (
    Block,
    Rule,
    call_template,
    out_region,
    region_shape,
    register,
    sample_dims,
)


def reshape_axis_map(in_shape, out_shape) -> list[int | None]:
    """For each output axis, the input axis it equals one-to-one (a common
    prefix or suffix of the two shapes), else None."""
    amap: list[int | None] = [None] * len(out_shape)
    k = 0
    while k < min(len(in_shape), len(out_shape)) and in_shape[k] == out_shape[k]:
        amap[k] = k
        k += 1
    if k == len(in_shape) == len(out_shape):
        return amap
    m = 1
    while (m <= min(len(in_shape), len(out_shape)) - k
           and in_shape[-m] == out_shape[-m]):
        amap[len(out_shape) - m] = len(in_shape) - m
        m += 1
    return amap


class _Mapped(Rule):
    """An op whose output axes map one-to-one to input axes (attrs['axis_map'])
    with an offset (attrs['offsets']); unmapped input axes are read whole,
    or at a fixed position for selected axes (attrs['fixed'])."""

    separable = True  # see Rule.separable

    def dims(self, op: Op, batch):
        amap = op.attrs["axis_map"]
        return [d for d in sample_dims(op.output_shape, batch) if amap[d.axis] is not None]

    def regions(self, op: Op, block: Block):
        out = out_region(op, block)
        in_shape = op.input_shapes[0]
        region = [slice(0, s) for s in in_shape]
        for ia, (a, b) in op.attrs.get("fixed", {}).items():
            region[ia] = slice(a, b)
        offsets = op.attrs.get("offsets", {})
        for oa, ia in enumerate(op.attrs["axis_map"]):
            if ia is not None:
                off = offsets.get(oa, 0)
                region[ia] = slice(out[oa].start + off, out[oa].stop + off)
        return [tuple(region)], {}

    def flops(self, op, block):
        return 0.0

    def backward_factor(self, op):
        return 1.0


@register("reshape")
class Reshape(_Mapped):
    def compute(self, op, block, inputs, params):
        return self.bind(op, block)(inputs, params)

    def bind(self, op, block):
        shape = region_shape(out_region(op, block))
        return lambda inputs, params: inputs[0].reshape(shape)


@register("transpose")
class Transpose(_Mapped):
    def compute(self, op, block, inputs, params):
        return inputs[0].permute(*op.attrs["perm"])


@register("index")
class Index(_Mapped):
    """Basic indexing.  attrs['fixed'] holds selected input axes as [i, i+1)
    (removed from the output) and read-whole axes; 'new_axes' output axes of size 1."""

    def compute(self, op, block, inputs, params):
        return self.bind(op, block)(inputs, params)

    def bind(self, op, block, within=None):
        """``within``: the region of the held input the partition's block is
        (relative slices); the index then applies to the held tensor in one go,
        as the module's own ``x[:, t]`` does, not as a slice and then an index."""
        # the partition's input block has the input's rank: the index is fixed
        idx = []
        amap = op.attrs["axis_map"]
        mapped = {ia for ia in amap if ia is not None}
        sliced = op.attrs.get("sliced", {})
        for ia in range(len(op.input_shapes[0])):
            if ia in mapped:
                idx.append(slice(None))
            elif ia in sliced:  # an unsplit axis read partially
                a, b = sliced[ia]
                idx.append(slice(a, b))
            else:
                idx.append(0)
        if within is not None:
            idx = [_within(r, i) for r, i in zip(within, idx)]
        idx, new_axes = tuple(idx), tuple(op.attrs.get("new_axes", ()))
        if not new_axes:
            return lambda inputs, params: inputs[0][idx]

        def index(inputs, params):
            y = inputs[0][idx]
            for oa in new_axes:
                y = y.unsqueeze(oa)
            return y
        return index


def _within(r: slice, i):
    """Index ``i`` (an int or a slice) of the part ``r`` of an axis, as an index of the axis."""
    if r.step not in (None, 1):
        raise ValueError(f"a region with step {r.step}")
    start = r.start or 0
    if isinstance(i, int):
        return start + i
    a = start if i.start is None else start + i.start
    b = r.stop if i.stop is None else start + i.stop
    return slice(a, b)


@register("concat")
class Concat(Rule):
    """torch.cat / torch.stack: every output axis splits, the concat axis
    too; a partition reads only the inputs its block overlaps."""

    separable = True  # see Rule.separable

    def dims(self, op: Op, batch):
        return sample_dims(op.output_shape, batch)

    def regions(self, op: Op, block: Block):
        out = out_region(op, block)
        axis, stack = op.attrs["axis"], op.attrs["stack"]
        ins = []
        for off, length in op.attrs["spans"]:
            a = max(out[axis].start, off)
            b = min(out[axis].stop, off + length)
            if a >= b:
                ins.append(None)
                continue
            if stack:
                ins.append(out[:axis] + out[axis + 1:])
            else:
                ins.append(out[:axis] + (slice(a - off, b - off),) + out[axis + 1:])
        return ins, {}

    def compute(self, op, block, inputs, params):
        axis = op.attrs["axis"]
        pieces = [x for x in inputs if x is not None]
        return torch.stack(pieces, axis) if op.attrs["stack"] else torch.cat(pieces, axis)

    def flops(self, op, block):
        return 0.0

    def backward_factor(self, op):
        return 1.0


@register("unpack")
class Unpack(Rule):
    """One output of an op with several outputs of different shapes, whose
    outputs travel packed as one flat tensor.  Runs whole."""

    def compute(self, op, block, inputs, params):
        off = op.attrs["offset"]
        n = math.prod(op.output_shape)
        return inputs[0][off:off + n].view(op.output_shape)

    def flops(self, op, block):
        return 0.0


@register("pad")
class Pad(_Mapped):
    """Constant padding (F.pad): padded axes stay whole, the others split."""

    def compute(self, op, block, inputs, params):
        return call_template(op, inputs, params)
