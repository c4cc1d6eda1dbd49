"""The configs the search may choose for an op (power-of-two degrees on contiguous
devices), and the size of the space they span."""

from __future__ import annotations

import itertools
import math

from ..graph.ir import Op, OpGraph
from .config import REPLICA, ParallelConfig

__all__ = ['candidate_configs', 'strategy_space_log10']


# --------------------------------------------------------------------------- candidates
def _pow2_upto(n: int) -> list[int]:
    out, k = [], 1
    while k <= n:
        out.append(k)
        k *= 2
    return out


def candidate_configs(op: Op, machine) -> list[ParallelConfig]:
    """Every config the search may choose for ``op``: power-of-two degrees
    per parallel dim whose product fits the machine, on contiguous device
    blocks aligned to their size (the paper's space), whole-op placements
    on any single device included."""
    D = machine.num_devices if not isinstance(machine, int) else machine
    cache = op.__dict__.setdefault("_candidates", {})
    if D in cache:
        return cache[D]
    # the configs depend only on the dims' names and sizes and whether a sample dim
    # exists: ops alike (every unrolled step of a layer) share one list
    shared = (tuple((d.name, d.size, d.unit) for d in op.dims), op.sample_dim is None, D)
    hit = _CANDIDATES.get(shared)
    if hit is not None:
        cache[D] = hit
        return hit
    per_dim = [[(d.name, k) for k in _pow2_upto(min(d.blocks, D))] for d in op.dims if searched(d)]
    out = []
    for combo in itertools.product(*per_dim):
        p = math.prod(k for _, k in combo)
        if p > D:
            continue
        degs = {n: k for n, k in combo if k > 1}
        for start in range(0, D - p + 1, p):
            out.append(ParallelConfig(degs, range(start, start + p)))
    if op.sample_dim is None:  # no batch to split: replicas instead
        for p in _pow2_upto(D)[1:]:
            for start in range(0, D - p + 1, p):
                out.append(ParallelConfig({REPLICA: p}, range(start, start + p)))
    cache[D] = _CANDIDATES[shared] = out
    return out


_CANDIDATES: dict = {}  # (dims' names and sizes, no sample dim, devices) -> configs


def searched(dim) -> bool:
    """Whether the candidates split ``dim``: all dims but a split of a layer's inputs with
    partial sums (a linear layer's ``k``, Megatron's row-parallel split), which pays only
    paired with a split of its producer's outputs and is left to ``Strategy.megatron``, and
    a causal attention's head-tail split (``z``), which reorders the tokens of the whole
    graph and so moves only with every attention at once (``Strategy.megatron(cp=)``)."""
    return not (dim.axis is None and dim.kind == "parameter") and dim.name != "z"


def strategy_space_log10(graph: OpGraph, machine) -> float:
    """log10 of the number of strategies (one config per share group)."""
    total = 0.0
    for members in graph.groups.values():
        total += math.log10(len(candidate_configs(graph.op(members[0]), machine)))
    return total
