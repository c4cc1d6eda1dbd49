"""Partition rules, one file per op family, registered by name in ``RULES``."""
from . import attention, conv, dense, loss, norm, pointwise, shape  # noqa: F401  (register rules)
from .base import RULES, Rule, full_region, out_region, region_numel, region_shape  # noqa: F401

__all__ = ["RULES", "Rule", "full_region", "out_region", "region_numel", "region_shape", "picks_stacked_part"]


def picks_stacked_part(op, src) -> bool:
    """Whether the index op ``op`` picks whole parts of its input ``src``, an op whose
    outputs are stacked and kept apart by the executor (an LSTM cell's (h, c): h =
    out[0]).  The executor then hands the part on and runs no op
    (``Runtime._stacked_item`` checks the partitions), so it costs no time."""
    if op.rule != "index" or not src.attrs.get("stacked") or not hasattr(RULES[src.rule], "compute_parts"):
        return False
    a = op.attrs
    return not (0 in a["axis_map"] or 0 in a.get("sliced", {}) or a.get("new_axes"))
