"""Sequence parallelism in DTensor's styles, and the styles' text form.

flexflow's ``megatron`` splits the ops between a tensor-parallel pair's layers (norms,
residual adds) along the tokens.  In torch's terms that is Megatron's sequence
parallelism, written as torchtitan writes it: the embedding vocabulary-parallel with its
output sharded along the sequence, each norm that feeds column-parallel layers
``SequenceParallel``, the column-parallel layers gathering the sequence
(``input_layouts=Shard(seq)``; once at the input of a module whose children they are, an
attention or an MLP, where its parent's forward shows it), the row-parallel layers
reduce-scattering into it
(``output_layouts=Shard(seq)``), and a norm that feeds a module computed whole (the output
layer) gathering the sequence before it (``PrepareModuleInput``).  The residual stream
between them is a local sequence shard, so every parameter-free op on it must act token by
token: where one does not (a pooling over the tokens), or the stream is not that shape,
the plan maps without sequence parallelism (its modules replicated in the group: the
same values, each rank computing them whole).

Styles are kept as the text of a constructor call (``"ColwiseParallel(input_layouts=
Shard(1))"``), readable in the JSON and turned into torch objects by :func:`make_style`,
which accepts those styles and placements only.
"""
from __future__ import annotations

import ast

from ..graph.ir import OpGraph

__all__ = ["make_style", "sequence_parallel_styles"]

_TOKENWISE = ("pointwise",)


def sequence_parallel_styles(graph: OpGraph, strategy, styles: dict[str, str],
                             token_split: dict[str, object]) -> dict | None:
    """The styles with sequence parallelism, or None where the plan's token-split modules
    do not form the stream described above.  ``styles``: owner FQN -> ``ColwiseParallel`` /
    ``RowwiseParallel``; ``token_split``: owner FQN -> (op, the op's tensor-parallel dim
    names) for each parameter module the plan splits along the tokens."""
    if not token_split or not styles:
        return None
    axes = {op.dim(k).axis for op, keys in token_split.values() if op.rule != "embedding" for k in keys}
    if len(axes) != 1 or None in axes:
        return None
    (a,) = axes
    keys = {k for op, ks in token_split.values() if op.rule != "embedding" for k in ks}
    ops = graph.compute_ops
    where = {op.name: i for i, op in enumerate(ops)}
    owner_of = {op.name: next(iter(op.params.values())).rsplit(".", 1)[0] for op in ops if op.params}
    users: dict[str, list] = {}
    for op in ops:
        for i in op.inputs:
            users.setdefault(i, []).append(op)
    out = {}
    gather_at = None
    feeds: dict[str, list[str]] = {}  # a sequence-parallel norm -> the column-parallel layers it feeds
    for owner, (op, _) in sorted(token_split.items(), key=lambda kv: where[kv[1][0].name]):
        if gather_at is not None:
            continue  # after the gather: computed whole on each rank of the group
        consumers = [owner_of.get(u.name) for u in users.get(op.name, [])]
        if op.rule == "embedding":
            out[owner] = f"RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard({a}))"
        elif consumers and all(styles.get(c) == "ColwiseParallel" for c in consumers):
            out[owner] = "SequenceParallel()" if a == 1 else f"SequenceParallel(sequence_dim={a})"
            feeds[owner] = consumers
        elif not any(c in styles for c in consumers):
            out[owner] = (f"PrepareModuleInput(input_layouts=(Shard({a}),), desired_input_layouts=(Replicate(),), "
                          "use_local_output=True)")
            gather_at = where[op.name]
        else:
            return None
    linears = [where[op.name] for op in ops if op.params and owner_of[op.name] in styles]
    if gather_at is None or not out or not next(iter(out.values())).startswith("RowwiseParallel(input") \
            or max(linears) > gather_at:
        return None
    # between the embedding and the gathering module the stream's own ops act token by token
    for op in ops[:gather_at]:
        if not op.params and op.rule not in _TOKENWISE and _token_split(op, strategy[op.name], a, keys):
            return None
    gathered = _gather_at_parents(graph.module, feeds, a, out)
    for owner, style in styles.items():
        if owner in gathered:
            out[owner] = "ColwiseParallel()"
        else:
            out[owner] = (f"ColwiseParallel(input_layouts=Shard({a}))" if style == "ColwiseParallel"
                          else f"RowwiseParallel(output_layouts=Shard({a}))")
    return out


