"""Strategy: a config for every placed op of a graph (ops that share parameters share
one), its JSON, and the built-ins: data parallel, model parallel, expert, single device,
random, ZeRO stages, FSDP and Megatron."""

from __future__ import annotations

import json
import math
import random as _random
from collections.abc import Mapping
from typing import Iterator

from ..graph.ir import Op, OpGraph, repeated_block
from ..graph.micro import microbatch_graph
from ..graph.ops.attention import balanced
from .candidates import candidate_configs
from .config import REPLICA, SHARD_LEVELS, ParallelConfig, StrategyError
from .layout import layout_blocks, token_layout
from .megatron import megatron_configs
from .pipeline import Pipeline, pipeline_layout, stage_configs
from .regions import has_param_replicas, validate_config

__all__ = ['Strategy']


# --------------------------------------------------------------------------- strategy
class Strategy(Mapping):
    """Op name -> ParallelConfig for every placed op of a graph.

    Ops that share parameters always share one config."""

    def __init__(self, graph: OpGraph, configs: Mapping[str, ParallelConfig], machine=None,
                 name: str = "custom", pipeline: dict | None = None):
        self.graph = graph
        self.pipeline: Pipeline | None = None
        self.name = name
        self.machine_fingerprint = machine.fingerprint() if machine is not None else None
        self.num_devices = machine.num_devices if machine is not None else None
        self._configs: dict[str, ParallelConfig] = {}
        for op in graph.compute_ops:
            if op.name in configs:
                self._configs[op.name] = configs[op.name]
            else:
                rep = next((m for m in graph.groups[op.group] if m in configs), None)
                if rep is None:
                    raise StrategyError(f"strategy has no config for {op.describe()}")
                self._configs[op.name] = configs[rep]
        unknown = [k for k in configs if k not in self._configs]
        if unknown:
            raise StrategyError(f"strategy names ops the graph does not have: {unknown[:5]}")
        for members in graph.groups.values():
            if len({self._configs[m] for m in members}) > 1:
                raise StrategyError(f"ops {members[:3]}... share parameters and must share one config")
        for op in graph.compute_ops:
            validate_config(op, self._configs[op.name], self.num_devices)
        _check_layout(graph, self._configs)
        if pipeline is not None:
            self.pipeline = pipeline_layout(graph, self._configs, **_pipeline_args(pipeline))

    # Mapping
    def __getitem__(self, k: str) -> ParallelConfig:
        return self._configs[k]

    def __iter__(self) -> Iterator[str]:
        return iter(self._configs)

    def __len__(self) -> int:
        return len(self._configs)

    def __eq__(self, other):
        return (isinstance(other, Strategy) and self._configs == other._configs
                and _spec(self.pipeline) == _spec(other.pipeline))

    def __hash__(self):
        h = hash(tuple(sorted(self._configs.items())))
        return h if self.pipeline is None else hash((h, self.pipeline.microbatches, self.pipeline.schedule))

    def _derive(self, configs, name=None, pipeline=False) -> "Strategy":
        s = Strategy.__new__(Strategy)
        s.graph, s.name = self.graph, name or self.name
        s.machine_fingerprint, s.num_devices = self.machine_fingerprint, self.num_devices
        s._configs = configs
        s.pipeline = self.pipeline
        if pipeline is not False:
            s.pipeline = None if pipeline is None else pipeline_layout(self.graph, configs, **_pipeline_args(pipeline))
        elif self.pipeline is not None and configs is not self._configs:
            s.pipeline = pipeline_layout(self.graph, configs, **_pipeline_args(_spec(self.pipeline)))
        return s

    def with_pipeline(self, microbatches: int = 1, schedule: str = "1f1b") -> "Strategy":
        """This strategy as a pipeline: the step's batch cut into ``microbatches`` that flow
        through the device groups of its placement under ``schedule`` (``"gpipe"``,
        ``"1f1b"``, ``"interleaved-1f1b"``); each op's degrees split one micro-batch.  An
        impossible pipeline is a :class:`StrategyError` saying why."""
        return self._derive(self._configs, pipeline={"microbatches": microbatches, "schedule": schedule})

    def without_pipeline(self) -> "Strategy":
        """This strategy's placement with no pipeline (one micro-batch, ops in turn)."""
        return self._derive(self._configs, pipeline=None)

    def replace(self, op_name: str, config: ParallelConfig) -> "Strategy":
        """A new strategy with ``op_name`` (and every op sharing its parameters) on ``config``."""
        op = self.graph.op(op_name)
        validate_config(op, config, self.num_devices)
        configs = dict(self._configs)
        for m in self.graph.groups[op.group]:
            configs[m] = config
        if balanced(op):
            _check_layout(self.graph, configs)
        return self._derive(configs)

    def replaced(self, changes: Mapping[str, ParallelConfig]) -> "Strategy":
        """A new strategy with the ops of ``changes`` (op name -> config; each share group
        whole) on their new configs, checked once (the pipeline too)."""
        configs = dict(self._configs)
        for name, cfg in changes.items():
            op = self.graph.op(name)
            validate_config(op, cfg, self.num_devices)
            for m in self.graph.groups[op.group]:
                configs[m] = cfg
        if any(balanced(self.graph.op(n)) for n in changes):
            _check_layout(self.graph, configs)
        return self._derive(configs)

    def recompute_blocks(self) -> "Strategy":
        """This strategy with every op of the graph's repeated blocks recomputed
        (:func:`flexflow.graph.ir.repeated_block`; a share group only where all of its ops
        are in blocks): block checkpointing, each block keeping what enters it."""
        configs = dict(self._configs)
        for members in self.graph.groups.values():
            if all(repeated_block(self.graph.op(m).module_path) for m in members):
                for m in members:
                    configs[m] = configs[m].with_recompute()
        name = f"{self.name}_rc" if self.name else "recompute_blocks"
        return self._derive(configs, name=name)

    def devices_used(self) -> set[int]:
        """The devices that some op of the strategy runs on, in order."""
        return {d for c in self._configs.values() for d in c.devices}

    def check(self, machine) -> None:
        """Refuse a strategy made for another machine, or one that does not fit it."""
        if self.machine_fingerprint and self.machine_fingerprint != machine.fingerprint():
            raise StrategyError(f"strategy was made for another machine (fingerprint "
                                f"{self.machine_fingerprint}, this machine {machine.fingerprint()})")
        for op in self.graph.compute_ops:
            validate_config(op, self._configs[op.name], machine.num_devices)

    def table(self) -> str:
        """One line per share group: ``conv3: S4 C2 @[0..7]``."""
        lines = [str(self.pipeline)] if self.pipeline is not None else []
        for members in self.graph.groups.values():
            op = self.graph.op(members[0])
            extra = f" (+{len(members) - 1} sharing)" if len(members) > 1 else ""
            lines.append(f"{op.name}: {self._configs[op.name]}{extra}")
        return "\n".join(lines)

    # JSON
    def to_json(self) -> str:
        """The strategy as JSON: per op its degrees, devices, shard level and recomputation,
        with the graph's fingerprint and the machine's size (``Strategy.from_json`` reads it
        back)."""
        d = {
            "format": "flexflow-strategy", "version": 1, "name": self.name,
            "graph": self.graph.fingerprint(), "machine": self.machine_fingerprint,
            "num_devices": self.num_devices,
            "ops": {k: c.to_dict() for k, c in self._configs.items()},
        }
        if self.pipeline is not None:
            d["pipeline"] = self.pipeline.to_dict()
        return json.dumps(d, indent=1)

    @classmethod
    def from_json(cls, text: str, graph: OpGraph, machine=None) -> "Strategy":
        """A strategy from ``to_json``'s text, bound to ``graph`` (and checked against
        ``machine`` when given); a strategy written for another graph or machine is a
        :class:`StrategyError` that says why."""
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise StrategyError(f"strategy file is not valid JSON: {e}") from None
        if isinstance(d, dict) and d.get("format") == "flexflow-plan" and isinstance(d.get("strategy"), dict):
            d = d["strategy"]  # a plan file (flexflow.Plan.to_json) carries its strategy
        if not isinstance(d, dict) or d.get("format") != "flexflow-strategy":
            raise StrategyError("not a flexflow strategy file (missing \"format\": \"flexflow-strategy\")")
        if d.get("graph") != graph.fingerprint():
            raise StrategyError(f"strategy was made for another graph (fingerprint {d.get('graph')}, "
                                f"this graph {graph.fingerprint()}): trace the same model, batch and dtype")
        ops = d.get("ops")
        if not isinstance(ops, dict):
            raise StrategyError("strategy file has no \"ops\" object")
        configs = {}
        for k, v in ops.items():
            if k not in graph:
                raise StrategyError(f"strategy entry {k!r} names no op of this graph")
            try:
                configs[k] = ParallelConfig.from_dict(v)
            except StrategyError as e:
                raise StrategyError(f"strategy entry {k!r}: {e}") from None
        pipe = d.get("pipeline")
        if pipe is not None and (not isinstance(pipe, dict) or set(pipe) - {"microbatches", "schedule"}):
            raise StrategyError(f"strategy file's \"pipeline\" must be an object with \"microbatches\" and "
                                f"\"schedule\", got {pipe!r}")
        s = cls(graph, configs, name=d.get("name", "custom"), pipeline=pipe)
        s.machine_fingerprint = d.get("machine")
        s.num_devices = d.get("num_devices")
        if machine is not None:
            s.check(machine)
        return s

    # built-ins
    @classmethod
    def data_parallel(cls, graph: OpGraph, machine) -> "Strategy":
        """Every op split along its sample dim over all devices; an op with no
        sample dim that reads only graph constants (positions, masks) and such
        ops is replicated on every device, as DistributedDataParallel in effect
        does (no activation travels for it; its gradients are all-reduced)."""
        D = machine.num_devices
        configs = {}
        replicated = _constant_fed(graph) if D > 1 else set()
        for members in graph.groups.values():
            op = graph.op(members[0])
            if all(m in replicated for m in members):
                configs[op.name] = ParallelConfig({REPLICA: D}, range(D))
            else:
                configs[op.name] = _sample_config(op, D)
        return cls(graph, configs, machine, name="data_parallel")

    @classmethod
    def zero(cls, graph: OpGraph, machine, stage: int) -> "Strategy":
        """Data parallelism with the parameters of every op that has replicas of them at
        shard level ``stage`` (1: optimizer state, 2: and gradients, 3: and parameters split
        among the replicas, as ZeRO's stages)."""
        if stage not in SHARD_LEVELS:
            raise StrategyError(f"stage must be one of {SHARD_LEVELS}, got {stage!r}")
        dp = cls.data_parallel(graph, machine)
        configs = {}
        for members in graph.groups.values():
            op, cfg = graph.op(members[0]), dp[members[0]]
            sharded = cfg.with_shard(stage) if stage else cfg
            configs[op.name] = (sharded if stage and any(graph.op(m).params and has_param_replicas(graph.op(m), cfg)
                                                         for m in members) else cfg)
        return cls(graph, configs, machine, name=f"zero{stage}" if stage != 3 else "fsdp")

    @classmethod
    def fsdp(cls, graph: OpGraph, machine) -> "Strategy":
        """Data parallelism with every replicated parameter at shard level 3 (FSDP, ZeRO-3)."""
        return cls.zero(graph, machine, 3)

    @classmethod
    def megatron(cls, graph: OpGraph, machine, tp: int | None = None, shard: int = 0, *, pp: int = 1,
                 microbatches: int = 1, schedule: str = "1f1b", interleave: int = 1, cp: int = 1,
                 sequence_parallel: bool = True, cp_balance: bool | None = None) -> "Strategy":
        """Megatron-style tensor parallelism of degree ``tp`` (default: the devices of one
        node) inside groups of ``tp`` consecutive devices, data parallelism across the
        groups; ``shard`` (0-3) shards every replicated parameter among its replicas
        (``shard=3``: the 2-D FSDP x TP plan).  Found from the graph: see
        :mod:`flexflow.strategy.megatron`.

        ``pp > 1`` adds pipeline stages (the 3-D plan): device ``t + tp * (s + pp * d)`` is
        rank t of the tensor-parallel group of stage s in data-parallel replica d; the
        repeated blocks are cut into ``pp * interleave`` contiguous chunks balanced by
        FLOPs (what comes before the first block with the first chunk, what comes after
        the last with the last), chunk c on stage ``c % pp``; the step's batch is cut into
        ``microbatches`` run under ``schedule``.  Each op's degrees split one micro-batch.

        ``cp > 1`` adds context parallelism: every op also split along the tokens ``cp``
        ways (device ``t + tp * (c + cp * d)``: tensor rank t of sequence chunk c), a causal
        attention by its query rows.  Balanced (``cp_balance``, Llama 3's): the tokens laid
        out head-tail -- of 2 cp chunks, sequence rank i holds chunks i and 2 cp - 1 - i --
        so each computes the same share of the causal triangle, the keys and values
        all-gathered in the group (:mod:`flexflow.strategy.layout`); the executor reorders
        the inputs and position tables and restores the outputs.  ``cp_balance=None``
        balances where the graph can run in that order (every op but the attention treats
        the tokens one by one), else splits contiguously -- each chunk reading the keys and
        values before it, the last computing the most; ``True`` requires it (a
        :class:`StrategyError` names the op that mixes the tokens), ``False`` refuses it.

        The ops between a tensor-parallel pair's layers (norms, residual adds) split along the
        tokens inside the group (Megatron's sequence parallelism, ``sequence_parallel=True``):
        the transitions are an all-gather and a reduce-scatter.  ``False`` keeps them whole on
        every device of the group, the pairs' partial sums all-reduced into them; offered where
        the group is every device (a replicated op cannot also split the samples or tokens in
        the SOAP space), else a :class:`StrategyError` says so."""
        if isinstance(cp, bool) or not isinstance(cp, int) or cp < 1:
            raise StrategyError(f"cp must be a positive int, got {cp!r}")
        D = machine.num_devices
        if not isinstance(sequence_parallel, bool):
            raise StrategyError(f"sequence_parallel must be True or False, got {sequence_parallel!r}")
        whole = (f"sequence_parallel=False keeps the ops between a pair's layers whole on every device of the "
                 f"tensor-parallel group, which needs tp to be all {D} devices without pp or cp (a replicated op "
                 f"cannot also split the samples or tokens)")
        if not sequence_parallel and (pp != 1 or cp != 1 or microbatches != 1 or interleave != 1):
            raise StrategyError(f"{whole}; got pp={pp}, cp={cp}")
        if pp != 1 or microbatches != 1 or interleave != 1:
            return _megatron_3d(cls, graph, machine, tp, shard, pp, microbatches, schedule, interleave, cp,
                                cp_balance)
        if tp is None:
            tp = math.gcd(D // cp if D % cp == 0 else D, getattr(machine, "devices_per_node", D))
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1 or D % tp:
            raise StrategyError(f"tp must be a positive int that divides the machine's {D} devices, got {tp!r}")
        if not sequence_parallel and tp != D:
            raise StrategyError(f"{whole}; got tp={tp}")
        if shard not in SHARD_LEVELS:
            raise StrategyError(f"shard must be one of {SHARD_LEVELS}, got {shard!r}")
        if D % (tp * cp):
            raise StrategyError(f"tp={tp} x cp={cp} does not divide the machine's {D} devices")
        if graph.batch_size is not None and D // (tp * cp) > graph.batch_size:
            with_cp = f", cp={cp}" if cp > 1 else ""
            raise StrategyError(f"megatron with tp={tp}{with_cp} on {D} devices splits the samples "
                                f"{D // (tp * cp)} ways, more than the batch of {graph.batch_size}: raise tp"
                                f"{', cp' if cp > 1 else ''} or the batch")
        dp = cls.data_parallel(graph, machine)
        if cp_balance not in (None, True, False):
            raise StrategyError(f"cp_balance must be None, True or False, got {cp_balance!r}")
        configs = megatron_configs(graph, D, tp, shard, dp, cp=cp, sequence_parallel=sequence_parallel,
                                   cp_balance=cp_balance)
        name = "megatron" if not shard else "fsdp_tp" if shard == 3 else f"megatron_z{shard}"
        if cp > 1:
            name += f"_cp{cp}"
        return cls(graph, configs, machine, name=name if sequence_parallel else name + "_nosp")

    @classmethod
    def model_parallel(cls, graph: OpGraph, machine) -> "Strategy":
        """Each op whole on one device; consecutive ops grouped so that
        parameter bytes are balanced over the devices."""
        D = machine.num_devices
        group_bytes = {g: graph.op(m[0]).param_bytes for g, m in graph.groups.items()}
        total = sum(group_bytes.values())
        configs, placed, cum, dev = {}, {}, 0.0, 0
        for op in graph.compute_ops:
            g = op.group
            if g not in placed:
                if total > 0 and group_bytes[g] > 0:
                    dev = min(D - 1, int((cum + group_bytes[g] / 2) * D / total))
                    cum += group_bytes[g]
                placed[g] = dev
            configs[op.name] = ParallelConfig({}, (placed[g],))
        return cls(graph, configs, machine, name="model_parallel")

    @classmethod
    def expert(cls, graph: OpGraph, machine) -> "Strategy":
        """"One weird trick": data parallel for convolution, pooling and
        recurrence; fully connected layers (the softmax layer included)
        split along their output channels over all devices."""
        D = machine.num_devices
        configs = {}
        for members in graph.groups.values():
            op = graph.op(members[0])
            if op.rule == "linear" and "c" in op.parallel_dims and op.dim("c").size >= 2:
                k = min(D, op.dim("c").blocks)
                configs[op.name] = ParallelConfig({"c": k}, range(k))
            else:
                configs[op.name] = _sample_config(op, D)
        return cls(graph, configs, machine, name="expert")

    @classmethod
    def single_device(cls, graph: OpGraph, machine, device: int = 0) -> "Strategy":
        """Every op whole on ``device``: no parallelism.  A model too small for
        its communication to pay (tiny layers, latency-bound steps) trains
        fastest this way; the other devices only receive the outputs."""
        if not 0 <= device < machine.num_devices:
            raise StrategyError(f"device {device} is not one of the machine's {machine.num_devices} devices")
        configs = {op.name: ParallelConfig({}, (device,)) for op in graph.compute_ops}
        return cls(graph, configs, machine, name="single_device")

    @classmethod
    def random(cls, graph: OpGraph, machine, seed: int = 0, *, base: "Strategy | None" = None,
               fraction: float = 1.0) -> "Strategy":
        """A uniformly random candidate config per share group; with ``base``, each
        group's config is redrawn with probability ``fraction`` and else kept from
        ``base`` (a random strategy at a chosen distance from, say, data parallelism)."""
        if not 0.0 <= fraction <= 1.0:
            raise StrategyError(f"fraction must lie in [0, 1], got {fraction!r}")
        rng = _random.Random(seed)
        configs = {}
        for members in graph.groups.values():
            op = graph.op(members[0])
            drawn = rng.choice(candidate_configs(op, machine))
            keep = base is not None and rng.random() >= fraction
            configs[op.name] = base[op.name] if keep else drawn
        name = f"random{seed}" if base is None else f"random{seed}@{fraction:g}"
        return cls(graph, configs, machine, name=name)


def _spec(p) -> dict | None:
    return None if p is None else p.to_dict()


def _pipeline_args(p) -> dict:
    if isinstance(p, Pipeline):
        return p.to_dict()
    if not isinstance(p, dict):
        raise StrategyError(f"pipeline must be a dict with 'microbatches' and 'schedule', got {p!r}")
    return {"microbatches": p.get("microbatches", 1), "schedule": p.get("schedule", "1f1b")}


def _megatron_3d(cls, graph, machine, tp, shard, pp, microbatches, schedule, interleave, cp=1,
                 cp_balance=None) -> "Strategy":
    D = machine.num_devices
    for k, v in (("pp", pp), ("interleave", interleave)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise StrategyError(f"{k} must be a positive int, got {v!r}")
    if D % pp:
        raise StrategyError(f"pp={pp} does not divide the machine's {D} devices")
    if interleave > 1 and schedule == "1f1b":
        schedule = "interleaved-1f1b"
    sub = machine.with_devices(D // pp)
    per_mb = graph.batch_size // microbatches if graph.batch_size and microbatches >= 1 else None
    if tp is None:
        tp = math.gcd(D // pp // cp if (D // pp) % cp == 0 else D // pp, getattr(machine, "devices_per_node", D))
    mp = tp * cp if isinstance(tp, int) and isinstance(cp, int) else tp
    if per_mb is not None and isinstance(tp, int) and tp >= 1 and (D // pp) % mp == 0 and D // pp // mp > per_mb:
        raise StrategyError(f"megatron with tp={tp}, pp={pp} on {D} devices splits each micro-batch "
                            f"{D // pp // mp} ways, more than its {per_mb} samples: raise tp or pp, or "
                            "use fewer micro-batches")
    # the plan of one micro-batch (each op's degrees split a micro-batch); same op names
    micro = microbatch_graph(graph, microbatches) if isinstance(microbatches, int) and microbatches > 1 \
        and graph.batch_size and graph.batch_size % microbatches == 0 and graph.module is not None else graph
    flat = cls.megatron(micro, sub, tp=tp, shard=shard, cp=cp, cp_balance=cp_balance)
    configs = stage_configs(graph, dict(flat._configs), pp, interleave, D // pp, tp * cp)
    name = f"megatron_pp{pp}" if not shard else f"fsdp_tp_pp{pp}" if shard == 3 else f"megatron_z{shard}_pp{pp}"
    return cls(graph, configs, machine, name=name, pipeline={"microbatches": microbatches, "schedule": schedule})


def _check_layout(graph: OpGraph, configs) -> None:
    """Refuse causal attentions split head-tail different ways, or a head-tail split of a
    graph that cannot run in that token order (:mod:`flexflow.strategy.layout`)."""
    blocks = layout_blocks(graph, configs)
    if blocks > 1:
        token_layout(graph, blocks)


def _constant_fed(graph: OpGraph) -> set[str]:
    """Placed ops without a sample dim whose inputs are all graph constants
    (``everywhere`` ops other than the inputs) or such ops themselves."""
    out: set[str] = set()
    for op in graph.compute_ops:
        if op.sample_dim is not None or not op.inputs:
            continue
        if all((graph.op(i).everywhere and graph.op(i).kind != "input") or i in out for i in op.inputs):
            out.add(op.name)
    return out


def _sample_config(op: Op, D: int) -> ParallelConfig:
    d = op.sample_dim
    if d is not None:
        k = min(D, d.blocks)
        return ParallelConfig({d.name: k}, range(k))
    return ParallelConfig({}, (0,))
