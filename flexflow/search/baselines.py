"""The baselines a search is compared with: data parallel, model parallel, expert, OptCNN,
ZeRO-1, ZeRO-2 and FSDP (data parallelism with every replicated parameter at shard level 1,
2, 3) where the graph has parameters to shard, and Megatron's tensor parallelism (``megatron``; with ``shard`` also the
2-D FSDP x TP plan, ``fsdp_tp``) where it has pairs of linear layers to split,
3-D plans with pipeline stages (``megatron_ppP``) where the machine spans nodes too, and
FSDP x TP with context parallelism (``fsdp_tp_cpC``) where sequences are long."""
from __future__ import annotations

import math
import time
from collections import OrderedDict

from ..graph.ir import OpGraph, repeated_block
from ..strategy.config import StrategyError
from ..strategy.megatron import linear_pairs
from ..strategy.strategy import Strategy
from .common import Candidates
from .optcnn import optcnn

__all__ = ["MEMORY_BASELINES", "baseline_strategies", "context_baselines", "memory_baselines",
           "pipeline_baselines"]

# a sequence at least this long gets the context-parallel baselines
LONG_SEQUENCE = 8192

# the baselines simulated only where data parallelism does not fit (see ``mcmc.search``)
MEMORY_BASELINES = ("zero1", "zero2", "fsdp", "megatron", "fsdp_tp")


def baseline_strategies(graph: OpGraph, machine, cost_model=None, *,
                        candidates: Candidates | None = None, shard: bool = True,
                        memory: bool = True) -> dict[str, Strategy]:
    """name -> Strategy for data_parallel, model_parallel, expert and optcnn, and with
    ``memory`` the plans of :func:`memory_baselines`."""
    out = {"data_parallel": Strategy.data_parallel(graph, machine),
           "model_parallel": Strategy.model_parallel(graph, machine),
           "expert": Strategy.expert(graph, machine),
           "optcnn": optcnn(graph, machine, cost_model, candidates=candidates)}
    if memory:
        out.update(memory_baselines(graph, machine, shard=shard, data_parallel=out["data_parallel"]))
    return out


def memory_baselines(graph: OpGraph, machine, *, shard: bool = True,
                     data_parallel: Strategy | None = None) -> dict[str, Strategy]:
    """zero1, zero2 and fsdp where data parallelism has parameter replicas to shard (and
    ``shard``);
    megatron (tensor parallelism over the devices of a node, data parallelism across
    nodes) where the machine has several devices, the graph pairs of linear layers and a
    batch for its data-parallel degree, and fsdp_tp (the same at shard level 3) with
    ``shard``; each where it is not data parallelism itself."""
    dp = data_parallel if data_parallel is not None else Strategy.data_parallel(graph, machine)
    out = {}
    if shard:
        out["zero1"] = Strategy.zero(graph, machine, 1)
        out["zero2"] = Strategy.zero(graph, machine, 2)
        out["fsdp"] = Strategy.fsdp(graph, machine)
    if machine.num_devices > 1 and linear_pairs(graph):
        try:
            out["megatron"] = Strategy.megatron(graph, machine)
            if shard:
                out["fsdp_tp"] = Strategy.megatron(graph, machine, shard=3)
        except StrategyError:  # a batch smaller than the data-parallel degree
            out.pop("megatron", None)
        out.update(pipeline_baselines(graph, machine))
        out.update(context_baselines(graph, machine, shard=shard))
    return {k: s for k, s in out.items() if s != dp}


