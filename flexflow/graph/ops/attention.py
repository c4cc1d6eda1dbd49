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
a contiguous split loads the last block most.  Runs
``F.scaled_dot_product_attention`` on the blocks."""
from __future__ import annotations

import math

from ..ir import Dim, InputRef, Op
from .base import Block, Rule, batch_dim, call_template, out_region, register
from .pointwise import broadcast_region

__all__ = ["Attention", "attention_attrs"]


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
                keys = out[2].stop if op.attrs["is_causal"] else shp[2]
                ins.append((b, h, slice(0, keys), slice(0, shp[3])))
        return ins, {}

    def compute(self, op, block, inputs, params):
        rows = out_region(op, block)[2]
        if not op.attrs["is_causal"] or rows.start == 0:
            return call_template(op, inputs, params)
        # a later block of a causal attention: its queries see the keys before them
        import torch.nn.functional as F
        from torch.nn.attention.bias import causal_lower_right
        names = ["query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa"]
        bound = dict(zip(names, op.args))
        bound.update(op.kwargs)
        q, k, v = (inputs[bound[n].index] for n in names[:3])
        extra = {n: bound[n] for n in ("scale", "enable_gqa") if n in bound}
        mask = causal_lower_right(q.shape[-2], k.shape[-2])
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=op.attrs["dropout_p"], **extra)

    def flops(self, op, block):
        out = out_region(op, block)
        rows = math.prod(s.stop - s.start for s in out[:3])
        full = 4.0 * rows * op.attrs["lk"] * op.attrs["head_dim"]
        Lq = op.output_shape[2]
        if not op.attrs["is_causal"] or (out[2].start, out[2].stop) == (0, Lq):
            return full
        # the block's share of the causal triangle (the whole op's count unchanged)
        a, b = out[2].start, out[2].stop
        return full * (b * b - a * a) / (Lq * (b - a))

    def backward_factor(self, op):
        return 2.5
