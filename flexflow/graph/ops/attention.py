"""Scaled dot-product attention, (B, H, Lq, D) x (B, H, Lk, D) -> (B, H, Lq, Dv).

Splits: the batch n (sample), the heads h (attribute: q, k, v and the mask
are sliced alike; with grouped-query attention k and v keep their fewer
heads, so h splits only when every block of query heads maps onto whole key
heads) and the query rows l (attribute: every block reads all of k and v
and its rows of the mask).  Under ``is_causal`` (queries and keys of one
length) a block of query rows [a, b) reads the keys and values [0, b) only
-- context parallelism: the sequence split, each block gathering the keys and
values before it -- and runs with the causal mask anchored at its last row
(``causal_lower_right``); its FLOPs are its share of the causal triangle, so
a contiguous split loads the last block most.

The balanced split (dim ``z``, causal self-attention only): the sequence is laid out
head-tail -- of 2c chunks, block i of c holds chunks i and 2c - 1 - i (Llama 3's
context parallelism) -- and the whole graph runs in that token order
(:mod:`flexflow.strategy.layout`: the executor reorders the inputs and position tables and
restores the outputs); every block reads all the keys and values (an all-gather in the
group) and computes the same share of the triangle.  Runs
``F.scaled_dot_product_attention`` on the blocks."""
from __future__ import annotations

import functools
import math

from ..ir import Dim, InputRef, Op
from .base import Block, Rule, batch_dim, call_template, out_region, register
from .pointwise import broadcast_region

__all__ = ["Attention", "attention_attrs", "head_tail_order", "sequence_order", "balanced"]


def head_tail_order(length: int, c: int) -> list[int]:
    """The original position of each position of the head-tail layout of ``c`` blocks:
    the sequence cut into 2c chunks, block i holding chunks i and 2c - 1 - i."""
    if c < 2 or length % (2 * c):
        raise ValueError(f"a head-tail layout of {c} blocks needs a length divisible by {2 * c}, got {length}")
    chunk = length // (2 * c)
    order = []
    for i in range(c):
        for k in (i, 2 * c - 1 - i):
            order.extend(range(k * chunk, (k + 1) * chunk))
    return order


def balanced(op: Op) -> bool:
    """Whether ``op`` is a causal self-attention whose rows may split head-tail (dim z)."""
    a = op.attrs
    return op.rule == "attention" and a.get("is_causal", False) and a["mask"] is None \
        and a["lk"] == op.output_shape[2] and op.output_shape[2] > 1


def attention_attrs(args, kwargs, shapes) -> dict | None:
    """attrs of an sdpa call (its template), or None when it is not plain."""
    names = ["query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa"]
    bound = dict(zip(names, args))
    bound.update(kwargs)
    if not all(isinstance(bound.get(k), InputRef) for k in names[:3]):
        return None
    mask = bound.get("attn_mask")
    if mask is not None and not isinstance(mask, InputRef):
        return None
    q, k = shapes[bound["query"].index], shapes[bound["key"].index]
    if len(q) != 4 or len(k) != 4:
        return None
    return {"query": bound["query"].index, "mask": mask.index if mask is not None else None, "is_causal": bool(bound.get("is_causal", False)),
            "dropout_p": float(bound.get("dropout_p", 0.0) or 0.0), "q_heads": q[1], "kv_heads": k[1],
            "lk": k[2], "head_dim": q[3]}


