"""Convolution and pooling (1-D and 2-D).  Spatial (attribute) splits read
a halo of input rows/columns; a partition pads only where its window leaves
the tensor, so stitched partitions equal the whole op exactly."""
from __future__ import annotations

import math

import torch.nn.functional as F

from ..ir import Dim, Op
from .base import (
    Block,
    Rule,
    batch_dim,
    bind_template,
    call_template,
    out_region,
    region_shape,
    register,
)

SPATIAL_NAMES = {1: ("l",), 2: ("h", "w"), 3: ("d", "h", "w")}


def window_input_range(o0: int, o1: int, stride: int, pad: int, dil: int, k: int, size: int):
    """Input rows [a, b) that output rows [o0, o1) read, clipped to the tensor,
    and the padding (lo, hi) the partition must add on each side."""
    a = o0 * stride - pad
    b = (o1 - 1) * stride - pad + dil * (k - 1) + 1
    return max(a, 0), min(b, size), max(0, -a), max(0, b - size)


def _spatial_dims(op: Op, batch, channel_kind: str | None) -> list[Dim]:
    shape = op.output_shape
    nsp = len(shape) - 2
    dims = []
    if shape[0] > 1:
        dims.append(batch_dim(0, shape[0], batch))
    if channel_kind and shape[1] > 1:
        dims.append(Dim("c", channel_kind, 1, shape[1]))
    if op.attrs.get("spatial_split", True):
        for i, name in enumerate(SPATIAL_NAMES[nsp]):
            if shape[2 + i] > 1:
                dims.append(Dim(name, "attribute", 2 + i, shape[2 + i]))
    return dims


def _spatial_regions(op: Op, out):
    """Input slices along the spatial axes and the padding per axis."""
    in_shape = op.input_shapes[0]
    a = op.attrs
    sl, pads = [], []
    for i in range(len(in_shape) - 2):
        if out[2 + i].start == 0 and out[2 + i].stop == op.output_shape[2 + i]:
            # axis not split: the whole input with the op's own padding (the kernel pads,
            # no copy), even where the last input rows feed no window
            sl.append(slice(0, in_shape[2 + i]))
            pads.append((a["padding"][i], a["padding"][i]))
            continue
        lo, hi, plo, phi = window_input_range(out[2 + i].start, out[2 + i].stop, a["stride"][i],
                                              a["padding"][i], a["dilation"][i], a["kernel"][i],
                                              in_shape[2 + i])
        sl.append(slice(lo, hi))
        pads.append((plo, phi))
    return sl, pads


def _native(pads, attrs) -> bool:
    """Whether a partition's padding equals the op's own on every side."""
    return all(lo == p and hi == p for (lo, hi), p in zip(pads, attrs["padding"]))


def _pad(x, pads, value=0.0):
    flat = []
    for lo, hi in reversed(pads):
        flat += [lo, hi]
    if any(flat):
        return F.pad(x, flat, value=value)
    return x


