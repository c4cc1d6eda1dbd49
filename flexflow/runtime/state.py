"""The runtime's state as full tensors: gathered from the ranks' shards, loaded into them.

BatchNorm split along samples or space keeps per-replica running statistics,
as DistributedDataParallel does: the full tensors report those of the first
rank of each shard.
"""
from __future__ import annotations

from collections import OrderedDict

import torch
import torch.distributed as dist

from .plan import _wire, tensor_of

__all__ = ["State"]


class State:
    """Full tensors of a :class:`~flexflow.runtime.execute.Runtime`'s shards (a mixin)."""

    def full_tensors(self) -> dict[str, torch.Tensor]:
        """qual -> full tensor (in its view shape) of every placed parameter and
        buffer, gathered on every rank: the first rank of each shard contributes."""
        fulls = OrderedDict()
        for qual, (view, shards, trainable) in self.placement.items():
            src = tensor_of(self.module, qual)
            full = torch.zeros(view, dtype=src.dtype, device=self.device)
            if qual in self.shards:
                held, region, ranks = self.shards[qual]
                if qual in self.slices:  # sharded: every replica gives its slice (they tile the region)
                    sl, whole = self.slices[qual], self.full[qual]
                    block = torch.zeros(whole.numel(), dtype=src.dtype, device=self.device)
                    block[sl.lo:sl.hi] = self.params[qual].detach()
                    full.view(held)[region] = block.view(whole.shape)
                elif ranks[0] == self.rank:
                    mine = self.compute_tensor(qual) if qual in self.params else self.buffers[qual]
                    full.view(held)[region] = mine.detach()  # held whole in its own shape, or a block of the view
            fulls[qual] = full
        if self.distributed and self.world > 1:
            by_dtype: dict = {}
            for qual, t in fulls.items():
                by_dtype.setdefault(t.dtype, []).append(qual)
            for dtype in sorted(by_dtype, key=str):
                quals = by_dtype[dtype]
                flat = torch.cat([_wire(fulls[q]).reshape(-1) for q in quals])
                dist.all_reduce(flat, group=self.coll_group)
                off = 0
                for q in quals:
                    n = fulls[q].numel()
                    fulls[q] = flat[off:off + n].view(fulls[q].shape).to(dtype)
                    off += n
        return fulls

    def load_from_module(self) -> None:
        """Copy this rank's blocks from the (full) tensors of the module."""
        with torch.no_grad():
            for qual, (view, region, _) in self.shards.items():
                block = tensor_of(self.module, qual).detach().reshape(view)[region]
                sl = self.slices.get(qual)
                if sl is not None:  # a sharded region: this rank's slice (gathered at the next use)
                    self.params[qual].copy_(block.reshape(-1)[sl.lo:sl.hi])
                    continue
                dst = self.params[qual] if qual in self.params else self.buffers[qual]
                dst.copy_(block)
