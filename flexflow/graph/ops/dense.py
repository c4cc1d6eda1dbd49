"""Ops with dense parameters or contractions: linear, matmul/bmm, embedding,
LSTM cell.  Parameter splits read the whole input row and a slice of the
weights (Table 1 of the paper: the channel/parameter dim)."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..ir import Dim, Op
from .base import (
    Block,
    Rule,
    batch_dim,
    out_region,
    region_shape,
    register,
)
from .pointwise import broadcast_region


def _lead_dims(shape, batch) -> list[Dim]:
    """Sample dim on axis 0, attribute dims s, s2, ... on the other axes."""
    dims = []
    for axis, size in enumerate(shape):
        if size <= 1:
            continue
        if axis == 0:
            dims.append(batch_dim(0, size, batch))
        else:
            dims.append(Dim("s" if axis == 1 else f"s{axis}", "attribute", axis, size))
    return dims


@register("linear")
class Linear(Rule):
    """y = x W^T + b over the last axis; out_features is the parameter dim c."""

    separable = True  # see Rule.separable

    def dims(self, op: Op, batch):
        dims = _lead_dims(op.output_shape[:-1], batch)
        c = op.output_shape[-1]
        if c > 1:
            dims.append(Dim("c", "parameter", len(op.output_shape) - 1, c))
        if op.input_shapes[0][-1] > 1:  # in_features: a reduction dim (see _in_block)
            dims.append(Dim("k", "parameter", None, op.input_shapes[0][-1]))
        return dims

    def regions(self, op: Op, block: Block):
        out = out_region(op, block)
        k = _in_block(op, block)
        x = out[:-1] + (k,)
        c = out[-1]
        ps = {"weight": (c, k)}
        if "bias" in op.param_shapes:
            ps["bias"] = (c,)
        return [x], ps

    def compute(self, op, block, inputs, params):
        return F.linear(inputs[0], params["weight"], _bias(op, block, params))

    def flops(self, op, block):
        out = region_shape(out_region(op, block))
        k = _in_block(op, block)
        return 2.0 * math.prod(out) * (k.stop - k.start)


# The in_features split of a linear layer (dim ``k``, a reduction dim): a partition reads
# its slice of the input's last axis and of the weight's columns and leaves a partial sum
# of the whole output block, which its consumers add up (Megatron's row-parallel layer,
# after a layer split by outputs).  The bias joins the first slice's sum only (the others
# add it times zero, so each holder of the bias gets a gradient).  The search's candidate
# configs leave this dim out (``strategy.candidates``); ``Strategy.megatron`` uses it.
def _in_block(op: Op, block: Block) -> slice:
    a, b = block.get("k", (0, op.input_shapes[0][-1]))
    return slice(a, b)


def _bias(op: Op, block: Block, params):
    bias = params.get("bias")
    if bias is None or block.get("k", (0,))[0] == 0:
        return bias
    return bias * 0


@register("matmul")
class Matmul(Rule):
    """(..., M, K) @ (..., K, N): batch axes, rows i and columns j split."""

    separable = True  # see Rule.separable

    def dims(self, op: Op, batch):
        shape = op.output_shape
        dims = _lead_dims(shape[:-2], batch)
        dims = [Dim(d.name if d.axis == 0 else f"b{d.axis}", d.kind, d.axis, d.size) for d in dims]
        R = len(shape)
        if shape[-2] > 1:
            dims.append(Dim("i", "attribute", R - 2, shape[-2]))
        if shape[-1] > 1:
            dims.append(Dim("j", "attribute", R - 1, shape[-1]))
        return dims

    def regions(self, op: Op, block: Block):
        out = out_region(op, block)
        a_shape, b_shape = op.input_shapes
        lead_out = op.output_shape[:-2]
        a_lead = broadcast_region(out[:-2], lead_out, a_shape[:-2])
        b_lead = broadcast_region(out[:-2], lead_out, b_shape[:-2])
        a = a_lead + (out[-2], slice(0, a_shape[-1]))
        b = b_lead + (slice(0, b_shape[-2]), out[-1])
        return [a, b], {}

    def compute(self, op, block, inputs, params):
        return torch.matmul(inputs[0], inputs[1])

    def flops(self, op, block):
        out = region_shape(out_region(op, block))
        return 2.0 * math.prod(out) * op.input_shapes[0][-1]


@register("embedding")
class Embedding(Rule):
    """Row lookup: ids (N, ...) -> (N, ..., E); E is the parameter dim e."""

    separable = True  # see Rule.separable

    def dims(self, op: Op, batch):
        dims = _lead_dims(op.output_shape[:-1], batch)
        e = op.output_shape[-1]
        if e > 1:
            dims.append(Dim("e", "parameter", len(op.output_shape) - 1, e))
        return dims

    def regions(self, op: Op, block: Block):
        out = out_region(op, block)
        vocab = op.param_shapes["weight"][0]
        return [out[:-1]], {"weight": (slice(0, vocab), out[-1])}

    def compute(self, op, block, inputs, params):
        return F.embedding(inputs[0], params["weight"], op.attrs.get("padding_idx"))

    def flops(self, op, block):
        return float(math.prod(region_shape(out_region(op, block))))

    def backward_factor(self, op):
        return 1.0


def _gate_rows(t):
    """An LSTM weight (4, hs, I) as its gate rows (4 hs, I); one held whole in the
    module's own shape, (4H, I), comes as it is."""
    return t if t.dim() == 2 else t.reshape(-1, t.shape[-1])


