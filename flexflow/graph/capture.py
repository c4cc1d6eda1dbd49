"""torch.export front end: a model as its library ships it -> fx graph in the
form :func:`flexflow.graph.trace._build_graph` reads.

``torch.export.export(module, args, kwargs, strict=False)`` captures the
training IR (ATen ops before decompositions: ``aten.linear``, ``conv2d``,
``layer_norm``, ``scaled_dot_product_attention``, ...).  This module turns
that graph back into the functional form the partition rules know:

- parameters and buffers become ``get_attr`` nodes on the user's module (by
  their qualified names), user inputs placeholders (tensors only, in the
  order of ``CallSpec.flatten``);
- every ATen op with a rule is rewritten to its ``torch.nn.functional`` /
  ``torch`` form (``_TRANSLATE``); the others keep their ATen target and
  become opaque ops (sample split or whole);
- a sub-graph that reads no user input or parameter (position ids, causal
  masks, rotary tables) is evaluated once here and becomes a constant;
- GPT-2's ``view -> addmm -> view`` (its Conv1D) becomes one ``linear_t``.

The module's output structure (a Hugging Face ``ModelOutput``, a dict, a
tuple) is kept as a pytree spec; the graph's outputs are that structure with
op names at the leaves.
"""
from __future__ import annotations

import inspect
import itertools
import operator
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
import torch.utils._pytree as pytree

__all__ = ["export_graph", "CallSpec", "CaptureError", "linear_t", "write_into"]

aten = torch.ops.aten


def linear_t(x, weight, bias=None):
    """``x @ weight + bias`` with ``weight`` stored (in, out), as GPT-2's Conv1D."""
    y = torch.matmul(x, weight)
    return y + bias if bias is not None else y


class CaptureError(RuntimeError):
    """An op of the exported graph that the front end cannot translate."""


class CallSpec:
    """How the traced call took its inputs: keyword names in order and the
    values of the non-tensor leaves, so a later call flattens alike."""

    def __init__(self, num_args: int, kwargs: dict):
        self.num_args = num_args
        self.kwargs = dict(kwargs)

    def flatten(self, args, kwargs) -> list:
        if len(args) != self.num_args:
            raise TypeError(f"the model was traced with {self.num_args} positional inputs, got {len(args)}")
        extra = set(kwargs) - set(self.kwargs)
        if extra:
            raise TypeError(f"keyword inputs {sorted(extra)} were not in example_kwargs "
                            f"({sorted(self.kwargs)}); the graph is fixed by the traced call")
        ordered = {k: kwargs.get(k, v) for k, v in self.kwargs.items()}
        leaves, _ = pytree.tree_flatten((tuple(args), ordered))
        return [x for x in leaves if isinstance(x, torch.Tensor)]


def _with_defaults(module, kwargs: dict) -> dict:
    """Training captures no key/value cache: ``use_cache=False`` unless given."""
    kwargs = dict(kwargs)
    try:
        params = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return kwargs
    if "use_cache" in params and "use_cache" not in kwargs:
        kwargs["use_cache"] = False
    return kwargs


# --------------------------------------------------------------------------- translation
_RED = {0: "none", 1: "mean", 2: "sum"}


def _embedding(w, idx, padding_idx=-1, *rest):
    return F.embedding, (idx, w, None if padding_idx == -1 else padding_idx), {}


def _slice(x, dim=0, start=None, end=None, step=1):
    rank = len(x.meta["val"].shape) if isinstance(x, fx.Node) else x.dim()
    idx = [slice(None)] * rank
    idx[dim % rank] = slice(start, end, step if step != 1 else None)
    return operator.getitem, (x, tuple(idx)), {}


def _cross_entropy(x, target, weight=None, reduction=1, ignore_index=-100, label_smoothing=0.0):
    return F.cross_entropy, (x, target), {"weight": weight, "ignore_index": ignore_index,
                                          "reduction": _RED[reduction], "label_smoothing": label_smoothing}


def _batch_norm(x, w, b, rm, rv, training, momentum, eps, *rest):
    return F.batch_norm, (x, rm, rv, w, b, training, momentum, eps), {}


