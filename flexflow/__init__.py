"""flexflow: find and run fast parallelization strategies for PyTorch models.

    import flexflow as ff
    model = ff.parallelize(model, devices, example_inputs=batch)

Traces the model with torch.fx, searches the SOAP space (sample, attribute,
parameter and operation parallelism) with MCMC scored by a task-graph
simulator, and runs the chosen strategy with torch.distributed.
"""
from . import models
from .cost.model import CostModel
from .graph.ir import Op, OpGraph
from .graph.ops.fused_ce import fused_cross_entropy
from .graph.trace import TraceError, trace
from .hardware.machine import Machine
from .launch import LaunchError, launch  # the function shadows the module name, as search does
from .plan import Plan, plan  # the function shadows the module name too
from .search import SearchResult, search  # the function shadows the module name, on purpose
from .sim.simulate import SimResult, Simulator
from .strategy.candidates import candidate_configs
from .strategy.config import ParallelConfig, StrategyError
from .strategy.strategy import Strategy

__all__ = ["models", "trace", "TraceError", "Op", "OpGraph", "Machine", "ParallelConfig",
           "Strategy", "StrategyError", "candidate_configs", "CostModel", "Simulator", "SimResult",
           "search", "SearchResult", "plan", "Plan", "parallelize", "ParallelModule", "launch", "LaunchError",
           "fused_cross_entropy"]

# the runtime loads on first use
_LAZY = {"parallelize": "api", "ParallelModule": "runtime.module"}


def __getattr__(name):
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'flexflow' has no attribute {name!r}")
