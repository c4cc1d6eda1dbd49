"""torch.fx tracing with concrete shapes -> :class:`OpGraph`.

The tracer runs every node on fake tensors as it records it, so shape reads
(``x.size(0)``, ``x.shape[-1]``) are plain integers and models that read
shapes in Python trace.  Each fx node then becomes an :class:`Op` whose
kind and partition rule come from :mod:`flexflow.graph.ops.catalog`.
"""
from __future__ import annotations

import re
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.node import map_aggregate

# fx patches these while it traces; evaluating a leaf module needs the originals
_ORIG_GETATTR = torch.nn.Module.__getattr__
_ORIG_CALL = torch.nn.Module.__call__

from .. import settings
from .batchflow import settle_batch
from .ir import Op, OpGraph
from .ops import RULES
from .ops.catalog import build_op
from .sourceinfo import _OWN_DIRS, _source_of, _user_frame  # noqa: F401

__all__ = ["trace", "TraceError"]


class TraceError(RuntimeError):
    """The model could not be traced; the message names the module and line."""


class _CProxy(fx.Proxy):
    """A proxy that knows its concrete (fake) value: shape reads are ints."""

    def _v(self):
        return self.node.meta["ff_value"]

    @property
    def shape(self):
        return self._v().shape

    @property
    def ndim(self):
        return self._v().dim()

    @property
    def dtype(self):
        return self._v().dtype

    @property
    def device(self):
        return self._v().device

    @property
    def is_cuda(self):
        return self._v().is_cuda

    def size(self, dim=None):
        v = self._v()
        return v.size() if dim is None else v.size(dim)

    def dim(self):
        return self._v().dim()

    def numel(self):
        return self._v().numel()

    def nelement(self):
        return self._v().numel()

    def __len__(self):
        return len(self._v())

    def __iter__(self):
        for i in range(len(self._v())):
            yield self[i]


class _Tracer(fx.Tracer):
    def __init__(self, root: torch.nn.Module, inputs: tuple):
        super().__init__()
        self.record_stack_traces = True
        self._inputs = list(inputs)
        self._placeholder_count = 0
        self._fake = FakeTensorMode(allow_non_fake_inputs=True)
        self._root = root

    def proxy(self, node):
        return _CProxy(node, self)

    def create_node(self, *args, **kwargs):
        node = super().create_node(*args, **kwargs)
        if "ff_value" not in node.meta:
            node.meta["ff_value"] = self._evaluate(node)
        return node

    def _fake_of(self, t):
        if isinstance(t, torch.Tensor):
            return self._fake.from_tensor(t)
        return t

    def _evaluate(self, node: fx.Node):
        if node.op == "placeholder":
            i = self._placeholder_count
            self._placeholder_count += 1
            if i >= len(self._inputs):
                raise TraceError(f"forward() takes more inputs than the {len(self._inputs)} "
                                 f"example inputs given (missing {node.target!r})")
            return self._fake_of(self._inputs[i])
        if node.op == "get_attr":
            return self._fake_of(_fetch_attr(self.root, node.target))
        if node.op == "output":
            return None

        def val(n):
            return n.meta["ff_value"] if isinstance(n, fx.Node) else n
        args = map_aggregate(node.args, val)
        kwargs = map_aggregate(node.kwargs, val)
        patched = torch.nn.Module.__getattr__, torch.nn.Module.__call__
        torch.nn.Module.__getattr__, torch.nn.Module.__call__ = _ORIG_GETATTR, _ORIG_CALL
        try:
            with self._fake:
                if node.op == "call_module":
                    return _fetch_attr(self.root, node.target)(*args, **kwargs)
                if node.op == "call_method":
                    return getattr(args[0], node.target)(*args[1:], **kwargs)
                return node.target(*args, **kwargs)
        finally:
            torch.nn.Module.__getattr__, torch.nn.Module.__call__ = patched


def _fetch_attr(root, target: str):
    """Attribute by dotted path without Module.__getattr__ (fx patches it)."""
    obj = root
    for part in target.split("."):
        if isinstance(obj, torch.nn.Module):
            for store in (obj._parameters, obj._buffers, obj._modules, obj.__dict__):
                if part in store:
                    obj = store[part]
                    break
            else:
                obj = getattr(obj, part)
        else:
            obj = getattr(obj, part)
    return obj