def _layer_norm(x, shape, w=None, b=None, eps=1e-5, *rest):
    return F.layer_norm, (x, shape, w, b, eps), {}


def _same(fn, n=None):
    def tr(*args, **kwargs):
        return fn, args if n is None else args[:n], kwargs
    return tr


_TRANSLATE = {
    aten.linear.default: _same(F.linear),
    aten.conv1d.default: _same(F.conv1d),
    aten.conv2d.default: _same(F.conv2d),
    aten.embedding.default: _embedding,
    aten.layer_norm.default: _layer_norm,
    aten.batch_norm.default: _batch_norm,
    aten.cross_entropy_loss.default: _cross_entropy,
    aten.scaled_dot_product_attention.default: _same(F.scaled_dot_product_attention),
    aten.view.default: _same(torch.reshape),
    aten.reshape.default: _same(torch.reshape),
    aten._unsafe_view.default: _same(torch.reshape),
    aten.slice.Tensor: _slice,
    aten.dropout.default: _same(F.dropout),
    aten.softmax.int: _same(torch.softmax, 2),
    aten._softmax.default: _same(torch.softmax, 2),
    aten.log_softmax.int: _same(torch.log_softmax, 2),
    aten.matmul.default: _same(torch.matmul),
    aten.bmm.default: _same(torch.bmm),
    aten.max_pool2d.default: _same(F.max_pool2d),
    aten.avg_pool2d.default: _same(F.avg_pool2d),
    aten.adaptive_avg_pool2d.default: _same(F.adaptive_avg_pool2d),
    aten.adaptive_avg_pool1d.default: _same(F.adaptive_avg_pool1d),
    aten.flatten.using_ints: _same(torch.flatten),
}

_RANDOM = {"dropout", "native_dropout", "rand", "randn", "rand_like", "randn_like", "randint",
           "randint_like", "bernoulli", "normal", "uniform", "multinomial", "randperm",
           "feature_dropout", "alpha_dropout", "feature_alpha_dropout"}
_SKIP = {"_assert_tensor_metadata", "_assert_async", "_assert_scalar", "sym_constrain_range_for_size",
         "sym_constrain_range", "_check_is_size"}


def _packet(target) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return target.overloadpacket.__name__
    return getattr(target, "__name__", str(target))


class _Constants:
    """Holds one captured graph's constants; graphs are read by attribute path."""


_HOLDERS = itertools.count()


class _Value:
    """A constant folded at capture time."""

    def __init__(self, tensor):
        self.tensor = tensor


def export_graph(module: torch.nn.Module, args: tuple, kwargs: dict):
    """(fx graph, flat tensor inputs, output spec, CallSpec) of ``module(*args, **kwargs)``."""
    kwargs = _with_defaults(module, kwargs or {})
    ep = torch.export.export(module, tuple(args), kwargs, strict=False)
    return _rebuild(module, ep, args, kwargs)


