"""State dicts of a runtime's shards, and their checkpoints with torch.distributed.checkpoint.

What a rank holds
    :func:`local_regions` is the one answer to "which values of which tensor does
    this rank hold": for every parameter and buffer it holds, boxes of the
    original module's tensor (offsets and sizes in the tensor's own shape), the
    rank's values there (views of its shard) and whether it writes them to a
    checkpoint (of the ranks that hold the same values, the first one does).
    Everything else here asks it.

Values of a state dict
    torch 2.13's ``torch.distributed.checkpoint`` (DCP) plans a save or a load from
    the values of a state dict, and offers three kinds of sharded value: DTensor,
    ShardedTensor, and any tensor with the ``_Checkpointable`` hooks
    (``__create_write_items__``, ``__create_chunk_list__``, ``__get_tensor_shard__``:
    ``planner_helpers._create_write_items``, ``_create_chunk_list`` and
    ``utils.find_tensor_shard``).  A DTensor lays a tensor out over a device mesh
    with Shard/Replicate placements (even splits of whole dimensions over mesh
    dimensions); a strategy here places each op on devices of its own (model
    parallelism puts whole layers on different ranks, a random strategy splits
    different parameters over different subsets of ranks, an LSTM's gate blocks are
    not boxes of its weight), which no mesh expresses.  ShardedTensor takes any
    boxes but is deprecated in favour of DTensor, needs a collective per value to
    build, and is no full tensor when read.  So the values implement the hooks
    themselves, with the boxes of :func:`local_regions`:

    - :class:`ShardedState` (``par.state_dict(full=False)``, ``par.optim_state_dict``):
      the full shape, no data of its own, this rank's boxes as views of its shards.
      DCP writes the boxes the rank writes and reads exactly the chunks that cover
      all its boxes, straight into the shards: a save costs the shards plus the one
      tensor being written.  Read as a plain tensor (any op, ``torch.save``) it is
      gathered: a collective, so every rank reads the same values in the same order.
    - :class:`FullState` (``par.state_dict()``): the full tensor, gathered when the
      state dict is made (as before: reading it on one rank is safe).  DCP writes
      the same boxes as above, so the checkpoint is the same, and loads it whole.

    Either loads into another strategy or another number of devices (DCP reads the
    overlap of the saved chunks with the new boxes), into the plain module, and with
    no process group at all.  ``state_dict()`` stays full by default: a lazy value
    read on one rank only (rank 0 saving it with ``torch.save``, then a barrier)
    would wait forever for the others' part of the gather.

The optimizer
    :func:`optim_state_dict` keys a torch optimizer's state (over the rank's shards)
    by parameter name, its shard-shaped tensors as ShardedState values, so that DCP
    reshards it like the model; scalars (Adam's ``step``) are plain.  State tensors
    of any other shape (factored statistics) are refused.
"""
from __future__ import annotations

import itertools
import math
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.nn.modules.module import _IncompatibleKeys
from torch.utils._pytree import tree_map

from .plan import ExecutorError, _wire_dtype, tensor_of

__all__ = ["FullState", "Region", "ShardedState", "gather", "load_module_state_dict", "load_optim_state_dict",
           "local_regions", "module_state_dict", "optim_state_dict"]


# --------------------------------------------------------------------------- what a rank holds
@dataclass(frozen=True)
class Region:
    """A box of a parameter or buffer that this rank holds."""

    qual: str  # the parameter or buffer (qualified name in the original module)
    offsets: tuple  # where the box starts, in the tensor's own shape
    sizes: tuple
    tensor: torch.Tensor  # this rank's values of the box (a view of its shard)
    writes: bool  # this rank writes the box to a checkpoint (one of the ranks holding it does)
    take: Callable  # a tensor shaped like the shard (an optimizer state) -> its view of the box


