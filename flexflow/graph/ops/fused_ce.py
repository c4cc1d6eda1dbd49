"""A fused cross-entropy: the loss over rows of logits without a float32 copy of them.

``torch.nn.functional.cross_entropy`` under autocast (or on bfloat16 logits held so)
computes in float32: it keeps the float32 log-softmax of the logits for its backward and
makes a float32 gradient as large -- for a language model's head, (tokens x vocabulary)
twice over in float32, often the largest tensors of the step.  The fused kernels people
train with (flash-attn's ``CrossEntropyLoss``, llm-foundry's default ``fused_crossentropy``,
llm.c's fused classifier, Liger's) keep only the logits as they are and one float32
log-sum-exp per row, and write the gradient in the logits' dtype.

:func:`fused_cross_entropy` is that loss for PyTorch code: one custom op
(``flexflow::fused_cross_entropy``) that traces as a single loss op, computed a block of
rows at a time in float32 (the same value as ``F.cross_entropy`` of the logits in float32,
to rounding), its backward remaking each block's softmax from the kept logits.  The
simulator prices and holds it as it runs: in the compute dtype, saving the logits only
(:mod:`flexflow.cost.precision`, :mod:`flexflow.sim.saves`); the ``loss`` rule splits it by rows
(:mod:`flexflow.graph.ops.loss`).
"""
from __future__ import annotations

import torch

__all__ = ["fused_cross_entropy"]

_ROWS = 4096  # rows computed at once (a float32 block of rows x vocabulary at a time)


def _check(logits, targets, reduction):
    if logits.dim() != 2 or targets.dim() != 1 or targets.shape[0] != logits.shape[0]:
        raise ValueError(f"fused_cross_entropy takes logits (rows, classes) and targets (rows,), got "
                         f"{tuple(logits.shape)} and {tuple(targets.shape)}")
    if reduction not in ("mean", "sum"):
        raise ValueError(f"fused_cross_entropy's reduction is 'mean' or 'sum', got {reduction!r}")


def _lse_and_picked(logits, targets, ignore_index):
    """Per row, float32: log-sum-exp and the target's logit (0 where ignored)."""
    n = logits.shape[0]
    lse = torch.empty(n, dtype=torch.float32, device=logits.device)
    picked = torch.zeros(n, dtype=torch.float32, device=logits.device)
    keep = targets != ignore_index
    safe = torch.where(keep, targets, torch.zeros_like(targets))
    for a in range(0, n, _ROWS):
        block = logits[a:a + _ROWS].float()
        lse[a:a + _ROWS] = torch.logsumexp(block, dim=1)
        picked[a:a + _ROWS] = block.gather(1, safe[a:a + _ROWS, None]).squeeze(1)
    return lse, picked, keep


@torch.library.custom_op("flexflow::fused_cross_entropy", mutates_args=())
def _fused_ce(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int, reduction: str) -> torch.Tensor:
    _check(logits, targets, reduction)
    lse, picked, keep = _lse_and_picked(logits, targets, ignore_index)
    total = ((lse - picked) * keep).sum()
    return total / keep.sum() if reduction == "mean" else total


@_fused_ce.register_fake
def _(logits, targets, ignore_index, reduction):
    return logits.new_empty((), dtype=torch.float32)


def _setup(ctx, inputs, output):
    logits, targets, ignore_index, reduction = inputs
    ctx.save_for_backward(logits, targets)
    ctx.ignore_index, ctx.reduction = ignore_index, reduction


def _backward(ctx, grad):
    logits, targets = ctx.saved_tensors
    keep = targets != ctx.ignore_index
    scale = grad.float() / (keep.sum() if ctx.reduction == "mean" else 1)
    out = torch.empty_like(logits)
    safe = torch.where(keep, targets, torch.zeros_like(targets))
    for a in range(0, logits.shape[0], _ROWS):
        p = torch.softmax(logits[a:a + _ROWS].float(), dim=1)
        p.scatter_add_(1, safe[a:a + _ROWS, None], -torch.ones_like(p[:, :1]))
        out[a:a + _ROWS] = (p * (keep[a:a + _ROWS, None] * scale)).to(logits.dtype)
    return out, None, None, None


_fused_ce.register_autograd(_backward, setup_context=_setup)


def fused_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100,
                        reduction: str = "mean") -> torch.Tensor:
    """The cross-entropy of ``logits`` (rows, classes) against ``targets`` (rows,), rows whose
    target is ``ignore_index`` left out (``reduction``: ``"mean"`` over the rest, or
    ``"sum"``), as ``F.cross_entropy`` of the logits in float32 -- keeping no float32 copy of
    them (see the module).  A float32 scalar."""
    return _fused_ce(logits, targets, int(ignore_index), str(reduction))
