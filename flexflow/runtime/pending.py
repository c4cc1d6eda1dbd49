"""Outputs whose all-reduce is still in flight: waited on at first read.

The executor returns every graph output in full on every rank, assembled by
an all-reduce.  Waiting for it at the end of the forward would add one
synchronisation of all ranks per step (the loss is read only after the
backward, in a usual loop).  So the all-reduce is started asynchronously and
the output is returned as a :class:`PendingTensor`: any torch operation that
reads it (``loss.item()``, ``float(loss)``, ``print``, arithmetic, ...) first
waits for the all-reduce.  ``backward()`` does not read the value (the
gradient of an output does not depend on it), so the backward starts at once
and overlaps with the all-reduce.  Results of operations on a pending tensor
are plain tensors.
"""
from __future__ import annotations

import torch

__all__ = ["PendingTensor", "Once", "pending"]

# Tensor methods that do not read the values: no wait.
_NO_WAIT = {torch.Tensor.backward, torch.autograd.backward,
            torch.Tensor.requires_grad.__get__, torch.Tensor.grad_fn.__get__,
            torch.Tensor.is_leaf.__get__, torch.Tensor.shape.__get__, torch.Tensor.dtype.__get__,
            torch.Tensor.device.__get__, torch.Tensor.size, torch.Tensor.dim, torch.Tensor.ndim.__get__,
            torch.Tensor.numel, torch.Tensor.nelement, torch.Tensor.register_hook,
            torch.Tensor.register_post_accumulate_grad_hook}


def _visit(x, out):
    if isinstance(x, PendingTensor):
        out.append(x)
    elif isinstance(x, (list, tuple)):
        for y in x:
            _visit(y, out)
    elif isinstance(x, dict):
        for y in x.values():
            _visit(y, out)


class PendingTensor(torch.Tensor):
    """A tensor whose values arrive when ``_ff_wait`` (an all-reduce) completes."""

    _ff_wait = None  # callable that waits for the values; None once they are there

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in _NO_WAIT:
            found: list = []
            _visit(args, found)
            _visit(kwargs, found)
            for t in found:
                t.ready()
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    def ready(self) -> "PendingTensor":
        """Wait for the values (once); returns self."""
        wait = self.__dict__.pop("_ff_wait", None)
        if wait is not None:
            wait()
        return self


def pending(t: torch.Tensor, wait) -> PendingTensor:
    """``t`` (same storage and autograd history) as a tensor that calls ``wait()`` before its first read."""
    p = t.as_subclass(PendingTensor)
    p.__dict__["_ff_wait"] = wait
    return p


class Once:
    """A wait that runs at most once, however many holders call it."""

    __slots__ = ("fn",)

    def __init__(self, fn):
        self.fn = fn

    def __call__(self) -> None:
        fn, self.fn = self.fn, None
        if fn is not None:
            fn()
