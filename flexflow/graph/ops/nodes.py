"""Names of op kinds and the helpers that read an fx node's arguments and parameters
(shared by the builder, :mod:`.catalog`, and the classifier, :mod:`.classify`)."""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn as nn

from ..ir import Op, ParamRef

__all__ = ['POINTWISE', 'index_attrs']


POINTWISE = {
    # unary
    "relu", "relu6", "gelu", "tanh", "sigmoid", "silu", "elu", "selu", "leaky_relu", "hardtanh",
    "hardswish", "hardsigmoid", "softplus", "mish", "dropout", "dropout1d", "dropout2d",
    "alpha_dropout", "exp", "log", "log1p", "neg", "sqrt", "rsqrt", "abs", "sin", "cos", "erf",
    "reciprocal", "square", "pow", "clamp", "clip", "contiguous", "clone", "float", "half",
    "bfloat16", "double", "to", "type_as", "detach", "masked_fill", "identity", "logical_not",
    "sign", "floor", "ceil", "round", "expand", "expand_as", "nan_to_num",
    # binary / ternary
    "add", "sub", "mul", "div", "truediv", "floordiv", "true_divide", "maximum", "minimum",
    "eq", "ne", "lt", "gt", "le", "ge", "where", "logical_and", "logical_or", "rsub", "radd",
    "rmul", "mod", "remainder", "and_", "or_",
}


_OPERATOR_NAMES = {operator.add: "add", operator.sub: "sub", operator.mul: "mul",
                   operator.truediv: "truediv", operator.floordiv: "floordiv",
                   operator.matmul: "matmul", operator.neg: "neg", operator.pow: "pow",
                   operator.getitem: "getitem", operator.eq: "eq", operator.ne: "ne",
                   operator.lt: "lt", operator.gt: "gt", operator.le: "le", operator.ge: "ge",
                   operator.mod: "mod", operator.and_: "and_", operator.or_: "or_"}


_ATEN_NAMES = {"__and__": "and_", "__or__": "or_", "alias": "identity", "lift_fresh_copy": "clone",
               "split_with_sizes": "split", "unbind": "unbind", "concat": "cat"}


_TUPLE_MAKERS = {"chunk", "split", "unbind", "tensor_split", "split_with_sizes"}


def _name_of(node: fx.Node) -> str:
    t = node.target
    if node.op == "call_method":
        return t
    if t in _OPERATOR_NAMES:
        return _OPERATOR_NAMES[t]
    if isinstance(t, torch._ops.OpOverload):  # an ATen op the export front end kept
        name = t.overloadpacket.__name__
        return _ATEN_NAMES.get(name, name.strip("_"))
    return getattr(t, "__name__", str(t)).lstrip("_")


def _is_tensor(v) -> bool:
    return isinstance(v, torch.Tensor)


def _pair(v, n):
    if isinstance(v, (tuple, list)):
        return tuple(int(x) for x in v)
    return (int(v),) * n


def index_attrs(in_shape, idx) -> dict | None:
    """Attrs of an index op for basic indexing ``x[idx]``; None if not basic."""
    if not isinstance(idx, tuple):
        idx = (idx,)
    if any(isinstance(e, (torch.Tensor, list)) or (isinstance(e, slice) and any(
            isinstance(v, torch.Tensor) for v in (e.start, e.stop, e.step))) for e in idx):
        return None
    real = sum(1 for e in idx if e is not None and e is not Ellipsis)
    expanded = []
    for e in idx:
        if e is Ellipsis:
            expanded += [slice(None)] * (len(in_shape) - real)
        else:
            expanded.append(e)
    expanded += [slice(None)] * (len(in_shape) - sum(1 for e in expanded if e is not None))
    axis_map, offsets, fixed, new_axes = [], {}, {}, []
    ia = 0
    for e in expanded:
        if e is None:
            new_axes.append(len(axis_map))
            axis_map.append(None)
        elif isinstance(e, (int, torch.SymInt)) and not isinstance(e, bool):
            i = int(e) % in_shape[ia]
            fixed[ia] = (i, i + 1)
            ia += 1
        elif isinstance(e, slice):
            start, stop, step = e.indices(in_shape[ia])
            if step != 1:
                return None
            offsets[len(axis_map)] = start
            axis_map.append(ia)
            ia += 1
        else:
            return None
    return {"axis_map": axis_map, "offsets": offsets, "fixed": fixed, "new_axes": new_axes}


def _module_params(b, op: Op, module: nn.Module):
    for local, p in module.named_parameters():
        op.params[local] = b.param_names.get(id(p), f"{b.node.target}.{local}")
        op.param_shapes[local] = tuple(p.shape)
    prefix = b.node.target
    for local, buf in module.named_buffers():
        if buf is not None:
            op.buffers[local] = f"{prefix}.{local}"
            op.buffer_shapes[local] = tuple(buf.shape)
    if op.rule == "lstm_cell":
        H = module.hidden_size
        for local, shp in list(op.param_shapes.items()):
            op.param_views[local] = (4, H) + tuple(shp[1:])


def _functional_params(b, op: Op, args, positions: dict[int, str], kwargs_names=None):
    """Rename ParamRefs at known argument positions to local names (weight, bias)."""
    args = list(args)
    for pos, local in positions.items():
        ref = args[pos] if pos < len(args) else op.kwargs.get(local)
        if isinstance(ref, ParamRef):
            q = b.params[ref.name]
            op.params[local] = q
            op.param_shapes[local] = tuple(_param_value(b, q).shape)
            if pos < len(args):
                args[pos] = ParamRef(local)
            else:
                op.kwargs = {**op.kwargs, local: ParamRef(local)}  # fx's kwargs are immutable
    op.args = tuple(args)


def _param_value(b, qual):
    obj = b.root
    for part in qual.split("."):
        obj = getattr(obj, part)
    return obj