def trace(module: torch.nn.Module, example_inputs, example_kwargs=None, *,
          frontend: str | None = None, batch_dim=None) -> OpGraph:
    """Trace ``module(*example_inputs, **example_kwargs)`` into an :class:`OpGraph`.

    ``frontend`` (default ``$FLEXFLOW_FRONTEND`` or ``"auto"``): ``"fx"`` is the
    shape-aware symbolic tracer, ``"export"`` torch.export's training IR
    (:mod:`flexflow.graph.capture`); ``"auto"`` tries fx on positional-only calls and
    falls back to export when fx cannot trace the model.

    ``batch_dim``: which dim of each tensor input is the batch (an int for every input,
    or one per input, None for an input without one); default: inferred from the graph
    (:mod:`flexflow.graph.batchflow`), dim 0 where nothing says otherwise.
    """
    if example_inputs is None:
        if not example_kwargs:
            raise ValueError("example_inputs are required: they fix the shapes of every op")
        example_inputs = ()
    if not isinstance(example_inputs, (tuple, list)):
        example_inputs = (example_inputs,)
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"trace() needs an nn.Module, got {type(module).__name__}")
    if example_kwargs is not None and not isinstance(example_kwargs, dict):
        raise TypeError(f"example_kwargs must be a dict, got {type(example_kwargs).__name__}")
    frontend = frontend or settings.frontend()
    if frontend not in ("auto", "fx", "export"):
        raise ValueError(f"frontend must be 'auto', 'fx' or 'export', got {frontend!r}")
    if example_kwargs and frontend == "fx":
        raise ValueError("the fx front end takes positional inputs only; use frontend='export'")
    # Tracing has two side effects we undo: evaluating train-mode BatchNorm
    # bumps num_batches_tracked, and fx stores tensor constants on the module
    # as _tensor_constant{i}, numbered after those an earlier trace left (which
    # would rename the constant ops and change the graph's fingerprint).
    saved = [(b, b.detach().clone()) for b in module.buffers() if b.device.type != "meta"]
    prefixes = ("_tensor_constant",)
    stale = {k: v for k, v in vars(module).items() if k.startswith(prefixes)}
    for k in stale:
        delattr(module, k)
    try:
        if frontend == "export" or example_kwargs:
            return _trace_export(module, tuple(example_inputs), example_kwargs or {}, batch_dim)
        try:
            return _trace(module, tuple(example_inputs), batch_dim)
        except Exception as fx_error:  # noqa: BLE001 - the export front end gets its turn
            if frontend == "fx":
                raise
            for k in [k for k in vars(module) if k.startswith(prefixes)]:
                delattr(module, k)
            try:
                return _trace_export(module, tuple(example_inputs), {}, batch_dim)
            except TraceError as e:
                raise TraceError(f"{e} (the fx tracer failed too: {str(fx_error).splitlines()[0]})") from e
    finally:
        with torch.no_grad():
            for b, v in saved:
                b.copy_(v)
        for k, v in stale.items():  # an earlier graph's constants this trace did not recreate
            if k not in vars(module):
                setattr(module, k, v)


def _trace(module: torch.nn.Module, example_inputs: tuple, batch_dim=None) -> OpGraph:
    tracer = _Tracer(module, example_inputs)
    name = type(module).__name__
    try:
        g = tracer.trace(module)
    except TraceError:
        raise
    except Exception as e:  # noqa: BLE001 - any tracing failure gets one clear error
        where = _user_frame(e.__traceback__)
        at = f" at {where}" if where else ""
        raise TraceError(
            f"cannot trace {name}{at}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}. "
            "torch.fx needs control flow that does not depend on tensor values; shape reads are "
            "fine. Move data-dependent code out of forward(), or wrap it in a leaf module "
            "(it then runs as one opaque op)."
        ) from e
    return _build_graph(module, g, example_inputs, batch_dim)


def _trace_export(module: torch.nn.Module, args: tuple, kwargs: dict, batch_dim=None) -> OpGraph:
    from .capture import export_graph
    name = type(module).__name__
    try:
        g, tensors, out_spec, call_spec = export_graph(module, args, kwargs)
    except Exception as e:  # noqa: BLE001 - any capture failure gets one clear error
        raise TraceError(_export_error(name, e)) from e
    graph = _build_graph(module, g, tuple(tensors), batch_dim)
    names = list(graph.outputs) if isinstance(graph.outputs, (tuple, list)) else [graph.outputs]
    graph.outputs = pytree.tree_unflatten(names, out_spec)
    graph.call_spec = call_spec
    graph.frontend = "export"
    return graph


