"""The baselines a search is compared with: data parallel, model parallel, expert, OptCNN."""
from __future__ import annotations

from ..graph.ir import OpGraph
from ..strategy.strategy import Strategy
from .common import Candidates
from .optcnn import optcnn

__all__ = ["baseline_strategies"]


def baseline_strategies(graph: OpGraph, machine, cost_model=None, *,
                        candidates: Candidates | None = None) -> dict[str, Strategy]:
    """name -> Strategy for data_parallel, model_parallel, expert and optcnn."""
    return {"data_parallel": Strategy.data_parallel(graph, machine),
            "model_parallel": Strategy.model_parallel(graph, machine),
            "expert": Strategy.expert(graph, machine),
            "optcnn": optcnn(graph, machine, cost_model, candidates=candidates)}
