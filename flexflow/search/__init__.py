"""Strategy search: Metropolis-Hastings MCMC over SOAP strategies, scored by
the simulator (section 5 of the paper), the baselines it is compared with,
and the optimality checks of section 8.

    result = search(graph, machine, budget=30.0)     # or evaluations=N
    result.strategy.to_json()

- :func:`search` runs several chains (data parallel, expert, OptCNN and
  random starts, plus ``init``) round-robin, one :class:`Simulator` per chain
  so that each proposal (one share group's config changed) is a delta
  simulation; then a local descent ("polish") from the best strategy found.
- :func:`baseline_strategies` / :func:`optcnn`: data parallel, model
  parallel, expert and OptCNN's layer-wise dynamic programming; where data
  parallelism does not fit, FSDP, Megatron's tensor parallelism and the 2-D
  FSDP x TP plan (``fsdp``, ``megatron``, ``fsdp_tp``) as well.  Baselines
  that took a while are kept for the next search of the same graph and machine.
- :func:`exhaustive_search` (branch and bound) and :func:`is_local_optimum`
  check the search on small cases.

Costs: the simulated iteration time; a strategy that does not fit device
memory costs its time plus a penalty (see :func:`_penalised`), and the best
*feasible* strategy always wins over any infeasible one.  When nothing fits,
the result is still no slower than any baseline.

Where memory binds, shard levels and recomputation join the space as levers of a
group's config (``levers``): carried over its split changes, changed one group or one op
kind at a time.

Where the graph repeats a block (a transformer's layers), repeat moves give the same op
of every block one config at once (``repeats``).

Counting: ``SearchResult.evaluations`` are the proposals scored (simulated, cut by a
proven bound, or screened by the load bound); chain starts and baselines are counted
apart, with their seconds.

Modules: ``common`` (space, costs, result, budget), ``mcmc`` (:func:`search`,
:func:`is_local_optimum`), ``levers`` (shard levels and recomputation), ``repeats``
(repeated layers), ``baselines``, ``optcnn``, ``exhaustive``.
"""
from .baselines import baseline_strategies
from .common import BASELINES, SearchError, SearchResult, _Space
from .exhaustive import _Bound, exhaustive_search
from .mcmc import is_local_optimum, search
from .optcnn import _OptCNN, optcnn, optcnn_cost

__all__ = ["search", "SearchResult", "SearchError", "baseline_strategies", "optcnn", "optcnn_cost",
           "exhaustive_search", "is_local_optimum", "BASELINES"]
