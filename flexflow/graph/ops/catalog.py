"""Which fx node is which op: the module, function and method forms of an
op (nn.ReLU, F.relu, torch.relu, x.relu()) map to one kind and one rule.
Anything unknown becomes an opaque op, never an error."""

from __future__ import annotations

import torch.fx as fx
import torch.nn as nn
from torch.fx.node import map_aggregate

from ..ir import InputRef, Op, ParamRef
from .base import RULES, flatten
from .classify import _opaque, classify
from .nodes import (
    _TUPLE_MAKERS,
    _is_tensor,
    _module_params,
    _name_of,
    _param_value,
    index_attrs,
)

__all__ = ["build_op", "index_attrs"]


_MODULE_KINDS = {
    nn.Conv1d: "conv1d", nn.Conv2d: "conv2d", nn.Linear: "linear", nn.Embedding: "embedding",
    nn.BatchNorm1d: "batch_norm", nn.BatchNorm2d: "batch_norm", nn.LayerNorm: "layer_norm",
    nn.RMSNorm: "rms_norm",
    nn.LSTMCell: "lstm_cell", nn.MaxPool1d: "max_pool1d", nn.MaxPool2d: "max_pool2d",
    nn.AvgPool1d: "avg_pool1d", nn.AvgPool2d: "avg_pool2d",
    nn.AdaptiveAvgPool1d: "adaptive_avg_pool1d", nn.AdaptiveAvgPool2d: "adaptive_avg_pool2d",
    nn.AdaptiveMaxPool1d: "adaptive_max_pool1d", nn.AdaptiveMaxPool2d: "adaptive_max_pool2d",
    nn.Softmax: "softmax", nn.LogSoftmax: "log_softmax", nn.CrossEntropyLoss: "cross_entropy",
    nn.NLLLoss: "nll_loss", nn.MSELoss: "mse_loss", nn.L1Loss: "l1_loss", nn.SmoothL1Loss: "smooth_l1_loss",
    nn.HuberLoss: "huber_loss", nn.BCELoss: "binary_cross_entropy",
    nn.BCEWithLogitsLoss: "binary_cross_entropy_with_logits", nn.SoftMarginLoss: "soft_margin_loss",
    nn.KLDivLoss: "kl_div",
    nn.Flatten: "flatten", nn.ReLU: "relu", nn.ReLU6: "relu6",
    nn.GELU: "gelu", nn.Tanh: "tanh", nn.Sigmoid: "sigmoid", nn.SiLU: "silu", nn.ELU: "elu",
    nn.LeakyReLU: "leaky_relu", nn.Hardtanh: "hardtanh", nn.Dropout: "dropout",
    nn.Dropout1d: "dropout1d", nn.Dropout2d: "dropout2d", nn.Identity: "identity",
    nn.Hardswish: "hardswish", nn.Hardsigmoid: "hardsigmoid", nn.Softplus: "softplus", nn.Mish: "mish",
}


