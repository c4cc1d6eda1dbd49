"""Where the batch is: the sample dim of every op follows the data, not position 0.

The rules say which dims an op can split; this pass says which of them is the batch.
It starts from the batch dim of each graph input (declared with ``batch_dim=``, or
inferred: the assignment under which the graph carries the batch furthest, with the
layouts that ``torch.nn``'s sequence-first modules declare taken as given) and follows
it op by op.  A dim carries the batch when the op's rule says that a block of it reads
the same block of the batch from an input (the rules' own regions are asked, so a
reshape that merges the batch with the dims after it, a transpose or a loss over
flattened rows keep it).  That dim becomes the op's sample dim (its blocks in whole
samples); a dim of the batch's size that does not carry it is an attribute.

An op the library does not know (opaque) is split along the batch only where that is
proven: a layout ``torch.nn`` documents (``nn.Transformer*``, ``nn.MultiheadAttention``,
``nn.RNN/LSTM/GRU``, each with its ``batch_first``), or, where its parameters are real
tensors, a check at capture that the op on a block of the batch gives that block of its
output.  Otherwise it runs whole, and :attr:`OpGraph.whole_reasons` says why.
"""
from __future__ import annotations

import inspect
import math

import torch

from .ir import Dim, InputRef, Op
from .ops import RULES

__all__ = ["settle_batch", "declared_layout", "BatchDimError"]


class BatchDimError(ValueError):
    """A ``batch_dim=`` that does not fit the inputs."""


# the sequence-first modules of torch.nn: argument name -> role
_SEQ_ARGS = {"query", "key", "value", "src", "tgt", "memory", "input"}
_MAX_CHECK = 1 << 22  # elements of inputs and output an opaque op is checked with at most


def _smallest_prime(n: int) -> int:
    for p in range(2, int(math.isqrt(n)) + 1):
        if n % p == 0:
            return p
    return n


# --------------------------------------------------------------------------- declared layouts
def _seq_modules():
    nn = torch.nn
    return (nn.MultiheadAttention, nn.Transformer, nn.TransformerEncoder, nn.TransformerDecoder,
            nn.TransformerEncoderLayer, nn.TransformerDecoderLayer, nn.RNNBase)


