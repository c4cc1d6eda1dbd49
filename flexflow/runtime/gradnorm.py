"""Global gradient norms over a runtime's shards, for torch's own utilities too.

A rank holds only its shards of each parameter, and a block held by several
ranks (replicas) sits on each of them with the same gradient once the
gradient sync has run.  The norm of the whole model's gradients is therefore
a collective: every rank takes the norms of the blocks it *owns* (the first
rank of each shard's ranks, so that a block counts once), and one all-gather
on a process group of the runtime (:class:`NormScope`, made at its first use)
combines them, in rank order, so that every rank gets the same value
(:func:`global_norm`).

So that ``torch.nn.utils.clip_grad_norm_(par.parameters(), c)`` and
``torch.nn.utils.get_total_norm`` compute that value too, the gradients of a
runtime's shards are :class:`ShardGrad` tensors (a tensor subclass set by
:func:`shard_grad`, after each backward).  Its ``__torch_function__`` passes
every call through unchanged (results are plain tensors: optimizer state,
momentum buffers) except the whole-tensor norms those utilities take
(``torch._foreach_norm``, ``torch.linalg.vector_norm``, also ``torch.norm``,
``Tensor.norm`` and ``torch.linalg.norm`` of a flattened tensor): their
results are :class:`_NormPart` tensors -- the shard's own norm, tagged with
its scope and whether this rank owns the block.  ``torch.stack`` of such parts
is a :class:`_NormStack`, and the norm of a stack (the utilities' last step)
is the global norm.  A stack that mixes these parts with other norms cannot
be combined right and raises an error naming ``par.clip_grad_norm_``.
"""
from __future__ import annotations

import itertools
import math
import weakref

import torch
import torch.distributed as dist

from . import shutdown
from .gloo import batched_gloo_loops
from .plan import ExecutorError

__all__ = ["NormScope", "ShardGrad", "shard_grad", "global_norm", "scale_grads_", "install_hooks", "local_norms"]

_serials = itertools.count()


class NormScope:
    """The gradient norms of one runtime: which of its shards this rank owns,
    and the process group (made at the first collective norm, by every rank)
    over which the ranks combine their parts."""

    def __init__(self, rt):
        self.serial = next(_serials)  # creation order, the same on every rank
        self._rt = weakref.ref(rt)
        # a block counts on the first of its ranks; a sharded region's slices on each
        self.owner = {q: ranks[0] == rt.rank or q in rt.full for q, (_, _, ranks) in rt.shards.items()}
        self.group = None
        self.closed = False

    @property
    def rt(self):
        rt = self._rt()
        if rt is None or rt.closed or self.closed:
            raise ExecutorError("the gradient norm of a parallel module whose runtime was shut down")
        return rt

    def _make_group(self, rt):
        """A group of all ranks for the norms (its own: a rank that wrongly skips a
        norm then makes the others fail at the timeout, never pairs another
        collective of the runtime with it)."""
        try:
            with batched_gloo_loops() as moved:
                self.group = dist.new_group(list(range(rt.world)), timeout=rt.timeout)
        except Exception as e:  # noqa: BLE001 - re-raised with what it was for
            raise ExecutorError(f"rank {rt.rank}: creating the process group of the gradient norm: "
                                f"{_MISUSE}: {e}") from e
        rt.batch_threads.extend(moved)
        shutdown.register(self)

    def combine(self, local: float, p: float) -> float:
        """The global value from this rank's ``local`` part (a sum of norm**p, or a
        max/min for p = +-inf): one all-gather, combined in rank order on every rank."""
        rt = self.rt
        if not (rt.distributed and rt.world > 1):
            return local
        if self.group is None:
            self._make_group(rt)
        mine = torch.tensor([local], dtype=torch.float64, device=rt.device)
        parts = [torch.empty_like(mine) for _ in range(rt.world)]
        work = dist.all_gather(parts, mine, group=self.group, async_op=True)
        rt.wait([work], lambda: f"the global gradient norm among all {rt.world} ranks ({_MISUSE})")
        values = [float(t) for t in parts]
        return _reduce(values, p)

    def close(self, wait_s: float = 10.0, destroy_groups: bool = True) -> None:
        """Destroy the group (called by :func:`flexflow.runtime.shutdown.shutdown`)."""
        self.closed = True
        group, self.group = self.group, None
        if group is not None and destroy_groups and dist.is_available() and dist.is_initialized():
            try:
                dist.destroy_process_group(group)
            except Exception:  # noqa: BLE001
                pass