def _rebuild(root, ep, args, kwargs):
    sig = ep.graph_signature
    specs = {s.arg.name: s for s in sig.input_specs if hasattr(s.arg, "name")}
    consts = dict(ep.constants)
    g = fx.Graph()
    env: dict[fx.Node, Any] = {}  # export node -> new node | _Value | python value
    user_leaves = list(pytree.tree_leaves((tuple(args), kwargs)))
    user_i = 0
    nconst = [0]

    holder = _Constants()  # this graph's folded constants, beside (not inside) the module's state
    hname = f"_ff_capture{next(_HOLDERS)}"
    root.__dict__[hname] = holder

    def const_node(t: torch.Tensor, like: fx.Node):
        i = nconst[0]
        nconst[0] += 1
        setattr(holder, f"c{i}", t)
        n = g.create_node("get_attr", f"{hname}.c{i}", name=f"ff_constant{i}")
        n.meta.update(_meta(like))
        n.meta["ff_value"] = t
        return n

    def use(x):
        """The new graph's argument for an export-graph argument."""
        def one(a):
            if not isinstance(a, fx.Node):
                return a
            v = env[a]
            if isinstance(v, _Value):
                if "node" not in v.__dict__:
                    v.node = const_node(v.tensor, a)
                return v.node
            return v
        return fx.node.map_aggregate(x, one)

    def real(x):
        return fx.node.map_aggregate(x, lambda a: env[a].tensor if isinstance(a, fx.Node) else a)

    out_node = None
    for node in ep.graph.nodes:
        if node.op == "placeholder":
            spec = specs[node.name]
            kind = spec.kind.name
            if kind in ("PARAMETER", "BUFFER"):
                n = g.get_attr(spec.target)
                n.meta["ff_value"] = node.meta.get("val")
                env[node] = n
                if kind == "BUFFER" and spec.persistent is False:
                    # a non-persistent buffer (position ids, rotary frequencies) is a constant
                    env[node] = _Value(_fetch(root, spec.target))
            elif kind in ("CONSTANT_TENSOR", "CUSTOM_OBJ"):
                env[node] = _Value(consts[spec.target])
            else:  # USER_INPUT, in pytree order of (args, kwargs)
                while user_i < len(user_leaves) and user_leaves[user_i] is None:
                    user_i += 1
                value = user_leaves[user_i] if user_i < len(user_leaves) else None
                user_i += 1
                if isinstance(value, torch.Tensor):
                    n = g.placeholder(node.name)
                    n.meta["ff_value"] = node.meta.get("val")
                    env[node] = n
                else:
                    env[node] = value
            continue
        if node.op == "output":
            out_node = node
            continue
        if node.op != "call_function":
            raise RuntimeError(f"unexpected {node.op} node {node.name} in the exported graph")
        try:
            _translate(node, env, g, use, real)
        except CaptureError:
            raise
        except Exception as e:  # noqa: BLE001 - name the op and the model's line
            raise CaptureError(f"cannot capture {node.target} ({node.name}) at {_where(node)}: "
                               f"{type(e).__name__}: {e}") from e
    # outputs: the user's, in the order of the output spec
    by_name = {a.name: a for a in out_node.args[0] if isinstance(a, fx.Node)}
    flat = []
    for s in sig.output_specs:
        if s.kind.name != "USER_OUTPUT":
            continue
        arg = by_name.get(getattr(s.arg, "name", None))
        flat.append(use(arg) if arg is not None else getattr(s.arg, "value", None))
    g.output(tuple(flat))
    g.eliminate_dead_code()
    tensors = [x for x in user_leaves if isinstance(x, torch.Tensor)]
    return g, tensors, ep.call_spec.out_spec, CallSpec(len(args), kwargs)


_VIEWS = {aten.slice.Tensor, aten.select.int, aten.alias.default, aten.unsqueeze.default,
          aten.view.default, aten.transpose.int}


def _mutates(target) -> bool:
    """An ATen op that writes into its first argument (``copy_``, ``fill_``, ``masked_fill_``)."""
    if not isinstance(target, torch._ops.OpOverload) or not target._schema.arguments:
        return False
    info = target._schema.arguments[0].alias_info
    return bool(info is not None and info.is_write)


def write_into(base, path, op, *args, **kwargs):
    """A copy of ``base`` with ``op`` applied in place to the view ``path``
    (``[(view op, its literal args), ...]``) of it: an in-place write as a value."""
    out = base.clone()
    view = out
    for fn, vargs in path:
        view = fn(view, *vargs)
    op(view, *args, **kwargs)
    return out


def _functionalize(node, env, g, use, real):
    """An in-place write into a tensor the graph made (``shifted[:, 0] = start``)
    becomes a ``write_into`` op whose value replaces that tensor for every
    later reader."""
    target, path = node.args[0], []
    while isinstance(target, fx.Node) and target.target in _VIEWS:
        if any(isinstance(a, fx.Node) for a in target.args[1:]):
            break
        path.append((target.target, tuple(target.args[1:])))
        target = target.args[0]
    path.reverse()
    rest = node.args[1:]
    if not isinstance(target, fx.Node) or target.op == "placeholder" and not isinstance(env[target], _Value):
        if isinstance(target, fx.Node) and target.op == "placeholder":
            return  # a write into a buffer (BatchNorm's counter): the rules keep that state
        raise CaptureError(f"cannot capture the in-place {node.target} ({node.name}) at {_where(node)}: "
                           "it writes into a model input; write into a copy instead")
    functional = _functional_of(node.target) if not path else None
    if functional is not None and not isinstance(env.get(target), _Value):
        n = g.call_function(functional, use(tuple(node.args)), use(dict(node.kwargs)))  # x += y -> x + y
        n.meta.update(_meta(node))
        n.meta["ff_value"] = node.meta.get("val")
        env[target] = env[node] = n
        return
    ins = [target] + [a for a in node.all_input_nodes if a is not node.args[0]]
    if all(isinstance(env.get(a), _Value) for a in ins):
        env[target] = _Value(write_into(env[target].tensor, path, node.target, *real(rest), **real(node.kwargs)))
    else:
        n = g.call_function(write_into, (use(target), path, node.target) + use(tuple(rest)),
                            use(dict(node.kwargs)))
        n.meta.update(_meta(node))
        n.meta["ff_value"] = target.meta.get("val")
        env[target] = n
    if not path:  # the op's result is the written tensor itself
        env[node] = env[target]


