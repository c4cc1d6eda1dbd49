"""The operator graph: what the tracer produces and everything after consumes.

An :class:`Op` is one operator of the model with its output shape, dtype,
parameters and the dims along which SOAP may split it.  An :class:`OpGraph`
holds the ops in topological order.  Nothing here imports
``torch.distributed``.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["Dim", "Op", "OpGraph", "InputRef", "ParamRef", "dtype_bytes", "repeated_block"]


_DTYPE_BYTES: dict = {torch.bool: 1}


def dtype_bytes(dtype: torch.dtype) -> int:
    """Bytes per element of ``dtype`` (the simulator asks tens of times per proposal)."""
    n = _DTYPE_BYTES.get(dtype)
    if n is None:
        n = _DTYPE_BYTES[dtype] = torch.empty((), dtype=dtype).element_size()
    return n


def repeated_block(module_path: str) -> str:
    """The repeated block an op ran in: its module's qualified name up to and including the
    first component that is an index (``"layers.3.mlp.up"`` -> ``"layers.3"``, ``"h.11"``
    -> ``"h.11"``); ``""`` outside such a block.  Recomputed ops of one block form one
    checkpoint, as checkpointing a whole transformer block does: a recomputed op's input
    made by a recomputed op of its own block is not kept for the backward but made again
    (:mod:`flexflow.runtime.recompute`, :mod:`flexflow.sim.memory`)."""
    parts = module_path.split(".") if module_path else []
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[:i + 1])
    return ""


@dataclass(frozen=True)
class Dim:
    """One parallelizable dim of an op.

    ``axis`` is the output axis the dim indexes, or ``None`` for a reduction
    dim (splitting it leaves each partition with a partial sum of the whole
    output block, e.g. the sample dim of a loss).
    """

    name: str  # short name used in configs: n, c, h, w, l, s, e, i, j, ...
    kind: str  # "sample" | "attribute" | "parameter"
    axis: int | None  # output axis, None for a reduction dim
    size: int  # extent along the dim
    # blocks start and stop at multiples of ``unit``: a dim that merges a batch of B with
    # the dims after it ((B*T) rows, unit T) splits into at most B blocks, each the rows of
    # whole samples, so that its blocks are the batch's blocks
    unit: int = 1

    @property
    def blocks(self) -> int:
        """The most blocks the dim splits into (its size in units)."""
        return self.size // self.unit


@dataclass(frozen=True)
class InputRef:
    """Marker inside an op's call template: the op's i-th tensor input."""

    index: int


@dataclass(frozen=True)
class ParamRef:
    """Marker inside an op's call template: the op's parameter ``name``."""

    name: str


@dataclass(eq=False)
class Op:
    """One operator of the traced model.

    ``inputs`` names the ops whose outputs are this op's tensor inputs, in
    the order of the call template's :class:`InputRef` markers.
    ``params`` maps the op's local parameter names (``weight``) to the
    qualified names in the module (``layer1.0.conv1.weight``);
    ``param_shapes`` gives their real shapes and ``param_views`` the logical
    shapes in which the op's regions index them (an LSTM cell views its
    (4H, I) weight as (4, H, I) so a hidden-unit split is one block).
    """

    name: str
    kind: str  # specific kind: conv2d, linear, relu, add, lstm_cell, ...
    rule: str  # the partition rule family in flexflow.graph.ops
    inputs: list[str]
    output_shape: tuple[int, ...]
    dtype: torch.dtype
    dims: list[Dim] = field(default_factory=list)
    params: dict[str, str] = field(default_factory=dict)
    param_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    param_views: dict[str, tuple[int, ...]] = field(default_factory=dict)
    buffers: dict[str, str] = field(default_factory=dict)  # BN running stats: local -> qualified
    buffer_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    attrs: dict[str, Any] = field(default_factory=dict)
    # how to call the op on whole tensors: call_function / call_method / call_module
    call_kind: str = "call_function"
    target: Any = None
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    everywhere: bool = False  # graph inputs and constants: present on every device
    share_group: str | None = None  # ops with one group share one config
    source: str = ""  # user source line, when known
    module_path: str = ""  # qualified name of the module that ran the op
    input_shapes: list[tuple[int, ...]] = field(default_factory=list)
    input_dtypes: list[torch.dtype] = field(default_factory=list)
    # per input: whether a gradient flows back into it in training (a parameter feeds it);
    # set by OpGraph, None on a lone op (every floating input then counts as needing one)
    input_grads: tuple | None = None

    def input_needs_grad(self, i: int) -> bool:
        """Whether training computes a gradient for tensor input ``i``."""
        if not self.input_dtypes[i].is_floating_point:
            return False
        return True if self.input_grads is None else bool(self.input_grads[i])

    @property
    def sample_dim(self) -> Dim | None:
        """The dim that splits the batch (kind ``sample``), or None."""
        for d in self.dims:
            if d.kind == "sample":
                return d
        return None

    @property
    def parallel_dims(self) -> dict[str, str]:
        """dim name -> SOAP kind, for the dims this op can split."""
        return {d.name: d.kind for d in self.dims}

    def dim(self, name: str) -> Dim:
        """The parallel dim named ``name`` (a clear ``KeyError`` listing the op's dims
        otherwise)."""
        for d in self.dims:
            if d.name == name:
                return d
        raise KeyError(f"op {self.name} ({self.kind}) has no parallel dim {name!r}; "
                       f"it has {[d.name for d in self.dims]}")

    @property
    def output_bytes(self) -> int:
        """Bytes of the op's whole output."""
        return math.prod(self.output_shape) * dtype_bytes(self.dtype)

    @property
    def param_bytes(self) -> int:
        """Bytes of the op's parameters."""
        return sum(math.prod(s) for s in self.param_shapes.values()) * dtype_bytes(self.dtype)

    @property
    def group(self) -> str:
        """Key of the config-sharing group (the op's own name when alone)."""
        return self.share_group or self.name

    def describe(self) -> str:
        """The op for messages: name, kind, module and source line."""
        where = f" at {self.source}" if self.source else ""
        mod = f" ({self.module_path})" if self.module_path else ""
        return f"{self.name} [{self.kind}]{mod}{where}"

    def __repr__(self) -> str:
        return f"Op({self.name!r}, {self.kind}, out={tuple(self.output_shape)})"


