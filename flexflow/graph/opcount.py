"""How many eager (aten) ops one op partition issues, forward and backward.

An eager op costs a roughly fixed dispatch time on top of its work (the
device's ``launch_overhead_s``: the CPU's dispatcher and autograd recording,
a GPU's kernel launch).  A rule's compute can issue many: an LSTM cell on a
CPU is some fifteen aten ops forward and twenty-five backward, a reshape one
and none.  The analytic cost model charges the launch overhead per aten op
counted here, instead of once per graph op.

The count runs the rule on meta tensors of the partition's shapes (no data,
no arithmetic) under a dispatch mode that counts what reaches aten, then
the backward of the output's sum the same way (less the sum's own ops).  A
rule that cannot run on meta tensors (it reads values) counts as one op
each way.
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .ir import Op
from .ops import RULES
from .ops.base import region_shape

__all__ = ["eager_op_counts"]

# bookkeeping ops that dispatch but cost next to nothing
_FREE = {"detach", "alias", "lift_fresh", "_to_copy"}


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ not in _FREE:
            self.n += 1
        return func(*args, **(kwargs or {}))


def _meta(shape, dtype, grad: bool) -> torch.Tensor:
    t = torch.empty(shape, dtype=dtype, device="meta")
    if t.dtype in (torch.int64, torch.int32):
        t = torch.zeros(shape, dtype=dtype, device="meta")
    return t.requires_grad_(grad and t.dtype.is_floating_point)


def eager_op_counts(op: Op, part) -> tuple[int, int]:
    """(forward, backward) aten ops of partition ``part`` of ``op``; (1, 1) when
    the rule does not run on meta tensors."""
    try:
        ins = [None if r is None else _meta(region_shape(r), dt, op.input_needs_grad(i))
               for i, (r, dt) in enumerate(zip(part.inputs, op.input_dtypes))]
        params = {}
        for local, region in part.params.items():
            grad = local in op.params
            params[local] = _meta(region_shape(region), op.dtype if grad else torch.float32, grad)
        rule = RULES[op.rule]
        with torch.enable_grad():
            fwd = _Count()
            with fwd:
                out = rule.compute(op, part.block, ins, params)
            outs = [t for t in (out if isinstance(out, (tuple, list)) else [out])
                    if isinstance(t, torch.Tensor) and t.requires_grad]
            if not outs:
                return max(fwd.n, 1), 0
            total = sum(t.float().sum() for t in outs)
            bwd = _Count()
            with bwd:
                total.backward()
        # the sum and its backward (an expand per output) are the counter's own
        return max(fwd.n, 1), max(bwd.n - 2 * len(outs), 1)
    except Exception:  # noqa: BLE001 - values needed, or an op without a meta kernel
        return 1, 1
