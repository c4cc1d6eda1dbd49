"""Exchanges that are collectives (a sequence-parallel norm read by column-parallel linears:
an all-gather; a row-parallel output read by the sequence-parallel stream: a reduce-scatter):
found from the messages alone, priced as the collective in the simulator, run as one in the
executor.  The runs equal to one process are in tests/test_megatron.py (every plan there moves
its transitions so); here the pure parts."""
from __future__ import annotations

import collections

import pytest

import flexflow as ff
from flexflow.runtime.collex import plan_collective
from flexflow.runtime.plan import Piece, Plan
from flexflow.sim.taskkeys import PS
from flexflow.strategy.collective import clique_groups


def test_clique_groups_are_every_ordered_pair_once():
    full = [(a, b) for a in range(3) for b in range(3) if a != b]
    assert clique_groups(full) == [(0, 1, 2)]
    two = [(a + k, b + k) for k in (0, 3) for a, b in full]
    assert clique_groups(two) == [(0, 1, 2), (3, 4, 5)]
    assert clique_groups(full[:-1]) is None  # a pair missing: point-to-point
    assert clique_groups(full + [(0, 1)]) is None  # two messages on one pair
    assert clique_groups([(0, 1), (1, 2), (2, 0)]) is None  # a ring of sends is not a gather
    assert clique_groups([(0, 1), (1, 0)]) is None  # a pair: one message each way, point to point
    assert clique_groups([(0, 1)]) is None and clique_groups([]) is None
    assert clique_groups([(0, 0)]) is None


@pytest.fixture(scope="module")
def llama():
    m, x = ff.models.get("llama", size="small", batch_size=4)
    return m, x, ff.trace(m, x)


def _plans(m, g, s, world):
    return [Plan(g, s, m, list(range(world)), rank=r, world=world) for r in range(world)]


@pytest.mark.parametrize("tp, world", [(4, 4), (4, 8), (8, 8)])
def test_megatron_transitions_run_as_gathers_and_scatters(llama, tp, world):
    m, _, g = llama
    s = ff.Strategy.megatron(g, ff.Machine.preset("h100-cluster", devices=world), tp=tp)
    plans = _plans(m, g, s, world)
    for p in plans:
        kinds = collections.Counter(ex.coll.kind for ex in p.exchanges if ex.coll is not None)
        # every block: the norms' outputs gathered for attention and MLP, the row-parallel
        # outputs reduce-scattered into the stream
        assert kinds["gather"] >= 2 * 2 and kinds["scatter"] >= 2 * 2, kinds
        for ex in p.exchanges:
            if ex.coll is not None:
                assert p.rank in ex.coll.group and len(ex.coll.group) == tp
                assert ex not in p.fwd_recv_ex and ex not in p.bwd_recv_ex  # no messages of their own
        assert p.coll_groups == plans[0].coll_groups  # every rank creates every group
    assert sorted(plans[0].coll_groups) == [tuple(range(k, k + tp)) for k in range(0, world, tp)]


B4, B8 = {r: (4, 8) for r in range(3)}, {r: (12, 8) for r in range(3)}


def _sl(*bounds):
    return tuple(slice(a, b) for a, b in bounds)


def test_plan_collective_reads_the_layout_off_the_pieces():
    """Three ranks each holding a third of the rows, all reading all: a gather, each piece
    put where it goes; partial sums each read in thirds: a scatter; read whole: an
    all-reduce; a halo (each sends its border rows, keeps its whole block), or blocks of
    different sizes: point-to-point."""
    R = range(3)
    gather = [Piece(s, d, _sl((0, 4), (0, 8)), _sl((4 * s, 4 * s + 4), (0, 8)), (4, 8)) for s in R for d in R]
    groups, c = plan_collective(gather, 1, partial=False, blocks=B4)
    assert groups == [(0, 1, 2)] and c.kind == "gather" and c.group == (0, 1, 2)
    assert c.region == _sl((0, 4), (0, 8))
    assert c.slots == (_sl((0, 4), (0, 8)), _sl((4, 8), (0, 8)), _sl((8, 12), (0, 8)))
    assert plan_collective(gather[:3] + gather[4:], 1, partial=False, blocks=B4) is None  # a message missing
    scatter = [Piece(s, d, _sl((4 * d, 4 * d + 4), (0, 8)), _sl((0, 4), (0, 8)), (4, 8)) for s in R for d in R]
    groups, c = plan_collective(scatter, 0, partial=True, blocks=B8)
    assert c.kind == "scatter" and c.slots == (_sl((0, 4), (0, 8)), _sl((4, 8), (0, 8)), _sl((8, 12), (0, 8)))
    assert plan_collective(scatter[1:], 0, partial=True, blocks=B8) is None  # rank 0's own partial missing
    whole = [Piece(s, d, _sl((0, 12),), _sl((0, 12),), (12,)) for s in R for d in R]
    _, c = plan_collective(whole, 1, partial=True, blocks=B8)  # partial sums read whole by all: an all-reduce
    assert c.kind == "reduce" and c.slots == (_sl((0, 12),),) * 3
    halo = [Piece(s, s, _sl((0, 4),), _sl((0, 4),), (4,)) for s in R] + \
           [Piece(s, d, _sl((3, 4),), _sl((0, 1),), (1,)) for s in R for d in R if s != d]
    assert plan_collective(halo, 0, partial=False, blocks={r: (4,) for r in R}) is None
    uneven = [Piece(s, d, _sl((0, 3 + s),), _sl((0, 3 + s),), (3 + s,)) for s in R for d in R]
    assert plan_collective(uneven, 0, partial=False, blocks={r: (3 + r,) for r in R}) is None
    pair = [Piece(s, d, _sl((0, 4),), _sl((4 * s, 4 * s + 4),), (4,)) for s in range(2) for d in range(2)]
    assert plan_collective(pair, 0, partial=False, blocks={0: (4,), 1: (4,)}) is None  # two: point to point


def test_simulator_prices_a_transition_as_the_collective():
    """LLaMA-8B TP 8 on one H100 node: the norm -> query projection transfers take NCCL's
    all-gather of the whole input, not one pair link's time for a piece (7 pieces arrive at
    once over 7 links in the point-to-point model)."""
    module, inputs = ff.models.get("llama", batch_size=1, size="8b", seq_len=8192, device="meta")
    g = ff.trace(module, inputs)
    machine = ff.Machine.preset("h100-node")
    s = ff.Strategy.megatron(g, machine, tp=8)
    sim = ff.Simulator(g, machine, optimizer="adam", precision="bf16-mixed")
    sim.simulate(s)
    ctx = sim.ctx
    checked = 0
    for o, op in enumerate(g.ops):
        if op.kind != "linear" or op.everywhere:
            continue
        for j, u in enumerate(ctx.inputs[o]):
            if ctx.everywhere[u] or g.ops[u].kind != "rms_norm":
                continue
            e = ctx.edge_plan(u, o, j, s[g.ops[u].name], s[op.name])
            if not e.xq:
                continue
            piece = int(e.recv[0]) // 7
            want = machine.allgather_time_s(range(8), 8 * piece) * PS
            assert all(abs(d - want) <= 1 for d in e.fcols[0]), (op.name, e.fcols[0][:3], want)
            # its backward: the input gathered again for the linear's backward, and the
            # gradient reduce-scattered
            assert all(abs(d - 2 * want) <= 2 for d in e.bcols[0])
            assert want > 3 * ctx.transfer_ps(0, 1, piece)
            checked += 1
    assert checked >= 32 * 2, checked  # q, k, v or the fused projection, and gate / up: each block
