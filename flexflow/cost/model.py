"""Cost model: how long one op partition runs on a device.

``CostModel.op_time(op, part, device)`` returns (forward_s, backward_s).
Measured profiles (see :mod:`flexflow.cost.profile`) are used where the device
kind is the one profiled and the partition's key was measured; elsewhere an
analytic roofline estimate:

    work     = max(F / (peak * eff[rule]), B / bandwidth)
    forward  = work + overhead
    backward = k * work + overhead

F is the partition's forward FLOPs from the op rule's ``flops`` (2 per
multiply-add), B the bytes of its input, output and parameter regions at the
op's dtype, k the rule's ``backward_factor``, overhead the device's launch
overhead.  ``eff`` is a per-rule fraction of peak: defaults below, or fitted
to measurements of the same device kind (:func:`fit_efficiency`); with
enough measurements :func:`fit_rules` also fits, per rule, the fixed forward
and backward costs, a bandwidth scale and a backward scale
(:meth:`CostModel.for_machine` does all of this).
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass

from ..graph.ir import Op, dtype_bytes
from ..graph.opcount import eager_op_counts
from ..graph.ops import RULES
from ..graph.ops.base import region_numel
from .profiledb import ProfileDB

# Gradients are all-reduced in buckets of this size by the executor; the
# simulator charges all-reduce latency per bucket share accordingly.
GRAD_BUCKET_BYTES = 25 * 2**20

__all__ = ["GRAD_BUCKET_BYTES", "CostModel", "partition_flops", "partition_bytes", "fit_efficiency", "fit_overhead",
           "fit_rules", "RuleFit",
           "DEFAULT_EFFICIENCY", "EFFICIENCY_RANGE"]

# Fraction of peak FLOP/s an op family reaches in practice (before fitting to
# measurements).  Dense contractions get close to peak; memory-bound families
# are limited by bandwidth anyway.
DEFAULT_EFFICIENCY = {"conv": 0.5, "linear": 0.6, "matmul": 0.6, "lstm_cell": 0.4,
                      "embedding": 0.1, "default": 0.25}
EFFICIENCY_RANGE = (0.01, 1.0)  # fitted efficiencies are clipped to this range
# attrs that only say where a piece sits (the region shapes in the key say how big it is)
_POSITION_ATTRS = ("spans", "fixed", "offsets", "offset")


def _op_key(op: Op) -> tuple:
    """The parts of ``CostModel.key`` that depend on the op alone, computed once per op
    (again if its input gradients are set afterwards, as OpGraph does)."""
    held = op.__dict__.get("_cost_key")
    if held is not None and held[0] is op.input_grads:
        return held[1]
    attrs = tuple(sorted((k, repr(v)) for k, v in op.attrs.items() if k not in _POSITION_ATTRS))
    in_dtypes = tuple(str(d).removeprefix("torch.") for d in op.input_dtypes)
    # floating inputs that get no gradient (an image batch): their backward is cheaper
    nograd = tuple(i for i, dt in enumerate(op.input_dtypes)
                   if dt.is_floating_point and not op.input_needs_grad(i))
    parts = ((op.kind, op.rule, str(op.dtype)), attrs, (in_dtypes,) + ((("nograd",) + nograd,) if nograd else ()))
    op.__dict__["_cost_key"] = (op.input_grads, parts)
    return parts


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


def _entries(db):
    if hasattr(db, "entries"):
        return list({**getattr(db, "fallback", {}), **db.entries}.values())
    return list(db)


def _quantile(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def fit_overhead(db, quantile: float = 0.1) -> tuple[float, float] | None:
    """Fixed cost per op on the profiled device: (forward_s, backward_s), the
    ``quantile`` of the measured forward and backward times of ops that compute
    (FLOPs > 0) -- on a CPU or GPU the smallest ops cost little more than
    dispatch / launch.  None with fewer than 5 such entries."""
    es = [e for e in _entries(db) if (e.get("flops") or 0) > 0 and e.get("fwd_s", 0) > 0]
    if len(es) < 5:
        return None
    bwd = [e["bwd_s"] for e in es if e.get("bwd_s", 0) > 0]
    return (_quantile([e["fwd_s"] for e in es], quantile), _quantile(bwd, quantile) if bwd else 0.0)


def fit_efficiency(db, spec, rules=None, overhead: float | None = None) -> dict[str, float]:
    """Per-rule efficiency fitted to the measured entries of ``db`` (a
    :class:`flexflow.cost.profiledb.ProfileDB`, or any iterable of entry dicts with
    ``rule``, ``dtype``, ``flops`` and ``fwd_s``) for a device ``spec``.

    For each rule: the median over its measured entries (with FLOPs > 0) of
    analytic-FLOP-time / measured compute time, where the FLOP time is
    ``flops / spec.flops(dtype)`` and the compute time is the measured forward
    time less the per-op overhead (``overhead``, default the spec's launch
    overhead; so that the fitted roofline plus the overhead reproduces the
    measurement), clipped to ``EFFICIENCY_RANGE``.  Rules without data are absent
    from the result (callers keep defaults).  ``db`` should hold measurements of
    ``spec``'s device kind."""
    oh = spec.launch_overhead_s if overhead is None else overhead
    lo, hi = EFFICIENCY_RANGE
    ratios: dict[str, list[float]] = {}
    for e in _entries(db):
        rule, flops, fwd = e.get("rule"), e.get("flops") or 0.0, e.get("fwd_s")
        if not rule or flops <= 0 or not fwd or fwd <= 0 or (rules and rule not in rules):
            continue
        t_flop = flops / spec.flops(e.get("dtype", "float32"))
        compute = max(fwd - oh, 0.05 * fwd)
        ratios.setdefault(rule, []).append(t_flop / compute)
    return {r: min(hi, max(lo, statistics.median(v))) for r, v in sorted(ratios.items())}


