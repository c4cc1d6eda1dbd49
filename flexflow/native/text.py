"""A plan's description in torch's terms (:func:`flexflow.native.native_plan`) as text a
person reads: the mesh and degrees, one tensor-parallel plan per repeated block, the
modules outside the blocks, FSDP's units, checkpointing and the pipeline."""
from __future__ import annotations

__all__ = ["describe"]


def describe(desc: dict) -> str:
    """The lines of ``desc`` (what ``flexflow simulate --native`` prints)."""
    mesh = desc["mesh"]
    lines = ["mesh: " + " x ".join(f"{n}={k}" for n, k in zip(mesh["dim_names"], mesh["shape"]))
             + f"   init_device_mesh(..., {tuple(mesh['shape'])}, mesh_dim_names={tuple(mesh['dim_names'])})"]
    par = desc.get("parallelism") or {}
    if par:
        shown = {k: v for k, v in par.items()
                 if not (v is None or v is False or v == "none" or (type(v) is int and v == 1))}
        lines.append("parallelism: " + ", ".join(f"{k}={v}" for k, v in shown.items()))
    per_block = desc.get("block_plan") or {}
    covered = set()
    for pattern, plan in per_block.items():
        lines.append(f"tensor parallel, every {pattern}:")
        lines += [f"  {fqn:<28} {style}" for fqn, style in plan.items()]
        prefix = pattern[:-1]
        covered |= {f for f in desc["tensor_parallel"] if f.startswith(prefix) and f[len(prefix):].split(".")[0].isdigit()}
    rest = {f: s for f, s in desc["tensor_parallel"].items() if f not in covered}
    if rest:
        lines.append("tensor parallel, other modules:" if per_block else "tensor parallel:")
        lines += [f"  {fqn:<28} {style}" for fqn, style in rest.items()]
    if desc.get("replicated_in_tp"):
        lines.append("whole on each tensor-parallel rank: " + ", ".join(desc["replicated_in_tp"]))
    units = desc.get("fully_shard") or []
    if units:
        u = units[0]
        mp = u.get("mp_policy")
        names = [x["module"] or "(root)" for x in units]
        lines.append(f"fully_shard: {_short(names)} (reshard_after_forward={u['reshard_after_forward']}"
                     + (f", mp_policy param {mp['param_dtype']} reduce {mp['reduce_dtype']}" if mp else "") + ")")
    if desc.get("replicate"):
        lines.append("replicate (DDP) on the data-parallel dim")
    if desc.get("checkpoint"):
        lines.append(f"checkpoint_wrapper: {_short(desc['checkpoint'])}")
    if desc.get("autocast"):
        lines.append(f"train under torch.autocast(dtype={desc['autocast']})")
    pipe = desc.get("pipeline")
    if pipe:
        lines.append(f"pipeline: {pipe['schedule']}, {pipe['microbatches']} micro-batches, "
                     f"{pipe['stages_per_rank']} stage(s) per pp rank")
        for i, fqns in enumerate(pipe["stages"]):
            lines.append(f"  stage {i}: {_short(fqns)}")
    return "\n".join(lines)


def _short(names: list[str]) -> str:
    """``a, layers.0..layers.15, b``: runs of numbered siblings collapsed."""
    out, i = [], 0
    while i < len(names):
        head, _, idx = names[i].rpartition(".")
        j = i
        if idx.isdigit():
            while (j + 1 < len(names) and names[j + 1].rpartition(".")[0] == head
                   and names[j + 1].rpartition(".")[2] == str(int(names[j].rpartition(".")[2]) + 1)):
                j += 1
        out.append(names[i] if j == i else f"{names[i]}..{names[j]}")
        i = j + 1
    return ", ".join(out)
