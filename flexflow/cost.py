"""Cost model: how long one op partition runs on a device.

``CostModel.op_time(op, part, device)`` returns (forward_s, backward_s).
Measured profiles (see :mod:`flexflow.profile`) are used where the device
kind is the one profiled; elsewhere an analytic roofline estimate:

    time = max(FLOPs / (peak * efficiency[kind]), bytes / bandwidth) + launch overhead

FLOPs come from each op rule's ``flops``; bytes are the partition's input,
output and parameter regions at the op's dtype.
"""
from __future__ import annotations

import math

from .ir import Op, dtype_bytes
from .ops import RULES
from .ops.base import region_numel

__all__ = ["CostModel", "partition_flops", "partition_bytes", "DEFAULT_EFFICIENCY"]

# Fraction of peak FLOP/s an op family reaches in practice (before fitting to
# measurements).  Dense contractions get close to peak; memory-bound families
# are limited by bandwidth anyway.
DEFAULT_EFFICIENCY = {"conv": 0.5, "linear": 0.6, "matmul": 0.6, "lstm_cell": 0.4,
                      "embedding": 0.1, "default": 0.25}


def partition_flops(op: Op, part) -> float:
    """Forward FLOPs of one partition (analytic, from the op rule)."""
    return float(RULES[op.rule].flops(op, part.block))


def partition_bytes(op: Op, part) -> float:
    """Bytes one partition reads and writes in its forward pass."""
    n = region_numel(part.output)
    for r, dt in zip(part.inputs, op.input_dtypes):
        if r is not None:
            n += region_numel(r) * dtype_bytes(dt) / dtype_bytes(op.dtype)
    for r in part.params.values():
        n += region_numel(r)
    return n * dtype_bytes(op.dtype)


class CostModel:
    """Per-partition execution time on a machine's devices, memoized."""

    def __init__(self, machine, efficiency: dict | None = None, profile=None):
        self.machine = machine
        self.efficiency = dict(DEFAULT_EFFICIENCY)
        if efficiency:
            self.efficiency.update(efficiency)
        self.profile = profile  # optional measured times, see flexflow.profile
        self._memo: dict = {}

    def key(self, op: Op, part) -> tuple:
        """What an op partition's time depends on: kind, shapes, dtype, attrs."""
        ins = tuple(None if r is None else tuple(s.stop - s.start for s in r) for r in part.inputs)
        ps = tuple(sorted((k, tuple(s.stop - s.start for s in r)) for k, r in part.params.items()))
        out = tuple(s.stop - s.start for s in part.output)
        attrs = tuple(sorted((k, repr(v)) for k, v in op.attrs.items() if k not in ("spans",)))
        return (op.kind, op.rule, str(op.dtype), out, ins, ps, attrs)

    def op_time(self, op: Op, part, device: int) -> tuple[float, float]:
        """(forward_s, backward_s) of partition ``part`` of ``op`` on ``device``."""
        spec = self.machine.devices[device].spec
        k = (spec.kind, self.key(op, part))
        hit = self._memo.get(k)
        if hit is None:
            hit = None
            if self.profile is not None:
                hit = self.profile.lookup(spec.kind, k[1])
            if hit is None:
                hit = self.analytic(op, part, spec)
            self._memo[k] = hit
        return hit

    def source(self, op: Op, part, device: int) -> str:
        """'measured' or 'analytic': where op_time's figure comes from."""
        spec = self.machine.devices[device].spec
        if self.profile is not None and self.profile.lookup(spec.kind, self.key(op, part)) is not None:
            return "measured"
        return "analytic"

    def analytic(self, op: Op, part, spec) -> tuple[float, float]:
        if op.everywhere:
            return (0.0, 0.0)
        flops = partition_flops(op, part)
        nbytes = partition_bytes(op, part)
        eff = self.efficiency.get(op.rule, self.efficiency["default"])
        fwd_compute = flops / (spec.flops(op.dtype) * eff)
        fwd = max(fwd_compute, nbytes / spec.mem_bw_Bps) + spec.launch_overhead_s
        factor = RULES[op.rule].backward_factor(op)
        bwd = max(fwd_compute * factor, nbytes * factor / spec.mem_bw_Bps) + spec.launch_overhead_s
        if not op.params and factor <= 1.0 and flops == 0.0:
            bwd = spec.launch_overhead_s  # structural ops: a view or a copy
        return (fwd, bwd)
