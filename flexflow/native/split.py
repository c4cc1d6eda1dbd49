"""A module cut into pipeline stages along module boundaries, for
``torch.distributed.pipelining``'s ``PipelineStage``.

The module's top level is traced with torch.fx, the units a plan places (each repeated
block, each module outside the blocks) kept whole as calls of the user's own modules, so
what torch's engines do to a module (``fully_shard``'s hooks, ``parallelize_module``'s
styles, ``checkpoint_wrapper``) still happens when a stage calls it.  Each call goes to
the stage its module is listed in; an op without a module goes to the latest stage of its
inputs.  A stage is a ``GraphModule`` that takes the previous stage's outputs (the first
takes the module's inputs) and returns every value a later stage needs, passed on stage by
stage as ``PipelineStage`` sends tensors only to the next one.

Values that are not tensors (a length read off an input's shape) are fixed at one
micro-batch's shapes; ops made only of such values and of the module's buffers (a rotary
table sliced to the sequence length) are repeated in each stage that uses them instead of
being sent.  The loss: the ops that read a *target* (an input none of the modules reads,
only the ops after the last stage) form the schedule's ``loss_fn(output, target)``, so
the schedule is stepped as torch's documentation shows: the first stage given the inputs,
the last the target.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx as fx

from ..strategy.config import StrategyError

__all__ = ["StageSplit", "split_stages"]


@dataclass
class StageSplit:
    """``modules``: one ``GraphModule`` per (virtual) stage, in pipeline order;
    ``loss_fn``: ``fn(output, target)`` of the last stage (None: the module's output is
    the loss itself, returned by the last stage); ``inputs``: indices of the module's
    inputs the first stage takes; ``target``: index of the input the loss reads (None)."""

    modules: list
    loss_fn: object
    inputs: list[int]
    target: int | None
    fixed: dict = field(default_factory=dict)  # node name -> value fixed at a micro-batch's shapes


class _UnitTracer(fx.Tracer):
    def __init__(self, units: set[str]):
        super().__init__()
        self.units = units

    def is_leaf_module(self, m, qualname):
        return qualname in self.units or super().is_leaf_module(m, qualname)


def _unit_of(target: str, owner: dict[str, int]) -> int | None:
    parts = target.split(".")
    for k in range(len(parts), 0, -1):
        s = owner.get(".".join(parts[:k]))
        if s is not None:
            return s
    return None


def _params_of(gm_root, node) -> list[str]:
    if node.op == "call_module":
        return [f"{node.target}.{n}" for n, _ in gm_root.get_submodule(node.target).named_parameters()]
    if node.op == "get_attr":
        try:
            if isinstance(gm_root.get_parameter(node.target), torch.nn.Parameter):
                return [node.target]
        except AttributeError:
            pass
    return []


def split_stages(model: torch.nn.Module, stages: list[list[str]], example_inputs) -> StageSplit:
    """Cut ``model`` into ``len(stages)`` stage modules; ``stages[k]`` lists the module FQNs
    of stage k (its repeated blocks and the modules outside them); ``example_inputs``: one
    micro-batch's inputs (fake or meta tensors serve: only their shapes are read)."""
    owner = {fqn: k for k, fqns in enumerate(stages) for fqn in fqns}
    tracer = _UnitTracer(set(owner))
    try:
        graph = tracer.trace(model)
    except Exception as e:  # noqa: BLE001 - any trace failure is the same answer
        raise StrategyError(f"{type(model).__name__}'s forward does not trace with torch.fx at its top level "
                            f"({type(e).__name__}: {e}); its pipeline stages cannot be cut") from e
    gm = fx.GraphModule(model, graph)
    nodes = list(graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    (out_node,) = [n for n in nodes if n.op == "output"]
    fixed = _fixed_values(gm, example_inputs)

    # free nodes: made of fixed values, constants and buffers only -> repeated where used
    free: set[fx.Node] = set()
    for n in nodes:
        if n.name in fixed or n.op == "get_attr" and not _params_of(model, n):
            free.add(n)
        elif n.op in ("call_function", "call_method") and all(a in free for a in n.all_input_nodes):
            free.add(n)
    # the target: an input read only by ops without parameters after every module
    depends: dict[fx.Node, set[fx.Node]] = {}
    for n in nodes:
        depends[n] = {n} if n.op == "placeholder" else set().union(*(depends[a] for a in n.all_input_nodes)) \
            if n.all_input_nodes else set()
    moduled = [n for n in nodes if n.op == "call_module" or _params_of(model, n)]
    target = None
    for p in placeholders[1:]:
        if p.users and not any(p in depends[m] for m in moduled):
            target = p
    tail = {n for n in nodes if target is not None and target in depends[n] and n not in free
            and n.op not in ("placeholder", "output")}
    # stage of every other node
    S = len(stages)
    stage: dict[fx.Node, int] = {}
    param_stage: dict[str, int] = {}
    for n in nodes:
        if n.op in ("output",) or n in free or n in tail:
            continue
        if n.op == "placeholder":
            stage[n] = 0
            continue
        ins = [stage[a] for a in n.all_input_nodes if a in stage]
        at = max(ins, default=0)
        if n.op == "call_module" or _params_of(model, n):
            own = _unit_of(str(n.target), owner) if n.op in ("call_module", "get_attr") else None
            if own is None:
                raise StrategyError(f"{n.op} {n.target}: not in any stage of the plan's pipeline "
                                    f"(its stages list {sum(len(s) for s in stages)} modules)")
            if own < at:
                raise StrategyError(f"module {n.target} is on stage {own} but reads a value made on stage {at}: "
                                    "the plan's stages are not in the order the module runs them")
            at = own
            for p in _params_of(model, n):
                if param_stage.setdefault(p, at) != at:
                    raise StrategyError(f"parameter {p} is used on stages {param_stage[p]} and {at} (tied "
                                        "weights): torch's pipeline stages own their parameters apart")
        stage[n] = at
    for n in nodes:  # a parameter read as a value (a tied weight) stays on its owner's stage
        if n.op == "get_attr" and n in stage:
            for u in n.users:
                at = S - 1 if u in tail else stage.get(u, stage[n])
                if at != stage[n]:
                    raise StrategyError(f"parameter {n.target} is used on stages {stage[n]} and {at} (tied weights): "
                                        "torch's pipeline stages own their parameters apart")
    # what each stage passes on: values made on stages <= k and read after stage k
    need_after: list[list[fx.Node]] = []
    for k in range(S):
        live = []
        for n in nodes:
            if n not in stage or stage[n] > k or n is target:
                continue
            readers = [u for u in n.users if u.op != "output" and u not in free]
            if any(u in tail or stage.get(u, -1) > k for u in readers) or (k < S - 1 and n in out_node.all_input_nodes):
                live.append(n)
        need_after.append(live)
    last_out = need_after[-1] if tail else list(out_node.all_input_nodes)
    if not tail:
        need_after[-1] = last_out
    inputs = [i for i, p in enumerate(placeholders) if p is not target]
    modules = []
    for k in range(S):
        received = [p for p in placeholders if p is not target] if k == 0 else need_after[k - 1]
        own = [n for n in nodes if stage.get(n) == k and n.op != "placeholder"]
        outs = need_after[k] if k < S - 1 else (last_out if tail else None)
        modules.append(_build(gm, nodes, received, own, free, fixed, outs, out_node if outs is None else None))
    loss_fn = None
    if tail:
        loss_fn = _LossFn(_build(gm, nodes, last_out + [target], [n for n in nodes if n in tail], free, fixed,
                                 None, out_node))
    return StageSplit(modules, loss_fn, inputs, placeholders.index(target) if target is not None else None, fixed)


def _fixed_values(gm: fx.GraphModule, example_inputs) -> dict:
    """Node name -> value of every node whose value is not a tensor (shapes, lengths),
    computed on fake tensors of one micro-batch."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    out = {}
    mode = FakeTensorMode(allow_non_fake_inputs=True)

    class Record(fx.Interpreter):
        def run_node(self, n):
            v = super().run_node(n)
            if n.op not in ("placeholder", "output", "get_attr") and not _has_tensor(v):
                out[n.name] = v
            return v

    with mode:
        args = [mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in example_inputs]
        Record(gm).run(*args)
    return out


def _has_tensor(v) -> bool:
    if isinstance(v, torch.Tensor):
        return True
    if isinstance(v, (tuple, list)):
        return any(_has_tensor(x) for x in v)
    if isinstance(v, dict):
        return any(_has_tensor(x) for x in v.values())
    return False


def _build(gm, nodes, received, own, free, fixed, outs, out_node) -> fx.GraphModule:
    """A GraphModule taking ``received``, computing ``own`` (with the free nodes they need
    repeated) and returning ``outs`` (a tensor or a tuple), or the original output."""
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for r in received:
        env[r] = g.placeholder(r.name)
        env[r].meta = dict(r.meta)

    def get(a: fx.Node) -> fx.Node:
        if a in env:
            return env[a]
        if a.name in fixed:
            return fixed[a.name]
        if a not in free:
            raise StrategyError(f"value {a.name} is read on a stage that does not receive it")
        for b in a.all_input_nodes:
            get(b)
        env[a] = g.node_copy(a, get)
        return env[a]

    wanted = set(own)
    for n in nodes:
        if n in wanted:
            env[n] = g.node_copy(n, get)
    if out_node is not None:
        g.output(fx.node.map_arg(out_node.args[0], get))
    else:
        vals = [get(o) for o in outs]
        g.output(vals[0] if len(vals) == 1 else tuple(vals))
    out = fx.GraphModule(gm, g)
    out.graph.eliminate_dead_code()
    out.recompile()
    return out


class _LossFn(torch.nn.Module):
    """``loss_fn(output, target)`` for the schedule: the module's ops after the last stage."""

    def __init__(self, gm: fx.GraphModule):
        super().__init__()
        self.gm = gm

    def forward(self, output, target):
        outs = output if isinstance(output, tuple) else (output,)
        return self.gm(*outs, target)

