"""Cost model: how long one op partition runs on a device.

``CostModel.op_time(op, part, device)`` returns (forward_s, backward_s).
Measured profiles (see :mod:`flexflow.profile`) are used where the device
kind is the one profiled and the partition's key was measured; elsewhere an
analytic roofline estimate:

    forward  = max(F / (peak * eff[rule]), B / bandwidth) + launch overhead
    backward = max(k F / (peak * eff[rule]), k B / bandwidth) + launch overhead

F is the partition's forward FLOPs from the op rule's ``flops`` (2 per
multiply-add), B the bytes of its input, output and parameter regions at the
op's dtype, k the rule's ``backward_factor``.  ``eff`` is a per-rule fraction
of peak: defaults below, or fitted from measurements of the same device kind
(:func:`fit_efficiency`, used by :meth:`CostModel.for_machine`).
"""
from __future__ import annotations

import statistics

from .ir import Op, dtype_bytes
from .ops import RULES
from .ops.base import region_numel

__all__ = ["CostModel", "partition_flops", "partition_bytes", "fit_efficiency",
           "DEFAULT_EFFICIENCY", "EFFICIENCY_RANGE"]

# Fraction of peak FLOP/s an op family reaches in practice (before fitting to
# measurements).  Dense contractions get close to peak; memory-bound families
# are limited by bandwidth anyway.
DEFAULT_EFFICIENCY = {"conv": 0.5, "linear": 0.6, "matmul": 0.6, "lstm_cell": 0.4,
                      "embedding": 0.1, "default": 0.25}
EFFICIENCY_RANGE = (0.01, 1.0)  # fitted efficiencies are clipped to this range


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


def fit_efficiency(db, spec, rules=None) -> dict[str, float]:
    """Per-rule efficiency fitted to the measured entries of ``db`` (a
    :class:`flexflow.profile.ProfileDB`, or any iterable of entry dicts with
    ``rule``, ``dtype``, ``flops`` and ``fwd_s``) for a device ``spec``.

    For each rule: the median over its measured entries (with FLOPs > 0) of
    analytic-FLOP-time / measured compute time, where the FLOP time is
    ``flops / spec.flops(dtype)`` and the compute time is the measured forward
    time less the spec's launch overhead (so that the fitted roofline plus the
    overhead reproduces the measurement), clipped to ``EFFICIENCY_RANGE``.
    Rules without data are absent from the result (callers keep defaults).
    ``db`` should hold measurements of ``spec``'s device kind."""
    entries = db.entries.values() if hasattr(db, "entries") else db
    lo, hi = EFFICIENCY_RANGE
    ratios: dict[str, list[float]] = {}
    for e in entries:
        rule, flops, fwd = e.get("rule"), e.get("flops") or 0.0, e.get("fwd_s")
        if not rule or flops <= 0 or not fwd or fwd <= 0 or (rules and rule not in rules):
            continue
        t_flop = flops / spec.flops(e.get("dtype", "float32"))
        compute = max(fwd - spec.launch_overhead_s, 0.05 * fwd)
        ratios.setdefault(rule, []).append(t_flop / compute)
    return {r: min(hi, max(lo, statistics.median(v))) for r, v in sorted(ratios.items())}


class CostModel:
    """Per-partition execution time on a machine's devices, memoized.

    ``profile``: an object with ``lookup(device_kind, key) -> (fwd_s, bwd_s) |
    None`` (a :class:`flexflow.profile.ProfileDB`); ``efficiency``: rule ->
    fraction of peak overriding ``DEFAULT_EFFICIENCY``."""

    def __init__(self, machine, efficiency: dict | None = None, profile=None):
        self.machine = machine
        self.efficiency = dict(DEFAULT_EFFICIENCY)
        if efficiency:
            self.efficiency.update(efficiency)
        self.profile = profile  # optional measured times, see flexflow.profile
        self._memo: dict = {}

    @classmethod
    def for_machine(cls, machine, profile_dir=None) -> "CostModel":
        """The cost model for ``machine``: the measured profile of its device
        kind when one exists (this cache's ``profiles/`` folder or
        ``profile_dir``, else the package's read-only ``flexflow/data/
        profile-<kind>.json``), with per-rule efficiencies fitted to it for
        the analytic estimate of partitions it lacks; otherwise analytic
        defaults only."""
        from .profile import ProfileDB
        spec = machine.spec
        db = ProfileDB.for_kind(spec.kind, profile_dir)
        if db is None or not len(db):
            return cls(machine)
        return cls(machine, efficiency=fit_efficiency(db, spec), profile=db)

    def key(self, op: Op, part) -> tuple:
        """What an op partition's time depends on: kind, shapes, dtypes, attrs.
        The profiler stores measurements under the same key."""
        ins = tuple(None if r is None else tuple(s.stop - s.start for s in r) for r in part.inputs)
        ps = tuple(sorted((k, tuple(s.stop - s.start for s in r)) for k, r in part.params.items()))
        out = tuple(s.stop - s.start for s in part.output)
        attrs = tuple(sorted((k, repr(v)) for k, v in op.attrs.items() if k not in ("spans",)))
        in_dtypes = tuple(str(d).removeprefix("torch.") for d in op.input_dtypes)
        return (op.kind, op.rule, str(op.dtype), out, ins, ps, attrs, in_dtypes)

    def _lookup(self, op: Op, part, spec):
        if self.profile is None or op.everywhere:
            return None
        return self.profile.lookup(spec.kind, self.key(op, part))

    def op_time(self, op: Op, part, device: int) -> tuple[float, float]:
        """(forward_s, backward_s) of partition ``part`` of ``op`` on ``device``."""
        spec = self.machine.devices[device].spec
        k = (spec.kind, self.key(op, part))
        hit = self._memo.get(k)
        if hit is None:
            hit = self._lookup(op, part, spec)
            if hit is None:
                hit = self.analytic(op, part, spec)
            self._memo[k] = hit = (float(hit[0]), float(hit[1]))
        return hit

    def source(self, op: Op, part, device: int) -> str:
        """'measured' or 'analytic': where op_time's figure comes from."""
        spec = self.machine.devices[device].spec
        return "measured" if self._lookup(op, part, spec) is not None else "analytic"

    def analytic(self, op: Op, part, spec) -> tuple[float, float]:
        """Roofline estimate (forward_s, backward_s) of a partition on a device spec."""
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