def local_regions(rt) -> list[Region]:
    """Every box this rank of runtime ``rt`` holds, qualified name by name.

    A block held whole is one box, written by the first rank holding it; a block
    read in another shape than the tensor's own (an LSTM weight's (4, H, .) gate
    view) is cut into the boxes of the tensor it covers; a rank keeping a flat
    slice of a block (``rt.slices``: shard levels) holds the boxes of the slice and
    writes them (each slice has one holder)."""
    out = []
    slices = getattr(rt, "slices", None) or {}
    for qual, (view, region, ranks) in rt.shards.items():
        held = (rt.params[qual] if qual in rt.params else rt.buffers[qual]).detach()
        native = tuple(tensor_of(rt.module, qual).shape)
        start, shape = tuple(s.start for s in region), tuple(s.stop - s.start for s in region)
        sl = slices.get(qual)
        if sl is None:  # (view offsets, sizes, elements of the flat slice or None: the block whole)
            boxes, writes = [(start, shape, None)], ranks[0] == rt.rank
        else:
            boxes, writes = [(tuple(a + o for a, o in zip(start, off)), sz, (a - sl.lo, b - sl.lo))
                             for off, sz, a, b in _flat_boxes(shape, sl.lo, sl.hi)], True
        for vstart, vsizes, flat in boxes:
            for off, sizes, take in _native_boxes(qual, native, tuple(view), vstart, vsizes):
                if flat is not None:
                    take = (lambda x, a=flat[0], b=flat[1], s=vsizes, f=take: f(x[a:b].view(s)))
                out.append(Region(qual, off, sizes, take(held), writes, take))
    return out


