"""Training precision: which dtype each kind of tensor of a training step has.

The names are PyTorch Lightning's (``Trainer(precision=...)``):

==============  =========  ==========  ==========  ==========  ==============
name            compute    parameters  reduce      all-gather  optimizer state
==============  =========  ==========  ==========  ==========  ==============
``32-true``     (the module's own dtypes, every tensor as traced)
``bf16-mixed``  bfloat16   float32     float32     bfloat16    float32
``16-mixed``    float16    float32     float32     float16     float32
``bf16-true``   bfloat16   bfloat16    bfloat16    bfloat16    bfloat16
``bf16-params`` bfloat16   float32     float32     bfloat16    float32
==============  =========  ==========  ==========  ==========  ==============

``bf16-params`` is not autocast: every parameter is cast to bfloat16 for compute (norms and
embeddings included) and every activation is bfloat16, the losses excepted (float32, as
Megatron and torchtitan compute them), as FSDP2's
``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)`` runs a model: the
residual stream between blocks is bfloat16 where ``bf16-mixed`` keeps it in float32.

*compute*: the dtype ops run in and activations (outputs, saved tensors, messages,
activation gradients) are held in, as under ``torch.autocast`` (``*-mixed``) or with the
module converted (``*-true``); *parameters*: the stored weights and their gradients;
*reduce*: what gradients are all-reduced / reduce-scattered in (FSDP2's
``MixedPrecisionPolicy(reduce_dtype=float32)``); *all-gather*: what sharded parameters are
gathered in (``param_dtype=bfloat16``).  Only floating tensors change: token ids and
targets keep their integer dtype; under ``*-mixed`` the graph's inputs and constants stay in
their own dtype (autocast casts them at the ops that read them).  Under ``*-mixed`` the losses (the ``loss`` and
``pointwise_loss`` rules: cross-entropy, NLL, MSE, ...) stay in float32, as autocast runs
them (``cross_entropy``, ``log_softmax``, ``mse_loss`` are on its float32 list) -- but for
``flexflow.fused_cross_entropy``, which reads its logits in their own dtype.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
from dataclasses import dataclass

import torch

from ..graph.ir import Op, OpGraph

__all__ = ["Precision", "PRECISIONS", "lowered_outputs", "CUDA_FLOAT32_KINDS", "autocast_device", "gathers_in_compute",
           "precision", "priced_op", "priced_ops", "priced_cost_model"]


@dataclass(frozen=True)
class Precision:
    """The dtypes of one precision name; None throughout for ``32-true`` (the module's own)."""
    name: str
    compute: torch.dtype | None
    param: torch.dtype | None
    reduce: torch.dtype | None
    gather: torch.dtype | None
    state: torch.dtype | None
    # whose autocast lists apply under *-mixed: "cpu" or "cuda" (which runs more ops in float32)
    autocast: str = "cpu"
    # False: no autocast; every floating tensor of the step in the compute dtype but the
    # losses (float32), the parameters' own state in ``param`` (``bf16-params``: FSDP2's
    # MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32), Megatron's bf16)
    autocast_lists: bool = True

    @property
    def key(self) -> str:
        """The name, and the autocast device where it is not the CPU (cached views' key)."""
        return self.name if self.autocast == "cpu" else f"{self.name}@{self.autocast}"

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
    "bf16-params": Precision("bf16-params", _BF16, _F32, _F32, _BF16, _F32, autocast_lists=False),
}
# rules autocast runs in float32 (its "autocast to float32" list: the losses)
_FLOAT32_RULES = frozenset({"loss", "pointwise_loss"})
# op kinds CUDA's autocast also runs in float32 (whatever their inputs), where the CPU's runs
# them in their inputs' dtype: its float32 list (normalizations, exp / log / pow, softmax and
# reductions); checked on a GPU by benchmarks/gpu_validate.py (its "autocast" table)
CUDA_FLOAT32_KINDS = frozenset({
    "softmax", "log_softmax", "layer_norm", "group_norm", "exp", "expm1", "log", "log1p", "log2",
    "log10", "pow", "rsqrt", "reciprocal", "sum", "cumsum", "cumprod", "prod", "norm", "softplus",
    "logsumexp", "erfinv", "acos", "asin", "cosh", "sinh", "tan", "cosine_similarity"})


