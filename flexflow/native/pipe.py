"""A plan's pipeline on ``torch.distributed.pipelining``: this rank's ``PipelineStage``\\ (s)
and the schedule, built from :func:`flexflow.native.native_plan`'s description.

The module is cut at the description's module boundaries (:mod:`flexflow.native.split`);
each of this rank's stages gets the plan's tensor parallelism, checkpointing and FSDP on
the rest of the mesh (:func:`flexflow.native.parallelize_fn`), then is wrapped in a
``PipelineStage`` on the mesh's ``pp`` dim; the schedule is the description's class with
its micro-batches.  :class:`NativePipeline` unpacks as ``(stage, schedule)`` (a list of
stages under an interleaved schedule) and steps them as torch's documentation does.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..strategy.config import StrategyError
from .split import StageSplit, split_stages

__all__ = ["NativePipeline", "pipeline"]


@dataclass
class NativePipeline:
    """``stage`` (this rank's ``PipelineStage``, or the list of them under an interleaved
    schedule), ``schedule`` (a ``torch.distributed.pipelining`` schedule), ``split`` (how
    the module was cut); ``stage, schedule = native_pipeline`` unpacks the first two."""

    stage: object
    schedule: object
    split: StageSplit
    microbatches: int

    def __iter__(self):
        return iter((self.stage, self.schedule))

    @property
    def stages(self) -> list:
        return self.stage if isinstance(self.stage, list) else [self.stage]

    def step(self, *inputs):
        """One training step on this rank's share of the batch (``inputs`` as the module
        takes them): the first stage is given the module's inputs, the last its target;
        the gradients are left in the parameters for the optimizer.  Returns the mean loss
        of the micro-batches on the rank holding the last stage, None elsewhere."""
        import torch
        first = any(s.is_first for s in self.stages)
        last = any(s.is_last for s in self.stages)
        args = tuple(inputs[i] for i in self.split.inputs) if first else ()
        target = None
        if last:
            if self.split.target is not None:
                target = inputs[self.split.target]
            else:  # the last stage returns the loss itself: a stand-in target to split
                target = torch.zeros(self.microbatches)
        losses: list = []
        self.schedule.step(*args, target=target, losses=losses if last else None)
        if not last:
            return None
        return torch.stack([x.detach().float() for x in losses]).mean()


class _OutputIsLoss:
    def __call__(self, output, target):
        return output


def pipeline(description: dict, model, device_mesh, loss_fn=None) -> NativePipeline:
    """This rank's stages of ``model`` and the schedule under ``description`` (a pipelined
    plan's :func:`~flexflow.native.native_plan`) on ``device_mesh`` (its shape and dim
    names).  ``loss_fn(output, target)``: needed only when the module returns no loss (its
    output then is the last stage's); a module that computes its loss from a target input
    has its loss ops run as the schedule's loss function."""
    import torch
    from torch.distributed import pipelining as P

    from . import parallelize_fn
    pipe = description.get("pipeline")
    if pipe is None:
        raise StrategyError("this plan has no pipeline stages: apply it with plan.parallelize_fn()")
    names = list(device_mesh.mesh_dim_names or ())
    if names != description["mesh"]["dim_names"] or list(device_mesh.mesh.shape) != description["mesh"]["shape"]:
        raise ValueError(f"the plan runs on a mesh of shape {description['mesh']['shape']} named "
                         f"{description['mesh']['dim_names']}; got {list(device_mesh.mesh.shape)} named {names}")
    pp = device_mesh["pp"]
    P_, rank = pp.size(), pp.get_local_rank()
    m = pipe["microbatches"]
    dp = next((k for n, k in zip(names, device_mesh.mesh.shape) if n.startswith("dp")), 1)
    ref = next(iter(model.parameters()), None)
    where = ref.device if ref is not None else torch.device("cpu")
    examples = []
    for spec in pipe["inputs"]:
        shape = list(spec["shape"])
        if spec["batch_dim"] is not None:
            if shape[spec["batch_dim"]] % (dp * m):
                raise StrategyError(f"an input's batch of {shape[spec['batch_dim']]} does not split into {dp} "
                                    f"data-parallel shares of {m} micro-batches")
            shape[spec["batch_dim"]] //= dp * m
        examples.append(torch.empty(shape, dtype=getattr(torch, spec["dtype"]), device=where))
    split = split_stages(model, pipe["stages"], examples)
    if split.loss_fn is None and loss_fn is None:
        out = split.modules[-1]
        if not _returns_scalar(out, split, examples):
            raise StrategyError("the module returns no loss and reads no target: give "
                                "pipeline(..., loss_fn=fn(output, target))")
    loss = loss_fn or split.loss_fn or _OutputIsLoss()
    if device_mesh.device_type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device(device_mesh.device_type)
    apply = parallelize_fn(description)
    mine = [rank + k * P_ for k in range(pipe["stages_per_rank"])]
    stages = []
    for i in mine:
        module = apply(split.modules[i], device_mesh)
        stages.append(P.PipelineStage(module, i, len(split.modules), device, group=pp.get_group()))
    cls = getattr(P, pipe["schedule"])
    if pipe["stages_per_rank"] > 1:
        schedule = cls(stages, m, loss_fn=loss)
        stage = stages
    else:
        schedule = cls(stages[0], m, loss_fn=loss)
        stage = stages[0]
    return NativePipeline(stage, schedule, split, m)


def _returns_scalar(last, split: StageSplit, examples) -> bool:
    """Whether the whole module's output on one micro-batch is a 0-d tensor (its loss)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        out = tuple(mode.from_tensor(examples[i]) for i in split.inputs)
        for g in split.modules:
            out = g(*out)
            out = out if isinstance(out, tuple) else (out,)
    return len(out) == 1 and isinstance(out[0], torch.Tensor) and out[0].dim() == 0