def _flat_boxes(shape: tuple, lo: int, hi: int, flat0: int = 0) -> list:
    """The elements ``lo:hi`` of a row-major box of ``shape`` as boxes, each
    contiguous: (offsets, sizes, first flat index, end flat index)."""
    if lo >= hi:
        return []
    if not shape:
        return [((), (), flat0, flat0 + 1)]
    inner = math.prod(shape[1:])
    if lo % inner == 0 and hi % inner == 0:
        return [((lo // inner,) + (0,) * (len(shape) - 1), (hi // inner - lo // inner,) + tuple(shape[1:]),
                 flat0 + lo, flat0 + hi)]
    out = []
    row = lo // inner
    if lo % inner or hi < (row + 1) * inner:  # a partial first row
        end = min(hi, (row + 1) * inner)
        out += [((row,) + o, (1,) + s, a, b) for o, s, a, b in
                _flat_boxes(tuple(shape[1:]), lo - row * inner, end - row * inner, flat0 + row * inner)]
        lo = end
    mid = hi // inner * inner
    if lo < mid:
        out += _flat_boxes(shape, lo, mid, flat0)
        lo = mid
    if lo < hi:
        row = lo // inner
        out += [((row,) + o, (1,) + s, a, b) for o, s, a, b in
                _flat_boxes(tuple(shape[1:]), 0, hi - row * inner, flat0 + row * inner)]
    return out


def _native_boxes(qual: str, native: tuple, view: tuple, start: tuple, sizes: tuple) -> list:
    """A box of the view (start, sizes) as boxes of the tensor's own shape:
    (offsets, sizes, view-box tensor -> that box's view)."""
    if view == native:
        return [(start, sizes, lambda x: x)]
    # the view splits the tensor's first dimension in several (an LSTM's 4H rows as (4, H))
    i = next((i for i in range(2, len(view) + 1)
              if math.prod(view[:i]) == native[0] and view[i:] == native[1:]), None)
    if i is None or not native:
        raise ExecutorError(f"{qual}: its block at {start} of size {sizes} in the view {view} is not a box of "
                            f"its shape {native}, so it cannot be checkpointed")
    rest_off, rest = start[i:], sizes[i:]
    inner = math.prod(view[1:i])
    if all(start[d] == 0 and sizes[d] == view[d] for d in range(1, i)):  # whole rows of the first dim
        return [((start[0] * inner,) + rest_off, (sizes[0] * inner,) + rest,
                 lambda x: x.view((sizes[0] * inner,) + rest))]
    out = []
    last = view[i - 1]
    for combo in itertools.product(*[range(sizes[d]) for d in range(i - 1)]):
        at = [start[d] + c for d, c in enumerate(combo)]
        row = 0
        for d in range(i - 1):
            row = row * view[d] + at[d]
        out.append(((row * last + start[i - 1],) + rest_off, (sizes[i - 1],) + rest,
                    lambda x, c=combo: x[c]))
    return out


def _index(offsets, sizes) -> tuple:
    return tuple(slice(o, o + s) for o, s in zip(offsets, sizes))


def _by_qual(regions) -> dict:
    out: dict = {}
    for r in regions:
        out.setdefault(r.qual, []).append(r)
    return out


# --------------------------------------------------------------------------- DCP's hooks
def _write_items(fqn: str, size, boxes) -> list:
    """DCP write items of (offsets, sizes, tensor) boxes of a value of ``size``."""
    return [WriteItem(MetadataIndex(fqn, torch.Size(off)), WriteItemType.SHARD, tensor_data=TensorWriteData(
        ChunkStorageMetadata(torch.Size(off), torch.Size(sz)), TensorProperties.create_from_tensor(t), size))
        for off, sz, t in boxes]


def _chunks(boxes) -> list:
    return [ChunkStorageMetadata(offsets=torch.Size(off), sizes=torch.Size(sz)) for off, sz in boxes]


class ShardedState(torch.Tensor):
    """A tensor of the full shape holding only this rank's boxes of it (views of the
    shards of runtime ``rt``: ``pieces``, (offsets, sizes, tensor, writes) each).

    torch.distributed.checkpoint writes the boxes this rank writes and loads into
    all of them; :meth:`full_tensor` gathers the whole tensor, as does any other use
    (an op, ``torch.save``, ``copy.deepcopy``) -- collective: every rank reads the
    same values in the same order.  ``copy_`` into it writes the boxes; other
    in-place ops raise.  ``repr`` shows the boxes, and gathers nothing."""

    @staticmethod
    def __new__(cls, shape, dtype, device, pieces, rt, name: str):
        self = torch.Tensor._make_wrapper_subclass(cls, tuple(shape), dtype=dtype, device=device)
        self._ff_pieces = tuple(pieces)
        self._ff_rt, self._ff_name = rt, name
        return self

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.ops.aten.detach.default, torch.ops.aten.alias.default):
            x = args[0]
            return ShardedState(x.shape, x.dtype, x.device, x._ff_pieces, x._ff_rt, x._ff_name)
        if func is torch.ops.aten.copy_.default and isinstance(args[0], ShardedState):
            dst, src = args[0], args[1]
            src = (src.full_tensor() if isinstance(src, ShardedState) else src).expand(dst.shape)
            for off, sz, t, _ in dst._ff_pieces:
                t.copy_(src[_index(off, sz)])
            return dst
        for i, a in enumerate(func._schema.arguments):
            x = args[i] if i < len(args) else kwargs.get(a.name)
            if a.alias_info is not None and a.alias_info.is_write and isinstance(x, ShardedState):
                raise RuntimeError(f"{func} on {x._ff_name!r} of a sharded state dict would change a gathered "
                                   "copy, not the shards; copy_ into it writes them")
        return func(*tree_map(_full, args), **tree_map(_full, kwargs))

    def full_tensor(self) -> torch.Tensor:
        """The whole tensor, gathered from the ranks' boxes (collective)."""
        return gather([self])[0]

    def __repr__(self, *, tensor_contents=None):
        boxes = ", ".join(f"{list(off)}+{list(sz)}{'' if w else ' (read)'}" for off, sz, _, w in self._ff_pieces)
        return f"ShardedState({self._ff_name!r}, shape={list(self.shape)}, dtype={self.dtype}, here: {boxes or '-'})"

    def __reduce_ex__(self, protocol):
        return self.full_tensor().__reduce_ex__(protocol)

    def __deepcopy__(self, memo):
        if id(self) not in memo:
            memo[id(self)] = self.full_tensor()
        return memo[id(self)]

    def __create_write_items__(self, fqn: str, obj) -> list:
        return _write_items(fqn, self.size(), [(o, s, t) for o, s, t, w in self._ff_pieces if w])

    def __create_chunk_list__(self) -> list:
        return _chunks([(o, s) for o, s, _, _ in self._ff_pieces])

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        for off, _, t, _ in self._ff_pieces:
            if tuple(off) == tuple(index.offset):
                return t
        raise ValueError(f"{self._ff_name!r}: this rank holds no box at {list(index.offset)}")


def _full(x):
    return x.full_tensor() if isinstance(x, ShardedState) else x


