"""Every rank's program, built in one process with no process group, checked across ranks.

A :class:`~flexflow.runtime.plan.Plan` is what a rank's runtime plans at setup;
here the plans of all ranks of a 2- or 4-device strategy are built side by side
and must match: every send has its receive on the peer (same tag, shape, dtype
and block), and the members of each process group launch the same collectives
in the same order (:func:`flexflow.runtime.program.check`, which the runtime
runs across processes at setup).
"""
from __future__ import annotations

import collections

import pytest
import torch
import torch.distributed as dist

import flexflow as ff
from flexflow.hardware.machine import Machine
from flexflow.runtime.compute import compile_program
from flexflow.runtime.execute import Runtime
from flexflow.runtime.plan import ExecutorError, Plan
from flexflow.runtime.program import ProgramMismatch, check, describe, messages, mismatches

MODELS = ["rnnlm", "transformer", "alexnet"]
STRATEGIES = ["data_parallel", "model_parallel", "expert", "random:0", "random:1", "random:2"]


@pytest.fixture(scope="module")
def zoo():
    """name -> (module, graph), traced once."""
    out = {}
    for name in MODELS:
        module, example = ff.models.get(name, batch_size=8, size="small")
        out[name] = (module, ff.trace(module, example))
    return out


def _strategy(spec: str, graph, devices: int):
    machine = Machine.preset("cpu", devices=devices)
    kind, _, seed = spec.partition(":")
    if kind == "random":
        return ff.Strategy.random(graph, machine, int(seed))
    return getattr(ff.Strategy, kind)(graph, machine)


def _plans(module, graph, strategy, ranks, world, **kw) -> list[Plan]:
    """The plan of every rank of the world, built in this process."""
    return [Plan(graph, strategy, module, ranks, rank=r, world=world, **kw) for r in range(world)]


def _piece(p) -> tuple:
    def box(region):
        return tuple((s.start, s.stop) for s in region)
    return p.src, p.dst, box(p.src_region), box(p.dst_region), tuple(p.shape)


def _assert_pieces_match(plans) -> None:
    """Every cross-rank piece is planned the same by its two ends: a send on its
    source is a receive on its destination, in the same exchange, block for block."""
    sent, received = collections.Counter(), collections.Counter()
    for rank, plan in enumerate(plans):
        for ex in plan.exchanges:
            key = (ex.index, ex.producer, ex.consumer, ex.input, ex.partial, ex.dtype, ex.grad)
            for p in ex.sends:
                assert p.src == rank != p.dst
                sent[key + _piece(p)] += 1
            for p in ex.recvs:
                assert p.dst == rank != p.src
                received[key + _piece(p)] += 1
            for p in ex.local:
                assert p.src == p.dst == rank
    assert sent == received


def _assert_match(plans) -> None:
    programs = [messages(p) for p in plans]
    assert mismatches(programs) == []
    check(programs)
    _assert_pieces_match(plans)
    # the global numbering and the choices every rank makes alike
    assert len({p.num_exchanges for p in plans}) == 1
    assert len({p.comm_bytes for p in plans}) == 1
    assert len({p.ride for p in plans}) == 1
    assert {p.last_exchange_op for p in plans} == {plans[0].last_exchange_op}
    for plan in plans:
        assert describe(plan).splitlines()[0].startswith(f"rank {plan.rank} of {len(plans)}")


@pytest.fixture
def no_process_group(monkeypatch):
    """Any call that needs a process group fails the test."""
    def boom(*a, **k):
        raise AssertionError("a plan must be built without torch.distributed")
    for name in ("new_group", "all_reduce", "all_gather_object", "get_rank", "get_world_size",
                 "get_backend", "isend", "irecv", "batch_isend_irecv", "barrier"):
        monkeypatch.setattr(dist, name, boom)
    assert not dist.is_initialized()


@pytest.mark.parametrize("devices", [2, 4])
@pytest.mark.parametrize("spec", STRATEGIES)
@pytest.mark.parametrize("name", MODELS)
def test_every_rank_matches(zoo, name, spec, devices, no_process_group):
    module, graph = zoo[name]
    strategy = _strategy(spec, graph, devices)
    plans = _plans(module, graph, strategy, list(range(devices)), devices)
    _assert_match(plans)
    if spec.startswith("random"):  # random configurations move activations between ranks
        assert any(messages(p)["p2p"] for p in plans)