@register("attention")
class Attention(Rule):
    separable = True  # see Rule.separable

    def dims(self, op: Op, batch):
        B, H, Lq, _ = op.output_shape
        a = op.attrs
        dims = []
        if B > 1:
            dims.append(batch_dim(0, B, batch))
        if H > 1 and a["kv_heads"] == H:
            dims.append(Dim("h", "attribute", 1, H))
        if Lq > 1 and (not a["is_causal"] or (a["lk"] == Lq and a["mask"] is None)):
            dims.append(Dim("l", "attribute", 2, Lq))
        if balanced(op) and Lq % 4 == 0:  # (blocks of whole chunk pairs)
            dims.append(Dim("z", "attribute", 2, Lq, unit=2))
        return dims

    def regions(self, op: Op, block: Block):
        out = out_region(op, block)
        B, H, Lq, _ = op.output_shape
        ins = []
        for i, shp in enumerate(op.input_shapes):
            if i == op.attrs["mask"]:
                scores = out[:3] + (slice(0, op.attrs["lk"]),)
                ins.append(broadcast_region(scores, (B, H, Lq, op.attrs["lk"]), shp))
            elif i == op.attrs["query"]:
                ins.append(out[:3] + (slice(0, shp[3]),))
            else:  # key / value: all their rows (causal: those up to the block's last query)
                b = out[0] if shp[0] == B else slice(0, shp[0])
                h = out[1] if shp[1] == H else slice(0, shp[1])
                keys = out[2].stop if op.attrs["is_causal"] and "z" not in block else shp[2]
                ins.append((b, h, slice(0, keys), slice(0, shp[3])))
        return ins, {}

    def compute(self, op, block, inputs, params):
        rows = out_region(op, block)[2]
        if not op.attrs["is_causal"] or (rows.start == 0 and "z" not in block):
            return call_template(op, inputs, params)
        # a later block of a causal attention: its queries see the keys before them
        import torch
        import torch.nn.functional as F
        from torch.nn.attention.bias import causal_lower_right
        names = ["query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa"]
        bound = dict(zip(names, op.args))
        bound.update(op.kwargs)
        q, k, v = (inputs[bound[n].index] for n in names[:3])
        extra = {n: bound[n] for n in ("scale", "enable_gqa") if n in bound}
        drop = op.attrs["dropout_p"]
        if "z" not in block:
            mask = causal_lower_right(q.shape[-2], k.shape[-2])
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=drop, **extra)
        # a head-tail block: its two chunks, each against the keys up to its end (the keys
        # come in the head-tail order: put back in sequence order first)
        L, c, chunk = op.output_shape[2], *_head_tail(op, block)
        inverse = sequence_order(L, c).to(k.device)
        k, v = k.index_select(2, inverse), v.index_select(2, inverse)
        i = rows.start // (2 * chunk)
        outs = []
        for half, j in enumerate((i, 2 * c - 1 - i)):
            qh = q[:, :, half * chunk:(half + 1) * chunk]
            end = (j + 1) * chunk
            mask = causal_lower_right(chunk, end)
            outs.append(F.scaled_dot_product_attention(qh, k[:, :, :end], v[:, :, :end], attn_mask=mask,
                                                       dropout_p=drop, **extra))
        return torch.cat(outs, dim=2)

    def flops(self, op, block):
        out = out_region(op, block)
        rows = math.prod(s.stop - s.start for s in out[:3])
        full = 4.0 * rows * op.attrs["lk"] * op.attrs["head_dim"]
        Lq = op.output_shape[2]
        if not op.attrs["is_causal"] or (out[2].start, out[2].stop) == (0, Lq) or "z" in block:
            return full  # (a head-tail block: the same share of the triangle as its share of rows)
        # the block's share of the causal triangle (the whole op's count unchanged)
        a, b = out[2].start, out[2].stop
        return full * (b * b - a * a) / (Lq * (b - a))

    def backward_factor(self, op):
        return 2.5


@functools.lru_cache(maxsize=64)
def sequence_order(length: int, c: int):
    """The head-tail layout position of each sequence position (a LongTensor, made once)."""
    import torch
    order = torch.tensor(head_tail_order(length, c))
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(length)
    return inverse


def _head_tail(op: Op, block: Block) -> tuple[int, int]:
    """(blocks c, chunk length) of a head-tail block."""
    a, b = block["z"]
    L = op.output_shape[2]
    if (b - a) % 2 or L % (b - a) or a % (b - a):
        raise ValueError(f"{op.describe()}: a head-tail split needs equal blocks of two chunks; "
                         f"rows [{a}, {b}) of {L}")
    return L // (b - a), (b - a) // 2
