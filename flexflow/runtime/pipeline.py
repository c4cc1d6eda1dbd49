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
    segments = None
    if pipe.interleave > 1:  # each chunk's gradient buckets its own
        segments = {name: r // pipe.num_stages for name, r in pipe.stage_of().items()}
    runtime = Runtime(micro, one, module, ranks, **dict(kw, reduce_outputs="eager", segments=segments))
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
        p, v, m = pipeline.num_stages, pipeline.interleave, pipeline.microbatches
        # a rank outside every stage still joins the outputs' all-reduces, in micro-batch order
        self.order = schedule_order(pipeline.schedule, p, v, m, stage if stage is not None else p - 1)
        self.bounds = self._chunks(runtime, pipeline) if v > 1 else [(0, len(runtime.program))]
        runtime.defer_waits = True  # sends are waited for at the end of the step: none blocks a schedule

    @staticmethod
    def _chunks(rt, pipeline) -> list[tuple[int, int]]:
        """Per chunk (virtual stage) of this rank, its program positions ``(lo, hi)``; a
        chunk's inputs must come from other ranks (an exchange), its backward then starts at
        its last token."""
        if any(rt.strategy[name].shard for name in rt.strategy):
            raise ExecutorError("the interleaved schedule runs without shard levels (a sharded parameter is "
                                "gathered once per forward of the whole program): use shard=0, or '1f1b'")
        p, v = pipeline.num_stages, pipeline.interleave
        stage_of = pipeline.stage_of()

        def label(step):
            # a partition of this rank: its op's chunk; an exchange this rank only sends in (the
            # consumer is elsewhere): the chunk of the data it sends, so that the gradient it
            # receives back arrives in that chunk's backward; else none (a step of no one here)
            if step.part is not None and step.op.name in stage_of:
                return stage_of[step.op.name] // p
            for entry in step.inputs or ():
                if entry is not None and entry[0] == "xchg" and entry[2].sends and entry[1] in stage_of:
                    return stage_of[entry[1]] // p
            return None
        chunk = [label(step) for step in rt.program]
        nxt = v - 1
        for pos in reversed(range(len(chunk))):  # everywhere steps go with the next placed one
            if chunk[pos] is None:
                chunk[pos] = nxt
            nxt = chunk[pos]
        if any(a > b for a, b in zip(chunk, chunk[1:])):
            raise ExecutorError(f"rank {rt.rank}: its program does not run its chunks in order")
        made = {step.op.name: c for step, c in zip(rt.program, chunk)}
        for step, c in zip(rt.program, chunk):
            for entry in step.inputs or ():
                if entry is not None and entry[0] != "xchg" and made.get(entry[1], c) < c \
                        and rt.graph.op(entry[1]).dtype.is_floating_point and not rt.graph.op(entry[1]).everywhere:
                    raise ExecutorError(f"rank {rt.rank}: {step.op.describe()} (chunk {c}) reads {entry[1]} of an "
                                        "earlier chunk on the same rank: the interleaved schedule needs every "
                                        "chunk's inputs to come from other ranks")
        bounds, pos = [], 0
        for c in range(v):
            hi = pos
            while hi < len(chunk) and chunk[hi] == c:
                hi += 1
            bounds.append((pos, hi))
            pos = hi
        return bounds

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
            out = self._combine([rt.run(micro[b]) for b in range(m)])
            rt.settle()
            return out
        outs: dict[int, torch.Tensor] = {}
        losses: list = [None] * m
        scale = 1.0 / m if self.mean else 1.0
        last = len(self.bounds) - 1
        states: dict[int, dict] = {}
        ends: dict[tuple, torch.Tensor] = {}  # (chunk, micro-batch) -> the token at the chunk's end
        for kind, c, b in self.order:
            if kind == "F":
                st = states.get(b)
                if st is None:
                    st = states[b] = rt.start(micro[b])
                lo, hi = self.bounds[c]
                out = rt.advance(st, lo, hi, finish=c == last)
                if c < last:  # the next chunk's autograd starts afresh: its backward stops here
                    ends[(c, b)] = st["token"]
                    if st["token"] is not None and st["grad"]:
                        st["token"] = torch.zeros((), device=rt.device, requires_grad=True)
                else:
                    outs[b] = out
                    del states[b]
            else:
                rt.sync.skip = not (sync and b == m - 1)  # every chunk's last backward syncs its own
                if c == last:
                    out = outs.pop(b)
                    losses[b] = out.detach()
                    torch.autograd.backward(out, torch.full_like(out, scale))
                else:
                    tok = ends.pop((c, b))
                    if tok is not None and tok.requires_grad:
                        torch.autograd.backward(tok, torch.zeros_like(tok))
        rt.settle()  # the step's sends, waited for now that every rank has posted its receives
        anchor = torch.zeros((), device=rt.device, requires_grad=True)
        return _StepDone.apply(anchor, self._combine(losses))

    def _combine(self, losses):
        total = torch.stack([x.detach() for x in losses]).sum()
        return total / len(losses) if self.mean else total