_MISUSE = ("every rank must compute it at the same point, over the gradients of the whole parallel "
           "module: par.clip_grad_norm_(max_norm) or par.grad_norm(), or torch.nn.utils.clip_grad_norm_"
           "(par.parameters(), max_norm) on every rank")


def _reduce(values, p: float) -> float:
    """The ranks' parts combined (a NaN anywhere gives NaN, as torch's norms do)."""
    if any(math.isnan(v) for v in values):
        return math.nan
    if p == math.inf:
        return max(values)
    if p == -math.inf:
        return min(values)
    return math.fsum(values)


def _check_p(p) -> float:
    p = float(p)
    if p == 0.0 or math.isnan(p):
        raise ValueError(f"norm_type {p} is not supported for the gradients of a parallel module "
                         "(the norm of a parameter's gradient is taken over its blocks: use p != 0 or "
                         "+-inf)")
    return p


def _finish(acc: float, p: float) -> float:
    if p in (math.inf, -math.inf):
        return acc
    if acc == 0.0:
        return 0.0 if p > 0 else math.inf
    return acc ** (1.0 / p)


def _local(norms: torch.Tensor, owners: list, p: float) -> float:
    """This rank's part from the norms of its blocks (``owners``: those it counts)."""
    mine = norms[torch.tensor(owners, dtype=torch.bool, device=norms.device)] if not all(owners) else norms
    mine = mine.double()
    if mine.isnan().any():
        return math.nan
    if p == math.inf:
        return float(mine.max()) if mine.numel() else 0.0
    if p == -math.inf:
        return float(mine.min()) if mine.numel() else math.inf
    return float(mine.pow(p).sum()) if mine.numel() else 0.0


def local_norms(grads: list, p: float) -> torch.Tensor:
    """The p-norm of each of ``grads`` (one foreach call per device and dtype), float64
    on the first one's device, in the order given."""
    if not grads:
        return torch.zeros(0, dtype=torch.float64)
    groups: dict = {}
    with torch.no_grad(), torch._C.DisableTorchFunctionSubclass():
        for i, g in enumerate(grads):
            groups.setdefault((g.device, g.dtype), []).append(i)
        if len(groups) == 1:
            return torch.stack(_foreach_norms(grads, p, None)).double()
        out = [None] * len(grads)
        for idx in groups.values():
            for i, n in zip(idx, _foreach_norms([grads[i] for i in idx], p, None)):
                out[i] = n.double().to(grads[0].device)
        return torch.stack(out)


def _foreach_norms(tensors: list, p: float, dtype) -> list:
    """``torch._foreach_norm`` of the tensors as plain ones; 0 for an empty one (the
    placeholder of a rank without blocks), whose inf-norm torch refuses."""
    with torch._C.DisableTorchFunctionSubclass():
        if all(t.numel() for t in tensors):
            return list(torch._foreach_norm(tensors, p, dtype=dtype))
        full = [i for i, t in enumerate(tensors) if t.numel()]
        out = [torch.zeros((), dtype=dtype or t.dtype, device=t.device) for t in tensors]
        if full:
            for i, n in zip(full, torch._foreach_norm([tensors[i] for i in full], p, dtype=dtype)):
                out[i] = n
        return out


def global_norm(rt, p: float, dtype=None) -> torch.Tensor:
    """The p-norm of the gradients of every parameter of the whole model (each block
    once), the same 0-dim tensor on every rank (collective)."""
    p = _check_p(p)
    scope = rt.sync.scope
    grads, owners = [], []
    for qual, param in rt.params.items():
        g = param.grad
        if g is not None:
            grads.append(g)
            owners.append(scope.owner.get(qual, True))
    acc = scope.combine(_local(local_norms(grads, p), owners, p), p)
    if dtype is None:
        dtype = grads[0].dtype if grads else torch.get_default_dtype()
    return torch.tensor(_finish(acc, p), dtype=dtype, device=rt.device)


