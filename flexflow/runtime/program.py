"""A rank's program in words, and the setup check that all ranks' programs match.

Every rank plans its program on its own from the same graph and strategy
(:class:`flexflow.runtime.plan.Plan`, which the runtime is).  If two ranks
ever disagreed (a send without its receive, another shape, another order of
collectives on a group), the first step would hang until the timeout.
:func:`check_programs` makes that an error at setup instead: each rank lists
the messages it will send and receive and the collectives it will launch per
process group (:func:`messages`), the lists are exchanged once, and every
rank verifies every pair (:func:`check`).  The functions take a plan as well
as a runtime: the plans of every rank, built in one process, are checked the
same way.
"""
from __future__ import annotations

import math

__all__ = ["describe", "messages", "mismatches", "check", "check_programs", "ProgramMismatch"]


class ProgramMismatch(RuntimeError):
    """The programs of two ranks do not match (raised on every rank, at setup)."""


def _dtype(d) -> str:
    return str(d).replace("torch.", "")


def messages(rt) -> dict:
    """This rank's communication, as plain data:
    ``p2p``: (direction, peer, tag, shape, dtype, what) per message, forward and backward;
    ``collectives``: group ranks -> [(numel, dtype, what)] in launch order."""
    p2p = []
    colls: dict = {}
    for ex in rt.exchanges:
        what = f"{ex.producer} -> {ex.consumer} (exchange {ex.index})"
        wire = "uint8" if _dtype(ex.dtype) == "bool" else _dtype(ex.dtype)
        if ex.coll is not None:  # forward and backward, on the exchange's own group
            c = ex.coll
            kinds = {"gather": ("all-gather", "reduce-scatter"), "scatter": ("reduce-scatter", "all-gather"),
                     "reduce": ("all-reduce", "all-reduce")}[c.kind]
            seq = colls.setdefault(tuple(c.group), [])
            numel = math.prod(c.shape) * (1 if c.kind == "reduce" else len(c.group))
            seq.append((numel, wire, f"{kinds[0]} {what}"))
            if ex.grad:
                seq.append((numel, _dtype(ex.dtype), f"{kinds[1]} {what} grad"))
            continue
        for p in ex.sends:
            p2p.append(("send", p.dst, 2 * ex.index, tuple(p.shape), wire, what))
            if ex.grad:
                p2p.append(("recv", p.dst, 2 * ex.index + 1, tuple(p.shape), _dtype(ex.dtype), what + " grad"))
        for p in ex.recvs:
            p2p.append(("recv", p.src, 2 * ex.index, tuple(p.shape), wire, what))
            if ex.grad:
                p2p.append(("send", p.src, 2 * ex.index + 1, tuple(p.shape), _dtype(ex.dtype), what + " grad"))
    if rt.world > 1:
        every = tuple(range(rt.world))
        for out in rt.outputs.values():
            if rt.ride is None:
                colls.setdefault(every, []).append((math.prod(out.shape), _dtype(out.dtype), f"output {out.name}"))
    riders = sum(math.prod(out.shape) for out in rt.outputs.values()) if rt.ride is not None else 0
    for step in reversed(rt.program):  # gradient buckets launch in backward order
        if step.gate is None:
            continue
        for pos, (key, quals) in enumerate(step.gate.buckets):
            numel = sum(rt.compute_tensor(q).numel() for q in quals)
            dtype = _dtype(rt.compute_tensor(quals[0]).dtype)
            what = f"gradients of {', '.join(quals[:3])}" + (" ..." if len(quals) > 3 else "")
            if rt.ride == (step.op.name, pos):
                numel += riders
                what += " and the outputs"
            colls.setdefault(tuple(key), []).append((numel, dtype, what))
    return {"p2p": p2p, "collectives": colls}


def describe(rt) -> str:
    """This rank's program, one line per action, in the order it runs them."""
    lines = [f"rank {rt.rank} of {rt.world}: strategy {rt.strategy.name!r}, devices {rt.ranks}"]
    by_producer = rt.sends_after
    for step in rt.program:
        op = step.op
        if step.everywhere:
            continue
        for entry in step.inputs:
            if entry is not None and entry[0] == "xchg" and entry[2].coll is not None:
                ex = entry[2]
                kind = {"gather": "all-gather", "scatter": "reduce-scatter", "reduce": "all-reduce"}[ex.coll.kind]
                lines.append(f"  {kind} {ex.producer} -> {op.name} among ranks {list(ex.coll.group)} "
                             f"(exchange {ex.index})")
            elif entry is not None and entry[0] == "xchg" and entry[2].recvs:
                ex = entry[2]
                srcs = sorted({p.src for p in ex.recvs})
                lines.append(f"  wait   {ex.producer} -> {op.name} from rank(s) {srcs} (exchange {ex.index})")
        if step.gate is not None:
            lines.append(f"  gate   {len(step.gate.quals)} gradient shard(s) all-reduced when the backward "
                         f"passes {op.name}")
        if step.part is not None:
            lines.append(f"  run    {op.name} [{op.kind}] {rt.strategy[op.name]} partition {step.part.index}")
        for ex in by_producer.get(op.name, ()):
            dsts = sorted({p.dst for p in ex.sends})
            lines.append(f"  send   {op.name} -> {ex.consumer} to rank(s) {dsts} (exchange {ex.index})")
    for out in rt.outputs.values():
        if rt.ride is not None:
            lines.append(f"  reduce output {out.name} with the gradients passing {rt.ride[0]} "
                         f"(there after backward)")
        else:
            lines.append(f"  reduce output {out.name} over all ranks (waited on at first read)")
    return "\n".join(lines)


def mismatches(programs: list) -> list[str]:
    """The mismatches among the ranks' programs, ``programs[r]`` being rank r's
    :func:`messages`: every send without its receive on the peer (same tag,
    shape and dtype) and the other way round, every group whose members launch
    different collectives; those of the first rank that has any."""
    problems = []
    for r, prog in enumerate(programs):
        for direction, peer, tag, shape, dtype, what in prog["p2p"]:
            want = ("recv" if direction == "send" else "send", r, tag, shape, dtype)
            if not any(m[:5] == want for m in programs[peer]["p2p"]):
                problems.append(f"rank {r} will {direction} {what} (tag {tag}, shape {shape}, {dtype}) "
                                f"{'to' if direction == 'send' else 'from'} rank {peer}, which has no "
                                f"matching {want[0]}")
        for group, seq in prog["collectives"].items():
            for other in group:
                theirs = [c[:2] for c in programs[other]["collectives"].get(group, [])]
                if theirs != [c[:2] for c in seq]:
                    problems.append(f"ranks {r} and {other} launch different collectives on group {list(group)}: "
                                    f"{[c[2] for c in seq][:3]} against "
                                    f"{[c[2] for c in programs[other]['collectives'].get(group, [])][:3]}")
        if problems:
            break
    return problems


def check(programs: list) -> None:
    """Raise :class:`ProgramMismatch` naming the first of :func:`mismatches`, if any."""
    problems = mismatches(programs)
    if problems:
        raise ProgramMismatch("the ranks' programs do not match (this would hang the first step): "
                              + problems[0] + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))


def check_programs(rt) -> None:
    """Collective: every rank's messages and collectives match its peers'.
    Raises :class:`ProgramMismatch` on every rank, naming the first mismatch."""
    import torch.distributed as dist
    if not rt.distributed or rt.world == 1:
        return
    mine = messages(rt)
    everyone = [None] * rt.world
    dist.all_gather_object(everyone, mine)
    check(everyone)