class FullState(torch.Tensor):
    """The full tensor (a plain one in every use: results are plain tensors, and
    ``torch.save``/``copy.deepcopy`` give plain copies) that torch.distributed.checkpoint
    saves as the boxes this rank writes (``boxes``: (offsets, sizes, writes) each),
    and loads whole."""

    _ff_boxes: tuple = ()
    _ff_loading: bool = False

    @staticmethod
    def of(full: torch.Tensor, boxes) -> FullState:
        out = full.as_subclass(FullState)
        out._ff_boxes = tuple(boxes)
        return out

    __torch_function__ = torch._C._disabled_torch_function_impl

    def _plain(self) -> torch.Tensor:
        return self.as_subclass(torch.Tensor)

    def __reduce_ex__(self, protocol):
        return self._plain().__reduce_ex__(protocol)

    def __deepcopy__(self, memo):
        if id(self) not in memo:
            memo[id(self)] = self._plain().clone()
        return memo[id(self)]

    # a value is either saved or loaded at a time: the hook DCP calls first tells which
    def __create_write_items__(self, fqn: str, obj) -> list:
        self._ff_loading = False
        plain = self._plain()
        return _write_items(fqn, self.size(), [(o, s, plain[_index(o, s)]) for o, s, w in self._ff_boxes if w])

    def __create_chunk_list__(self) -> list:
        self._ff_loading = True
        return _chunks([((0,) * self.dim(), tuple(self.shape))])

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        plain = self._plain()
        if self._ff_loading:
            return plain
        for off, sz, _ in self._ff_boxes:
            if tuple(off) == tuple(index.offset):
                return plain[_index(off, sz)]
        raise ValueError(f"this rank writes no box at {list(index.offset)} of this tensor")


# --------------------------------------------------------------------------- gathering
def gather(values) -> list[torch.Tensor]:
    """The full tensors of :class:`ShardedState` ``values``: each box written by its
    writer, summed over the ranks, one all-reduce per runtime and dtype (collective:
    every rank passes the same values in the same order)."""
    fulls = [torch.zeros(v.shape, dtype=_wire_dtype(v.dtype), device=v.device) for v in values]
    with torch.no_grad():
        for v, full in zip(values, fulls):
            for off, sz, t, writes in v._ff_pieces:
                if writes:
                    full[_index(off, sz)] = t.to(full.dtype)
    groups: dict = {}
    for i, v in enumerate(values):
        groups.setdefault((id(v._ff_rt), fulls[i].dtype), []).append(i)
    for idx in groups.values():
        rt = values[idx[0]]._ff_rt
        if rt.closed:
            raise ExecutorError(f"gathering {values[idx[0]]._ff_name!r}: its parallel module's runtime was shut down")
        if not (rt.distributed and rt.world > 1):
            continue
        flat = torch.cat([fulls[i].reshape(-1) for i in idx])
        work = dist.all_reduce(flat, group=rt.coll_group, async_op=True)
        what = (f"gathering {values[idx[0]]._ff_name!r} of a sharded state dict among all {rt.world} ranks "
                "(collective: every rank reads the same values in the same order)")
        rt.wait([work], lambda: what)  # noqa: B023 - called at once
        off = 0
        for i in idx:  # each value its own storage (a torch.save of one saves just it)
            n = fulls[i].numel()
            fulls[i] = flat[off:off + n].view(fulls[i].shape)
            fulls[i] = fulls[i].clone() if len(idx) > 1 else fulls[i]
            off += n
    return [f.to(v.dtype) for f, v in zip(fulls, values)]


# --------------------------------------------------------------------------- the module's state
def _sharded_values(rt) -> dict:
    """qual -> :class:`ShardedState` of every parameter and buffer the strategy places."""
    regions = _by_qual(local_regions(rt))
    out = OrderedDict()
    for qual in rt.placement:
        t = tensor_of(rt.module, qual)
        out[qual] = ShardedState(t.shape, t.dtype, rt.device,
                                 [(r.offsets, r.sizes, r.tensor, r.writes) for r in regions.get(qual, ())], rt, qual)
    return out


def _quals_by_key(rt, module) -> dict:
    by_id = {id(tensor_of(module, q)): q for q in rt.placement}
    return {k: by_id.get(id(t)) for k, t in module.state_dict(keep_vars=True).items()}


def module_state_dict(rt, module, destination=None, prefix: str = "", full: bool = True):
    """The original module's state dict from runtime ``rt``: :class:`FullState` values
    (``full``: gathered now, collective) or :class:`ShardedState` ones; the tensors
    the strategy does not place (read by no op) are the module's own."""
    values = _sharded_values(rt)
    if full:
        fulls = gather(list(values.values()))
        values = {q: FullState.of(f, [(o, s, w) for o, s, _, w in v._ff_pieces])
                  for (q, v), f in zip(values.items(), fulls)}
    out = OrderedDict() if destination is None else destination
    tensors = module.state_dict(keep_vars=True)
    for key, qual in _quals_by_key(rt, module).items():
        t = tensors[key].detach()
        out[prefix + key] = values[qual] if qual is not None else (t.clone() if full else t)
    return out


