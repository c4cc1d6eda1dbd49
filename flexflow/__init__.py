"""flexflow: find and run fast parallelization strategies for PyTorch models.

    import flexflow as ff
    model = ff.parallelize(model, devices, example_inputs=batch)

Traces the model with torch.fx, searches the SOAP space (sample, attribute,
parameter and operation parallelism) with MCMC scored by a task-graph
simulator, and runs the chosen strategy with torch.distributed.
"""
from . import models
from .ir import Op, OpGraph
from .machine import Machine
from .strategy import ParallelConfig, Strategy, candidate_configs
from .trace import TraceError, trace
from .simulate import SimResult, Simulator
from .search import SearchResult, search  # the function shadows the module name, on purpose

__all__ = ["models", "trace", "TraceError", "Op", "OpGraph", "Machine", "ParallelConfig",
           "Strategy", "candidate_configs", "Simulator", "SimResult", "search", "SearchResult",
           "parallelize", "launch"]

_LAZY = {"parallelize": "api", "launch": "api"}


def __getattr__(name):
    # the runtime (torch.distributed) loads on first use
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'flexflow' has no attribute {name!r}")