@register("conv")
class Conv(Rule):
    """Conv1d / Conv2d: n sample, c (output channels) parameter, h/w or l attribute."""

    separable = True  # see Rule.separable

    def dims(self, op: Op, batch):
        kind = "parameter" if op.attrs["groups"] == 1 else None
        return _spatial_dims(op, batch, kind)

    def regions(self, op: Op, block: Block):
        out = out_region(op, block)
        sl, _ = _spatial_regions(op, out)
        cin = op.input_shapes[0][1]
        x = (out[0], slice(0, cin), *sl)
        w_shape = op.param_shapes["weight"]
        ps = {"weight": (out[1],) + tuple(slice(0, s) for s in w_shape[1:])}
        if "bias" in op.param_shapes:
            ps["bias"] = (out[1],)
        return [x], ps

    def bind(self, op, block):
        out = out_region(op, block)
        _, pads = _spatial_regions(op, out)
        a = op.attrs
        if not _native(pads, a):
            return super().bind(op, block)
        fn = F.conv1d if len(out) == 3 else F.conv2d
        stride, padding, dilation, groups = a["stride"], a["padding"], a["dilation"], a["groups"]
        return lambda inputs, params: fn(inputs[0], params["weight"], params.get("bias"), stride, padding,
                                         dilation, groups)

    def compute(self, op, block, inputs, params):
        out = out_region(op, block)
        _, pads = _spatial_regions(op, out)
        a = op.attrs
        fn = F.conv1d if len(out) == 3 else F.conv2d
        if _native(pads, a):  # the window pads exactly as the whole op: let the kernel pad
            return fn(inputs[0], params["weight"], params.get("bias"), a["stride"], a["padding"],
                      a["dilation"], a["groups"])
        x = _pad(inputs[0], pads)
        return fn(x, params["weight"], params.get("bias"), a["stride"], 0, a["dilation"], a["groups"])

    def flops(self, op, block):
        out = region_shape(out_region(op, block))
        w = op.param_shapes["weight"]
        return 2.0 * math.prod(out) * math.prod(w[1:])


@register("pool")
class Pool(Rule):
    """Max / average pooling (adaptive pooling with whole windows is
    rewritten to a plain pool at trace time).  Channels are an attribute dim."""

    separable = True  # see Rule.separable

    def dims(self, op: Op, batch):
        return _spatial_dims(op, batch, "attribute")

    def regions(self, op: Op, block: Block):
        out = out_region(op, block)
        sl, _ = _spatial_regions(op, out)
        return [(out[0], out[1], *sl)], {}

    def bind(self, op, block):
        a = op.attrs
        if a.get("native"):
            return bind_template(op) or super().bind(op, block)
        out = out_region(op, block)
        _, pads = _spatial_regions(op, out)
        if not _native(pads, a) or a.get("divisor_override"):
            return super().bind(op, block)
        nsp = len(out) - 2
        kernel, stride, padding = a["kernel"], a["stride"], a["padding"]
        if a["mode"] == "max":
            fn, dilation = (F.max_pool1d if nsp == 1 else F.max_pool2d), a["dilation"]
            return lambda inputs, params: fn(inputs[0], kernel, stride, padding, dilation)
        fn = F.avg_pool1d if nsp == 1 else F.avg_pool2d
        return lambda inputs, params: fn(inputs[0], kernel, stride, padding)

    def compute(self, op, block, inputs, params):
        a = op.attrs
        if a.get("native"):  # ceil_mode or count_include_pad=False: no spatial split
            return call_template(op, inputs, params)
        out = out_region(op, block)
        _, pads = _spatial_regions(op, out)
        nsp = len(out) - 2
        if _native(pads, a) and not a.get("divisor_override"):
            if a["mode"] == "max":
                fn = F.max_pool1d if nsp == 1 else F.max_pool2d
                return fn(inputs[0], a["kernel"], a["stride"], a["padding"], a["dilation"])
            fn = F.avg_pool1d if nsp == 1 else F.avg_pool2d
            return fn(inputs[0], a["kernel"], a["stride"], a["padding"])
        if a["mode"] == "max":
            x = _pad(inputs[0], pads, value=float("-inf"))
            fn = F.max_pool1d if nsp == 1 else F.max_pool2d
            return fn(x, a["kernel"], a["stride"], 0, a["dilation"])
        x = _pad(inputs[0], pads)
        fn = F.avg_pool1d if nsp == 1 else F.avg_pool2d
        if a.get("divisor_override") and nsp == 2:
            return fn(x, a["kernel"], a["stride"], 0, divisor_override=a["divisor_override"])
        return fn(x, a["kernel"], a["stride"], 0)

    def flops(self, op, block):
        out = region_shape(out_region(op, block))
        return float(math.prod(out) * math.prod(op.attrs["kernel"]))

    def backward_factor(self, op):
        return 1.0