@dataclass(frozen=True)
class RuleFit:
    """Analytic parameters of one rule fitted to measurements (see :func:`fit_rules`):
    forward = max(F / (peak * efficiency), B / (bandwidth * bandwidth_scale)) + overhead_fwd_s,
    backward = backward_scale * factor * (forward less its overhead) + overhead_bwd_s."""
    efficiency: float
    overhead_fwd_s: float
    overhead_bwd_s: float
    bandwidth_scale: float = 1.0
    backward_scale: float = 1.0
    n: int = 0  # entries it was fitted to


def fit_rules(db, spec, min_entries: int = 4) -> dict[str, RuleFit]:
    """Analytic parameters fitted to measured entries (a ProfileDB or entry dicts with
    ``rule``, ``kind``, ``dtype``, ``flops``, ``bytes``, ``backward_factor``, ``fwd_s``,
    ``bwd_s``) of ``spec``'s device kind: one :class:`RuleFit` per rule (key: the
    rule's name) and one per op kind with at least ``min_entries`` entries (key
    ``"kind:<kind>"``, e.g. dropout apart from relu in the pointwise rule).

    Least squares on log time over a grid: forward efficiency (in
    ``EFFICIENCY_RANGE``), a fixed forward cost and a bandwidth scale; then a backward
    scale and a fixed backward cost.  Groups with fewer than ``min_entries`` entries
    fit only efficiency and backward scale, with the fixed costs of
    :func:`fit_overhead`."""
    glob = fit_overhead(db) or (spec.launch_overhead_s, spec.launch_overhead_s)
    groups: dict[str, list] = {}
    for e in _entries(db):
        if e.get("rule") and (e.get("flops") or 0) > 0 and e.get("fwd_s", 0) > 0:
            groups.setdefault(e["rule"], []).append(e)
            if e.get("kind"):
                groups.setdefault("kind:" + e["kind"], []).append(e)
    return {g: _fit_group(es, spec, glob, len(es) < min_entries) for g, es in sorted(groups.items())
            if not g.startswith("kind:") or len(es) >= min_entries}