def scale_grads_(rt, max_norm: float, total: torch.Tensor, foreach=None) -> None:
    """Every shard gradient of ``rt`` times ``min(1, max_norm / (total + 1e-6))``, as
    ``torch.nn.utils.clip_grads_with_norm_`` scales (one foreach call per device and
    dtype unless ``foreach`` is False)."""
    grads = [p.grad for p in rt.params.values() if p.grad is not None]
    if not grads:
        return
    coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
    with torch.no_grad(), torch._C.DisableTorchFunctionSubclass():
        groups: dict = {}
        for g in grads:
            groups.setdefault((g.device, g.dtype), []).append(g)
        for (device, _), group in groups.items():
            c = coef.to(device)
            if foreach is False:
                for g in group:
                    g.mul_(c)
            else:
                torch._foreach_mul_(group, c)


# --------------------------------------------------------------------------- the tensor subclasses
_passthrough = torch._C._disabled_torch_function_impl  # the call as on plain tensors (nn.Parameter's)


class _Tagged(torch.Tensor):
    """A tensor whose calls pass through as on a plain tensor (results plain), but
    for the norms in ``_HANDLERS``."""

    _ff_scope = None
    _ff_owner = False

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        handler = _HANDLERS.get(func)
        if handler is not None:
            out = handler(args, kwargs or {})
            if out is not NotImplemented:
                return out
        if kwargs:
            return _passthrough(func, types, args, kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args)

    # a copy (copy.deepcopy, pickle, torch.save) is a plain tensor: the tags belong to this rank's runtime
    def __deepcopy__(self, memo):
        if id(self) not in memo:
            memo[id(self)] = _plain(self).__deepcopy__({})
        return memo[id(self)]

    def __reduce_ex__(self, protocol):
        return _plain(self).__reduce_ex__(protocol)


class ShardGrad(_Tagged):
    """The gradient of a runtime's shard: a plain tensor but for its whole-tensor
    norms, which torch's gradient utilities combine into the global norm."""


class _NormPart(_Tagged):
    """The norm of one shard's gradient (its own value), tagged with its scope and
    whether this rank counts the block."""


class _NormStack(_Tagged):
    """Norms of shards stacked (``_ff_parts``: (scope, owner) of each entry)."""

    _ff_parts = ()


def _tag(t: torch.Tensor, cls, scope, owner: bool):
    out = t.as_subclass(cls)
    out._ff_scope, out._ff_owner = scope, owner
    return out


def shard_grad(g: torch.Tensor, scope: NormScope, owner: bool) -> ShardGrad:
    """``g`` (same storage) as the gradient of a shard of ``scope``."""
    return _tag(g, ShardGrad, scope, owner)


def install_hooks(params: dict, scope: NormScope) -> None:
    """Every shard gradient made by autograd's accumulation becomes a :class:`ShardGrad`
    (the bucketed ones are made so by the gradient sync)."""
    for qual, param in params.items():
        if param.requires_grad:
            param.register_post_accumulate_grad_hook(_Rewrap(scope, scope.owner.get(qual, True)))


class _Rewrap:
    __slots__ = ("scope", "owner")

    def __init__(self, scope, owner):
        self.scope, self.owner = scope, owner

    def __call__(self, param) -> None:
        g = param.grad
        if g is not None and type(g) is not ShardGrad:
            param.grad = shard_grad(g, self.scope, self.owner)


# --------------------------------------------------------------------------- the norms torch takes
def _plain(t):
    return t.as_subclass(torch.Tensor)


def _arg(args, kwargs, i, name, default):
    return args[i] if len(args) > i else kwargs.get(name, default)


def _whole_p(args, kwargs, pname, pdefault, dim_i=2, keep_i=3):
    """The p of a norm over the whole of ``args[0]`` (None: not such a norm)."""
    if _arg(args, kwargs, dim_i, "dim", None) is not None or _arg(args, kwargs, keep_i, "keepdim", False):
        return None
    if kwargs.get("out") is not None:
        return None
    p = _arg(args, kwargs, 1, pname, pdefault)
    if p is None or p == "fro":
        return 2.0
    if isinstance(p, str):
        return None
    return float(p)


