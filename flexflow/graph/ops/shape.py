"""Structural ops: reshape/view/flatten, transpose/permute, indexing
(slices, select, narrow, chunk/split/unbind pieces, tuple items), concat /
stack, and unpacking of ops with several outputs of different shapes."""
from __future__ import annotations

import math

import torch

from ..ir import Dim, Op
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


def reshape_groups(in_shape, out_shape) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The axes of a reshape in groups of equal product, in order: each group a run of
    input axes and the run of output axes holding the same elements ((B, T, C) ->
    (B*T, C): ((0, 1), (0,)) and ((2,), (1,))).  Size-1 axes join the group before them
    (the first group when they lead).  [] when the shapes do not hold as many elements."""
    if math.prod(in_shape) != math.prod(out_shape):
        return []
    groups, i, j = [], 0, 0
    ni, no = len(in_shape), len(out_shape)
    while i < ni or j < no:
        gi, go = [], []
        pi = po = 1
        while True:
            if pi == po and gi and go and pi > 1:
                break
            if (pi <= po or j >= no) and i < ni:
                pi *= in_shape[i]
                gi.append(i)
                i += 1
            elif j < no:
                po *= out_shape[j]
                go.append(j)
                j += 1
            else:
                break
        while i < ni and in_shape[i] == 1:  # trailing size-1 axes join this group
            gi.append(i)
            i += 1
        while j < no and out_shape[j] == 1:
            go.append(j)
            j += 1
        if groups and (pi == 1 or po == 1):  # a run of size-1 axes alone: the group before it
            groups[-1] = (groups[-1][0] + tuple(gi), groups[-1][1] + tuple(go))
        else:
            groups.append((tuple(gi), tuple(go)))
    return groups


def merge_splits(in_shape, out_shape) -> dict[int, tuple[int, int, int, int]]:
    """The leading output axis of each reshape group that merges or splits axes, as
    output axis -> (input axis, unit, output elements per index, input elements per index):
    the output axis's blocks in multiples of ``unit`` read the leading input axis's rows
    ``[a * out_per // in_per, b * out_per // in_per)`` and the group's other axes whole.
    (B, T, C) -> (B*T, C): {0: (0, T, 1, T)}: rows of whole samples; (B*T, C) -> (B, T, C):
    {0: (0, 1, T, 1)}; (B, C) -> (G, B/G, C): {0: (0, 1, B/G, 1)}."""
    out = {}
    for gi, go in reshape_groups(in_shape, out_shape):
        lead_i = next((a for a in gi if in_shape[a] > 1), None)
        lead_o = next((a for a in go if out_shape[a] > 1), None)
        if lead_i is None or lead_o is None:
            continue
        in_per = math.prod(in_shape[a] for a in gi if a > lead_i)
        out_per = math.prod(out_shape[a] for a in go if a > lead_o)
        if in_per == 1 and out_per == 1:
            continue  # one axis to one: the axis map has it
        unit = in_per // math.gcd(in_per, out_per)
        if out_shape[lead_o] % unit or out_shape[lead_o] // unit < 2:
            continue
        out[lead_o] = (lead_i, unit, out_per, in_per)
    return out


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
    """A reshape: axes it keeps map one to one; an axis that merges a run of input axes
    ((B, T) -> B*T) or splits one ((B*T) -> (B, T), (B) -> (G, B/G)) splits too, along
    its leading input axis (see :func:`merge_splits`)."""

    def _merges(self, op):
        held = op.__dict__.get("_merges")
        if held is None or held[0] is not op.output_shape:
            held = op.__dict__["_merges"] = (op.output_shape, merge_splits(tuple(op.input_shapes[0]),
                                                                           tuple(op.output_shape)))
        return held[1]

    def dims(self, op: Op, batch):
        amap, merges = op.attrs["axis_map"], self._merges(op)
        dims = []
        for d in sample_dims(op.output_shape, batch):
            if amap[d.axis] is not None:
                dims.append(d)
            elif d.axis in merges:
                dims.append(Dim(d.name, d.kind, d.axis, d.size, merges[d.axis][1]))
        return dims

    def regions(self, op: Op, block: Block):
        (region,), ps = super().regions(op, block)
        merges = self._merges(op)
        if merges:
            out = out_region(op, block)
            region = list(region)
            for oa, (ia, unit, out_per, in_per) in merges.items():
                a, b = out[oa].start, out[oa].stop
                if (a, b) != (0, op.output_shape[oa]):
                    region[ia] = slice(a * out_per // in_per, b * out_per // in_per)
            region = tuple(region)
        return [region], ps

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
    outputs travel packed as one flat tensor: runs whole.  Packed by sample
    (attrs['sample_axis']: the producer holds a (B, per sample) tensor, each
    output's samples flattened at columns [offset, offset + per sample)), it
    splits along the batch: rows of the packed tensor, its own columns."""

    separable = True  # see Rule.separable

    def dims(self, op: Op, batch):
        ax = op.attrs.get("sample_axis")
        if ax is None or op.output_shape[ax] < 2:
            return []
        return [Dim("n", "sample", ax, op.output_shape[ax])]

    def regions(self, op: Op, block: Block):
        ax = op.attrs.get("sample_axis")
        if ax is None:
            return super().regions(op, block)
        a, b = block.get("n", (0, op.output_shape[ax]))
        off = op.attrs["offset"]
        return [(slice(a, b), slice(off, off + op.attrs["per_sample"]))], {}

    def compute(self, op, block, inputs, params):
        ax = op.attrs.get("sample_axis")
        if ax is not None:  # this block's rows, this output's columns
            x = inputs[0]
            rest = tuple(s for i, s in enumerate(op.output_shape) if i != ax)
            return x.reshape((x.shape[0],) + rest).movedim(0, ax)
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
