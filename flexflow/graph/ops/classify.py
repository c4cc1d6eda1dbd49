"""Per-kind construction of ops from fx nodes: attributes (stride, padding,
axes, ...) and the rule each kind is partitioned by."""
from __future__ import annotations

import copy

import torch

from ..ir import InputRef, Op, ParamRef
from .loss import POINTWISE_LOSSES
from .nodes import POINTWISE, _functional_params, _module_params, _pair, index_attrs
from .shape import reshape_axis_map


def _get(args, kwargs, pos, key, default=None):
    if key in kwargs:
        return kwargs[key]
    if pos is not None and pos < len(args):
        return args[pos]
    return default


def _spatial_attrs(n, kernel, stride, padding, dilation):
    return {"kernel": _pair(kernel, n), "stride": _pair(stride, n), "padding": _pair(padding, n),
            "dilation": _pair(dilation, n)}


def _opaque(b, name, module, args, kwargs) -> Op:
    op = b.make(name or "opaque", "opaque", target=module if module is not None else b.node.target,
                args=args, kwargs=kwargs)
    if module is not None:
        op.module_path = b.node.target
        _module_params(b, op, module)
    else:
        for local, q in b.params.items():
            op.params[local] = q
            op.param_shapes[local] = tuple(_param_shape(b, q))
    return op


def _param_shape(b, q):
    obj = b.root
    for part in q.split("."):
        obj = getattr(obj, part)
    return obj.shape


