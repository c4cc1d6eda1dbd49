"""A plan in torch's own terms: FSDP2 (``fully_shard``), DTensor tensor parallelism
(``parallelize_module``) and activation checkpointing on one device mesh.

A plan maps when its ops split along one mesh of data (replicated or sharded) x tensor
parallelism with uniform degrees: what ``Strategy.data_parallel``, ``fsdp``, ``zero(2|3)``
and ``megatron(..., shard=3)`` build, and what the search returns while it stays in that
family.  :func:`native_plan` describes it (JSON-able); :func:`parallelize_fn` returns
``fn(model, device_mesh) -> model`` applying it, the signature Lightning's
``ModelParallelStrategy`` and torchtitan's parallelize functions take.  A plan outside the
family is a :class:`StrategyError` naming the first op that does not map and why;
``flexflow.parallelize`` still runs it on flexflow's own runtime.

Mapping, per module (the owner of a parameter, by its qualified name):

- a linear layer split by its outputs (``C``) is ``ColwiseParallel``, one split by its inputs
  (``K``: Megatron's row-parallel layer) ``RowwiseParallel``; any other parameter op is
  replicated over the tensor-parallel group (flexflow may split it by tokens or by its
  embedding dim; torch computes the same values whole on each rank of the group);
- shard level 3 is ``fully_shard(reshard_after_forward=True)`` per repeated block and at
  the root, level 2 ``reshard_after_forward=False``; level 0 without tensor parallelism is
  ``replicate`` (DDP); level 1 (optimizer state only) has no FSDP2 form;
- a repeated block whose ops are all recomputed is wrapped in ``checkpoint_wrapper``.
"""
from __future__ import annotations

import copy

from ..graph.ir import OpGraph, repeated_block
from ..strategy.config import REPLICA, StrategyError
from ..strategy.regions import partitions
from .styles import make_style, sequence_parallel_styles

__all__ = ["native_plan", "parallelize_fn", "local_batch"]


