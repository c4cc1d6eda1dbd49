"""Running a pipelined strategy: the step's batch cut into micro-batches, each rank running
its stage's forwards and backwards in the schedule's order.

The rank's :class:`~flexflow.runtime.execute.Runtime` is built on the graph of one
micro-batch (:func:`flexflow.graph.micro.microbatch_graph`), so one ``run`` is one forward
of one micro-batch: the rank computes its partitions, sends the activations the next
stage reads as soon as they exist (point-to-point, not waited for) and receives the ones
it reads.  A backward is ``torch.autograd.backward`` on that forward's output: the runtime's
exchange Functions send the activations' gradients back and receive the ones it needs.
Messages between two ranks keep their order in each direction (every rank runs the
forwards, and the backwards, in micro-batch order), so schedules may interleave them
freely: GPipe (every forward, then every backward) and 1F1B (``p - s - 1`` forwards ahead,
then one forward one backward) run as :func:`flexflow.strategy.pipeline.schedule_order`
lists them.

Gradients accumulate over the micro-batches (each backward of the loss scaled by ``1/m``
where the loss is a mean over the batch, so the sum is the whole batch's gradient); the
gradient all-reduce among a stage's data-parallel replicas runs in the backward of the
last micro-batch only (``no_sync`` for the others, and for that one too inside the
module's ``no_sync()``).  The whole schedule runs inside ``forward``: the returned loss
(the micro-batches' losses combined as the model's loss combines its samples) carries no
graph to walk; its ``backward()`` checks that it is called as a training step calls it.

The interleaved schedule needs a forward of one chunk at a time, which one ``run`` of
the rank's whole program does not give: the executor refuses it (the simulator and the
search plan it).
"""
from __future__ import annotations

import torch

from ..strategy.pipeline import schedule_order
from .plan import ExecutorError

__all__ = ["PipelineDriver", "runtime_for"]


def runtime_for(graph, strategy, module, ranks, **kw):
    """(runtime, driver) of ``strategy`` on this rank: a :class:`Runtime` of ``graph`` and no
    driver, or for a pipelined strategy a runtime of one micro-batch's graph (each forward
    one micro-batch, each micro-batch's loss summed over the ranks at once) and the
    :class:`PipelineDriver` that runs the schedule.  ``kw``: the Runtime's arguments."""
    from ..graph.micro import microbatch_graph
    from ..strategy.shapecheck import check_partition_shapes
    from ..strategy.strategy import Strategy
    from .execute import Runtime
    pipe = strategy.pipeline
    if pipe is None:
        return Runtime(graph, strategy, module, ranks, **kw), None
    micro = microbatch_graph(graph, pipe.microbatches)
    one = Strategy(micro, dict(strategy.items()), name=strategy.name)
    check_partition_shapes(micro, one)
    runtime = Runtime(micro, one, module, ranks, **dict(kw, reduce_outputs="eager"))
    try:
        return runtime, PipelineDriver(runtime, pipe, graph)
    except BaseException:
        runtime.close(wait_s=0.0)
        raise


class _StepDone(torch.autograd.Function):
    """The loss of a pipelined step: its backward already ran, micro-batch by micro-batch."""

    @staticmethod
    def forward(ctx, anchor, value):
        return value.clone()

    @staticmethod
    def backward(ctx, g):
        if g is not None and not bool(torch.all(g == 1)):
            raise RuntimeError("a pipelined module runs its backward inside forward (micro-batch by "
                               "micro-batch), so its loss's backward takes no other gradient than 1: call "
                               "loss.backward() on the returned loss as it is (scale the loss inside the model, "
                               "or the learning rate)")
        return torch.zeros((), device=g.device if g is not None else None), None


class PipelineDriver:
    """Runs ``pipeline`` (a :class:`flexflow.strategy.pipeline.Pipeline` of the full graph
    ``graph``) on ``runtime`` (built on one micro-batch's graph), as the module's doc says."""

    def __init__(self, runtime, pipeline, graph):
        if pipeline.interleave > 1 or pipeline.schedule not in ("gpipe", "1f1b"):
            raise ExecutorError(f"the executor runs the 'gpipe' and '1f1b' schedules; this plan's "
                                f"'{pipeline.schedule}' with {pipeline.interleave} virtual stages a device "
                                "group is simulated and planned but not run (use schedule='1f1b')")
        outs = graph.output_names()
        if len(outs) != 1 or graph.op(outs[0]).output_shape != () or not graph.op(outs[0]).dtype.is_floating_point:
            raise ExecutorError("a pipeline runs a model that returns its training loss (one floating-point "
                                f"scalar); this one returns {len(outs)} output(s) "
                                f"{[tuple(graph.op(o).output_shape) for o in outs][:3]}")
        self.rt, self.pipe, self.graph = runtime, pipeline, graph
        out = graph.op(outs[0])
        self.mean = out.attrs.get("reduction", "mean") != "sum" and out.kind != "sum"
        self.axes = [op.attrs.get("batch_axis") for op in graph.ops if op.kind == "input"]
        me = runtime.rank
        ranks = list(runtime.ranks)
        device = ranks.index(me) if me in ranks else None
        stage = next((s for s, devs in enumerate(pipeline.stages) if device in devs), None)
        p, m = pipeline.num_stages, pipeline.microbatches
        # a rank outside every stage still joins the outputs' all-reduces, in micro-batch order
        self.order = schedule_order(pipeline.schedule, p, 1, m, stage if stage is not None else p - 1)

    def step(self, tensors: list, sync: bool):
        """One step on the global inputs ``tensors``: the loss, every rank."""
        m = self.pipe.microbatches
        if len(tensors) != len(self.axes):
            raise ExecutorError(f"the model was traced with {len(self.axes)} tensor inputs, got {len(tensors)}")
        parts = []
        for x, axis in zip(tensors, self.axes):
            if axis is None:
                parts.append([x] * m)
                continue
            if x.shape[axis] % m:
                raise ExecutorError(f"an input's batch of {x.shape[axis]} does not cut into {m} micro-batches")
            parts.append(list(torch.chunk(x, m, dim=axis)))
        micro = [[p[b] for p in parts] for b in range(m)]
        rt = self.rt
        if not torch.is_grad_enabled():
            return self._combine([rt.run(micro[b]) for b in range(m)])
        outs: dict[int, torch.Tensor] = {}
        losses: list = [None] * m
        scale = 1.0 / m if self.mean else 1.0
        for kind, _, b in self.order:
            if kind == "F":
                outs[b] = rt.run(micro[b])
            else:
                rt.sync.skip = not (sync and b == m - 1)
                out = outs.pop(b)
                losses[b] = out.detach()
                torch.autograd.backward(out, torch.full_like(out, scale))
        anchor = torch.zeros((), device=rt.device, requires_grad=True)
        return _StepDone.apply(anchor, self._combine(losses))

    def _combine(self, losses):
        total = torch.stack([x.detach() for x in losses]).sum()
        return total / len(losses) if self.mean else total
