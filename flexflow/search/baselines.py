"""The baselines a search is compared with: data parallel, model parallel, expert, OptCNN,
and FSDP (data parallelism with every replicated parameter at shard level 3) where the
graph has parameters to shard."""
from __future__ import annotations

from ..graph.ir import OpGraph
from ..strategy.strategy import Strategy
from .common import Candidates
from .optcnn import optcnn

__all__ = ["baseline_strategies"]


def baseline_strategies(graph: OpGraph, machine, cost_model=None, *,
                        candidates: Candidates | None = None, shard: bool = True) -> dict[str, Strategy]:
    """name -> Strategy for data_parallel, model_parallel, expert and optcnn, and fsdp where
    data parallelism has parameter replicas to shard (and ``shard``)."""
    out = {"data_parallel": Strategy.data_parallel(graph, machine),
           "model_parallel": Strategy.model_parallel(graph, machine),
           "expert": Strategy.expert(graph, machine),
           "optcnn": optcnn(graph, machine, cost_model, candidates=candidates)}
    fsdp = Strategy.fsdp(graph, machine) if shard else None
    if fsdp is not None and fsdp != out["data_parallel"]:
        out["fsdp"] = fsdp
    return out