def declared_layout(op: Op, batch: int):
    """The batch layout a ``torch.nn`` sequence-first module documents for ``op``:
    ``(inputs, outputs)``, each a list of ``(axis, unit)`` or None per tensor input and
    per output leaf; None when ``op`` is not such a module."""
    mod = op.target
    if op.call_kind != "call_module" or not isinstance(mod, _seq_modules()):
        return None
    bf = bool(getattr(mod, "batch_first", False))
    if isinstance(mod, (torch.nn.TransformerEncoder, torch.nn.TransformerDecoder)):
        first = mod.layers[0] if len(mod.layers) else None
        bf = bool(getattr(first, "self_attn", None) is not None and first.self_attn.batch_first)
    seq_axis = 0 if bf else 1
    try:
        names = list(inspect.signature(mod.forward).parameters)
    except (TypeError, ValueError):
        return None
    roles: dict[int, str] = {}
    for pos, a in enumerate(op.args):
        if isinstance(a, InputRef) and pos < len(names):
            roles[a.index] = names[pos]
    for k, a in op.kwargs.items():
        if isinstance(a, InputRef):
            roles[a.index] = k
    ins = []
    for i, shape in enumerate(op.input_shapes):
        role = roles.get(i, "")
        if role in _SEQ_ARGS:
            ins.append((seq_axis, 1) if len(shape) == 3 and shape[seq_axis] == batch else None)
        elif role.endswith("key_padding_mask"):
            ins.append((0, 1) if len(shape) == 2 and shape[0] == batch else None)
        elif role.endswith("mask"):  # (T, S) shared, or (B * heads, T, S): the batch outermost
            ins.append((0, shape[0] // batch) if len(shape) == 3 and shape[0] % batch == 0 else None)
        elif role in ("hx", "h_0", "c_0"):  # (layers * directions, B, H), whatever batch_first says
            ins.append((1, 1) if len(shape) == 3 and shape[1] == batch else None)
        else:
            ins.append(None)
    if not any(ins):
        return None  # unbatched inputs
    leaves = _out_leaves(op)
    outs = []
    for k, shape in enumerate(leaves):
        if isinstance(mod, torch.nn.MultiheadAttention):
            axis = seq_axis if k == 0 else 0  # (attention, weights (B, T, S))
        elif isinstance(mod, torch.nn.RNNBase):
            axis = seq_axis if k == 0 else 1  # (output, h_n[, c_n]) with h_n (L * D, B, H)
        else:
            axis = seq_axis
        outs.append((axis, 1) if len(shape) > axis and shape[axis] == batch else None)
    return ins, outs


def _out_leaves(op: Op) -> list[tuple]:
    """The shapes of the output leaves of ``op`` (one, unless packed or stacked)."""
    if op.attrs.get("packed"):
        return list(op.attrs.get("leaf_shapes", ()))
    if op.attrs.get("stacked"):
        return [tuple(op.output_shape[1:])] * op.output_shape[0]
    return [tuple(op.output_shape)]


# --------------------------------------------------------------------------- propagation
def _carrying_dim(op: Op, i: int, axis: int, size: int, batch: int):
    """The dim of ``op`` whose blocks read the same blocks of the batch from input ``i``
    (batch on ``axis``, of extent ``size``), or None."""
    p = _smallest_prime(batch)
    rule = RULES[op.rule]
    cands = sorted(op.dims, key=lambda d: d.axis != axis)
    for d in cands:
        if d.axis is not None and not (d.size % batch == 0 or batch % d.size == 0):
            continue
        n = d.size // d.unit
        if n % p or size % p:
            continue
        step = n // p * d.unit
        ok = True
        for a in (0, d.size - step):
            try:
                ins, _ = rule.regions(op, {d.name: (a, a + step)})
            except Exception:  # noqa: BLE001 - a rule that cannot say: not carried
                return None
            r = ins[i] if i < len(ins) else None
            want = size // p
            if r is None or len(r) <= axis or (r[axis].start, r[axis].stop) != (a // step * want, a // step * want + want):
                ok = False
                break
        if ok:
            return d
    return None


def _guess(shape, axis, batch):
    """The batch position of an output nothing proves: the axis its input had, when it
    has the batch's size there."""
    if axis is not None and len(shape) > axis and shape[axis] == batch:
        return (axis, batch)
    return None


def _flow(ops: list[Op], starts: dict[str, tuple | None], batch: int, final: bool):
    """Follow the batch from the inputs: op name -> (axis, extent) of its output's batch,
    or None; and the score of the run (layouts honoured, ops that carry the batch).
    ``final``: also record each op's carrying dim (``op.__dict__['_carry']``)."""
    pos: dict[str, tuple | None] = {}
    leaves: dict[str, list] = {}
    score = 0
    for op in ops:
        if op.kind == "input":
            pos[op.name] = starts.get(op.name)
            continue
        if op.everywhere:
            pos[op.name] = None
            continue
        ins = [pos.get(s) for s in op.inputs]
        first = next(((i, b) for i, b in enumerate(ins) if b is not None), None)
        if op.rule == "unpack":
            src = op.inputs[0]
            lay = leaves.get(src)
            k = op.attrs.get("leaf", 0)
            pos[op.name] = (lay[k][0], op.output_shape[lay[k][0]]) if lay and k < len(lay) and lay[k] else None
            if final:  # packed by sample: it splits along the batch
                op.__dict__["_carry"] = op.sample_dim
            continue
        if op.rule == "opaque":
            lay = op.attrs.get("declared")
            if lay is not None:
                want, outs = lay
                for b, w in zip(ins, want):
                    if w is not None:
                        score += 1000 if b is not None and b[0] == w[0] else -1000
                leaves[op.name] = outs
                single = not op.attrs.get("packed") and not op.attrs.get("stacked")
                o = outs[0] if single and outs else None
                pos[op.name] = (o[0], op.output_shape[o[0]]) if o else None
            else:
                axis = first[1][0] if first else None
                if op.attrs.get("packed"):
                    leaves[op.name] = [(axis, 1) if _guess(s, axis, batch) else None
                                       for s in op.attrs.get("leaf_shapes", ())]
                    pos[op.name] = None
                else:
                    pos[op.name] = _guess(op.output_shape, axis, batch)
            if pos[op.name] is not None:
                score += 1
            continue
        d = _carrying_dim(op, first[0], first[1][0], first[1][1], batch) if first else None
        if final:
            op.__dict__["_carry"] = d
        if d is not None:
            score += 1
            pos[op.name] = (d.axis, d.size) if d.axis is not None else None
        elif not op.dims and first is not None:  # runs whole: the batch may still be where it was
            pos[op.name] = _guess(op.output_shape, first[1][0], batch)
        else:
            pos[op.name] = None
    return pos, score


def _starts(inputs: list[Op], axes) -> tuple[dict, int | None]:
    """Batch position of each input under ``axes`` (one per input, None: unbatched) and
    the batch: the first batched input's extent there."""
    batch = None
    for op, a in zip(inputs, axes):
        if a is not None and len(op.output_shape) > a:
            batch = op.output_shape[a]
            break
    starts = {}
    for op, a in zip(inputs, axes):
        ok = a is not None and len(op.output_shape) > a and op.output_shape[a] == batch
        starts[op.name] = (a, batch) if ok else None
    return starts, batch


def _candidates(inputs: list[Op], batch_dim):
    """The input batch dims to try: the declared one, or axis 0, then axis 1."""
    if batch_dim is not None:
        if isinstance(batch_dim, int) and not isinstance(batch_dim, bool):
            n = [len(op.output_shape) for op in inputs]
            return [[batch_dim % k if -k <= batch_dim < k else None for k in n]]
        dims = list(batch_dim)
        if len(dims) != len(inputs):
            raise BatchDimError(f"batch_dim has {len(dims)} entries but the model takes {len(inputs)} "
                                f"tensor inputs ({', '.join(op.name for op in inputs)})")
        for op, a in zip(inputs, dims):
            if a is not None and not (isinstance(a, int) and -len(op.output_shape) <= a < len(op.output_shape)):
                raise BatchDimError(f"batch_dim {a!r} of input {op.name} does not index its shape "
                                    f"{tuple(op.output_shape)}")
        return [[a % len(op.output_shape) if a is not None else None for op, a in zip(inputs, dims)]]
    # one axis for every input of two axes or more (inputs of one axis: their axis 0); a
    # model that mixes layouts across its inputs says so with batch_dim
    first = [0 if op.output_shape else None for op in inputs]
    second = [1 if len(op.output_shape) >= 2 else a for op, a in zip(inputs, first)]
    return [first] if second == first else [first, second]


def settle_batch(ops: list[Op], root, batch_dim=None) -> tuple[int | None, dict[str, str]]:
    """Decide the batch of every op (see the module's doc): sets each op's dims (its
    rule's, with the dim that carries the batch as the sample dim) and returns the batch
    and, per op that runs whole though the batch reaches it, the reason."""
    inputs = [op for op in ops if op.kind == "input"]
    placed = [op for op in ops if not op.everywhere and op.kind != "input"]
    guess = next((op.output_shape[0] for op in inputs if op.output_shape), None)
    for op in placed:
        if op.rule == "opaque":
            lay = declared_layout(op, guess) if guess else None
            op.attrs.pop("declared", None)
            if lay is not None:
                op.attrs["declared"] = lay
    best = None
    for axes in _candidates(inputs, batch_dim):
        starts, batch = _starts(inputs, axes)
        if batch is None:
            continue
        if batch != guess:
            _redim(placed, batch, root, declared_only=True)
        _, score = _flow(ops, starts, batch, final=False)
        if best is None or score > best[0]:
            best = (score, axes, starts, batch)
        if batch != guess:
            _redim(placed, guess, root, declared_only=True)
    if best is None:
        return None, {}
    _, axes, starts, batch = best
    for op in inputs:  # the axis that carries the batch, for tracing a micro-batch (graph.micro)
        op.attrs["batch_axis"] = starts[op.name][0] if starts.get(op.name) else None
    _redim(placed, batch, root, declared_only=True)
    reasons = _redim(placed, batch, root, declared_only=False, starts=starts, ops=ops)
    pos, _ = _flow(ops, starts, batch, final=True)
    lost: dict[str, str] = {}  # op -> the op where the batch its inputs had was lost
    for op in placed:
        d = op.__dict__.pop("_carry", None)
        if op.rule == "opaque":
            d = op.sample_dim
        if batch == 1:  # a batch of one splits nothing: no dim is its (the tokens stay attributes)
            op.dims = [Dim("d0" if x.name == "n" else x.name, "attribute", x.axis, x.size) if x.kind == "sample"
                       else x for x in op.dims]
            continue
        if op.sample_dim is None and d is None and op.name not in reasons and not op.output_shape:
            reasons[op.name] = "its output is a scalar (nothing to split)"
        if op.sample_dim is None and d is None and op.name not in reasons:
            if any(pos.get(s) is not None for s in op.inputs):
                reasons[op.name] = _lost(op)
            else:
                origin = next((lost[s] for s in op.inputs if s in lost), None)
                if origin is not None:
                    reasons[op.name] = (f"its inputs no longer carry the batch (lost at {origin})"
                                        if op.output_shape else "its output is a scalar of the whole batch")
        if (d is None and op.sample_dim is None and pos.get(op.name) is None
                and any(pos.get(s) is not None or s in lost for s in op.inputs)):
            lost[op.name] = next((lost[s] for s in op.inputs if s in lost), op.name)
        if op.rule == "opaque":
            continue
        out = []
        for x in op.dims:
            if d is not None and x is d:
                unit = x.unit
                if x.axis is not None and x.size % batch == 0 and x.size > batch:
                    unit = math.lcm(unit, x.size // batch)
                out.append(Dim(x.name, "sample", x.axis, x.size, unit))
            elif x.kind == "sample":
                out.append(Dim(x.name, "attribute", x.axis, x.size, x.unit))
            else:
                out.append(x)
        op.dims = out
        if d is not None and d.name != "n":
            _name_sample(op)
    return batch, reasons


def _lost(op: Op) -> str:
    """Why ``op`` has no dim that carries the batch its input carries."""
    if op.rule == "reshape":
        return "the reshape merges the batch into a dim after another (its blocks are not whole samples)"
    if op.rule == "unpack":
        return f"one output of {op.inputs[0]}, whose outputs travel packed (it runs whole)"
    if not op.output_shape:
        return "its output is a scalar of the whole batch"
    if not op.dims:
        return f"the {op.rule} rule runs it whole"
    return "its rule mixes the samples (no dim of it reads one block of the batch)"


# rules whose regions read a dim with an output axis by its axis alone (out_region)
_BY_AXIS = {"pointwise", "rowwise", "reshape", "transpose", "index", "pad", "concat", "linear",
            "linear_t", "embedding", "matmul"}


def _name_sample(op: Op) -> None:
    """Call the sample dim ``n`` (printed S), where that changes no region: the dim that
    had the name (a sequence axis of the batch's size) becomes ``d0``."""
    d = op.sample_dim
    names = {x.name for x in op.dims}
    if d.axis is None:
        ok = d.name == "d0" and "n" not in names  # a reduced batch axis: both read axis 0
    else:
        ok = op.rule in _BY_AXIS and ("n" not in names or "d0" not in names)
    if not ok:
        return
    rule = RULES[op.rule]
    k = 2 if d.blocks >= 2 else 1
    step = d.size // d.unit // k * d.unit
    before = rule.regions(op, {d.name: (0, step)})
    old = op.dims
    op.dims = [Dim("n", x.kind, x.axis, x.size, x.unit) if x is d
               else Dim("d0", x.kind, x.axis, x.size, x.unit) if x.name == "n" else x for x in old]
    try:
        same = rule.regions(op, {"n": (0, step)}) == before
    except Exception:  # noqa: BLE001 - a rule that reads the old name: keep the names
        same = False
    if not same:
        op.dims = old


def _redim(placed: list[Op], batch: int, root, *, declared_only: bool, starts=None, ops=None):
    """Each op's dims under ``batch``; with ``declared_only`` just the declared layouts of
    opaque ops (for a trial), else opaque ops' proven layouts too."""
    reasons: dict[str, str] = {}
    pos = None
    if not declared_only:
        pos, _ = _flow(ops, starts, batch, final=False)
    for op in placed:
        if op.rule == "opaque":
            lay = declared_layout(op, batch)
            op.attrs.pop("declared", None)
            op.attrs.pop("layout", None)
            if lay is not None:
                op.attrs["declared"] = lay
            if declared_only:
                continue
            single = not op.attrs.get("packed") and not op.attrs.get("stacked")
            ins = [pos.get(s) for s in op.inputs]
            agree = lay is not None and all(w is None or (b is not None and b[0] == w[0])
                                            for b, w in zip(ins, lay[0]))
            if lay is not None and not agree:
                reasons[op.name] = "its inputs do not hold the batch where its layout says"
            elif lay is not None and single and lay[1] and lay[1][0] is not None:
                op.attrs["layout"] = (list(lay[0]), lay[1][0])
            elif lay is not None and op.attrs.get("packed") and lay[1] and all(lay[1]) \
                    and all(u == 1 for _, u in lay[1]):
                _pack_by_sample(op, lay, batch, [o for o in ops if o.rule == "unpack" and o.inputs[:1] == [op.name]])
            elif lay is None and single:
                why = _prove(op, root, ins, batch)
                if why is None:
                    axis = next(b[0] for b in ins if b is not None)
                    op.attrs["layout"] = ([(b[0], 1) if b is not None else None for b in ins], (axis, 1))
                elif any(b is not None for b in ins):
                    reasons[op.name] = why
            elif any(pos.get(s) is not None for s in op.inputs):
                reasons[op.name] = ("several outputs of different shapes travel packed as one tensor"
                                    if op.attrs.get("packed") else "its layout is not known")
        op.dims = [] if op.everywhere else RULES[op.rule].dims(op, batch)
    return reasons


def _pack_by_sample(op: Op, lay, batch: int, unpacks: list[Op]) -> None:
    """A packed op whose every output holds the batch (nn.LSTM's (out, (h, c)), nn.Multihead-
    Attention's (out, weights)) packs by sample: a (B, per sample) tensor, each output's
    samples flattened side by side, so that it splits along the batch like its outputs."""
    shapes = op.attrs["leaf_shapes"]
    axes = [ax for ax, _ in lay[1]]
    per = [math.prod(s) // s[ax] for s, ax in zip(shapes, axes)]
    offsets = [sum(per[:k]) for k in range(len(per))]
    op.output_shape = (batch, sum(per))
    op.attrs.update(by_sample=axes, layout=(list(lay[0]), (0, 1)))
    for u in unpacks:
        k = u.attrs["leaf"]
        u.input_shapes = [op.output_shape]
        u.attrs.update(sample_axis=axes[k], offset=offsets[k], per_sample=per[k])


def _prove(op: Op, root, ins, batch: int) -> str | None:
    """None when ``op`` on each block of the batch gives that block of its output, else why
    not: checked with random inputs and the module's own parameters (stand-ins of their
    shapes for a module on the meta device), on a mini-batch of two samples where the
    whole batch is too large."""
    from .ops.base import call_template
    if not any(b is not None for b in ins):
        return "no input carries the batch"
    axis = next(b[0] for b in ins if b is not None)
    if any(b is not None and b[1] != batch for b in ins):
        return "an input holds the batch merged with other dims"
    if len(op.output_shape) <= axis or op.output_shape[axis] != batch:
        return f"its output has no axis {axis} of the batch's size"
    if batch < 2:
        return "a batch of one"
    tensors = {}
    gen = torch.Generator().manual_seed(0)
    for names in (op.params, op.buffers):
        for local, q in names.items():
            t = _lookup(root, q)
            if t is None:
                return "its parameters are not the module's"
            if t.device.type != "meta":
                tensors[local] = t.detach().clone()
            elif t.numel() > _MAX_CHECK:
                return "its parameters are on the meta device and too large to check it with stand-ins"
            else:  # planned on the meta device: stand-ins of the same shapes say as much
                tensors[local] = (torch.randn(t.shape, generator=gen).to(t.dtype) if t.dtype.is_floating_point
                                  else torch.zeros(t.shape, dtype=t.dtype))
    total = sum(math.prod(s) for s in op.input_shapes) + math.prod(op.output_shape)
    shapes, n = list(op.input_shapes), batch
    if total > _MAX_CHECK:  # checked on a mini-batch of two samples (an op bound to its batch fails it)
        if 2 * total // batch > _MAX_CHECK:
            return "too large to check that its samples are independent"
        n = 2
        shapes = [tuple(2 if i == b[0] else d for i, d in enumerate(s)) if b is not None else tuple(s)
                  for s, b in zip(op.input_shapes, ins)]
    device = next((t.device for t in tensors.values()), torch.device("cpu"))
    xs = []
    for shape, dtype in zip(shapes, op.input_dtypes):
        if dtype.is_floating_point:
            xs.append(torch.randn(shape, generator=gen).to(device=device, dtype=dtype))
        else:
            xs.append(torch.zeros(shape, dtype=dtype, device=device))
    batch = n
    p = _smallest_prime(batch)
    step = batch // p
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            whole = call_template(op, xs, dict(tensors))
            for a in (0, batch - step):
                part = [x.narrow(b[0], a, step) if b is not None else x for x, b in zip(xs, ins)]
                torch.manual_seed(0)
                y = call_template(op, part, dict(tensors))
                ref = whole.narrow(axis, a, step)
                if not isinstance(y, torch.Tensor) or y.shape != ref.shape or \
                        not torch.allclose(y.float(), ref.float(), rtol=1e-4, atol=1e-5):
                    return "a block of its batch does not give that block of its output"
    except Exception as e:  # noqa: BLE001 - an op that cannot run on a block runs whole
        return f"it does not run on a block of its batch ({type(e).__name__})"
    return None


def _lookup(root, qualified: str):
    obj = root
    for part in qualified.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj if isinstance(obj, torch.Tensor) else None