def native_plan(graph: OpGraph, strategy, precision: str = "32-true") -> dict:
    """The description of ``strategy`` (on ``graph``) in torch's terms: ``mesh`` (shape,
    dim names as torchtitan names them), ``tensor_parallel`` (module FQN -> style),
    ``fully_shard`` (module FQNs and their arguments, the root last), ``replicate`` (DDP),
    ``checkpoint`` (block FQNs), ``replicated_in_tp`` (parameter modules computed whole on
    each tensor-parallel rank), ``precision`` and ``pipeline`` (None: no pipeline stages).
    Each data-parallel rank feeds its share of the global batch (:func:`local_batch`)."""
    pipe = getattr(strategy, "pipeline", None)
    groups, group_of = _stage_groups(graph, strategy, pipe)
    D = len(groups[0])
    ops = graph.compute_ops
    for op in ops:
        _check_devices(op, strategy[op.name], groups[group_of[op.name]], D, pipe)
    for op in ops:
        if op.rule == "attention" and (strategy[op.name].degree("l") > 1 or strategy[op.name].degree("z") > 1):
            raise StrategyError(f"{op.describe()}: splits its query rows (context parallelism), which "
                                "native() does not map to torch's context_parallel yet: run the plan with "
                                "flexflow.parallelize")
    dp = tp = None
    shard = None
    styles: dict[str, str] = {}
    whole_in_tp: set[str] = set()
    recompute: dict[str, list[bool]] = {}
    levels: list = []
    token_split: dict[str, tuple] = {}
    for op in ops:
        cfg = strategy[op.name]
        group = groups[group_of[op.name]]
        local = {dev: i for i, dev in enumerate(group)}
        d = op.sample_dim
        op_dp = cfg.degrees.get(d.name, 1) if d is not None else 1
        if d is None and op.output_shape:
            op_dp = None  # no batch: its degree says nothing of the mesh
        if op_dp is not None:
            if dp is None:
                dp, tp = op_dp, D // op_dp
            elif op_dp != dp:
                raise StrategyError(f"{op.describe()}: splits the batch {op_dp} ways where the plan's other ops "
                                    f"split it {dp} ways: one mesh has one data-parallel degree")
        block = repeated_block(op.module_path)
        if block:
            recompute.setdefault(block, []).append(bool(cfg.recompute))
        if not op.params:
            continue
        levels.append((op, cfg.shard))
        tensor = {k: v for k, v in cfg.degrees.items() if d is None or k != d.name}
        owner = next(iter(op.params.values())).rsplit(".", 1)[0]
        if op.rule in ("linear", "linear_t") and tensor in ({"c": tp}, {"k": tp}) and tp > 1:
            style = "ColwiseParallel" if "c" in tensor else "RowwiseParallel"
            if styles.get(owner, style) != style:
                raise StrategyError(f"{op.describe()}: module {owner} is split both ways by its uses")
            styles[owner] = style
        elif tensor and tp > 1 and not all(k in ("s", "e", "d0", REPLICA) or k.startswith(("s", "t")) for k in tensor):
            raise StrategyError(f"{op.describe()}: splits {sorted(tensor)} in the tensor-parallel group, which no "
                                "DTensor style of a whole module expresses")
        elif tp > 1:  # (whole on every rank of the group, or split along the tokens: sequence parallelism)
            whole_in_tp.add(owner)
            if tensor and REPLICA not in tensor:
                token_split.setdefault(owner, (op, sorted(tensor)))
        _check_order(op, cfg, d, dp or 1, tp or 1, local)
    if dp is None:
        dp, tp = D, 1
    shard = 0
    if dp > 1:  # (with one data-parallel rank nothing is sharded in torch's terms)
        for op, level in levels:
            if level != levels[0][1]:
                raise StrategyError(f"{op.describe()}: shard level {level} where the plan's other parameters are "
                                    f"at {levels[0][1]}: the mesh's data-parallel dim shards every parameter alike")
        shard = levels[0][1] if levels else 0
    if shard == 1:
        raise StrategyError("shard level 1 (optimizer state sharded, parameters and gradients whole) has no "
                            "FSDP2 form: plan with shard 0, 2 or 3")
    if tp > 1 and shard == 0 and dp > 1 and pipe is None:
        raise StrategyError("data parallelism without sharding beside tensor parallelism: torch's replicate "
                            "(DDP) takes a 1-D mesh; plan with shard=3 (FSDP x TP)")
    dp_name = "dp_shard" if shard else "dp_replicate"
    if pipe is None:
        dims = [(dp_name, dp)] + ([("tp", tp)] if tp > 1 else [])
        pipeline = None
    else:
        dims, pipeline = _pipeline_description(graph, strategy, groups, dp, tp, dp_name)
    names, shape = [n for n, _ in dims], [k for _, k in dims]
    seq = sequence_parallel_styles(graph, strategy, styles, token_split) if tp > 1 else None
    if seq is not None:
        styles = seq
        whole_in_tp -= set(seq)
    blocks = sorted({b for b in recompute}, key=_block_key)
    units = []
    if shard:
        units = [{"module": b, "reshard_after_forward": shard == 3} for b in blocks]
        units.append({"module": "", "reshard_after_forward": shard == 3})
    mp = None
    if precision == "bf16-params":
        mp = {"param_dtype": "bfloat16", "reduce_dtype": "float32"}
    elif precision == "bf16-true":
        mp = {"param_dtype": "bfloat16", "reduce_dtype": "bfloat16"}
    for u in units:
        u["mp_policy"] = mp
    checkpoint = [b for b in blocks if all(recompute[b])]
    degrees = dict(zip(names, shape))
    titan = {
        "data_parallel_replicate_degree": degrees.get("dp_replicate", 1),
        "data_parallel_shard_degree": degrees.get("dp_shard", 1),
        "fsdp_reshard_after_forward": "always" if shard == 3 else "never" if shard == 2 else None,
        "tensor_parallel_degree": tp,
        "sequence_parallel": seq is not None,
        "context_parallel_degree": 1,
        "pipeline_parallel_degree": degrees.get("pp", 1),
        "pipeline_parallel_schedule": pipeline["schedule"].removeprefix("Schedule") if pipeline else None,
        "pipeline_parallel_microbatches": pipeline["microbatches"] if pipeline else None,
        "activation_checkpoint": "full" if checkpoint and len(checkpoint) == len(blocks) else
        "per block" if checkpoint else "none",
        "mixed_precision_param": (mp or {}).get("param_dtype", "bfloat16" if precision in ("bf16-mixed", "16-mixed")
                                                else "float32"),
    }
    return {
        "parallelism": titan,
        "block_plan": _block_plan(styles, blocks),
        "mesh": {"shape": shape, "dim_names": names},
        "tensor_parallel": dict(sorted(styles.items(), key=lambda kv: _block_key(kv[0]))),
        "sequence_parallel": seq is not None,
        "replicated_in_tp": sorted(whole_in_tp, key=_block_key),
        "fully_shard": units,
        "replicate": not shard and dp > 1,
        "checkpoint": checkpoint,
        "precision": precision,
        "autocast": "bfloat16" if precision in ("bf16-mixed", "16-mixed") else None,
        "pipeline": pipeline,
    }