class _Builder:
    """Turns one fx node into an Op (the template of its call included)."""

    def __init__(self, root, node, value, by_node, param_names, ops):
        self.root, self.node, self.value = root, node, value
        self.by_node, self.param_names, self.ops = by_node, param_names, ops
        self.inputs: list[str] = []
        self.params: dict[str, str] = {}
        self.ops_by_name = {op.name: op for op in ops}

    # -- arguments --------------------------------------------------------
    def _arg(self, n: fx.Node):
        entry = self.by_node.get(n)
        if isinstance(entry, str):
            self.inputs.append(entry)
            return InputRef(len(self.inputs) - 1)
        if isinstance(entry, tuple) and entry[0] == "param":
            local = entry[1]
            self.params[local] = entry[1]
            return ParamRef(local)
        if isinstance(entry, tuple) and entry[0] == "value":
            return entry[1]
        if isinstance(entry, tuple) and entry[0] == "split":
            return tuple(self._arg_piece(n, i) for i in range(len(entry[3])))
        return n.meta.get("ff_value")

    def _arg_piece(self, n, i):
        name = self.materialize_piece(n, i)
        self.inputs.append(name)
        return InputRef(len(self.inputs) - 1)

    def materialize_piece(self, n: fx.Node, i: int) -> str:
        """An index op for piece i of a chunk/split/unbind node."""
        _, src, axis, pieces = self.by_node[n]
        src_op = self.ops_by_name[src]
        shape = src_op.output_shape
        piece = pieces[i]
        idx = [slice(None)] * len(shape)
        idx[axis] = piece if isinstance(piece, int) else slice(*piece)
        attrs = index_attrs(shape, tuple(idx))
        name = f"{n.name}_{i}"
        if name in self.ops_by_name:
            return name
        value = n.meta["ff_value"][i]
        op = Op(name=name, kind="getitem", rule="index", inputs=[src], output_shape=tuple(value.shape),
                dtype=value.dtype, attrs=attrs, input_shapes=[shape], input_dtypes=[src_op.dtype],
                everywhere=src_op.everywhere)
        # the batch as the tracer takes it (the first tensor input's first axis): a piece of a
        # batch-first tensor splits along samples like every other op
        batch = next((o.output_shape[0] for o in self.ops if o.kind == "input" and o.output_shape), None)
        op.dims = [] if op.everywhere else RULES["index"].dims(op, batch)
        self.ops.append(op)
        self.ops_by_name[name] = op
        return name

    def template(self):
        args = map_aggregate(self.node.args, lambda n: self._arg(n) if isinstance(n, fx.Node) else n)
        kwargs = map_aggregate(self.node.kwargs, lambda n: self._arg(n) if isinstance(n, fx.Node) else n)
        return args, kwargs

    def vals(self):
        def val(n):
            return n.meta.get("ff_value") if isinstance(n, fx.Node) else n
        return map_aggregate(self.node.args, val), map_aggregate(self.node.kwargs, val)

    # -- op construction ----------------------------------------------------
    def make(self, kind, rule, **kw) -> Op:
        shapes, dtypes = [], []
        for name in self.inputs:
            src = self.ops_by_name[name]
            shapes.append(tuple(src.output_shape))
            dtypes.append(src.dtype)
        v = self.value
        if isinstance(v, (tuple, list)):
            out_shape, dtype = kw.pop("output_shape"), kw.pop("dtype")
        else:
            out_shape, dtype = tuple(v.shape), v.dtype
        op = Op(name=self.node.name, kind=kind, rule=rule, inputs=list(self.inputs),
                output_shape=out_shape, dtype=dtype, input_shapes=shapes, input_dtypes=dtypes,
                call_kind=self.node.op, **kw)
        stack = self.node.meta.get("nn_module_stack")
        if stack and not op.module_path:
            op.module_path = list(stack.values())[-1][0] if isinstance(
                list(stack.values())[-1], tuple) else str(list(stack.keys())[-1])
        return op


def build_op(root, node: fx.Node, value, by_node, param_names, ops) -> Op | None:
    b = _Builder(root, node, value, by_node, param_names, ops)
    if node.op == "placeholder":
        if not _is_tensor(value):
            by_node[node] = ("value", value)
            return None
        return Op(name=node.name, kind="input", rule="base", inputs=[], output_shape=tuple(value.shape),
                  dtype=value.dtype, everywhere=True, call_kind="placeholder", target=node.target)
    if node.op == "get_attr":
        if not _is_tensor(value):
            by_node[node] = ("value", value)
            return None
        return Op(name=node.name, kind="constant", rule="base", inputs=[], output_shape=tuple(value.shape),
                  dtype=value.dtype, everywhere=True, call_kind="get_attr", target=node.target)
    name = _name_of(node) if node.op != "call_module" else None
    module = root.get_submodule(node.target) if node.op == "call_module" else None
    if module is not None:
        name = _MODULE_KINDS.get(type(module))
    # tuple producers: chunk / split / unbind become index ops per piece
    if name in _TUPLE_MAKERS and isinstance(value, (tuple, list)) and all(map(_is_tensor, value)):
        src_entry = by_node.get(node.args[0])
        if isinstance(src_entry, str):
            args, kwargs = b.vals()
            axis = kwargs.get("dim", args[2] if len(args) > 2 else 0)
            src_shape = args[0].shape
            axis = axis % len(src_shape)
            if name == "unbind":
                pieces = list(range(len(value)))
            else:
                pieces, off = [], 0
                for t in value:
                    pieces.append((off, off + t.shape[axis]))
                    off += t.shape[axis]
            by_node[node] = ("split", src_entry, axis, pieces)
            return None
    if name == "getitem":
        src = node.args[0]
        entry = by_node.get(src) if isinstance(src, fx.Node) else None
        if isinstance(entry, tuple) and entry[0] == "split":
            by_node[node] = b.materialize_piece(src, node.args[1])
            return None
        if isinstance(entry, tuple) and entry[0] == "subtree":  # an inner tuple of a packed op
            _, src_name, tree = entry
            return _leaf_item(b, node, by_node, b.ops_by_name[src_name], tree, node.args[1])
        if isinstance(entry, str):
            src_op = b.ops_by_name[entry]
            if src_op.attrs.get("tree") is not None:
                return _leaf_item(b, node, by_node, src_op, src_op.attrs["tree"], node.args[1])
            if src_op.attrs.get("stacked") or src_op.attrs.get("packed"):
                return _tuple_item(b, src_op, node.args[1])
    if not _is_tensor(value):
        if isinstance(value, (tuple, list)) and value and all(map(_is_tensor, value)):
            return _multi_output(b, name or type(module).__name__.lower(), module)
        leaves = list(flatten(value)) if isinstance(value, (tuple, list)) else []
        if leaves and all(map(_is_tensor, leaves)):  # nested outputs: nn.LSTM's (out, (h, c))
            return _multi_output(b, name or type(module).__name__.lower(), module)
        if node.op != "get_attr" and any(map(_is_tensor, leaves)) and \
                all(t is None or _is_tensor(t) for t in leaves):
            # tensors beside None (nn.MultiheadAttention's (out, None) without its weights):
            # an op all the same, whose None items are constants
            return _multi_output(b, name or type(module).__name__.lower(), module)
        by_node[node] = ("value", value)
        return None
    return _classify(b, name, module)


