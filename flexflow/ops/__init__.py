"""Partition rules, one file per op family, registered by name in ``RULES``."""
from .base import RULES, Rule, full_region, out_region, region_numel, region_shape  # noqa: F401
from . import pointwise, dense, conv, norm, shape, loss, attention  # noqa: F401  (register rules)

__all__ = ["RULES", "Rule", "full_region", "out_region", "region_numel", "region_shape"]