def _gather_at_parents(root, feeds: dict[str, list[str]], a: int, out: dict) -> set[str]:
    """Where a norm's column-parallel readers are the children of one module that the
    norm's output is passed to (an attention module, an MLP), gather the sequence once at
    that module's input (``PrepareModuleInput``, as torchtitan writes it) rather than in
    each reader: the module's call is read off its parent's forward (torch.fx, its children
    kept whole).  Adds those styles to ``out``; returns the readers gathered so."""
    done: set[str] = set()
    if root is None:
        return done
    traced: dict = {}  # parent FQN -> its forward's graph (a block's norms share it), or None
    for norm, readers in feeds.items():
        parts = [r.split(".") for r in readers]
        common = []
        for xs in zip(*parts):
            if len(set(xs)) != 1:
                break
            common.append(xs[0])
        target = ".".join(common)
        if len(readers) < 2 or not target or target in readers or target == norm:
            continue
        parent, _, child = target.rpartition(".")
        if norm.rpartition(".")[0] != parent:
            continue  # the norm is not called beside it
        if parent not in traced:
            traced[parent] = _children_graph(root, parent)
        g = traced[parent]
        if g is None:  # not traceable: gather in each reader
            continue
        normal = norm.rpartition(".")[2]
        calls = [n for n in g.nodes if n.op == "call_module" and n.target == child]
        made = [n for n in g.nodes if n.op == "call_module" and n.target == normal]
        if len(calls) != 1 or len(made) != 1 or calls[0].kwargs:
            continue
        args = calls[0].args
        at = [i for i, x in enumerate(args) if x is made[0]]
        if len(at) != 1:
            continue
        ins = ", ".join(f"Shard({a})" if i == at[0] else "None" for i in range(len(args)))
        want = ", ".join("Replicate()" if i == at[0] else "None" for i in range(len(args)))
        comma = "," if len(args) == 1 else ""
        out[target] = (f"PrepareModuleInput(input_layouts=({ins}{comma}), desired_input_layouts=({want}{comma}), "
                       "use_local_output=True)")
        done |= set(readers)
    return done


def _children_graph(root, parent: str):
    """The torch.fx graph of module ``parent``'s forward with its children kept whole, or None."""
    import torch.fx as fx
    try:
        owner = root.get_submodule(parent) if parent else root
        kids = {n for n, _ in owner.named_children()}

        class Kids(fx.Tracer):
            def is_leaf_module(self, m, qualname):
                return qualname in kids or super().is_leaf_module(m, qualname)
        return Kids().trace(owner)
    except Exception:  # noqa: BLE001 - any trace failure is the same answer
        return None


def _token_split(op, cfg, a: int, keys: set) -> bool:
    """Whether the plan splits ``op``'s output along the sequence (a dim named as the
    token-split modules' at their axis ``a``): an op on the sequence-sharded stream."""
    return any(k in keys and n > 1 and op.dim(k).axis == a for k, n in cfg.degrees.items())


_NAMES = ("ColwiseParallel", "RowwiseParallel", "SequenceParallel", "PrepareModuleInput", "PrepareModuleOutput",
          "Shard", "Replicate")


def make_style(text: str):
    """The torch object a style's text names (only DTensor's parallel styles and
    placements, with literal arguments)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor import parallel as tp
    known = {"Shard": Shard, "Replicate": Replicate}
    known.update({n: getattr(tp, n) for n in _NAMES if n not in known})

    def build(node):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in known:
            return known[node.func.id](*[build(x) for x in node.args],
                                       **{k.arg: build(k.value) for k in node.keywords})
        if isinstance(node, ast.Tuple):
            return tuple(build(x) for x in node.elts)
        if isinstance(node, ast.Constant):
            return node.value
        raise ValueError(f"style {text!r}: only {', '.join(_NAMES)} with literal arguments are understood")
    try:
        tree = ast.parse(text, mode="eval").body
    except SyntaxError as e:
        raise ValueError(f"style {text!r} is not a constructor call") from e
    if isinstance(tree, ast.Name):  # a bare class name
        tree = ast.Call(func=tree, args=[], keywords=[])
    return build(tree)
