"""Batch normalization: per-channel parameters and running statistics.

Along a sample (or spatial) split each partition normalizes with the
statistics of its own block, as DistributedDataParallel does: the per-replica
statistics of the paper's data parallelism.  A channel split is exact."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..ir import Op
from .base import Block, Rule, batch_dim, out_region, region_shape, register
from .conv import _spatial_dims


@register("batchnorm")
class BatchNorm(Rule):
    separable = True  # see Rule.separable

    def dims(self, op: Op, batch):
        if len(op.output_shape) == 2:  # BatchNorm1d on (N, C)
            op.attrs["spatial_split"] = False
            shape = op.output_shape
            from ..ir import Dim
            dims = []
            if shape[0] > 1:
                dims.append(batch_dim(0, shape[0], batch))
            if shape[1] > 1:
                dims.append(Dim("c", "parameter", 1, shape[1]))
            return dims
        return _spatial_dims(op, batch, "parameter")

    def regions(self, op: Op, block: Block):
        out = out_region(op, block)
        c = out[1]
        ps = {n: (c,) for n in op.param_shapes}
        for n, shp in op.buffer_shapes.items():
            ps[n] = (c,) if len(shp) == 1 else ()
        return [out], ps

    def compute(self, op, block, inputs, params):
        a = op.attrs
        training = op.target.training if op.call_kind == "call_module" else a.get("training", True)
        rm, rv = params.get("running_mean"), params.get("running_var")
        if training and "num_batches_tracked" in params:
            with torch.no_grad():
                params["num_batches_tracked"].add_(1)
        use_batch = training or rm is None
        return F.batch_norm(inputs[0], rm, rv, params.get("weight"), params.get("bias"),
                            use_batch, a.get("momentum", 0.1) or 0.0, a.get("eps", 1e-5))

    def flops(self, op, block):
        return 8.0 * math.prod(region_shape(out_region(op, block)))