def autocast_device(where) -> str:
    """"cuda" or "cpu": whose autocast a run on ``where`` (a Machine, a torch.device or its
    name, None for the CPU) gets; a machine of NCCL devices runs CUDA's."""
    if where is None:
        return "cpu"
    spec = getattr(where, "spec", None)
    if spec is not None:
        return "cuda" if getattr(spec, "backend", "gloo") == "nccl" else "cpu"
    return "cuda" if torch.device(where).type == "cuda" else "cpu"


def precision(name, where=None) -> Precision:
    """The :class:`Precision` of a name (a :class:`Precision` passes through, or is moved to
    ``where``'s autocast); a ``ValueError`` listing the valid names for anything else.
    ``where``: the machine or device the run is on (:func:`autocast_device`; default the CPU)."""
    if isinstance(name, Precision):
        p = name
    else:
        p = PRECISIONS.get(name) if isinstance(name, str) else None
        if p is None:
            raise ValueError(f"unknown precision {name!r}: expected one of {', '.join(PRECISIONS)}")
    dev = autocast_device(where) if where is not None else p.autocast
    return p if dev == p.autocast else dataclasses.replace(p, autocast=dev)


def priced_op(op: Op, prec: Precision) -> Op:
    """``op`` as it runs under ``prec``: a shallow copy whose floating output and input dtypes
    are the compute dtype (float32 for a loss under ``*-mixed``), for the cost model's key
    and analytic rates and for activation bytes; where its graph was priced
    (:func:`priced_ops`), the dtypes autocast gives it there.  ``op`` itself under
    ``32-true`` or where nothing changes.  Cached on the op per precision."""
    if prec.native:
        return op
    views = op.__dict__.setdefault("_precision_views", {})
    v = views.get(prec.key + "@graph") or views.get(prec.key)
    if v is None:
        if not prec.autocast_lists:  # every floating tensor in the compute dtype, the losses in float32
            to = _F32 if _float32_loss(op) else prec.compute
        elif prec.mixed and op.everywhere:
            to = None  # inputs and constants stay as given; autocast casts them where used
        else:
            to = _F32 if prec.mixed and _in_float32(op, prec) else prec.compute
        out = _cast(op.dtype, to)
        ins = [_cast(d, to) for d in op.input_dtypes]
        if out == op.dtype and ins == list(op.input_dtypes):
            v = op
        else:
            v = copy.copy(op)
            v.__dict__ = {k: x for k, x in op.__dict__.items() if k not in ("_cost_key", "_precision_views")}
            v.dtype, v.input_dtypes = out, ins
        views[prec.key] = v
    return v


def _in_float32(op: Op, prec: Precision) -> bool:
    """Whether autocast runs ``op`` in float32 (its float32 list, the device's)."""
    return _float32_loss(op) or (prec.autocast == "cuda" and op.kind in CUDA_FLOAT32_KINDS)


def _float32_loss(op: Op) -> bool:
    """A loss computed in float32 (a fused cross-entropy, ``flexflow.fused_cross_entropy``,
    reads its logits as they are: its float32 is per block of rows, inside the op)."""
    return op.rule in _FLOAT32_RULES and op.attrs.get("fn") != "fused"


# rules autocast runs in its lower dtype (its "lower precision" list: matrix products,
# convolutions, attention), casting their floating inputs
LOWERED_RULES = frozenset({"linear", "linear_t", "matmul", "conv", "attention"})
# op kinds with parameters whose output follows input 0's dtype (the parameters do not
# promote it): normalizations and the recurrent cell, as torch runs them under autocast
_FOLLOW_INPUT0 = frozenset({"layer_norm", "rms_norm", "batch_norm", "group_norm", "instance_norm", "lstm_cell"})


def gathers_in_compute(prec: Precision, rules) -> bool:
    """Whether a sharded parameter that ops of ``rules`` read is gathered (and held) in the
    compute dtype under ``prec``: under ``*-mixed``, where only lowered rules read it (autocast
    casts it so for them anyway); the executor and the simulator both ask this."""
    rules = set(rules)
    return prec.mixed and bool(rules) and (rules <= LOWERED_RULES or not prec.autocast_lists)