def _check_devices(op, cfg, group, D: int, pipe) -> None:
    if sorted(cfg.devices) != list(group):  # (the order: _check_order)
        where = f"the whole mesh of {D}" if pipe is None else f"its stage's devices {list(group)}"
        raise StrategyError(f"{op.describe()}: runs on devices {list(cfg.devices)}, not on {where}: torch's "
                            "engines place every module on every rank of its mesh")


def _stage_groups(graph: OpGraph, strategy, pipe) -> tuple[list[list[int]], dict[str, int]]:
    """The device group of each pipeline stage (one group without a pipeline) and each
    op's group."""
    if pipe is None:
        D = getattr(strategy, "num_devices", None) or max(len(strategy[op.name].devices) for op in graph.compute_ops)
        return [list(range(D))], {op.name: 0 for op in graph.compute_ops}
    sizes = {len(g) for g in pipe.stages}
    if len(sizes) > 1:
        raise StrategyError(f"the pipeline's stages have {sorted(sizes)} devices: one mesh gives each stage the "
                            "same number")
    run_of = pipe.stage_of()
    return [list(g) for g in pipe.stages], {name: pipe.runs[r][0] for name, r in run_of.items()}


_SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved-1f1b": "ScheduleInterleaved1F1B"}


def _pipeline_description(graph: OpGraph, strategy, groups, dp: int, tp: int, dp_name: str):
    """The mesh dims (the stages' devices as a slice of it) and the ``pipeline`` entry: the
    module FQNs of each virtual stage, the schedule class, the micro-batches, and the
    inputs (global shapes, dtypes, batch axes) from which one micro-batch is made."""
    pipe = strategy.pipeline
    pp, G = len(groups), len(groups[0])
    outer = [list(range(s * G, (s + 1) * G)) for s in range(pp)]
    inner = [sorted(t + tp * (s + pp * d) for d in range(dp) for t in range(tp)) for s in range(pp)]
    data = [(dp_name, dp)] if dp > 1 else []
    tensor = [("tp", tp)] if tp > 1 else []
    if groups == outer:
        dims = [("pp", pp)] + data + tensor
    elif groups == inner:
        dims = data + [("pp", pp)] + tensor
    else:
        raise StrategyError(f"the pipeline's stages run on devices {groups}, which no mesh of {pp} stages x "
                            f"{dp} data x {tp} tensor ranks lays out (each stage a slice of the mesh's pp dim)")
    unit_run: dict[str, int] = {}
    stages: list[list[str]] = [[] for _ in pipe.runs]
    for r, (_, names) in enumerate(pipe.runs):
        for name in names:
            op = graph.op(name)
            if not op.module_path:
                continue
            unit = repeated_block(op.module_path) or op.module_path
            first = unit_run.setdefault(unit, r)
            if first != r:
                raise StrategyError(f"{op.describe()}: the cut between pipeline stages {first} and {r} falls inside "
                                    f"module {unit}: torch's pipeline stages are cut between modules")
            if unit not in stages[r]:
                stages[r].append(unit)
    inputs = [{"shape": list(op.output_shape), "dtype": str(op.dtype).removeprefix("torch."),
               "batch_dim": op.attrs.get("batch_axis")} for op in graph.ops if op.kind == "input"]
    return dims, {"stages": stages, "schedule": _SCHEDULES[pipe.schedule], "microbatches": pipe.microbatches,
                  "stages_per_rank": pipe.interleave, "inputs": inputs}


def _block_plan(styles: dict[str, str], blocks: list[str]) -> dict:
    """The tensor-parallel plan of one repeated block, FQNs relative to it, keyed by the
    blocks' pattern (``{"layers.*": {"attention.wq": ...}}``), where every block of that
    container has the same plan (as torchtitan writes one plan for every block)."""
    out = {}
    by_parent: dict[str, list[str]] = {}
    for b in blocks:
        by_parent.setdefault(b.rsplit(".", 1)[0], []).append(b)
    for parent, bs in by_parent.items():
        plans = [{k[len(b) + 1:]: v for k, v in styles.items() if k.startswith(b + ".")} for b in bs]
        if plans[0] and all(p == plans[0] for p in plans):
            out[f"{parent}.*"] = dict(sorted(plans[0].items()))
    return out


def _block_key(name: str):
    return [int(p) if p.isdigit() else p for p in name.split(".")]


