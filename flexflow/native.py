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

from .graph.ir import OpGraph, repeated_block
from .strategy.config import StrategyError
from .strategy.regions import partitions

__all__ = ["native_plan", "parallelize_fn", "local_batch"]


def native_plan(graph: OpGraph, strategy, precision: str = "32-true") -> dict:
    """The description of ``strategy`` (on ``graph``) in torch's terms: ``mesh`` (shape,
    dim names as torchtitan names them), ``tensor_parallel`` (module FQN -> style),
    ``fully_shard`` (module FQNs and their arguments, the root last), ``replicate`` (DDP),
    ``checkpoint`` (block FQNs), ``replicated_in_tp`` (parameter modules computed whole on
    each tensor-parallel rank), ``precision`` and ``pipeline`` (None: no pipeline stages).
    Each data-parallel rank feeds its share of the global batch (:func:`local_batch`)."""
    D = getattr(strategy, "num_devices", None)
    pipe = getattr(strategy, "pipeline", None)
    if pipe is not None:
        raise StrategyError(f"this plan is a pipeline ({pipe}); its description for torch.distributed.pipelining "
                            "is not written yet: run it with flexflow.parallelize")
    ops = graph.compute_ops
    dp = tp = None
    shard = None
    styles: dict[str, str] = {}
    whole_in_tp: set[str] = set()
    recompute: dict[str, list[bool]] = {}
    for op in ops:
        cfg = strategy[op.name]
        n = len(cfg.devices)
        if D is None:
            D = n
        if tuple(cfg.devices) != tuple(range(D)):
            raise StrategyError(f"{op.describe()}: runs on devices {list(cfg.devices)}, not on the whole mesh of "
                                f"{D}: torch's engines place every module on every rank")
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
        level = cfg.shard
        if shard is None:
            shard = level
        elif level != shard:
            raise StrategyError(f"{op.describe()}: shard level {level} where the plan's other parameters are at "
                                f"{shard}: the mesh's data-parallel dim shards every parameter alike")
        tensor = {k: v for k, v in cfg.degrees.items() if d is None or k != d.name}
        owner = next(iter(op.params.values())).rsplit(".", 1)[0]
        if op.rule in ("linear", "linear_t") and tensor in ({"c": tp}, {"k": tp}) and tp > 1:
            style = "ColwiseParallel" if "c" in tensor else "RowwiseParallel"
            if styles.get(owner, style) != style:
                raise StrategyError(f"{op.describe()}: module {owner} is split both ways by its uses")
            styles[owner] = style
        elif tensor and tp > 1 and not all(k in ("s", "e", "d0") or k.startswith(("s", "t")) for k in tensor):
            raise StrategyError(f"{op.describe()}: splits {sorted(tensor)} in the tensor-parallel group, which no "
                                "DTensor style of a whole module expresses")
        elif tp > 1:
            whole_in_tp.add(owner)
        _check_order(op, cfg, d, dp or 1, tp or 1)
    if dp is None:
        dp, tp = D, 1
    shard = shard or 0
    if shard == 1:
        raise StrategyError("shard level 1 (optimizer state sharded, parameters and gradients whole) has no "
                            "FSDP2 form: plan with shard 0, 2 or 3")
    if tp > 1 and shard == 0 and dp > 1:
        raise StrategyError("data parallelism without sharding beside tensor parallelism: torch's replicate "
                            "(DDP) takes a 1-D mesh; plan with shard=3 (FSDP x TP)")
    if tp > 1:
        names = ["dp_shard", "tp"]
    else:
        names = ["dp_shard"] if shard else ["dp_replicate"]
    shape = [dp, tp] if tp > 1 else [dp]
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
    return {
        "mesh": {"shape": shape, "dim_names": names},
        "tensor_parallel": dict(sorted(styles.items(), key=lambda kv: _block_key(kv[0]))),
        "replicated_in_tp": sorted(whole_in_tp, key=_block_key),
        "fully_shard": units,
        "replicate": not shard and dp > 1,
        "checkpoint": [b for b in blocks if all(recompute[b])],
        "precision": precision,
        "autocast": "bfloat16" if precision in ("bf16-mixed", "16-mixed") else None,
        "pipeline": None,
    }


