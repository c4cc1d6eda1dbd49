"""The SOAP strategy space: configs, the one partition function everything else asks
"which device holds which slice", candidate configs, and strategies.

- :mod:`.config`: :class:`ParallelConfig` (a degree per parallel dim and a device per
  partition), :class:`StrategyError`;
- :mod:`.regions`: :func:`partitions` (output, input and parameter regions of every
  partition), :func:`param_placement` (which devices hold which parameter block),
  :func:`overlap`, :func:`pick_replica`;
- :mod:`.boxes`: the same regions as integer arrays, assembled one dim at a time for
  rules that declare themselves separable (many configs of one op at little cost);
- :mod:`.candidates`: :func:`candidate_configs`, :func:`strategy_space_log10`;
- :mod:`.strategy`: :class:`Strategy` and the built-ins;
- :mod:`.megatron`: ``Strategy.megatron``'s plan read off the graph (:func:`linear_pairs`);
- :mod:`.localrun`: the single-process reference run of a graph, partition by partition.
"""
from .candidates import candidate_configs, strategy_space_log10
from .config import REPLICA, ParallelConfig, StrategyError, format_devices
from .regions import (ParamShard, Partition, canonical_partitions, overlap, param_placement, partitions,
                      pick_replica, validate_config)
from .megatron import linear_pairs
from .strategy import Strategy

__all__ = ["ParallelConfig", "Partition", "Strategy", "StrategyError", "partitions", "candidate_configs",
           "param_placement", "ParamShard", "validate_config", "strategy_space_log10", "format_devices",
           "overlap", "REPLICA", "pick_replica", "canonical_partitions", "linear_pairs"]