def _autocast_dtypes(graph, prec: Precision) -> dict:
    """op name -> (output dtype, input dtypes) under ``*-mixed``, as ``torch.autocast``
    computes them: the lowered rules in the compute dtype (their floating inputs cast to
    it), the losses in float32 (on CUDA also ``CUDA_FLOAT32_KINDS``), normalizations and
    the recurrent cell in their input's
    dtype, embeddings in their table's; every other op by type promotion over its floating
    inputs and parameters (a residual sum of a float32 stream and a bfloat16 branch, or a
    product with a float32 weight, is float32).  Inputs and constants keep their dtype."""
    out: dict = {}
    for op in graph.ops:
        ins = [out[s][0] if s in out else d for s, d in zip(op.inputs, op.input_dtypes)]
        if op.everywhere or not op.dtype.is_floating_point:
            t = op.dtype
        elif _in_float32(op, prec):
            t = _F32
            ins = [_cast(d, _F32) for d in ins]
        elif op.rule in LOWERED_RULES:
            t = prec.compute
            ins = [_cast(d, prec.compute) for d in ins]
        elif op.kind in _FOLLOW_INPUT0 and ins and ins[0].is_floating_point:
            t = ins[0]
        elif op.kind == "embedding":
            t = op.dtype
        else:
            floats = [d for d in ins if d.is_floating_point] + ([op.dtype] if op.params else [])
            t = functools.reduce(torch.promote_types, floats) if floats else op.dtype
        out[op.name] = (t, ins)
    return out


def priced_ops(graph, prec: Precision) -> list:
    """Every op of ``graph`` as it runs under ``prec`` (:func:`priced_op`); under ``*-mixed``
    each op's dtypes follow autocast through the graph (:func:`_autocast_dtypes`).  The
    views are cached on the ops, so a later :func:`priced_op` of one of them agrees."""
    if prec.native:
        return list(graph.ops)
    if not prec.mixed or not prec.autocast_lists:
        return [priced_op(op, prec) for op in graph.ops]
    dts = _autocast_dtypes(graph, prec)
    res = []
    for op in graph.ops:
        views = op.__dict__.setdefault("_precision_views", {})
        v = views.get(prec.key + "@graph")
        if v is None:
            v = views[prec.key + "@graph"] = _view(op, *dts[op.name])
        res.append(v)
    return res


def _view(op: Op, out, ins) -> Op:
    if out == op.dtype and list(ins) == list(op.input_dtypes):
        return op
    v = copy.copy(op)
    v.__dict__ = {k: x for k, x in op.__dict__.items() if k not in ("_cost_key", "_precision_views")}
    v.dtype, v.input_dtypes = out, list(ins)
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


def priced_cost_model(cost_model, name, graph=None):
    """``cost_model`` pricing ops under precision ``name`` (itself under ``32-true``), for
    callers that time ops directly (the OptCNN baseline); with ``graph``, its ops priced
    as they run in it (:func:`priced_ops`); under the autocast of the cost model's machine."""
    prec = precision(name, getattr(cost_model, "machine", None))
    if graph is not None and not prec.native:
        priced_ops(graph, prec)
    return cost_model if prec.native or cost_model is None else _PricedCostModel(cost_model, prec)


# rules that keep their floating inputs' dtype when they hold no parameter (elementwise, layout)
_FOLLOWS_INPUTS = frozenset({"pointwise", "reshape", "transpose", "index", "concat", "pad", "pool", "unpack"})


def lowered_outputs(graph: OpGraph) -> set:
    """Names of the ops whose floating output autocast computes in its lower dtype on
    every device type: the :data:`LOWERED_RULES`, and elementwise or layout ops without
    parameters all of whose floating inputs are such outputs."""
    out: set = set()
    for op in graph.ops:
        if not op.dtype.is_floating_point or op.everywhere:
            continue
        if op.rule in LOWERED_RULES:
            out.add(op.name)
        elif op.rule in _FOLLOWS_INPUTS and not op.params:
            floats = [s for s in op.inputs if graph.op(s).dtype.is_floating_point]
            if floats and all(s in out for s in floats):
                out.add(op.name)
    return out
