"""The graph of one micro-batch: the same model traced again with every input's batch cut.

A pipeline's ops split one micro-batch (``Strategy.pipeline``); its tasks are timed on the
graph a micro-batch makes.  Tracing runs on fake tensors, so the new graph costs no memory
and, for a model on the meta device, seconds.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.utils._pytree as pytree

from .ir import OpGraph

__all__ = ["microbatch_graph"]


def microbatch_graph(graph: OpGraph, microbatches: int) -> OpGraph:
    """``graph``'s model traced on inputs whose batch is ``1/microbatches`` of its own
    (cached on the graph).  The ops keep their names; a model whose ops change with the
    batch size is a ``ValueError`` saying which."""
    if microbatches == 1:
        return graph
    cache = graph.__dict__.setdefault("_microbatch_graphs", {})
    hit = cache.get(microbatches)
    if hit is not None:
        return hit
    module = graph.module
    if module is None:
        raise ValueError("this graph carries no module, so it cannot be traced per micro-batch")
    B = graph.batch_size
    if B is None or B % microbatches:
        raise ValueError(f"{microbatches} micro-batches do not divide the batch of {B}")
    ref = next(iter(module.parameters()), None)
    if ref is None:
        ref = next(iter(module.buffers()), None)
    device = ref.device if ref is not None else torch.device("cpu")
    tensors, axes = [], []
    for op in graph.ops:
        if op.kind != "input":
            continue
        axis = op.attrs.get("batch_axis")
        shape = list(op.output_shape)
        if axis is not None:
            shape[axis] //= microbatches
        axes.append(axis)
        tensors.append(torch.zeros(shape, dtype=op.dtype, device=device))
    from .trace import trace
    if graph.call_spec is None:
        micro = trace(module, tuple(tensors), frontend=graph.frontend, batch_dim=axes)
    else:
        spec = graph.call_spec
        it = iter(tensors)
        args = tuple(next(it) for _ in range(spec.num_args))
        kwargs = pytree.tree_map(lambda v: next(it) if isinstance(v, torch.Tensor) else v, spec.kwargs)
        micro = trace(module, args, kwargs, frontend="export", batch_dim=axes)
    have = {op.name: op.kind for op in graph.ops}
    got = {op.name: op.kind for op in micro.ops}
    if have != got:
        diff = sorted(set(have.items()) ^ set(got.items()))[:3]
        raise ValueError(f"the model traced on a micro-batch of {B // microbatches} has other ops than "
                         f"on its batch of {B} (first differences: {diff}): a pipeline needs a model whose "
                         "ops do not depend on the batch size")
    # an op whose dims the micro-batch's trace names otherwise (one sample is read as no batch
    # at all: its axis of size 1 is not a dim) keeps the full graph's, so that the full graph's
    # strategies fit it: a sample dim then spans the micro-batch's own extent along its axis (a
    # batch reshaped into a fixed number of groups keeps them), a reduction dim a micro-batch
    for op in micro.ops:
        full, shape = graph.op(op.name), op.output_shape
        if [(d.name, d.kind, d.axis) for d in op.dims] == [(d.name, d.kind, d.axis) for d in full.dims]:
            continue
        dims = []
        for d in full.dims:
            if d.kind == "sample":
                size = shape[d.axis] if d.axis is not None and d.axis < len(shape) else d.size // microbatches
                d = dataclasses.replace(d, size=size, unit=d.unit if size % d.unit == 0 else 1)
            dims.append(d)
        op.dims = dims
    micro.batch_size = B // microbatches
    micro.whole_reasons = dict(graph.whole_reasons)
    cache[microbatches] = micro
    return micro
