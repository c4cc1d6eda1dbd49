"""A strategy checked before it runs: every partition, computed on ``meta`` tensors (shapes,
no memory, no time) from the regions it reads, gives the shape of its output region.

A partition whose rule computes another shape would, on the devices, send or receive
the wrong number of elements: a peer then waits on a receive until the timeout.  Here it
is a :class:`StrategyError` at setup that names the op, the partition and both shapes.
Partitions alike (the same block and region shapes) are checked once; a rule that cannot
run on meta tensors (an opaque module that reads values) is not checked.
"""
from __future__ import annotations

import torch

from ..graph.ir import OpGraph
from ..graph.ops import RULES
from ..graph.ops.base import region_shape
from .config import StrategyError
from .regions import partitions

__all__ = ["check_partition_shapes"]


def check_partition_shapes(graph: OpGraph, strategy) -> int:
    """Raise :class:`StrategyError` at the first partition whose computed output shape is
    not its region's; returns the number of partitions checked."""
    checked = 0
    seen = set()
    for op in graph.compute_ops:
        if op.rule in ("base",) or op.kind == "constant":
            continue
        config = strategy[op.name]
        if len(config.devices) == 1 and not config.degrees:
            continue  # whole: the module's own call
        rule = RULES[op.rule]
        for part in partitions(op, config):
            ins = [None if r is None else region_shape(r) for r in part.inputs]
            ps = {k: region_shape(r) for k, r in part.params.items()}
            key = (op.name, tuple(sorted((k, b - a) for k, (a, b) in part.block.items())), tuple(ins),
                   tuple(sorted(ps.items())))
            if key in seen:
                continue
            seen.add(key)
            xs = [None if s is None else torch.empty(s, dtype=dt, device="meta")
                  for s, dt in zip(ins, op.input_dtypes)]
            params = {k: torch.empty(s, dtype=op.dtype if op.dtype.is_floating_point else torch.float32,
                                     device="meta") for k, s in ps.items()}
            try:
                y = rule.compute(op, part.block, xs, params)
            except Exception:  # noqa: BLE001 - a rule that cannot run on meta: not checked
                continue
            checked += 1
            if not isinstance(y, torch.Tensor):
                continue
            want = region_shape(part.output)
            if tuple(y.shape) != tuple(want) and y.numel() != 0:
                raise StrategyError(
                    f"{op.describe()}: under {config} partition {part.index} (block {part.block}) "
                    f"computes a {tuple(y.shape)} output where its region is {tuple(want)}: the plan "
                    "cannot run (its exchanges would not match)")
    return checked