def _functional_of(target):
    """aten.add_.Tensor -> aten.add.Tensor (None when there is no such overload)."""
    name = target.overloadpacket.__name__
    if not name.endswith("_") or name.startswith("_"):
        return None
    packet = getattr(aten, name[:-1], None)
    return getattr(packet, target._overloadname, None) if packet is not None else None


def _where(node) -> str:
    from .sourceinfo import _source_of
    return _source_of(node) or node.name


def _fetch(root, qual: str):
    obj = root
    for part in qual.split("."):
        obj = getattr(obj, part)
    return obj


def _translate(node, env, g, use, real) -> None:
    """Add the new graph's node(s) for one call_function node of the export graph."""
    name = _packet(node.target).strip("_")
    if name in _SKIP or node.meta.get("ff_fused"):
        return
    ins = [a for a in node.all_input_nodes]
    val = node.meta.get("val")
    foldable = (name not in _RANDOM and all(isinstance(env.get(a), _Value) for a in ins)
                and (isinstance(val, torch.Tensor) or isinstance(val, (list, tuple)) and val
                     and all(isinstance(v, torch.Tensor) for v in val)))
    if foldable:
        env[node] = _Value(node.target(*real(node.args), **real(node.kwargs)))
        return
    if _mutates(node.target):
        _functionalize(node, env, g, use, real)
        return
    if node.target is operator.getitem:
        src = env[node.args[0]]
        n = g.call_function(operator.getitem, (src, node.args[1]))
    elif node.target is aten.addmm.default and _fuse_conv1d(node, env, g, use):
        return
    else:
        tr = _TRANSLATE.get(node.target)
        if tr is not None:
            fn, a, k = tr(*node.args, **node.kwargs)
        else:
            fn, a, k = node.target, node.args, node.kwargs
        n = g.call_function(fn, use(tuple(a)), use(dict(k)))
    n.meta.update(_meta(node))
    n.meta["ff_value"] = node.meta.get("val")
    env[node] = n


def _meta(node: fx.Node) -> dict:
    return {k: node.meta[k] for k in ("stack_trace", "nn_module_stack") if k in node.meta}


def _fuse_conv1d(node, env, g, use) -> bool:
    """addmm(b, view(x, (-1, I)), W) followed by view(., x.shape[:-1] + (O,)):
    one linear_t on x (keeps the batch axis visible to the rules)."""
    bias, x2d, w = node.args[:3]
    if node.kwargs or not all(isinstance(a, fx.Node) for a in (bias, x2d, w)):
        return False
    if x2d.target not in (aten.view.default, aten.reshape.default, aten._unsafe_view.default):
        return False
    x = x2d.args[0]
    users = list(node.users)
    if len(users) != 1 or users[0].target not in (aten.view.default, aten.reshape.default):
        return False
    xs, ys = tuple(x.meta["val"].shape), tuple(users[0].meta["val"].shape)
    if len(xs) < 2 or xs[:-1] != ys[:-1]:
        return False
    n = g.call_function(linear_t, use((x, w, bias)))
    n.meta.update(_meta(node))
    n.meta["ff_value"] = users[0].meta["val"]
    env[node] = n  # the addmm and its trailing view are this one node
    env[users[0]] = n
    users[0].meta["ff_fused"] = True
    return True