def load_module_state_dict(rt, module, state_dict, strict: bool = True):
    """Load the original module's keys into runtime ``rt``: each rank keeps its boxes.
    A :class:`ShardedState` of ``rt`` itself is copied box by box (after a DCP load
    into it, there is nothing left to copy); any other value goes through the
    module (a ShardedState of another runtime is gathered first: collective)."""
    quals = _quals_by_key(rt, module)
    missing = [k for k in quals if k not in state_dict]
    unexpected = [k for k in state_dict if k not in quals]
    if strict and (missing or unexpected):
        raise RuntimeError(f"Error(s) in loading state_dict for {type(module).__name__}:" + "".join(
            f"\n\t{what} key(s) in state_dict: " + ", ".join(f'"{k}"' for k in keys) + "."
            for what, keys in (("Unexpected", unexpected), ("Missing", missing)) if keys))
    own, plain = {}, OrderedDict()
    for key, v in state_dict.items():
        qual = quals.get(key)
        if isinstance(v, ShardedState):
            if qual is not None and v._ff_rt is rt and v._ff_name == qual:
                own[qual] = v
                continue
            v = v.full_tensor()
        plain[key] = v
    module.load_state_dict(plain, strict=False)
    fed = {quals[k] for k in plain if quals.get(k) is not None}
    with torch.no_grad():
        for r in local_regions(rt):
            if r.qual in own:
                src = own[r.qual].__get_tensor_shard__(MetadataIndex(r.qual, torch.Size(r.offsets)))
                if src.data_ptr() != r.tensor.data_ptr():
                    r.tensor.copy_(src)
            elif r.qual in fed:
                r.tensor.copy_(tensor_of(module, r.qual).detach()[_index(r.offsets, r.sizes)])
    return _IncompatibleKeys(missing, unexpected)


# --------------------------------------------------------------------------- the optimizer's state
def _param_names(rt, module) -> dict:
    """qual -> the name of the parameter in the original module's state dict."""
    names: dict = {}
    for key, qual in _quals_by_key(rt, module).items():
        if qual is not None:
            names.setdefault(qual, key)
    return names


def _opt_params(optimizer):
    return [p for g in optimizer.param_groups for p in g["params"]]


def _init_state(optimizer) -> None:
    """An optimizer without state gets it from one step with zero gradients and a
    zero learning rate (the parameters do not change), so that DCP has tensors to
    load into (as ``torch.distributed.checkpoint.state_dict`` does)."""
    if optimizer.state:
        return
    params = [p for p in _opt_params(optimizer) if p.requires_grad]
    grads = [p.grad for p in params]
    lrs = [g.get("lr") for g in optimizer.param_groups]
    try:
        for p in params:
            p.grad = torch.zeros_like(p)
        for g in optimizer.param_groups:
            if "lr" in g:
                g["lr"] = torch.tensor(0.0) if isinstance(g["lr"], torch.Tensor) else 0.0
        optimizer.step()
    finally:
        for g, lr in zip(optimizer.param_groups, lrs):
            if lr is not None:
                g["lr"] = lr
        for p, grad in zip(params, grads):
            p.grad = grad


def _holders(rt, optimizer):
    """(parameter, qual or None) of every tensor the optimizer updates."""
    quals = {id(p): q for q, p in rt.params.items()}
    out = []
    for p in _opt_params(optimizer):
        q = quals.get(id(p))
        if q is None and p.numel():
            raise ValueError(f"the optimizer updates a tensor of shape {tuple(p.shape)} that is not a parameter "
                             "of this parallel module: build it over par.parameters()")
        out.append((p, q))
    return out