def classify(b, name, module) -> Op:
    av, kv = b.vals()
    at, kt = b.template()
    x_in = b.inputs[:]
    mk = dict(args=at, kwargs=kt)
    if module is not None:
        mk["target"] = module
        mk["module_path"] = b.node.target
    else:
        mk["target"] = b.node.target

    def module_op(kind, rule, attrs):
        op = b.make(kind, rule, attrs=attrs, **mk)
        _module_params(b, op, module)
        return op

    def fn_op(kind, rule, attrs, positions=None):
        op = b.make(kind, rule, attrs=attrs, **mk)
        if positions:
            _functional_params(b, op, at, positions)
            if set(b.params) - set(op.params.values()) - set(op.params):
                return None
        return op

    # -- convolution --------------------------------------------------------
    if name in ("conv1d", "conv2d"):
        n = 1 if name == "conv1d" else 2
        if module is not None:
            if module.padding_mode != "zeros":
                return _opaque(b, name, module, at, kt)
            pad = module.padding
            if isinstance(pad, str):
                pad = _str_padding(pad, module.kernel_size, module.dilation)
            attrs = _spatial_attrs(n, module.kernel_size, module.stride, pad, module.dilation)
            attrs["groups"] = module.groups
            return module_op(name, "conv", attrs)
        w = _get(at, kt, 1, "weight")
        if isinstance(w, ParamRef) and len(x_in) == 1:
            wshape = _param_shape(b, b.params[w.name])
            pad = _get(av, kv, 4, "padding", 0)
            dil = _get(av, kv, 5, "dilation", 1)
            if isinstance(pad, str):
                pad = _str_padding(pad, tuple(wshape[2:]), _pair(dil, n))
            attrs = _spatial_attrs(n, tuple(wshape[2:]), _get(av, kv, 3, "stride", 1), pad, dil)
            attrs["groups"] = _get(av, kv, 6, "groups", 1)
            op = fn_op(name, "conv", attrs, {1: "weight", 2: "bias"})
            if op is not None:
                return op
        return _opaque(b, name, module, at, kt)

    # -- linear / matmul ------------------------------------------------------
    if name == "linear":
        if module is not None:
            return module_op("linear", "linear", {})
        if len(x_in) == 1 and isinstance(_get(at, kt, 1, "weight"), ParamRef):
            op = fn_op("linear", "linear", {}, {1: "weight", 2: "bias"})
            if op is not None:
                return op
        return _opaque(b, name, module, at, kt)
    if name == "linear_t":  # x @ W + b, W stored (in, out): the export front end's GPT-2 Conv1D
        if len(x_in) == 1 and isinstance(_get(at, kt, 1, "weight"), ParamRef):
            op = fn_op("linear", "linear_t", {}, {1: "weight", 2: "bias"})
            if op is not None:
                return op
        return _opaque(b, name, module, at, kt)
    if name == "scaled_dot_product_attention":
        from .attention import attention_attrs
        shapes = [b.ops_by_name[i].output_shape for i in x_in]
        attrs = attention_attrs(at, kt, shapes) if not b.params else None
        if attrs is not None:  # attention dropout draws per partition, as dropout does
            return b.make("attention", "attention", attrs=attrs, **mk)
        return _opaque(b, name, module, at, kt)
    if name in ("matmul", "bmm", "mm"):
        if len(x_in) == 2 and not b.params and all(len(b.ops_by_name[i].output_shape) >= 2 for i in x_in):
            return b.make(name, "matmul", **mk)
        return _opaque(b, name, module, at, kt)

    # -- pooling ---------------------------------------------------------------
    if name and ("pool1d" in name or "pool2d" in name):
        op = _pool(b, name, module, av, kv, mk)
        return op if op is not None else _opaque(b, name, module, at, kt)

    # -- normalization, softmax -------------------------------------------------
    if name == "batch_norm" and module is not None:
        return module_op("batch_norm", "batchnorm", {"eps": module.eps, "momentum": module.momentum})
    if name == "batch_norm" and module is None and x_in:
        op = _functional_batch_norm(b, av, kv, at, kt, mk)
        return op if op is not None else _opaque(b, name, module, at, kt)
    if name == "layer_norm":
        if module is not None:
            k = len(module.normalized_shape)
            attrs = {"whole_axes": tuple(range(len(b.value.shape) - k, len(b.value.shape)))}
            return module_op("layer_norm", "rowwise", attrs)
        shape = _get(av, kv, 1, "normalized_shape")
        k = len(shape) if isinstance(shape, (tuple, list, torch.Size)) else 1
        attrs = {"whole_axes": tuple(range(len(b.value.shape) - k, len(b.value.shape)))}
        op = fn_op("layer_norm", "rowwise", attrs, {2: "weight", 3: "bias"})
        return op if op is not None else _opaque(b, name, module, at, kt)
    if name == "rms_norm":  # nn.RMSNorm or F.rms_norm(x, normalized_shape, weight, eps)
        shape = module.normalized_shape if module is not None else _get(av, kv, 1, "normalized_shape")
        k = len(shape) if isinstance(shape, (tuple, list, torch.Size)) else 1
        rank = len(b.value.shape)
        if k > rank:
            return _opaque(b, name, module, at, kt)
        attrs = {"whole_axes": tuple(range(rank - k, rank))}
        if module is not None:
            return module_op("rms_norm", "rowwise", attrs)
        op = fn_op("rms_norm", "rowwise", attrs, {2: "weight"})
        return op if op is not None else _opaque(b, name, module, at, kt)
    if name in ("softmax", "log_softmax"):
        dim = module.dim if module is not None else _get(av, kv, 1, "dim")
        if dim is None or b.params:
            return _opaque(b, name, module, at, kt)
        return b.make(name, "rowwise", attrs={"whole_axes": (dim % len(b.value.shape),)}, **mk)

    # -- embedding ---------------------------------------------------------------
    if name == "embedding":
        if module is not None:
            if module.max_norm is not None:
                return _opaque(b, name, module, at, kt)
            return module_op("embedding", "embedding", {"padding_idx": module.padding_idx})
        if len(x_in) == 1 and isinstance(_get(at, kt, 1, "weight"), ParamRef):
            op = fn_op("embedding", "embedding", {"padding_idx": _get(av, kv, 2, "padding_idx")},
                       {1: "weight"})
            if op is not None:
                return op
        return _opaque(b, name, module, at, kt)

    # -- losses ----------------------------------------------------------------
    if name in ("cross_entropy", "nll_loss"):
        if module is not None:
            red, ign = module.reduction, module.ignore_index
            simple = module.weight is None and getattr(module, "label_smoothing", 0.0) == 0.0
        else:
            red = _get(av, kv, 6, "reduction", "mean")
            ign = _get(av, kv, 4, "ignore_index", -100)
            simple = (_get(av, kv, 2, "weight") is None and _get(av, kv, 7, "label_smoothing", 0.0) == 0.0
                      and _get(av, kv, 3, "size_average") is None and _get(av, kv, 5, "reduce") is None)
        ok = (simple and len(x_in) == 2 and not b.params and red in ("mean", "sum", "none")
              and not b.ops_by_name[x_in[1]].dtype.is_floating_point)
        if not ok:
            return _opaque(b, name, module, at, kt)
        attrs = {"fn": "nll" if name == "nll_loss" else "ce", "reduction": red, "ignore_index": ign}
        return b.make(name, "loss", attrs=attrs, **mk)

    if name == "fused_cross_entropy" and getattr(b.node.target, "namespace", None) == "flexflow":
        # flexflow.fused_cross_entropy (flexflow.models.losses): (logits, targets, ignore_index, reduction)
        red, ign = _get(av, kv, 3, "reduction", "mean"), _get(av, kv, 2, "ignore_index", -100)
        if len(x_in) == 2 and not b.params and red in ("mean", "sum") and isinstance(ign, int):
            attrs = {"fn": "fused", "reduction": red, "ignore_index": ign}
            return b.make(name, "loss", attrs=attrs, **mk)
        return _opaque(b, name, module, at, kt)

    if name in POINTWISE_LOSSES and not isinstance(b.node.target, torch._ops.OpOverload):
        red_pos, must_be_none, keyword_pos = POINTWISE_LOSSES[name]
        if module is not None:
            red = module.reduction
            plain = all(getattr(module, k, None) is None for k in must_be_none if k not in ("size_average", "reduce"))
            keywords = tuple((k, getattr(module, k)) for k in keyword_pos)
        else:
            red = _get(av, kv, red_pos, "reduction", "mean")
            plain = all(_get(av, kv, i, k) is None for k, i in must_be_none.items())
            keywords = tuple((k, _get(av, kv, i, k, default)) for k, (i, default) in keyword_pos.items())
        shapes = [tuple(b.ops_by_name[i].output_shape) for i in x_in]
        ok = (plain and len(x_in) == 2 and not b.params
              and red in (("mean", "sum", "none", "batchmean") if name == "kl_div" else ("mean", "sum", "none"))
              and shapes[0] == shapes[1] and all(isinstance(v, (int, float, bool)) for _, v in keywords)
              and all(b.ops_by_name[i].dtype.is_floating_point for i in x_in)
              and at[:2] == (InputRef(0), InputRef(1)))
        if not ok:
            return _opaque(b, name, module, at, kt)
        attrs = {"fn": name, "reduction": red, "keywords": keywords}
        return b.make(name, "pointwise_loss", attrs=attrs, **mk)

    # -- structure ---------------------------------------------------------------
    if name in ("cat", "concat", "concatenate", "stack"):
        tensors = _get(at, kt, 0, "tensors")
        attrs = _concat_attrs(b, name, tensors, av, kv, x_in)
        if attrs is not None:
            return b.make(name, "concat", attrs=attrs, **mk)
        return _opaque(b, name, module, at, kt)
    if name in ("flatten", "view", "reshape", "squeeze", "unsqueeze", "view_as", "reshape_as"):
        if len(x_in) >= 1 and not b.params and at and at[0] == InputRef(0):
            in_shape = b.ops_by_name[x_in[0]].output_shape
            amap = reshape_axis_map(tuple(in_shape), tuple(b.value.shape))
            op = b.make(name, "reshape", attrs={"axis_map": amap}, **mk)
            op.inputs, op.input_shapes, op.input_dtypes = op.inputs[:1], op.input_shapes[:1], op.input_dtypes[:1]
            return op
        return _opaque(b, name, module, at, kt)
    if name == "pad":
        pad, mode = _get(av, kv, 1, "pad"), _get(av, kv, 2, "mode", "constant")
        if (len(x_in) == 1 and not b.params and at and at[0] == InputRef(0) and mode == "constant"
                and isinstance(pad, (tuple, list)) and len(pad) % 2 == 0):
            rank = len(b.value.shape)
            padded = {rank - 1 - i // 2 for i, p in enumerate(pad) if p}
            amap = [None if a in padded else a for a in range(rank)]
            return b.make(name, "pad", attrs={"axis_map": amap}, **mk)
        return _opaque(b, name, module, at, kt)
    if name in ("transpose", "permute", "t", "swapaxes", "swapdims", "movedim"):
        if len(x_in) == 1 and not b.params:
            rank = len(b.value.shape)
            perm = _perm(name, av, kv, rank)
            if perm is not None:
                return b.make(name, "transpose", attrs={"axis_map": perm, "perm": perm}, **mk)
        return _opaque(b, name, module, at, kt)
    if name in ("getitem", "narrow", "select"):
        if x_in and at and at[0] == InputRef(0) and len(x_in) == 1 and not b.params:
            shape = b.ops_by_name[x_in[0]].output_shape
            if name == "getitem":
                idx = av[1]
            else:
                dim = _get(av, kv, 1, "dim") % len(shape)
                idx = [slice(None)] * len(shape)
                if name == "narrow":
                    start = _get(av, kv, 2, "start")
                    idx[dim] = slice(start, start + _get(av, kv, 3, "length"))
                else:
                    idx[dim] = _get(av, kv, 2, "index")
                idx = tuple(idx)
            attrs = index_attrs(shape, idx)
            if attrs is not None:
                return b.make(name, "index", **mk, attrs=attrs)
        return _opaque(b, name, module, at, kt)
    if name in ("sum", "mean", "amax", "amin"):
        if len(x_in) == 1 and not b.params:
            attrs, reduced, keep = _reduce_attrs(b.ops_by_name[x_in[0]].output_shape, av, kv, b.value.shape)
            if attrs is not None:
                if name in ("sum", "mean") and kv.get("dtype") is None \
                        and b.ops_by_name[x_in[0]].dtype.is_floating_point and b.value.dtype.is_floating_point:
                    attrs.update(reduced=reduced, keepdim=keep)  # splits as partial sums
                return b.make(name, "reduce", attrs=attrs, **mk)
        return _opaque(b, name, module, at, kt)

    # -- element-wise ---------------------------------------------------------------
    if name in POINTWISE and x_in and b.params and _broadcasts(b, x_in) and _params_broadcast(b):
        op = fn_op(name, "pointwise", {})
        for local, q in b.params.items():
            op.params[local] = q
            op.param_shapes[local] = tuple(_param_shape(b, q))
        return op
    if name in POINTWISE and x_in and not b.params and _broadcasts(b, x_in):
        if module is not None and getattr(module, "inplace", False):
            module = copy.copy(module)
            module.inplace = False
            mk["target"] = module
        attrs = {"expand": True} if name in ("expand", "expand_as") else {}
        if name in ("expand", "expand_as"):
            op = b.make(name, "pointwise", attrs=attrs, **mk)
            op.inputs, op.input_shapes, op.input_dtypes = op.inputs[:1], op.input_shapes[:1], op.input_dtypes[:1]
            return op
        return b.make(name, "pointwise", attrs=attrs, **mk)
    return _opaque(b, name, module, at, kt)


def _concat_attrs(b, name, tensors, av, kv, x_in) -> dict | None:
    """attrs of a plain cat / stack of traced tensors, or None: inputs that are not all
    traced, parameters, an axis outside the output, or inputs whose shapes do not line up
    with the output along the other axes.  torch.cat also takes 1-d empty tensors beside
    tensors of any rank (a key / value cache that starts empty): they get an empty span,
    which no partition reads."""
    if not (isinstance(tensors, (list, tuple)) and tensors and all(isinstance(t, InputRef) for t in tensors)
            and len(tensors) == len(x_in) and not b.params):
        return None
    out = tuple(b.value.shape)
    dim = _get(av, kv, 1, "dim", 0)
    if isinstance(dim, bool) or not isinstance(dim, int) or not out or not -len(out) <= dim < len(out):
        return None
    stack = name == "stack"
    axis = dim % len(out)
    spans, off = [], 0
    rest = out[:axis] + out[axis + 1:]  # the other axes, which every input must match
    for i in x_in:
        shape = tuple(b.ops_by_name[i].output_shape)
        if not stack and shape == (0,) and len(out) > 1:
            spans.append((off, 0))
            continue
        if stack and shape != rest:
            return None
        if not stack and (len(shape) != len(out) or shape[:axis] + shape[axis + 1:] != rest):
            return None
        length = 1 if stack else shape[axis]
        spans.append((off, length))
        off += length
    return {"axis": axis, "stack": stack, "spans": spans} if off == out[axis] else None


def _functional_batch_norm(b, av, kv, at, kt, mk):
    """F.batch_norm(x, running_mean, running_var, weight, bias, training, momentum, eps)
    whose statistics are buffers of the module (timm's BatchNormAct2d, the ATen
    form): the batchnorm rule with those buffers as the op's own state."""
    buffers = dict(b.root.named_buffers())
    x_in = b.inputs
    if not isinstance(_get(at, kt, 0, "input"), InputRef) or _get(at, kt, 0, "input").index != 0:
        return None
    op = b.make("batch_norm", "batchnorm", attrs={"training": bool(_get(av, kv, 5, "training", False)),
                                                  "momentum": _get(av, kv, 6, "momentum", 0.1),
                                                  "eps": _get(av, kv, 7, "eps", 1e-5)}, **mk)
    for pos, local in {1: "running_mean", 2: "running_var", 3: "weight", 4: "bias"}.items():
        ref = _get(at, kt, pos, local)
        if isinstance(ref, ParamRef):
            q = b.params[ref.name]
            op.params[local] = q
            op.param_shapes[local] = tuple(_param_shape(b, q))
        elif isinstance(ref, InputRef):
            src = b.ops_by_name[x_in[ref.index]]
            if ref.index == 0 or src.kind != "constant" or src.target not in buffers:
                return None
            op.buffers[local] = src.target
            op.buffer_shapes[local] = tuple(buffers[src.target].shape)
        elif ref is not None:
            return None
    if len(op.output_shape) < 2 or any(len(s) != 1 or s[0] != op.output_shape[1]
                                       for s in list(op.param_shapes.values()) + list(op.buffer_shapes.values())):
        return None
    counter = op.buffers.get("running_mean", "").rsplit(".", 1)[0] + ".num_batches_tracked"
    if op.attrs["training"] and counter in buffers:  # the rule counts batches, as BatchNorm2d does
        op.buffers["num_batches_tracked"] = counter
        op.buffer_shapes["num_batches_tracked"] = tuple(buffers[counter].shape)
    op.inputs, op.input_shapes, op.input_dtypes = op.inputs[:1], op.input_shapes[:1], op.input_dtypes[:1]
    return op


def _params_broadcast(b) -> bool:
    out = tuple(b.value.shape)
    for q in b.params.values():
        s = tuple(_param_shape(b, q))
        if len(s) > len(out) or any(a != o and a != 1 for a, o in zip(reversed(s), reversed(out))):
            return False
    return True


def _broadcasts(b, x_in) -> bool:
    out = tuple(b.value.shape)
    for i in x_in:
        s = b.ops_by_name[i].output_shape
        if len(s) > len(out):
            return False
        for a, o in zip(reversed(s), reversed(out)):
            if a != o and a != 1:
                return False
    return True


def _str_padding(pad: str, kernel, dilation):
    if pad == "valid":
        return tuple(0 for _ in kernel)
    # 'same' with stride 1; odd total padding puts the extra on the right in
    # torch, which a symmetric number cannot express: fall back to whole ops.
    totals = [d * (k - 1) for k, d in zip(_pair(kernel, len(kernel)), _pair(dilation, len(kernel)))]
    return tuple(t // 2 for t in totals)


def _perm(name, av, kv, rank):
    if name == "t":
        return [1, 0] if rank == 2 else list(range(rank))
    if name == "permute":
        dims = av[1:] if len(av) > 1 else kv.get("dims")
        if len(dims) == 1 and isinstance(dims[0], (tuple, list)):
            dims = dims[0]
        return [d % rank for d in dims]
    if name in ("transpose", "swapaxes", "swapdims"):
        a = _get(av, kv, 1, "dim0") % rank
        c = _get(av, kv, 2, "dim1") % rank
        perm = list(range(rank))
        perm[a], perm[c] = perm[c], perm[a]
        return perm
    return None


def _reduce_attrs(in_shape, av, kv, out_shape):
    dim = _get(av, kv, 1, "dim")
    keep = bool(_get(av, kv, 2, "keepdim", False))
    rank = len(in_shape)
    if dim is None or isinstance(dim, torch.dtype):
        reduced = set(range(rank))
    else:
        reduced = {d % rank for d in (dim if isinstance(dim, (tuple, list)) else [dim])}
    amap = []
    for ia in range(rank):
        if ia in reduced:
            if keep:
                amap.append(None)
        else:
            amap.append(ia)
    if len(amap) != len(out_shape):
        return None, (), keep
    return {"axis_map": amap}, tuple(sorted(reduced)), keep


def _pool(b, name, module, av, kv, mk):
    n = 1 if "1d" in name else 2
    in_shape = b.ops_by_name[b.inputs[0]].output_shape if b.inputs else None
    if in_shape is None or len(b.inputs) != 1 or b.params:
        return None
    mode = "max" if "max" in name else "avg"
    if name.startswith("adaptive"):
        out_sp = tuple(b.value.shape[2:])
        in_sp = tuple(in_shape[2:])
        if any(i % o for i, o in zip(in_sp, out_sp)):
            return b.make(name, "pool", attrs={"native": True, "spatial_split": False, "mode": mode}, **mk)
        k = tuple(i // o for i, o in zip(in_sp, out_sp))
        attrs = _spatial_attrs(n, k, k, 0, 1)
        attrs["mode"] = mode
        return b.make(name, "pool", attrs=attrs, **mk)
    if module is not None:
        if getattr(module, "return_indices", False):
            return None
        k, s, p = module.kernel_size, module.stride or module.kernel_size, module.padding
        d = getattr(module, "dilation", 1)
        ceil = module.ceil_mode
        cip = getattr(module, "count_include_pad", True)
        div = getattr(module, "divisor_override", None)
    else:
        k = _get(av, kv, 1, "kernel_size")
        s = _get(av, kv, 2, "stride") or k
        p = _get(av, kv, 3, "padding", 0)
        if mode == "max":
            d = _get(av, kv, 4, "dilation", 1)
            ceil = _get(av, kv, 5, "ceil_mode", False)
            if _get(av, kv, 6, "return_indices", False):
                return None
            cip, div = True, None
        else:
            d = 1
            ceil = _get(av, kv, 4, "ceil_mode", False)
            cip = _get(av, kv, 5, "count_include_pad", True)
            div = _get(av, kv, 6, "divisor_override", None)
    attrs = _spatial_attrs(n, k, s, p, d)
    attrs["mode"] = mode
    attrs["divisor_override"] = div
    if ceil or (mode == "avg" and not cip and any(attrs["padding"])):
        attrs.update(native=True, spatial_split=False)
    return b.make(name, "pool", attrs=attrs, **mk)
