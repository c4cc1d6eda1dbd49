"""What each op kind keeps for its backward (from PyTorch's derivative formulas), for the
memory model (:mod:`flexflow.sim.memory`, :mod:`flexflow.sim.rcmem`)."""
from __future__ import annotations

__all__ = ["_saves"]


class _Saves:
    """What an op kind keeps for its backward (from PyTorch's derivative formulas).

    inputs: indices of the inputs it saves ("all": every tensor input);
    output: it saves its output;
    extra: (factor, per) -- more saved bytes: factor x the bytes of ``per`` ("out": the
        output, "in0": input 0's region); ``itemsize`` replaces the dtype size when set;
    fwd_temp / bwd_temp: transients of its forward / backward, in the same units."""

    __slots__ = ("inputs", "output", "extra", "itemsize", "fwd_temp", "bwd_temp")

    def __init__(self, inputs=(), output=False, extra=(0.0, "out"), itemsize=None,
                 fwd_temp=(0.0, "out"), bwd_temp=(0.0, "out")):
        self.inputs, self.output, self.extra, self.itemsize = inputs, output, extra, itemsize
        self.fwd_temp, self.bwd_temp = fwd_temp, bwd_temp


_SAVES = {
    "conv2d": _Saves(inputs=(0,)), "conv1d": _Saves(inputs=(0,)),
    "linear": _Saves(inputs=(0,)),
    "batch_norm": _Saves(inputs=(0,)), "layer_norm": _Saves(inputs=(0,)),
    "relu": _Saves(output=True), "sigmoid": _Saves(output=True), "tanh": _Saves(output=True),
    "softmax": _Saves(output=True), "log_softmax": _Saves(output=True),
    "gelu": _Saves(inputs=(0,)),
    "max_pool2d": _Saves(inputs=(0,), extra=(1.0, "out"), itemsize=8),  # int64 indices
    "max_pool1d": _Saves(inputs=(0,), extra=(1.0, "out"), itemsize=8),
    "avg_pool2d": _Saves(inputs=(0,)), "adaptive_avg_pool2d": _Saves(inputs=(0,)),
    "avg_pool1d": _Saves(inputs=(0,)),
    "dropout": _Saves(extra=(1.0, "out"), itemsize=1),  # bool mask
    # log_softmax of the logits is kept; its gradient is a transient of the backward
    "cross_entropy": _Saves(extra=(1.0, "in0"), bwd_temp=(1.0, "in0")),
    # flexflow.fused_cross_entropy: the logits as they are (and a float32 per row: no matter)
    "fused_cross_entropy": _Saves(inputs=(0,)),
    # composite cell: gates (4H) and tanh(c') (H) kept, out = (h', c') = 2H; the two gate
    # products (2 x 4H) live until they are added; the backward's gate gradients likewise
    "lstm_cell": _Saves(inputs="all", extra=(2.5, "out"), fwd_temp=(4.0, "out"),
                        bwd_temp=(4.0, "out")),
    "bmm": _Saves(inputs="all"), "matmul": _Saves(inputs="all"),
    "embedding": _Saves(), "add": _Saves(), "sub": _Saves(), "cat": _Saves(), "stack": _Saves(),
    "contiguous": _Saves(), "masked_fill": _Saves(), "neg": _Saves(),
    "mul": _Saves(inputs="all"), "div": _Saves(inputs="all"),
}
_OPAQUE = _Saves(inputs="all")
_NOTHING = _Saves()
_BINARY = frozenset({"mul", "div"})  # by a scalar they keep nothing


# a product keeps each factor for the other's gradient only: x * cos (a rotary table that
# needs no gradient) keeps cos, not x; keyed by (input 1 needs a gradient, input 0 does)
_MUL = {(a, b): _Saves(inputs=tuple(i for i, keep in ((0, a), (1, b)) if keep))
        for a in (False, True) for b in (False, True)}


def _saves(op) -> _Saves:
    if op.kind in _BINARY and len(op.inputs) < 2:
        return _NOTHING
    if op.kind == "mul" and len(op.inputs) == 2:
        return _MUL[op.input_needs_grad(1), op.input_needs_grad(0)]
    return _SAVES.get(op.kind, _OPAQUE)