def optim_state_dict(rt, module, optimizer) -> dict:
    """The state of ``optimizer`` (over ``par.parameters()``) keyed by the original
    module's parameter names: ``{"state": {name: {key: value}}, "param_groups":
    [hyperparameters]}``.  A state tensor shaped like the rank's shard is a
    :class:`ShardedState` of the parameter's full shape (views of the optimizer's own
    tensors), a scalar stays as it is; a rank lists the parameters it holds."""
    _init_state(optimizer)
    names, regions = _param_names(rt, module), _by_qual(local_regions(rt))
    state = {}
    for p, q in _holders(rt, optimizer):
        st = optimizer.state.get(p)
        if q is None or not st:
            continue
        native = tuple(tensor_of(rt.module, q).shape)
        entry = {}
        for k, v in st.items():
            if isinstance(v, torch.Tensor) and v.dim() and v.shape == p.shape:
                v = v.detach()
                entry[k] = ShardedState(native, v.dtype, v.device,
                                        [(r.offsets, r.sizes, r.take(v), r.writes) for r in regions[q]],
                                        rt, f"{names[q]}/{k}")
            elif isinstance(v, torch.Tensor) and v.dim():
                raise ValueError(f"optimizer state {k!r} of {names[q]!r} has shape {tuple(v.shape)}, neither the "
                                 f"shard's {tuple(p.shape)} nor a scalar: it cannot be checkpointed by boxes")
            else:
                entry[k] = v
        state[names[q]] = entry
    groups = [{k: v for k, v in g.items() if k not in ("params", "param_names")} for g in optimizer.param_groups]
    return {"state": state, "param_groups": groups}


def load_optim_state_dict(rt, module, optimizer, state_dict) -> None:
    """Load a state from :func:`optim_state_dict` (of any strategy, filled by DCP)
    or one with full tensors keyed by parameter name; each rank keeps its boxes."""
    if not isinstance(state_dict, dict) or not {"state", "param_groups"} <= set(state_dict):
        raise ValueError("an optimizer state dict needs 'state' and 'param_groups' "
                         "(as par.optim_state_dict(optimizer) makes)")
    groups = state_dict["param_groups"]
    if len(groups) != len(optimizer.param_groups):
        raise ValueError(f"the state has {len(groups)} parameter groups, the optimizer {len(optimizer.param_groups)}")
    _init_state(optimizer)
    names, regions = _param_names(rt, module), _by_qual(local_regions(rt))
    holders = {id(p): q for p, q in _holders(rt, optimizer)}
    tstate, out_groups, index = {}, [], 0
    for saved, g in zip(groups, optimizer.param_groups):
        ids = []
        for p in g["params"]:
            q = holders[id(p)]
            if q is None:
                if optimizer.state.get(p):
                    tstate[index] = optimizer.state[p]  # the placeholder of a rank without blocks
            elif names[q] in state_dict["state"]:
                cur = optimizer.state.get(p) or {}
                tstate[index] = {k: _local(v, p, q, cur.get(k), regions[q], rt, names[q])
                                 for k, v in state_dict["state"][names[q]].items()}
            ids.append(index)
            index += 1
        out_groups.append({**saved, "params": ids, **({"param_names": g["param_names"]} if "param_names" in g else {})})
    optimizer.load_state_dict({"state": tstate, "param_groups": out_groups})


def _local(v, p, qual, dst, regions, rt, name):
    """This rank's part of one state value, as a tensor shaped like its shard."""
    if not isinstance(v, torch.Tensor):
        return v
    if not v.dim():  # a scalar (Adam's step): the optimizer's own after a DCP load, else a copy
        return v if v is dst else v.detach().clone()
    if dst is None or dst.shape != p.shape:
        dst = torch.empty(p.shape, dtype=v.dtype, device=p.device)
    with torch.no_grad():
        if isinstance(v, ShardedState):
            if v._ff_rt is not rt:
                raise ValueError(f"optimizer state of {name!r} is sharded for another parallel module: load it "
                                 "with torch.distributed.checkpoint into par.optim_state_dict(optimizer), or pass "
                                 "full tensors")
            pieces = {tuple(off): t for off, _, t, _ in v._ff_pieces}
            for r in regions:
                d = r.take(dst)
                src = pieces[tuple(r.offsets)]
                if d.data_ptr() != src.data_ptr():
                    d.copy_(src)
            return dst
        native = tuple(tensor_of(rt.module, qual).shape)
        if tuple(v.shape) != native:
            raise ValueError(f"optimizer state of {name!r} has shape {tuple(v.shape)}, the parameter {native}")
        for r in regions:
            r.take(dst).copy_(v[_index(r.offsets, r.sizes)])
    return dst