@pytest.mark.parametrize("reduce_outputs", ["eager", "with_gradients"])
@pytest.mark.parametrize("name", ["rnnlm", "transformer"])
def test_tiny_buckets_and_eager_outputs(zoo, name, reduce_outputs, no_process_group):
    """Nearly every gradient shard its own bucket; outputs on their own or riding."""
    module, graph = zoo[name]
    for spec in ("data_parallel", "random:1"):
        plans = _plans(module, graph, _strategy(spec, graph, 4), list(range(4)), 4,
                       bucket_cap_mb=1e-4, reduce_outputs=reduce_outputs)
        _assert_match(plans)
        colls = messages(plans[0])["collectives"]
        if spec == "data_parallel":
            assert len(colls[(0, 1, 2, 3)]) > 1  # many buckets
            assert (plans[0].ride is not None) == (reduce_outputs == "with_gradients")


def test_devices_on_other_ranks(zoo, no_process_group):
    """The strategy's devices 0, 1 on ranks 3, 1 of 4: ranks 0 and 2 hold
    nothing but still take part in the outputs' all-reduce."""
    module, graph = zoo["transformer"]
    for spec in ("data_parallel", "model_parallel", "random:0"):
        plans = _plans(module, graph, _strategy(spec, graph, 2), [3, 1], 4)
        _assert_match(plans)
        for idle in (0, 2):
            assert not plans[idle].params and not plans[idle].exchanges
            assert all(step.part is None for step in plans[idle].program if not step.everywhere)


def test_compiled_plan_is_the_runtimes(zoo):
    """A runtime is its rank's plan: in one process (a world of 1) both plan alike."""
    module, graph = zoo["rnnlm"]
    strategy = _strategy("single_device", graph, 1)
    rt = Runtime(graph, strategy, module, [0])
    try:
        plan = Plan(graph, strategy, module, [0])
        compile_program(plan)
        assert isinstance(rt, Plan)
        assert describe(rt) == describe(plan)
        assert messages(rt) == messages(plan)
        assert [(s.op.name, s.run is None, [k for k, _ in s.param_readers]) for s in rt.program] == \
               [(s.op.name, s.run is None, [k for k, _ in s.param_readers]) for s in plan.program]
        assert list(rt.params) == list(plan.params)
        assert all(torch.equal(rt.params[q], plan.params[q]) for q in plan.params)
    finally:
        rt.close()


def test_plan_refuses_bad_ranks(zoo):
    module, graph = zoo["alexnet"]
    strategy = _strategy("data_parallel", graph, 2)
    with pytest.raises(ExecutorError, match="distinct ranks"):
        Plan(graph, strategy, module, [0, 0], rank=0, world=2)
    with pytest.raises(ExecutorError, match="only 1 devices"):
        Plan(graph, strategy, module, [0], rank=0, world=2)
    with pytest.raises(ExecutorError, match="reduce_outputs"):
        Plan(graph, strategy, module, [0, 1], rank=0, world=2, reduce_outputs="never")


# --------------------------------------------------------------------------- the checker catches
def test_a_dropped_send_is_caught(zoo, no_process_group):
    module, graph = zoo["rnnlm"]
    plans = _plans(module, graph, _strategy("model_parallel", graph, 2), [0, 1], 2)
    check([messages(p) for p in plans])
    ex = next(e for e in plans[0].exchanges if e.sends)
    ex.sends = []  # rank 0 forgets to send; rank 1 still waits for it
    with pytest.raises(ProgramMismatch, match=r"rank 1 will recv .* from rank 0, which has no matching send"):
        check([messages(p) for p in plans])


def test_a_changed_shape_is_caught(zoo, no_process_group):
    module, graph = zoo["alexnet"]
    plans = _plans(module, graph, _strategy("random:0", graph, 2), [0, 1], 2)
    ex = next(e for e in plans[1].exchanges if e.recvs)
    p = ex.recvs[0]
    ex.recvs[0] = type(p)(p.src, p.dst, p.src_region, p.dst_region, (p.shape[0] + 1,) + tuple(p.shape[1:]))
    problems = mismatches([messages(p) for p in plans])
    assert problems and any("rank 1 will recv" in x or "rank 0 will send" in x for x in problems)


def test_different_buckets_are_caught(zoo, no_process_group):
    """Rank 0 packs its gradients in other buckets than rank 1: the collectives differ."""
    module, graph = zoo["transformer"]
    strategy = _strategy("data_parallel", graph, 2)
    plans = [Plan(graph, strategy, module, [0, 1], rank=0, world=2, bucket_cap_mb=1e-4),
             Plan(graph, strategy, module, [0, 1], rank=1, world=2)]
    with pytest.raises(ProgramMismatch, match=r"launch different collectives on group \[0, 1\]"):
        check([messages(p) for p in plans])


def test_ranks_of_different_strategies_are_caught(zoo, no_process_group):
    module, graph = zoo["rnnlm"]
    a, b = _strategy("random:0", graph, 2), _strategy("random:1", graph, 2)
    plans = [Plan(graph, a, module, [0, 1], rank=0, world=2), Plan(graph, b, module, [0, 1], rank=1, world=2)]
    assert mismatches([messages(p) for p in plans])