class OpGraph:
    """Ops of a traced model in topological order."""

    def __init__(self, ops: list[Op], outputs: Any, module: torch.nn.Module | None = None,
                 batch_size: int | None = None, opaque: list[str] | None = None):
        self.ops = list(ops)
        self._by_name = {op.name: op for op in self.ops}
        self.outputs = outputs  # the module's output structure with op names at the leaves
        self.module = module
        self.batch_size = batch_size
        self.opaque = list(opaque or [])
        # op name -> why it runs whole though the batch reaches it (graph.batchflow)
        self.whole_reasons: dict[str, str] = {}
        self.consumers: dict[str, list[str]] = {op.name: [] for op in self.ops}
        for op in self.ops:
            for src in op.inputs:
                if op.name not in self.consumers[src]:
                    self.consumers[src].append(op.name)
        self.index = {op.name: i for i, op in enumerate(self.ops)}
        # which values carry a gradient in training: those a trainable parameter feeds
        grad: dict[str, bool] = {}
        for op in self.ops:
            op.input_grads = tuple(grad.get(src, False) for src in op.inputs)
            grad[op.name] = op.dtype.is_floating_point and (bool(op.params) or any(op.input_grads))
        groups: dict[str, list[str]] = {}
        for op in self.compute_ops:
            groups.setdefault(op.group, []).append(op.name)
        self.groups = groups
        self._fingerprint: str | None = None
        self.call_spec = None  # capture.CallSpec when traced with keyword inputs (export)
        self.frontend = "fx"  # "fx" or "export": which front end made the graph

    def flat_inputs(self, args, kwargs=None) -> list:
        """The tensors of a call ``module(*args, **kwargs)``, in the order of the
        graph's input ops."""
        if self.call_spec is not None:
            return self.call_spec.flatten(tuple(args), dict(kwargs or {}))
        if kwargs:
            raise TypeError(f"the model was traced with positional inputs only, got keywords {sorted(kwargs)}")
        return [x for x in args if isinstance(x, torch.Tensor)]

    def __len__(self) -> int:
        return len(self.ops)

    def __iter__(self):
        return iter(self.ops)

    def __contains__(self, name: str) -> bool:
        return name in self._by_name

    def op(self, name: str) -> Op:
        """The op named ``name`` (a clear ``KeyError`` when there is none)."""
        try:
            return self._by_name[name]
        except KeyError:
            raise KeyError(f"the graph has no op named {name!r}") from None

    @property
    def compute_ops(self) -> list[Op]:
        """Ops that a strategy places (all but graph inputs and constants)."""
        return [op for op in self.ops if not op.everywhere]

    def output_names(self) -> list[str]:
        """The names of the ops at the leaves of the module's output structure, in order."""
        names: list[str] = []

        def walk(x):
            if isinstance(x, str):
                names.append(x)
            elif isinstance(x, (list, tuple)):
                for y in x:
                    walk(y)
            elif isinstance(x, dict):
                for y in x.values():
                    walk(y)
        walk(self.outputs)
        return names

    @property
    def param_bytes(self) -> int:
        """Bytes of the model's parameters (each counted once)."""
        seen: dict[str, int] = {}
        for op in self.ops:
            for local, qual in op.params.items():
                seen[qual] = math.prod(op.param_shapes[local]) * dtype_bytes(op.dtype)
        return sum(seen.values())

    def fingerprint(self) -> str:
        """Stable hash of the graph's structure (names, kinds, shapes)."""
        if self._fingerprint is None:
            h = hashlib.sha256()
            for op in self.ops:
                h.update(repr((op.name, op.kind, tuple(op.output_shape), str(op.dtype),
                               tuple(op.inputs), sorted(op.param_shapes.items()),
                               [(d.name, d.size) for d in op.dims])).encode())
            self._fingerprint = h.hexdigest()[:16]
        return self._fingerprint

    def __repr__(self) -> str:
        return f"OpGraph({len(self.ops)} ops, {len(self.compute_ops)} placed)"