def _fit_group(es, spec, glob, few: bool) -> RuleFit:
    import numpy as np
    lo, hi = EFFICIENCY_RANGE
    x = np.array([e["flops"] / spec.flops(e.get("dtype", "float32")) for e in es])
    m = np.array([(e.get("bytes") or 0.0) / spec.mem_bw_Bps for e in es])
    t = np.array([e["fwd_s"] for e in es])
    a = np.array([min(glob[0], 0.95 * t.min())]) if few else np.linspace(0, 0.95 * t.min(), 24)
    eff = np.geomspace(lo, hi, 49)
    sc = np.array([1.0]) if few else np.geomspace(0.25, 4.0, 9)
    pred = np.maximum(x / eff[None, :, None, None], m / sc[None, None, :, None]) + a[:, None, None, None]
    loss = ((np.log(pred) - np.log(t)) ** 2).sum(-1)
    i, j, k = np.unravel_index(np.argmin(loss), loss.shape)
    fit = dict(efficiency=float(eff[j]), overhead_fwd_s=float(a[i]), bandwidth_scale=float(sc[k]),
               overhead_bwd_s=glob[1], n=len(es))
    bw = [(e, c) for e, c in zip(es, np.maximum(x / eff[j], m / sc[k])) if e.get("bwd_s", 0) > 0]
    if bw:
        u = np.array([e["bwd_s"] for e, _ in bw])
        c = np.array([c * (e.get("backward_factor") or 1.0) for e, c in bw])
        b = np.array([min(glob[1], 0.95 * u.min())]) if few else np.linspace(0, 0.95 * u.min(), 24)
        g = np.geomspace(0.25, 8.0, 41)
        loss = ((np.log(g[None, :, None] * c + b[:, None, None]) - np.log(u)) ** 2).sum(-1)
        i, j = np.unravel_index(np.argmin(loss), loss.shape)
        fit.update(overhead_bwd_s=float(b[i]), backward_scale=float(g[j]))
    return RuleFit(**fit)