def context_baselines(graph: OpGraph, machine, *, shard: bool = True) -> dict[str, Strategy]:
    """FSDP x TP with context parallelism (``Strategy.megatron(tp=node, cp=C, shard=3)``, C of
    2, 4, 8, 16, balanced head-tail where the graph allows; and the same with every block
    recomputed, ``..._rc``) where a causal
    attention reads sequences of at least ``LONG_SEQUENCE`` tokens: the plans of a long-context
    phase, where the activations of one sequence outgrow a device."""
    D, dpn, B = machine.num_devices, getattr(machine, "devices_per_node", machine.num_devices), graph.batch_size
    long = any(op.rule == "attention" and op.attrs.get("is_causal") and op.output_shape[2] >= LONG_SEQUENCE
               and "l" in op.parallel_dims for op in graph.compute_ops)
    if not long or D < 2:
        return {}
    out = {}
    for cp in (2, 4, 8, 16):
        tp = math.gcd(D // cp, dpn) if D % cp == 0 else 0
        if not tp or D % (tp * cp) or (B is not None and D // (tp * cp) > B):
            continue
        try:
            s = Strategy.megatron(graph, machine, tp=tp, cp=cp, shard=3 if shard else 0)
        except StrategyError:
            continue
        name = f"{'fsdp_tp' if shard else 'megatron'}_cp{cp}"
        out[name] = s
        out[name + "_rc"] = s.recompute_blocks()
    for k, s in out.items():
        s.name = k
    return out


def pipeline_baselines(graph: OpGraph, machine) -> dict[str, Strategy]:
    """The 3-D plans (``Strategy.megatron`` with ``pp`` of 2, 4 and 8 stages, tensor
    parallelism inside a node, every block recomputed, 1F1B over 4 pp micro-batches, or
    fewer where the batch has too few samples for its data-parallel replicas) where the
    machine spans nodes and the graph has repeated blocks to cut; named ``megatron_ppP``."""
    D, dpn, B = machine.num_devices, getattr(machine, "devices_per_node", machine.num_devices), graph.batch_size
    blocks = {repeated_block(op.module_path) for op in graph.compute_ops} - {""}
    if D <= dpn or len(blocks) < 2 or B is None or graph.module is None:
        return {}
    out = {}
    for pp in (2, 4, 8):
        if D % pp or pp > len(blocks):
            continue
        tp = math.gcd(D // pp, dpn)
        dp = D // pp // tp
        m = next((k for k in (4 * pp, 2 * pp, pp) if B % k == 0 and (B // k) % dp == 0), None)
        if m is None:
            continue
        try:
            out[f"megatron_pp{pp}"] = Strategy.megatron(graph, machine, tp=tp, pp=pp, microbatches=m).recompute_blocks()
        except StrategyError:  # too few heads, blocks or samples for it
            continue
    for k, s in out.items():
        s.name = k
    return out


# ------------------------------------------------------------------------------ reuse
# Baselines built and simulated for a graph and machine, kept for the next search of the same
# (at 64 devices OptCNN's tables and the baselines' simulations take seconds).  Only those
# that took at least _REUSE_CPU_S of processor time are kept: a small search stays a function
# of its arguments and its clock alone.
_REUSE: OrderedDict = OrderedDict()
_REUSE_SIZE = 4
_REUSE_CPU_S = 1.0


def reuse_key(graph: OpGraph, machine, cost_model, *settings):
    """The key under which a search's baselines are kept (None: not kept, e.g. under a
    restricted candidate space): graph, machine, the cost model (the analytic default, or
    that very object) and the simulator's settings."""
    return (graph.fingerprint(), machine.fingerprint(), "analytic" if cost_model is None else id(cost_model),
            *settings)


def reused(key, graph: OpGraph, machine):
    """(strategies, results) kept under ``key``, the strategies on ``graph``; or None."""
    hit = _REUSE.get(key) if key is not None else None
    if hit is None:
        return None
    _REUSE.move_to_end(key)
    strategies, results = hit[0], hit[1]
    if any(s.graph is not graph for s in strategies.values()):
        strategies = {k: Strategy(graph, dict(s), machine, name=s.name,
                                  pipeline=s.pipeline.to_dict() if s.pipeline is not None else None)
                      for k, s in strategies.items()}
    return dict(strategies), dict(results)


def keep(key, strategies: dict, results: dict, cost_model, cpu_s: float) -> None:
    """Keep a search's baselines under ``key`` when they took at least ``_REUSE_CPU_S``."""
    if key is None or cpu_s < _REUSE_CPU_S:
        return
    _REUSE[key] = (dict(strategies), dict(results), cost_model)  # (the model: its id stays its own)
    while len(_REUSE) > _REUSE_SIZE:
        _REUSE.popitem(last=False)


def cpu_seconds() -> float:
    """This process's processor time (what ``keep`` compares)."""
    return time.process_time()