def _tuple_item(b: _Builder, src_op: Op, i: int) -> Op:
    b.inputs.append(src_op.name)
    if src_op.attrs.get("stacked"):
        shape = src_op.output_shape
        idx = (int(i),) + (slice(None),) * (len(shape) - 1)
        return b.make("getitem", "index", attrs=index_attrs(shape, idx))
    off = src_op.attrs["offsets"][i]
    return b.make("unpack", "unpack", attrs={"offset": off, "leaf": i})


def _multi_output(b: _Builder, name: str, module) -> Op:
    """An op with several tensor outputs: stacked when they share a shape,
    else packed flat (and then it runs whole)."""
    v = b.value
    same = all(_is_tensor(t) and t.shape == v[0].shape and t.dtype == v[0].dtype for t in v)
    holes = any(t is None for t in flatten(v))
    if name == "lstm_cell" and same and module is not None:
        args, kwargs = b.template()
        op = b.make("lstm_cell", "lstm_cell", output_shape=(2,) + tuple(v[0].shape), dtype=v[0].dtype,
                    attrs={"stacked": True}, target=module, args=args, kwargs=kwargs,
                    module_path=b.node.target)
        _module_params(b, op, module)
        return op
    args, kwargs = b.template()
    leaves = [t for t in flatten(v) if t is not None]
    nested = len(leaves) != len(v) or holes
    if same:
        shape, attrs = (len(v),) + tuple(v[0].shape), {"stacked": True}
    else:
        offsets, off = [], 0
        for t in leaves:
            offsets.append(off)
            off += t.numel()
        shape, attrs = (off,), {"packed": True, "offsets": offsets,
                                "leaf_shapes": [tuple(t.shape) for t in leaves]}
        if nested:  # leaf indices in the output's structure, e.g. (0, (1, 2)); None stays None
            attrs["tree"] = _leaf_tree(v, iter(range(len(leaves))))
            attrs["leaf_count"] = len(leaves)
    op = b.make(name, "opaque", output_shape=shape, dtype=leaves[0].dtype, attrs=attrs,
                target=module if module is not None else b.node.target, args=args, kwargs=kwargs)
    if module is not None:
        op.module_path = b.node.target
        _module_params(b, op, module)
    else:
        for local, q in b.params.items():
            op.params[local] = q
            op.param_shapes[local] = tuple(_param_value(b, q).shape)
    return op


def _leaf_tree(value, counter):
    if isinstance(value, (tuple, list)):
        return tuple(_leaf_tree(x, counter) for x in value)
    return None if value is None else next(counter)


def _leaf_item(b: _Builder, node, by_node, src_op: Op, tree, i):
    """Item i of a packed op's (nested) output: a leaf becomes an unpack op,
    an inner tuple a subtree entry that later getitems index further."""
    sub = tree[i]
    if isinstance(sub, tuple):
        by_node[node] = ("subtree", src_op.name, sub)
        return None
    if sub is None:  # a None item of the output
        by_node[node] = ("value", None)
        return None
    b.inputs.append(src_op.name)
    return b.make("unpack", "unpack", attrs={"offset": src_op.attrs["offsets"][sub], "leaf": sub})


def _classify(b: _Builder, name: str | None, module) -> Op:
    """The op of a node by its kind's rule; where the rule meets a pattern it does not
    handle (it raises while reading the call, or the op it makes cannot say its parallel
    dims), the op is opaque instead: a model never fails to trace for a rule's sake."""
    n_ops = len(b.ops)
    try:
        op = classify(b, name, module)
        if op.rule != "opaque":
            RULES[op.rule].dims(op, op.output_shape[0] if op.output_shape else None)
        return op
    except Exception:  # noqa: BLE001 - any rule failure: the op runs whole (or split by samples)
        del b.ops[n_ops:]  # index ops the failed attempt made for tuple pieces are made again
        b.ops_by_name = {o.name: o for o in b.ops}
        b.inputs, b.params = [], {}
        at, kt = b.template()
        return _opaque(b, name, module, at, kt)