class CostModel:
    """Per-partition execution time on a machine's devices, memoized.

    ``profile``: an object with ``lookup(device_kind, key) -> (fwd_s, bwd_s) |
    None`` (a :class:`flexflow.cost.profiledb.ProfileDB`); ``efficiency``: rule ->
    fraction of peak overriding ``DEFAULT_EFFICIENCY``; ``overhead``: fixed
    (forward_s, backward_s) per op on the machine's device kind, replacing the
    spec's ``launch_overhead_s`` (see :func:`fit_overhead`); ``fits``: rule ->
    :class:`RuleFit` (see :func:`fit_rules`), which replaces all of these for
    its rule.  Fitted figures describe the machine's device kind only."""

    def __init__(self, machine, efficiency: dict | None = None, profile=None,
                 overhead: tuple[float, float] | None = None, fits: dict | None = None):
        self.machine = machine
        self.efficiency = dict(DEFAULT_EFFICIENCY)
        # the device's published kernel efficiencies (hardware.specs.KERNEL_EFFICIENCY), if any
        spec = getattr(machine, "spec", None)
        self.efficiency.update(getattr(spec, "efficiency", None) or {})
        # what a training run reaches of those rates (hardware.specs.RUN_EFFICIENCY)
        run = getattr(spec, "run_efficiency", 1.0)
        if run != 1.0:
            self.efficiency = {k: v * run for k, v in self.efficiency.items()}
        if efficiency:
            self.efficiency.update(efficiency)
        self.profile = profile  # optional measured times, see flexflow.cost.profile
        self.overhead = None if overhead is None else (float(overhead[0]), float(overhead[1]))
        self.fits = dict(fits or {})
        self._memo: dict = {}
        self._counts: dict = {}  # (op, split dims) -> eager ops forward and backward

    @classmethod
    def for_machine(cls, machine, profile_dir=None) -> "CostModel":
        """The cost model for ``machine``: the measured profile of its device
        kind when one exists (this cache's ``profiles/`` folder or
        ``profile_dir``, else the package's read-only ``flexflow/data/
        profile-<kind>.json``), and for partitions it lacks the analytic
        estimate fitted to it (per-op overhead :func:`fit_overhead`, per-rule
        efficiencies :func:`fit_efficiency` refined by :func:`fit_rules`);
        without a profile the analytic defaults."""
        spec = machine.spec
        db = ProfileDB.for_kind(spec.kind, profile_dir)
        if db is None or not len(db):
            return cls(machine)
        overhead = fit_overhead(db)
        eff = fit_efficiency(db, spec, overhead=None if overhead is None else overhead[0])
        return cls(machine, efficiency=eff, profile=db, overhead=overhead, fits=fit_rules(db, spec))

    def key(self, op: Op, part) -> tuple:
        """What an op partition's time depends on: kind, shapes, dtypes, attrs.
        The profiler stores measurements under the same key."""
        ins = tuple(None if r is None else tuple(s.stop - s.start for s in r) for r in part.inputs)
        ps = tuple(sorted((k, tuple(s.stop - s.start for s in r)) for k, r in part.params.items()))
        out = tuple(s.stop - s.start for s in part.output)
        head, attrs, tail = _op_key(op)
        if "z" in part.block and op.rule == "attention":  # a head-tail block computes less than the
            attrs = attrs + (("rows", "head-tail"),)  # contiguous last block of its shapes
        return head + (out, ins, ps, attrs) + tail

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

    def eager_ops(self, op: Op, part) -> tuple[int, int]:
        """(forward, backward) eager ops of a partition (:func:`flexflow.graph.opcount.eager_op_counts`),
        counted once per op and set of split dims."""
        split = tuple(sorted(d.name for d in op.dims if d.name in part.block
                             and tuple(part.block[d.name]) != (0, d.size)))
        key = (op.name, op.kind, tuple(op.input_shapes), split)
        hit = self._counts.get(key)
        if hit is None:
            hit = self._counts[key] = eager_op_counts(op, part)
        return hit

    def analytic(self, op: Op, part, spec) -> tuple[float, float]:
        """Roofline estimate (forward_s, backward_s) of a partition on a device spec."""
        if op.everywhere:
            return (0.0, 0.0)
        fit = self.fits.get("kind:" + op.kind) or self.fits.get(op.rule)
        oh_f, oh_b = self.overhead or (spec.launch_overhead_s, spec.launch_overhead_s)
        eff = self.efficiency.get(op.rule, self.efficiency["default"])
        bw, factor = spec.mem_bw_Bps, RULES[op.rule].backward_factor(op)
        if op.params and not any(op.input_needs_grad(i) for i in range(len(op.input_dtypes))):
            factor *= 0.5  # the parameters' gradient only: no input gradient (the first layer)
        if fit is not None:
            oh_f, oh_b, eff = fit.overhead_fwd_s, fit.overhead_bwd_s, fit.efficiency
            bw, factor = bw * fit.bandwidth_scale, factor * fit.backward_scale
        if fit is None and self.overhead is None and spec.kind == "cpu":
            # no measurement of this host's ops: the launch overhead per eager op the
            # rule issues (an LSTM cell is some 20 forward), plus one for the
            # executor's own dispatch of the partition
            nf, nb = self.eager_ops(op, part)
            oh_f, oh_b = (nf + 1) * spec.launch_overhead_s, nb * spec.launch_overhead_s
        flops = partition_flops(op, part)
        if op.rule == "attention" and op.attrs.get("is_causal"):
            flops /= 2  # a fused causal kernel skips the masked half (its FLOPs still count whole)
        nbytes = partition_bytes(op, part)
        work = max(flops / (spec.flops(op.dtype) * eff), nbytes / bw)
        if flops == 0.0 and not op.params and RULES[op.rule].backward_factor(op) <= 1.0:
            return (work + oh_f, oh_b)  # structural ops: a view or a copy
        return (work + oh_f, work * factor + oh_b)