def _check_order(op, cfg, d, dp: int, tp: int, local: dict) -> None:
    """Partition k of a plan on the mesh runs on rank (batch block) * tp + (tensor block):
    the data-parallel dim outermost, as the mesh lays ranks out."""
    if tp == 1 or d is None or len(cfg.devices) == 1:
        return
    for p in partitions(op, cfg):
        a, _ = p.block.get(d.name, (0, d.size))
        i = (a // d.unit) * dp // d.blocks
        if local[p.device] // tp != i:
            raise StrategyError(f"{op.describe()}: partition {p.index} (batch block {i}) runs on rank {p.device}, "
                                f"outside that block's tensor-parallel group: the mesh puts data parallelism "
                                "outermost")


def parallelize_fn(description: dict):
    """``fn(model, device_mesh) -> model`` applying ``description`` (:func:`native_plan`) with
    torch's engines: tensor parallelism on the mesh's ``tp`` dim, checkpointing, then
    ``fully_shard`` per block and at the root on its data dim (or ``replicate``).  Under a
    pipeline ``model`` is one stage (:func:`flexflow.native.pipe.pipeline` calls it per
    stage): what the description names outside the stage is left alone."""
    desc = copy.deepcopy(description)  # a copy the caller cannot change
    staged = desc.get("pipeline") is not None

    def fn(model, device_mesh):
        import torch
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        from torch.distributed.tensor.parallel import parallelize_module

        names = list(device_mesh.mesh_dim_names or ())
        want = desc["mesh"]["dim_names"]
        if names != want or list(device_mesh.mesh.shape) != desc["mesh"]["shape"]:
            raise ValueError(f"the plan runs on a mesh of shape {desc['mesh']['shape']} named {want}; "
                             f"got {list(device_mesh.mesh.shape)} named {names}")

        def has(fqn: str) -> bool:
            if not fqn:
                return True
            try:
                model.get_submodule(fqn)
            except AttributeError:
                if staged:
                    return False
                raise
            return True
        if "tp" in names:
            plan = {fqn: make_style(s) for fqn, s in desc["tensor_parallel"].items() if has(fqn)}
            parallelize_module(model, device_mesh["tp"], plan)
        for fqn in desc["checkpoint"]:
            if not has(fqn):
                continue
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
            parent, _, child = fqn.rpartition(".")
            owner = model.get_submodule(parent) if parent else model
            setattr(owner, child, checkpoint_wrapper(getattr(owner, child)))
        dp_name = next((n for n in names if n.startswith("dp")), None)
        if dp_name is None:
            return model
        data = device_mesh[dp_name] if len(names) > 1 else device_mesh
        for unit in desc["fully_shard"]:
            if not has(unit["module"]):
                continue
            mp = unit.get("mp_policy")
            policy = MixedPrecisionPolicy(param_dtype=getattr(torch, mp["param_dtype"]),
                                          reduce_dtype=getattr(torch, mp["reduce_dtype"])) if mp \
                else MixedPrecisionPolicy()
            target = model.get_submodule(unit["module"]) if unit["module"] else model  # (a block's checkpoint wrapper)
            fully_shard(target, mesh=data, reshard_after_forward=unit["reshard_after_forward"], mp_policy=policy)
        if desc["replicate"]:
            if staged:  # the replicate pipeline stages know (FSDP's, without sharding)
                from torch.distributed._composable.replicate_with_fsdp import replicate
                replicate(model, mesh=data)
            else:
                from torch.distributed._composable.replicate import replicate
                replicate(model, device_mesh=data)
        return model
    return fn


def local_batch(batch, device_mesh, batch_dim: int = 0):
    """This rank's share of a global ``batch`` (a tensor or a tuple of them) under a plan's
    mesh: the data-parallel rank (the mesh's ``dp_*`` dim) takes its block of the batch dim;
    the ranks of one tensor-parallel group take the same block, as torch's engines expect."""
    import torch
    dp_name = next((n for n in device_mesh.mesh_dim_names or () if n.startswith("dp")), None)
    if dp_name is None:
        return batch
    data = device_mesh[dp_name] if device_mesh.ndim > 1 else device_mesh
    k, n = data.get_local_rank(), data.size()

    def share(t):
        if not isinstance(t, torch.Tensor):
            return t
        size = t.shape[batch_dim]
        if size % n:
            raise ValueError(f"a batch of {size} does not split into {n} equal data-parallel shares")
        return t.narrow(batch_dim, k * size // n, size // n)
    return tuple(share(t) for t in batch) if isinstance(batch, (tuple, list)) else share(batch)
