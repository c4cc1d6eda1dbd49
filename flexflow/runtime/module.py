"""ParallelModule: the nn.Module a rank trains, in front of its Runtime.

Its ``parameters()`` are the rank's shards, its forward takes the global inputs
and returns the full outputs on every rank, and its state dict speaks the
original module's full tensors.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
import torch.nn as nn

from ..strategy.strategy import Strategy
from .execute import Runtime
from .plan import tensor_of
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
    """

    def __init__(self, module: nn.Module, runtime: Runtime):
        super().__init__()
        object.__setattr__(self, "_module", module)  # not a submodule: its tensors are not ours
        object.__setattr__(self, "_runtime", runtime)
        for qual, p in runtime.params.items():
            owner, name = self._owner(qual)
            owner.register_parameter(name, p)
        for qual, b in runtime.buffers.items():
            owner, name = self._owner(qual)
            owner.register_buffer(name, b)
        if not runtime.params:
            # A rank that holds no parameter block still gets a (0-element) parameter,
            # so that ``torch.optim.X(model.parameters())`` works on every rank.
            self.register_parameter("_no_shard", nn.Parameter(torch.empty(0, device=runtime.device)))
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
        return self._runtime

    @property
    def strategy(self) -> Strategy:
        return self._runtime.strategy

    @property
    def graph(self):
        return self._runtime.graph

    def program(self) -> str:
        """This rank's program in words: what it runs, sends, waits for and reduces, in order."""
        return describe(self._runtime)

    def forward(self, *inputs, **kwargs):
        return self._runtime.run(self._runtime.graph.flat_inputs(inputs, kwargs))

    def train(self, mode: bool = True):
        super().train(mode)
        self._module.train(mode)
        return self

    def state_dict(self, *args, destination=None, prefix="", keep_vars=False):
        """Full tensors keyed like the original module's state_dict (collective)."""
        if args:  # the deprecated positional form (destination, prefix, keep_vars)
            destination = args[0]
            prefix = args[1] if len(args) > 1 else prefix
        fulls = self._runtime.full_tensors()
        by_id = {id(tensor_of(self._module, q)): q for q in fulls}
        out = OrderedDict() if destination is None else destination
        for key, t in self._module.state_dict(keep_vars=True).items():
            q = by_id.get(id(t))
            value = fulls[q].reshape(t.shape) if q is not None else t.detach()
            out[prefix + key] = value.clone()
        return out

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Load full tensors (the original module's keys) and keep this rank's blocks."""
        result = self._module.load_state_dict(state_dict, strict=strict)
        self._runtime.load_from_module()
        return result

    def extra_repr(self) -> str:
        rt = self._runtime
        return (f"strategy={rt.strategy.name!r}, rank={rt.rank}, devices={rt.ranks}, "
                f"exchanges={rt.num_exchanges}")