def _export_error(name: str, e: Exception) -> str:
    from .capture import CaptureError
    if isinstance(e, CaptureError):
        return f"{name}: {str(e).strip().splitlines()[0]}"
    where = _user_frame(e.__traceback__)
    at = f" at {where}" if where else ""
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    op = re.search(r"(aten\.[A-Za-z0-9_.]+)", str(e))
    what = f" in op {op.group(1)}" if op else ""
    return (f"cannot capture {name}{at}{what}: {type(e).__name__}: {first}. torch.export needs "
            "control flow that does not depend on tensor values (use torch.cond, or move that code "
            "out of forward()), and outputs made of tensors, tuples, lists, dicts and registered "
            "dataclasses.")


def _build_graph(root: torch.nn.Module, g: fx.Graph, inputs: tuple, batch_dim=None) -> OpGraph:
    param_names = {id(p): n for n, p in root.named_parameters()}
    batch = next((x.shape[0] for x in inputs if isinstance(x, torch.Tensor) and x.dim() > 0), None)
    ops: list[Op] = []
    by_node: dict[fx.Node, Any] = {}  # node -> op name, or a tuple source spec
    opaque: list[str] = []
    outputs = None
    for node in g.nodes:
        value = node.meta.get("ff_value")
        if node.op == "output":
            outputs = map_aggregate(node.args[0], lambda n: by_node.get(n) if isinstance(n, fx.Node) else n)
            continue
        if _counts_batches(root, node):
            continue
        if node.op == "get_attr" and id(_fetch_attr(root, node.target)) in param_names:
            by_node[node] = ("param", param_names[id(_fetch_attr(root, node.target))])
            continue
        op = build_op(root, node, value, by_node, param_names, ops)
        if op is None:
            continue
        op.source = _source_of(node)
        op.dims = RULES[op.rule].dims(op, batch)
        if op.rule == "opaque" and not op.everywhere:
            opaque.append(op.name)
        ops.append(op)
        by_node[node] = op.name
    _propagate_everywhere(ops)
    settled, whole = settle_batch(ops, root, batch_dim)
    if settled is not None:
        batch = settled
    _assign_share_groups(ops)
    everywhere = {op.name for op in ops if op.everywhere}
    opaque = [name for name in opaque if name not in everywhere]
    graph = OpGraph(ops, outputs, module=root, batch_size=batch, opaque=opaque)
    graph.whole_reasons = whole
    return graph


def _counts_batches(root, node: fx.Node) -> bool:
    """``self.num_batches_tracked.add_(1)`` of a BatchNorm written with F.batch_norm
    (timm's BatchNormAct2d): the batchnorm rule keeps that count itself."""
    if node.op != "call_method" or node.target != "add_" or node.users or not node.args:
        return False
    src = node.args[0]
    return (isinstance(src, fx.Node) and src.op == "get_attr"
            and str(src.target).endswith("num_batches_tracked"))


_RANDOM_KINDS = {"dropout", "dropout2d", "alpha_dropout", "rand", "randn", "rand_like",
                 "randn_like", "bernoulli"}


def _propagate_everywhere(ops: list[Op]) -> None:
    """Ops computed from constants alone are constants too (masks, positions)."""
    by_name = {op.name: op for op in ops}
    for op in ops:
        if (not op.everywhere and op.inputs and not op.params and not op.buffers
                and op.kind not in _RANDOM_KINDS
                and all(by_name[i].everywhere and by_name[i].kind != "input" for i in op.inputs)):
            op.everywhere = True
            op.dims = []


def _assign_share_groups(ops: list[Op]) -> None:
    """Ops that use the same parameters with the same shapes share one config."""
    groups: dict[frozenset, list[Op]] = {}
    for op in ops:
        if op.params and not op.everywhere:
            groups.setdefault(frozenset(op.params.values()), []).append(op)
    for key, members in groups.items():
        if len(members) < 2:
            continue
        sig = {(m.kind, tuple(m.output_shape), tuple(map(tuple, m.input_shapes))) for m in members}
        if len(sig) == 1:
            gname = members[0].module_path or members[0].name
            for m in members:
                m.share_group = "group:" + gname
