"""How a rank computes its partition of an op: the rule, its inputs and parameters.

:func:`compile_program` turns each step of a :class:`~flexflow.runtime.plan.Plan`
that reads only local values into one function of (vals, pvals), with every
choice the runtime's general loop makes per step made once; the values of
stacked ops (an LSTM cell's (h, c)) are kept as their parts (:class:`_Stacked`).
"""
from __future__ import annotations

import operator

import torch

from ..graph.ir import Op
from ..graph.ops import RULES, picks_stacked_part
from ..graph.ops.base import region_shape
from .plan import Plan, _is_full, _Step

__all__ = ["compile_program", "compile_step"]


# --------------------------------------------------------------------------- compiled steps
def compile_program(plan: Plan) -> None:
    """Every step's parameter readers, and its compiled function (:func:`compile_step`)."""
    for step in plan.program:
        if step.part is not None and not step.everywhere:
            step.param_readers = tuple((local, _param_reader(qual, reshape_to, region, plan.params_cast))
                                       for local, qual, reshape_to, region in step.params)
    for step in plan.program:
        step.run = compile_step(plan, step)


def compile_step(plan: Plan, step: _Step):
    """The step as one function of (vals, pvals), with every choice the general
    loop makes per step (how each input and parameter is read, the rule, the
    stacking of the output) made here once; None for steps that exchange,
    gate parameters or run everywhere."""
    op = step.op
    if step.everywhere or step.part is None or step.gate is not None or plan.strategy[op.name].recompute or \
            any(e is not None and e[0] in ("xchg", "shared") for e in step.inputs) or \
            any((op.name, i) in plan.cast_share for i in range(len(step.inputs))):
        return None
    stacked_in = {s for s in op.inputs if plan.graph.op(s).attrs.get("stacked")
                  and hasattr(RULES[plan.graph.op(s).rule], "compute_parts")}
    if op.rule == "index" and len(step.inputs) == 1 and step.inputs[0] is not None \
            and step.inputs[0][1] in stacked_in:
        k = _stacked_item(plan, op, step.inputs[0])
        if k is not None:  # h or c of a cell: the part itself, no op at all
            src = step.inputs[0][1]
            return lambda vals, pvals: vals[src].parts[k]
    rule, block = RULES[op.rule], step.part.block
    if op.rule == "index" and len(step.inputs) == 1 and step.inputs[0] is not None \
            and step.inputs[0][2] is not None and step.inputs[0][1] not in stacked_in:
        _, src, data = step.inputs[0]  # the region read and the index as one index
        fn = rule.bind(op, block, within=data)
        return lambda vals, pvals: fn([vals[src]], None)
    getters = []
    for entry in step.inputs:
        if entry is None:
            getters.append(lambda vals: None)
            continue
        _, src, data = entry
        if src in stacked_in:
            def get(vals, src=src, data=data, whole=op.rule != "index"):
                x = vals[src] if data is None else vals[src][data]
                return x.stack() if whole and isinstance(x, _Stacked) else x
        elif data is None:
            get = operator.itemgetter(src)
        else:
            def get(vals, src=src, data=data):
                return vals[src][data]
        getters.append(get)
    pgetters = step.param_readers
    if op.attrs.get("stacked") and hasattr(rule, "compute_parts"):  # (h, c) kept apart
        def fn(ins, params):
            return _Stacked(rule.compute_parts(op, block, ins, params))
    else:
        fn = rule.bind(op, block)
    getters = tuple(getters)
    if len(getters) == 1:
        get0 = getters[0]
        return lambda vals, pvals: fn([get0(vals)], {k: g(pvals) for k, g in pgetters})
    return lambda vals, pvals: fn([g(vals) for g in getters], {k: g(pvals) for k, g in pgetters})


def _stacked_item(plan: Plan, op: Op, entry) -> int | None:
    """The part k when the index op ``op`` reads exactly part k of its stacked
    input (as an LSTM cell's h = out[0]), else None."""
    _, src, data = entry
    if not picks_stacked_part(op, plan.graph.op(src)):
        return None
    held = plan.part_of(plan.graph.op(src))
    if held is None:
        return None
    shape = region_shape(held.output)
    if data is None:
        return 0
    first = data[0]
    if first.step not in (None, 1) or not _is_full(data[1:], shape[1:]):
        return None
    return first.start


# --------------------------------------------------------------------------- stacked outputs
class _Stacked:
    """The value of an op whose outputs are stacked (an LSTM cell's (h, c)),
    kept as its parts: indexing one part returns it without the stack and the
    select, whose backward would allocate and add full-size zeros for every
    use.  Anything else gets the stacked tensor (:meth:`stack`, made once)."""

    __slots__ = ("parts", "_whole")

    def __init__(self, parts):
        self.parts, self._whole = list(parts), None

    def stack(self) -> torch.Tensor:
        if self._whole is None:
            self._whole = torch.stack(self.parts)
        return self._whole

    @property
    def dtype(self):
        return self.parts[0].dtype

    def dim(self) -> int:
        return self.parts[0].dim() + 1

    def detach(self) -> "_Stacked":
        return _Stacked([p.detach() for p in self.parts])

    def contiguous(self) -> torch.Tensor:
        return self.stack().contiguous()

    def __getitem__(self, idx):
        if not isinstance(idx, tuple):
            idx = (idx,)
        first, rest = idx[0], idx[1:]
        shape = self.parts[0].shape
        full = all(isinstance(r, slice) and r.step in (None, 1) and (r.start or 0) == 0
                   and (r.stop is None or r.stop >= n) for r, n in zip(rest, shape))
        if isinstance(first, int):
            part = self.parts[first]
            return part if full else part[rest]
        if isinstance(first, slice) and first.step in (None, 1):
            sub = self.parts[first]
            return _Stacked(sub if full else [p[rest] for p in sub])
        return self.stack()[idx]


def _param_reader(qual: str, reshape_to, region, cast=None):
    """pvals -> what a partition reads of parameter ``qual``: the tensor, reshaped to the
    op's view, then its region (see ``Plan._param_access``); floating ones cast to ``cast``
    where given (``bf16-params``: after the gradient gate, so that gradients reach it, and
    are reduced, in the parameter's own dtype)."""
    if reshape_to is None and region is None and cast is None:
        return operator.itemgetter(qual)

    def read(pvals):
        t = pvals[qual]
        if reshape_to is not None:
            t = t.reshape(reshape_to)
        t = t if region is None else t[region]
        return t.to(cast) if cast is not None and t.is_floating_point() else t
    return read


def _compute(op: Op, block, ins: list, params: dict):
    """One partition of ``op`` by its rule; an LSTM cell's (h, c) kept apart."""
    rule = RULES[op.rule]
    if op.attrs.get("stacked") and hasattr(rule, "compute_parts"):
        return _Stacked(rule.compute_parts(op, block, ins, params))
    return rule.compute(op, block, ins, params)


def _tensor(vals: dict, name: str):
    """vals[name] as a tensor (a stacked value stacked, once: :meth:`_Stacked.stack`
    keeps it, and readers of one part still read the part); None when absent."""
    v = vals.get(name)
    return v.stack() if isinstance(v, _Stacked) else v
