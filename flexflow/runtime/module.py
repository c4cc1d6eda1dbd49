"""ParallelModule: the nn.Module a rank trains, in front of its Runtime.

Its ``parameters()`` are the rank's shards, its forward takes the global inputs
and returns the full outputs on every rank, and its state dict speaks the
original module's full tensors.  In a training loop: ``clip_grad_norm_`` and
``grad_norm`` take the whole model's gradient norm (so does torch's own
``clip_grad_norm_`` over ``parameters()``: :mod:`.gradnorm`), several
``backward()`` before one optimizer step accumulate, and ``no_sync()`` skips
the gradient all-reduce of the backward passes inside it, as DDP's does.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from ..strategy.strategy import Strategy
from .checkpoint import (
    load_module_state_dict,
    load_optim_state_dict,
    module_state_dict,
    optim_state_dict,
)
from .execute import Runtime
from .gradnorm import NormScope, global_norm, scale_grads_, shard_grad
from .program import describe

__all__ = ['ParallelModule']


# --------------------------------------------------------------------------- the module
class ParallelModule(nn.Module):
    """The module returned by :func:`parallelize`.

    ``forward`` takes the global inputs (the same on every rank) and returns
    the module's outputs in full on every rank.  ``parameters()`` are this
    rank's shards, named like the original's parameters (a top-level name
    that clashes with an attribute of this class gets a trailing ``_``; a
    rank holding no block has one empty parameter, ``_no_shard``, so that
    optimizers accept the list).  ``state_dict()`` gathers full tensors keyed
    like the original module's state_dict (every rank gets them;
    collective); ``load_state_dict()`` takes such a dict on every rank and
    keeps each rank's blocks.  ``train()``/``eval()`` also switch the
    original module, whose Dropout and BatchNorm the ops read.

    Gradients: ``clip_grad_norm_(max_norm)`` clips by the global norm of the
    whole model's gradients (each parameter block once, the same on every
    rank; collective), as ``torch.nn.utils.clip_grad_norm_`` does in one
    process; ``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)``
    on every rank computes the same (the shards' gradients are
    :class:`~flexflow.runtime.gradnorm.ShardGrad` tensors); ``grad_norm()``
    only reports it.  ``no_sync()``: see there.
    """

    def __init__(self, module: nn.Module, runtime: Runtime, *, pipeline=None, strategy: Strategy | None = None):
        super().__init__()
        object.__setattr__(self, "_module", module)  # not a submodule: its tensors are not ours
        object.__setattr__(self, "_runtime", runtime)
        # a pipelined strategy: the runtime runs one micro-batch a forward, the driver the schedule
        object.__setattr__(self, "_pipeline", pipeline)
        object.__setattr__(self, "_strategy", strategy or runtime.strategy)
        for qual, p in runtime.params.items():
            owner, name = self._owner(qual)
            owner.register_parameter(name, p)
        for qual, b in runtime.buffers.items():
            owner, name = self._owner(qual)
            owner.register_buffer(name, b)
        if not any(p.requires_grad for p in runtime.params.values()):
            # A rank that holds no (trainable) parameter block still gets a (0-element)
            # parameter, so that ``torch.optim.X(model.parameters())`` works on every rank,
            # and torch's clip_grad_norm_ takes part in the global norm here too.
            self.register_parameter("_no_shard", _NoShard(torch.empty(0, device=runtime.device),
                                                          scope=runtime.sync.scope))
        self.require_backward_grad_sync = True  # False inside no_sync() (DDP's name)
        self.train(module.training)

    def _owner(self, qual: str):
        *path, name = qual.split(".")
        owner = self
        if path and hasattr(type(self), path[0]) or not path and hasattr(type(self), name):
            if path:
                path[0] += "_"
            else:
                name += "_"
        for part in path:
            if part not in owner._modules:
                owner.add_module(part, nn.Module())
            owner = owner._modules[part]
        return owner, name

    @property
    def original_module(self) -> nn.Module:
        """The module given to parallelize (its parameters are not updated by
        training: ``original_module.load_state_dict(model.state_dict())``)."""
        return self._module

    @property
    def runtime(self) -> Runtime:
        """This rank's runtime: its program, groups and shards."""
        return self._runtime

    @property
    def strategy(self) -> Strategy:
        """The strategy this module runs (with its pipeline, where it has one)."""
        return self._strategy

    @property
    def graph(self):
        """The traced graph of the original module."""
        return self._runtime.graph

    def program(self) -> str:
        """This rank's program in words: what it runs, sends, waits for and reduces, in order."""
        return describe(self._runtime)

    def forward(self, *inputs, **kwargs):
        """The original module's forward on the global inputs (the same on every rank); returns
        its outputs on every rank."""
        flat = self._runtime.graph.flat_inputs(inputs, kwargs)
        if self._pipeline is not None:  # the whole schedule, backward included (runtime.pipeline)
            return self._pipeline.step(flat, sync=self.require_backward_grad_sync)
        if torch.is_grad_enabled():  # the backward of this forward synchronizes or not
            self._runtime.sync.skip = not self.require_backward_grad_sync
        return self._runtime.run(flat)

    # -- gradients ------------------------------------------------------------
    def grad_norm(self, norm_type: float = 2.0) -> torch.Tensor:
        """The ``norm_type``-norm of the whole model's gradients, each parameter
        block counted once: a 0-dim tensor, the same on every rank (collective:
        every rank calls it).  ``norm_type``: any p but 0, or ``inf``/``-inf``."""
        return global_norm(self._runtime, norm_type)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                        foreach: bool | None = None) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over the whole model: every rank's
        shards scaled by ``min(1, max_norm / (total + 1e-6))`` where ``total`` is
        :meth:`grad_norm`, which it returns (collective: every rank calls it)."""
        total = self.grad_norm(norm_type)
        if error_if_nonfinite and not bool(torch.isfinite(total)):  # the same on every rank
            raise RuntimeError(f"The total norm of order {float(norm_type)} for gradients from `parameters` is "
                               f"non-finite, so it cannot be clipped. To disable this error and scale the "
                               f"gradients by the non-finite norm anyway, set `error_if_nonfinite=False`")
        scale_grads_(self._runtime, max_norm, total, foreach)
        return total

    @contextlib.contextmanager
    def no_sync(self):
        """Within it, the backward of each forward exchanges no parameter gradient
        between the ranks holding a parameter block (only the activations' gradients
        move, and the outputs are still summed): each rank accumulates its own, and
        the first backward of a forward outside it all-reduces them with its own, so
        that several micro-batches accumulate as in one process (DDP's no_sync).  An
        optimizer step belongs after that synchronized backward."""
        old = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old

    def train(self, mode: bool = True):
        """Train or eval mode, as ``nn.Module.train``, on this rank's shards."""
        super().train(mode)
        self._module.train(mode)
        return self

    def state_dict(self, *args, destination=None, prefix="", keep_vars=False, full: bool = True):
        """The original module's state dict (its keys and full shapes; collective).

        ``full=True``: full tensors, gathered now on every rank (for models whose
        whole state fits a rank).  ``full=False``: nothing is gathered; each value
        holds this rank's boxes of the tensor (views of its shards) and is gathered
        only when read (collective: every rank reads the same values in order).
        Either saves with ``torch.distributed.checkpoint`` as the same checkpoint,
        each rank writing its own boxes once; ``full=False`` is the one to load it
        into (each rank reads only the chunks covering its boxes, into its shards).
        See :mod:`flexflow.runtime.checkpoint`."""
        if args:  # the deprecated positional form (destination, prefix, keep_vars)
            destination = args[0]
            prefix = args[1] if len(args) > 1 else prefix
        return module_state_dict(self._runtime, self._module, destination, prefix, full)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Load a state dict with the original module's keys (full tensors, or either
        kind of :meth:`state_dict` of any strategy) and keep this rank's blocks."""
        return load_module_state_dict(self._runtime, self._module, state_dict, strict)

    def extra_repr(self) -> str:
        rt = self._runtime
        return (f"strategy={rt.strategy.name!r}, rank={rt.rank}, devices={rt.ranks}, "
                f"exchanges={rt.num_exchanges}")

    # -- checkpoints of the optimizer (flexflow.runtime.checkpoint) --------------
    def optim_state_dict(self, optimizer: torch.optim.Optimizer) -> dict:
        """The state of ``optimizer`` (built over ``parameters()``) keyed by the
        original module's parameter names, for ``torch.distributed.checkpoint``:
        state tensors shaped like a shard are sharded values of the parameter's full
        shape (this rank's boxes, views of the optimizer's tensors), so that a
        checkpoint loads under another strategy or number of devices.  An optimizer
        with no state yet gets it from a step with zero gradients and learning rate."""
        return optim_state_dict(self._runtime, self._module, optimizer)

    def load_optim_state_dict(self, optimizer: torch.optim.Optimizer, state_dict: dict) -> None:
        """Load into ``optimizer`` a state from :meth:`optim_state_dict` (filled by
        ``torch.distributed.checkpoint.load``) or one with full tensors keyed by
        parameter name."""
        load_optim_state_dict(self._runtime, self._module, optimizer, state_dict)


class _NoShard(nn.Parameter):
    """The empty parameter of a rank that holds no trainable block.  Its gradient is
    always an empty shard gradient (``zero_grad()`` cannot drop it), so that torch's
    clip_grad_norm_ on this rank takes its (empty) part in the global norm."""

    def __new__(cls, data, requires_grad: bool = True, scope: NormScope | None = None):
        self = super().__new__(cls, data, requires_grad=requires_grad)
        self._ff_grad = shard_grad(torch.zeros_like(data), scope, False)
        return self

    @property
    def grad(self):
        return self._ff_grad

    @grad.setter
    def grad(self, value):
        if value is not None and value.numel():
            raise RuntimeError("the placeholder parameter of a rank holding no block has no gradient")