def _gate_bias(t):
    """An LSTM bias (4, hs) as (4 hs,); one held as the module holds it as it is."""
    return t if t.dim() == 1 else t.reshape(-1)


@register("lstm_cell")
class LSTMCell(Rule):
    """One time step of an LSTM.  Output is (h, c) stacked: (2, N, H).
    The hidden units h are the parameter dim: a partition reads the whole
    input x and previous h rows, its slice of c, and its slice of each of
    the four gates' weights (weights viewed as (4, H, ·))."""

    separable = True  # see Rule.separable

    def dims(self, op: Op, batch):
        _, n, h = op.output_shape
        dims = []
        if n > 1:
            dims.append(batch_dim(1, n, batch))
        if h > 1:
            dims.append(Dim("h", "parameter", 2, h))
        return dims

    def regions(self, op: Op, block: Block):
        out = out_region(op, block)
        rows, hs = out[1], out[2]
        x_in = op.input_shapes[0][1]
        H = op.output_shape[2]
        ins = [(rows, slice(0, x_in))]
        if len(op.input_shapes) == 3:
            ins += [(rows, slice(0, H)), (rows, hs)]
        four = slice(0, 4)
        ps = {"weight_ih": (four, hs, slice(0, x_in)), "weight_hh": (four, hs, slice(0, H))}
        for b in ("bias_ih", "bias_hh"):
            if b in op.param_shapes:
                ps[b] = (four, hs)
        return ins, ps

    def compute(self, op, block, inputs, params):
        return torch.stack(self.compute_parts(op, block, inputs, params))

    # a whole weight may come in the module's own shape, (4H, I) and (4H,)
    native_params = True

    def compute_parts(self, op, block, inputs, params):
        """(h, c) of the partition, unstacked (the executor keeps them apart)."""
        x = inputs[0]
        w_ih = _gate_rows(params["weight_ih"])  # (4 hs, I)
        hs = w_ih.shape[0] // 4
        if hs == op.output_shape[2] and len(inputs) == 3 and "bias_ih" in params:
            # whole hidden block: the fused kernel, as nn.LSTMCell runs it
            h, c = torch.lstm_cell(x, (inputs[1], inputs[2]), w_ih, _gate_rows(params["weight_hh"]),
                                   _gate_bias(params["bias_ih"]), _gate_bias(params["bias_hh"]))
            return h, c
        gates = x @ w_ih.t()
        if len(inputs) == 3:
            h_prev, c_prev = inputs[1], inputs[2]
            gates = gates + h_prev @ _gate_rows(params["weight_hh"]).t()
        else:
            c_prev = None
        for b in ("bias_ih", "bias_hh"):
            if b in params:
                gates = gates + _gate_bias(params[b])
        gates = gates.view(x.shape[0], 4, hs)
        i, f, g, o = gates.unbind(1)
        c = torch.sigmoid(i) * torch.tanh(g)
        if c_prev is not None:
            c = c + torch.sigmoid(f) * c_prev
        h = torch.sigmoid(o) * torch.tanh(c)
        return h, c

    def flops(self, op, block):
        _, n, hs = region_shape(out_region(op, block))
        x_in = op.input_shapes[0][1]
        H = op.output_shape[2] if len(op.input_shapes) == 3 else 0  # no state: no h @ W_hh
        return 2.0 * n * 4 * hs * (x_in + H) + 12.0 * n * hs


@register("linear_t")
class LinearT(Linear):
    """y = x W + b with W stored (in, out) (GPT-2's Conv1D): as linear, the
    parameter dim c slices W's columns."""

    separable = True  # see Rule.separable

    def regions(self, op: Op, block: Block):
        out = out_region(op, block)
        k = _in_block(op, block)
        x = out[:-1] + (k,)
        c = out[-1]
        ps = {"weight": (k, c)}
        if "bias" in op.param_shapes:
            ps["bias"] = (c,)
        return [x], ps

    def compute(self, op, block, inputs, params):
        y = torch.matmul(inputs[0], params["weight"])
        bias = _bias(op, block, params)
        return y + bias if bias is not None else y