def _block_key(name: str):
    return [int(p) if p.isdigit() else p for p in name.split(".")]


def _check_order(op, cfg, d, dp: int, tp: int) -> None:
    """Partition k of a plan on the mesh runs on rank (batch block) * tp + (tensor block):
    the data-parallel dim outermost, as the mesh lays ranks out."""
    if tp == 1 or d is None or len(cfg.devices) == 1:
        return
    for p in partitions(op, cfg):
        a, _ = p.block.get(d.name, (0, d.size))
        i = (a // d.unit) * dp // d.blocks
        if p.device // tp != i:
            raise StrategyError(f"{op.describe()}: partition {p.index} (batch block {i}) runs on rank {p.device}, "
                                f"outside that block's tensor-parallel group: the mesh puts data parallelism "
                                "outermost")


def parallelize_fn(description: dict):
    """``fn(model, device_mesh) -> model`` applying ``description`` (:func:`native_plan`) with
    torch's engines: tensor parallelism on the mesh's ``tp`` dim, checkpointing, then
    ``fully_shard`` per block and at the root on its data dim (or ``replicate``)."""
    desc = copy.deepcopy(description)  # a copy the caller cannot change

    def fn(model, device_mesh):
        import torch
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        names = list(device_mesh.mesh_dim_names or ())
        want = desc["mesh"]["dim_names"]
        if names != want or list(device_mesh.mesh.shape) != desc["mesh"]["shape"]:
            raise ValueError(f"the plan runs on a mesh of shape {desc['mesh']['shape']} named {want}; "
                             f"got {list(device_mesh.mesh.shape)} named {names}")
        if "tp" in names:
            styles = {"ColwiseParallel": ColwiseParallel, "RowwiseParallel": RowwiseParallel}
            plan = {fqn: styles[s]() for fqn, s in desc["tensor_parallel"].items()}
            parallelize_module(model, device_mesh["tp"], plan)
        for fqn in desc["checkpoint"]:
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
            parent, _, child = fqn.rpartition(".")
            owner = model.get_submodule(parent) if parent else model
            setattr(owner, child, checkpoint_wrapper(getattr(owner, child)))
        data = device_mesh[names[0]] if len(names) > 1 else device_mesh
        for unit in desc["fully_shard"]:
            mp = unit.get("mp_policy")
            policy = MixedPrecisionPolicy(param_dtype=getattr(torch, mp["param_dtype"]),
                                          reduce_dtype=getattr(torch, mp["reduce_dtype"])) if mp \
                else MixedPrecisionPolicy()
            target = model.get_submodule(unit["module"]) if unit["module"] else model  # (a block's checkpoint wrapper)
            fully_shard(target, mesh=data, reshard_after_forward=unit["reshard_after_forward"], mp_policy=policy)
        if desc["replicate"]:
            from torch.distributed._composable.replicate import replicate
            replicate(model, device_mesh=data)
        return model
    return fn


def local_batch(batch, device_mesh, batch_dim: int = 0):
    """This rank's share of a global ``batch`` (a tensor or a tuple of them) under a plan's
    mesh: the data-parallel rank (the mesh's first dim) takes its block of the batch dim;
    the ranks of one tensor-parallel group take the same block, as torch's engines expect."""
    import torch
    data = device_mesh[device_mesh.mesh_dim_names[0]] if device_mesh.ndim > 1 else device_mesh
    k, n = data.get_local_rank(), data.size()

    def share(t):
        if not isinstance(t, torch.Tensor):
            return t
        size = t.shape[batch_dim]
        if size % n:
            raise ValueError(f"a batch of {size} does not split into {n} equal data-parallel shares")
        return t.narrow(batch_dim, k * size // n, size // n)
    return tuple(share(t) for t in batch) if isinstance(batch, (tuple, list)) else share(batch)
