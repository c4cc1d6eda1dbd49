"""Losses (cross-entropy, NLL; element-wise losses such as MSE) and opaque ops.

A loss with reduction 'mean' or 'sum' returns a scalar: its sample dim is a
reduction dim, each partition computes a partial sum (already divided by
the global count for 'mean') and the partials add up to the loss."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..ir import Dim, Op
from .base import (
    Block,
    Rule,
    batch_dim,
    block_range,
    call_template,
    flatten,
    leaves,
    reduced_axis,
    register,
)
from .fused_ce import fused_cross_entropy


def _class_last(fn):
    """``fn`` (cross-entropy or NLL) of an input with the class dim in place 1 and more dims
    after it (``logits.transpose(1, 2)``, (B, C, T)), computed over rows with the class dim
    last: the same values (the same reduction over the same targets), but torch's softmax
    over a dim that is not the last is several times slower, on GPUs and CPUs alike (a
    (4, 128256, 2048) bfloat16 input: 212 of a 400-ms LLaMA-1B step on an H200,
    benchmarks/results/gpu_breakdown-H200.md)."""
    def rows(x, t, reduction, ignore_index):
        if x.dim() < 3:
            return fn(x, t, reduction=reduction, ignore_index=ignore_index)
        out = fn(x.movedim(1, -1).reshape(-1, x.shape[1]), t.reshape(-1), reduction=reduction,
                 ignore_index=ignore_index)
        return out.reshape(t.shape) if reduction == "none" else out
    return rows


def _fused(x, t, reduction, ignore_index):
    """flexflow.fused_cross_entropy (rows, classes) as the rule calls a loss."""
    return fused_cross_entropy(x, t, ignore_index=ignore_index, reduction=reduction)


@register("loss")
class Loss(Rule):
    separable = True  # see Rule.separable

    def dims(self, op: Op, batch):
        if not op.attrs.get("splittable", True):
            return []
        tshape = op.input_shapes[1]
        reduced = op.attrs["reduction"] != "none"
        dims = []
        for axis, size in enumerate(tshape):
            if size <= 1:
                continue
            out_axis = None if reduced else axis
            if axis == 0:
                dims.append(batch_dim(out_axis, size, batch))
            else:
                dims.append(Dim("s" if axis == 1 else f"s{axis}", "attribute", out_axis, size))
        return dims

    def _target_region(self, op, block):
        tshape = op.input_shapes[1]
        by_axis = {}
        for d in op.dims:
            by_axis[d.axis if d.axis is not None else reduced_axis(d.name)] = block_range(op, block, d.name)
        return tuple(slice(*by_axis.get(a, (0, s))) for a, s in enumerate(tshape))

    def regions(self, op: Op, block: Block):
        t = self._target_region(op, block)
        x = (t[0], slice(0, op.input_shapes[0][1])) + t[1:]
        # a 'mean' divides by the number of targets that are not ignore_index:
        # every partition reads the whole target to count them
        whole_t = tuple(slice(0, s) for s in op.input_shapes[1])
        ins = [x, whole_t if op.attrs["reduction"] == "mean" else t] + [tuple(slice(0, s) for s in shp) for shp in op.input_shapes[2:]]
        return ins, {}

    def compute(self, op, block, inputs, params):
        return self.bind(op, block)(inputs, params)

    def bind(self, op, block):
        red = op.attrs["reduction"]
        fn = _fused if op.attrs["fn"] == "fused" else _class_last(F.nll_loss if op.attrs["fn"] == "nll" else F.cross_entropy)
        ignore = op.attrs.get("ignore_index", -100)
        t_region = self._target_region(op, block)
        whole = all(s.start == 0 and s.stop == n for s, n in zip(t_region, op.input_shapes[1]))
        if red == "none" or (red == "mean" and whole):  # the whole mean: as the module computes it
            return lambda inputs, params: fn(inputs[0], inputs[1], reduction=red, ignore_index=ignore)
        if red == "sum":
            return lambda inputs, params: fn(inputs[0], inputs[1], reduction="sum", ignore_index=ignore)

        def partial_mean(inputs, params):
            # this block's share of the mean: its sum over the count of the whole target
            total = fn(inputs[0], inputs[1][t_region], reduction="sum", ignore_index=ignore)
            return total / (inputs[1] != ignore).sum()
        return partial_mean

    def flops(self, op, block):
        t = self._target_region(op, block)
        return 4.0 * math.prod(s.stop - s.start for s in t) * op.input_shapes[0][1]

    def backward_factor(self, op):
        return 1.0


# element-wise losses of (input, target) of one shape, as their functionals take them:
# name -> (position of ``reduction``, {argument that must be None: position},
#          {keyword the rule passes on: (position, default)})
_OLD = {"size_average": 2, "reduce": 3}  # the deprecated pair, after (input, target)
POINTWISE_LOSSES = {
    "mse_loss": (4, {**_OLD, "weight": 5}, {}),
    "l1_loss": (4, {**_OLD, "weight": 5}, {}),
    "smooth_l1_loss": (4, _OLD, {"beta": (5, 1.0)}),
    "huber_loss": (2, {"weight": 4}, {"delta": (3, 1.0)}),
    "soft_margin_loss": (4, _OLD, {}),
    "kl_div": (4, _OLD, {"log_target": (5, False)}),
    "binary_cross_entropy": (5, {"weight": 2, "size_average": 3, "reduce": 4}, {}),
    "binary_cross_entropy_with_logits": (5, {"weight": 2, "size_average": 3, "reduce": 4, "pos_weight": 6}, {}),
}


@register("pointwise_loss")
class PointwiseLoss(Rule):
    """A loss that is a sum (or mean) of one term per element of its input, such as
    ``mse_loss``: every axis of the input splits, the batch axis being the sample dim.
    Reduced ('mean', 'sum', kl_div's 'batchmean'), every dim is a reduction dim and
    the partitions hold partial sums, each already divided by the whole input's size
    for 'mean' (its batch for 'batchmean'); with 'none' the output is split like the
    input."""

    separable = True  # see Rule.separable

    def dims(self, op: Op, batch):
        reduced = op.attrs["reduction"] != "none"
        dims = []
        for axis, size in enumerate(op.input_shapes[0]):
            if size <= 1:
                continue
            out_axis = None if reduced else axis
            dims.append(batch_dim(out_axis, size, batch) if axis == 0
                        else Dim(f"e{axis}", "attribute", out_axis, size))
        return dims

    def _region(self, op, block):
        by_axis = {reduced_axis(d.name) if d.axis is None else d.axis: block_range(op, block, d.name)
                   for d in op.dims}
        return tuple(slice(*by_axis.get(a, (0, s))) for a, s in enumerate(op.input_shapes[0]))

    def regions(self, op: Op, block: Block):
        r = self._region(op, block)
        return [r, r], {}

    def compute(self, op, block, inputs, params):
        return self.bind(op, block)(inputs, params)

    def bind(self, op, block):
        fn = getattr(F, op.attrs["fn"])
        kw = dict(op.attrs.get("keywords", ()))
        red = op.attrs["reduction"]
        r = self._region(op, block)
        whole = all(s.start == 0 and s.stop == n for s, n in zip(r, op.input_shapes[0]))
        if red == "none" or red == "sum" or whole:
            return lambda inputs, params: fn(inputs[0], inputs[1], reduction=red, **kw)
        # 'batchmean' (kl_div) divides by the batch, 'mean' by every element
        count = op.input_shapes[0][0] if red == "batchmean" else math.prod(op.input_shapes[0])

        def partial_mean(inputs, params):  # this block's share of the mean
            return fn(inputs[0], inputs[1], reduction="sum", **kw) / count
        return partial_mean

    def flops(self, op, block):
        r = self._region(op, block)
        return 4.0 * math.prod(s.stop - s.start for s in r)

    def backward_factor(self, op):
        return 1.0


def _sized_by_batch(op: Op, batch: int) -> bool:
    """An ATen op (export front end) whose literal arguments hold a size that
    counts the batch (``new_ones(x, [B, L])``, ``view(x, [B * L, C])``), or
    that reads a second tensor (index tensors hold absolute positions): on a
    block of samples it could compute something else, so it runs whole."""
    if not isinstance(op.target, torch._ops.OpOverload):
        return False
    if len(op.inputs) != 1:
        return True
    ints = [v for v in leaves((op.args, op.kwargs)) if isinstance(v, int) and not isinstance(v, bool)]
    return any(v >= batch and v % batch == 0 for v in ints)


@register("opaque")
class Opaque(Rule):
    """An op the library does not know: split along the batch where its layout is proven
    (attrs['layout'] = (per input (axis, unit) or None, output (axis, unit)): a layout
    torch.nn documents, or one checked at capture, :mod:`flexflow.graph.batchflow`), else
    run whole."""

    separable = True  # see Rule.separable

    def dims(self, op: Op, batch):
        lay = op.attrs.get("layout")
        if lay is None or op.attrs.get("stacked") or batch is None or batch <= 1 \
                or (op.attrs.get("packed") and not op.attrs.get("by_sample")):
            return []
        axis, unit = lay[1]
        if len(op.output_shape) <= axis or op.output_shape[axis] != batch * unit:
            return []
        return [Dim("n", "sample", axis, op.output_shape[axis], unit)]

    def regions(self, op: Op, block: Block):
        ins, ps = super().regions(op, block)
        if "n" in block:
            a, b = block["n"]
            lay = op.attrs["layout"]
            out_unit = lay[1][1]
            new = []
            for r, shp, w in zip(ins, op.input_shapes, lay[0]):
                if w is None:
                    new.append(r)
                    continue
                axis, unit = w
                r = list(r)
                r[axis] = slice(a // out_unit * unit, b // out_unit * unit)
                new.append(tuple(r))
            ins = new
        return ins, ps

    def compute(self, op, block, inputs, params):
        out = call_template(op, inputs, params)
        if op.attrs.get("by_sample"):  # (B, per sample): each output's samples, side by side
            leaves = [t for t in flatten(out) if t is not None]
            return torch.cat([t.movedim(ax, 0).reshape(t.shape[ax], -1)
                              for t, ax in zip(leaves, op.attrs["by_sample"])], dim=1)
        if op.attrs.get("packed"):
            return torch.cat([t.reshape(-1) for t in flatten(out) if t is not None])
        if op.attrs.get("stacked"):
            return torch.stack(list(out))
        return out

