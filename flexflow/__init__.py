"""flexflow: find and run fast parallelization strategies for PyTorch models."""
from . import models
from .ir import Op, OpGraph
from .trace import TraceError, trace
from .machine import Machine

__all__ = ["models", "trace", "TraceError", "Op", "OpGraph", "Machine"]