def _norm(x, p, dtype):
    with torch._C.DisableTorchFunctionSubclass():
        if not x.numel():
            return torch.zeros((), dtype=dtype or x.dtype, device=x.device)
        return torch.linalg.vector_norm(x, p, dtype=dtype)


def _on(x, p, dtype):
    """A whole-tensor p-norm of ``x``: tagged for a shard gradient, global for a stack
    of tagged norms; NotImplemented (a plain call) otherwise."""
    if p is None:
        return NotImplemented
    if type(x) is ShardGrad:
        return _tag(_norm(x, p, dtype), _NormPart, x._ff_scope, x._ff_owner)
    if type(x) is _NormStack:
        p = _check_p(p)
        parts = x._ff_parts
        norms = _plain(x).reshape(-1)
        if len(parts) != norms.numel():
            return NotImplemented
        scope = min((s for s, _ in parts), key=lambda s: s.serial)
        acc = scope.combine(_local(norms, [o for _, o in parts], p), p)
        return torch.tensor(_finish(acc, p), dtype=dtype or x.dtype, device=x.device)
    return NotImplemented


def _vector_norm(args, kwargs):
    return _on(args[0], _whole_p(args, kwargs, "ord", 2.0), kwargs.get("dtype"))


def _torch_norm(args, kwargs):
    return _on(args[0], _whole_p(args, kwargs, "p", "fro"), _arg(args, kwargs, 5, "dtype", None))


def _tensor_norm(args, kwargs):
    return _on(args[0], _whole_p(args, kwargs, "p", "fro"), _arg(args, kwargs, 4, "dtype", None))


def _linalg_norm(args, kwargs):
    x = args[0]
    ord_ = _arg(args, kwargs, 1, "ord", None)
    if ord_ is not None and x.dim() != 1:  # a matrix norm
        return NotImplemented
    return _on(x, _whole_p(args, kwargs, "ord", None), kwargs.get("dtype"))


def _foreach_norm(args, kwargs):
    tensors = list(args[0])
    p = float(_arg(args, kwargs, 1, "ord", 2.0))
    norms = _foreach_norms(tensors, p, kwargs.get("dtype"))
    return [(_tag(n, _NormPart, t._ff_scope, t._ff_owner) if type(t) is ShardGrad else n)
            for t, n in zip(tensors, norms)]


def _stack(args, kwargs):
    tensors = list(_arg(args, kwargs, 0, "tensors", ()))
    if _arg(args, kwargs, 1, "dim", 0) != 0 or kwargs.get("out") is not None \
            or any(t.dim() != 0 for t in tensors):
        return NotImplemented
    if not all(type(t) is _NormPart for t in tensors):
        raise RuntimeError(
            "a norm over gradients of a parallel module's shards and other tensors together "
            "(torch.nn.utils.clip_grad_norm_ or get_total_norm over a mix): a rank holds only its "
            "shards, so their global norm needs all ranks; clip the parallel module with "
            "par.clip_grad_norm_(max_norm) (or torch.nn.utils.clip_grad_norm_(par.parameters(), "
            "max_norm)) and the other parameters on their own")
    with torch._C.DisableTorchFunctionSubclass():
        out = torch.stack([_plain(t) for t in tensors]).as_subclass(_NormStack)
    out._ff_parts = [(t._ff_scope, t._ff_owner) for t in tensors]
    return out


def _to(args, kwargs):
    x = args[0]
    if type(x) is not _NormPart:
        return NotImplemented
    with torch._C.DisableTorchFunctionSubclass():
        out = torch.Tensor.to(*args, **kwargs)
    return x if out is x else _tag(out, _NormPart, x._ff_scope, x._ff_owner)


_HANDLERS = {
    torch.linalg.vector_norm: _vector_norm,
    torch.norm: _torch_norm,
    torch.functional.norm: _torch_norm,
    torch.Tensor.norm: _tensor_norm,
    torch.linalg.norm: _linalg_norm,
    torch._foreach_norm: _foreach_norm,
    torch.stack: _stack,
    torch.Tensor.to: _to,
}
