"""Training precision: which dtype each kind of tensor of a training step has.

The names are PyTorch Lightning's (``Trainer(precision=...)``):

==============  =========  ==========  ==========  ==========  ==============
name            compute    parameters  reduce      all-gather  optimizer state
==============  =========  ==========  ==========  ==========  ==============
``32-true``     (the module's own dtypes, every tensor as traced)
``bf16-mixed``  bfloat16   float32     float32     bfloat16    float32
``16-mixed``    float16    float32     float32     float16     float32
``bf16-true``   bfloat16   bfloat16    bfloat16    bfloat16    bfloat16
==============  =========  ==========  ==========  ==========  ==============

*compute*: the dtype ops run in and activations (outputs, saved tensors, messages,
activation gradients) are held in, as under ``torch.autocast`` (``*-mixed``) or with the
module converted (``*-true``); *parameters*: the stored weights and their gradients;
*reduce*: what gradients are all-reduced / reduce-scattered in (FSDP2's
``MixedPrecisionPolicy(reduce_dtype=float32)``); *all-gather*: what sharded parameters are
gathered in (``param_dtype=bfloat16``).  Only floating tensors change: token ids and
targets keep their integer dtype; under ``*-mixed`` the graph's inputs and constants stay in
their own dtype (autocast casts them at the ops that read them).  Under ``*-mixed`` the losses (the ``loss`` and
``pointwise_loss`` rules: cross-entropy, NLL, MSE, ...) stay in float32, as autocast runs
them (``cross_entropy``, ``log_softmax``, ``mse_loss`` are on its float32 list).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from ..graph.ir import Op

__all__ = ["Precision", "PRECISIONS", "precision", "priced_op", "priced_cost_model"]


@dataclass(frozen=True)
class Precision:
    """The dtypes of one precision name; None throughout for ``32-true`` (the module's own)."""
    name: str
    compute: torch.dtype | None
    param: torch.dtype | None
    reduce: torch.dtype | None
    gather: torch.dtype | None
    state: torch.dtype | None

    @property
    def native(self) -> bool:
        """Every tensor in the dtype the module traced it in (``32-true``)."""
        return self.compute is None

    @property
    def mixed(self) -> bool:
        """Compute in a lower dtype than the parameters (autocast)."""
        return self.compute is not None and self.compute != self.param

    def param_dtype(self, traced: torch.dtype) -> torch.dtype:
        return _cast(traced, self.param)

    def reduce_dtype(self, traced: torch.dtype) -> torch.dtype:
        return _cast(traced, self.reduce)

    def gather_dtype(self, traced: torch.dtype) -> torch.dtype:
        return _cast(traced, self.gather)


def _cast(traced: torch.dtype, to: torch.dtype | None) -> torch.dtype:
    return traced if to is None or not traced.is_floating_point else to


_F32, _BF16, _F16 = torch.float32, torch.bfloat16, torch.float16
PRECISIONS = {
    "32-true": Precision("32-true", None, None, None, None, None),
    "bf16-mixed": Precision("bf16-mixed", _BF16, _F32, _F32, _BF16, _F32),
    "bf16-true": Precision("bf16-true", _BF16, _BF16, _BF16, _BF16, _BF16),
    "16-mixed": Precision("16-mixed", _F16, _F32, _F32, _F16, _F32),
}
# rules autocast runs in float32 (its "autocast to float32" list: the losses)
_FLOAT32_RULES = frozenset({"loss", "pointwise_loss"})


def precision(name) -> Precision:
    """The :class:`Precision` of a name (a :class:`Precision` passes through); a
    ``ValueError`` listing the valid names for anything else."""
    if isinstance(name, Precision):
        return name
    p = PRECISIONS.get(name) if isinstance(name, str) else None
    if p is None:
        raise ValueError(f"unknown precision {name!r}: expected one of {', '.join(PRECISIONS)}")
    return p


def priced_op(op: Op, prec: Precision) -> Op:
    """``op`` as it runs under ``prec``: a shallow copy whose floating output and input dtypes
    are the compute dtype (float32 for a loss under ``*-mixed``), for the cost model's key
    and analytic rates and for activation bytes.  ``op`` itself under ``32-true`` or where
    nothing changes.  Cached on the op per precision."""
    if prec.native:
        return op
    views = op.__dict__.setdefault("_precision_views", {})
    v = views.get(prec.name)
    if v is None:
        if prec.mixed and op.everywhere:
            to = None  # inputs and constants stay as given; autocast casts them where used
        else:
            to = _F32 if prec.mixed and op.rule in _FLOAT32_RULES else prec.compute
        out = _cast(op.dtype, to)
        ins = [_cast(d, to) for d in op.input_dtypes]
        if out == op.dtype and ins == list(op.input_dtypes):
            v = op
        else:
            v = copy.copy(op)
            v.__dict__ = {k: x for k, x in op.__dict__.items() if k not in ("_cost_key", "_precision_views")}
            v.dtype, v.input_dtypes = out, ins
        views[prec.name] = v
    return v


class _PricedCostModel:
    """A cost model that prices each op as it runs under a precision (:func:`priced_op`);
    everything else is the wrapped model's."""

    def __init__(self, cost_model, prec: Precision):
        self._cm, self._prec = cost_model, prec

    def op_time(self, op: Op, part, device: int) -> tuple[float, float]:
        return self._cm.op_time(priced_op(op, self._prec), part, device)

    def source(self, op: Op, part, device: int) -> str:
        return self._cm.source(priced_op(op, self._prec), part, device)

    def __getattr__(self, name):
        return getattr(self._cm, name)


def priced_cost_model(cost_model, name):
    """``cost_model`` pricing ops under precision ``name`` (itself under ``32-true``), for
    callers that time ops directly (the OptCNN baseline)."""
    prec = precision(name)
    return cost_model if prec.native or cost_model is None else _PricedCostModel(cost_model, prec)
