"""Run an OpGraph in one process, op by op, partition by partition.

The reference semantics of a strategy: every partition is computed from
exactly the input and parameter regions :func:`flexflow.strategy.partitions`
says it reads, and the partitions are stitched (or summed, for partial
outputs) into each op's output.  Tests compare it with the module itself; the
executor is its distributed version.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree

from ..graph.ir import Op, OpGraph
from ..graph.ops import RULES
from .config import ParallelConfig
from .layout import Reordering
from .regions import partitions
from .strategy import Strategy

__all__ = ["run_graph", "param_view", "constant_value_of", "whole_config", "compute_partition",
           "fill_outputs"]


def whole_config(op: Op) -> ParallelConfig:
    return ParallelConfig({}, (0,))


def param_view(module: torch.nn.Module, qual: str, view) -> torch.Tensor:
    """A parameter or buffer of ``module`` by qualified name, in its view shape."""
    t = module.get_parameter(qual) if _is_param(module, qual) else module.get_buffer(qual)
    return t.view(view) if tuple(t.shape) != tuple(view) else t


def _is_param(module, qual) -> bool:
    try:
        module.get_parameter(qual)
        return True
    except AttributeError:
        return False


def compute_partition(op: Op, part, inputs: list, params: dict) -> torch.Tensor:
    """One partition's output from its input and parameter regions."""
    return RULES[op.rule].compute(op, part.block, inputs, params)


def run_graph(graph: OpGraph, module: torch.nn.Module, inputs, strategy: Strategy | None = None):
    """Outputs of the graph computed op by op (on the partitions of ``strategy``)."""
    if not isinstance(inputs, (tuple, list)):
        inputs = (inputs,)
    values: dict[str, torch.Tensor] = {}
    order = Reordering.of(graph, strategy) if strategy is not None else None  # (a head-tail token layout)
    input_ops = [op for op in graph.ops if op.kind == "input"]
    for i, op in enumerate(input_ops):
        values[op.name] = inputs[i] if order is None else order.value(op.name, inputs[i])
    for op in graph.ops:
        if op.kind == "input":
            continue
        if op.kind == "constant":
            values[op.name] = constant_value_of(op, module)
            if order is not None:
                values[op.name] = order.value(op.name, values[op.name])
            continue
        config = strategy[op.name] if (strategy is not None and not op.everywhere) else whole_config(op)
        parts = partitions(op, config)
        params = {local: param_view(module, q, op.param_views.get(local, op.param_shapes[local]))
                  for local, q in op.params.items()}
        params.update({local: param_view(module, q, op.buffer_shapes[local])
                       for local, q in op.buffers.items()})
        out = None
        for p in parts:
            ins = [None if r is None else values[src][r] for src, r in zip(op.inputs, p.inputs)]
            ps = {k: params[k][r] for k, r in p.params.items()}
            y = compute_partition(op, p, ins, ps)
            if len(parts) == 1:
                out = y
                break
            if out is None:
                out = torch.zeros(op.output_shape, dtype=y.dtype)
            if p.partial:
                out[p.output] = out[p.output] + y
            else:
                out[p.output] = y
        values[op.name] = out if order is None else order.value(op.name, out)
    if order is not None:
        values.update({n: order.output(n, values[n]) for n in order.layout.outputs})
    return fill_outputs(graph.outputs, values)


def constant_value_of(op: Op, module) -> torch.Tensor:
    obj = module
    for part in op.target.split("."):
        obj = getattr(obj, part)
    return obj


def fill_outputs(x: Any, values):
    """The graph's output structure with each op name replaced by its value
    (tuples, lists, dicts, named tuples and pytree-registered classes such as
    Hugging Face's ModelOutput keep their type)."""
    if isinstance(x, str):
        return values.get(x, x)
    if isinstance(x, (list, tuple, dict)) and type(x) in (list, tuple, dict):
        if isinstance(x, dict):
            return {k: fill_outputs(v, values) for k, v in x.items()}
        return type(x)(fill_outputs(y, values) for y in x)
    leaves, spec = pytree.tree_flatten(x)
    if len(leaves) == 1 and leaves[0] is x:
        return x
    return pytree.tree_unflatten([fill_outputs(y, values) for y in leaves], spec)
