"""The distributed executor against single-process PyTorch.

Real multi-process runs with gloo on CPU (2 and 4 ranks, one spawn per
world size for all the equivalence cases), workers in ``_dist_workers.py``.
Each case trains 3 SGD steps with a strategy and compares every loss and
every state_dict tensor with the plain module (rank 0 runs the reference).
Batches are not multiples of the world size (5 on 2 ranks, 6 on 4 ranks) to
catch uneven slicing.  Dropout and per-replica BatchNorm statistics differ
from one process by design, so most models run in eval mode; train-mode
BatchNorm is checked with strategies that split BatchNorm along channels
only (exact), on small networks: the deep zoo CNNs (resnet101, inception_v3
at size "small") are so ill-conditioned in train mode at these batches that
float32 rounding differences between two computation orders grow to 1e-2 in
3 steps (measured: the single-process executor, whose conv rule pads
explicitly, against the plain module: gradients within 1e-4 after one step,
losses 2-4% apart after three).
"""
from __future__ import annotations

import copy
import re
import sys

import pytest
import torch

import _dist_workers as W
import flexflow as ff
from flexflow.api import parallelize
from flexflow.launch import LaunchError, launch
from flexflow.hardware.machine import Machine
from flexflow.strategy.strategy import Strategy
from flexflow.strategy.config import StrategyError

TOL = 1e-5
ZOO = ["lenet", "alexnet", "inception_v3", "resnet101", "rnntc", "rnnlm", "nmt", "transformer"]
BASIC = ["data_parallel", "model_parallel", "expert"]
HEAVY = {"inception_v3", "resnet101"}  # hundreds of ops: fewer random strategies

# (model, batch, mode, strategies, check state_dict round trip)
CASES_2 = [(m, 5, "eval", BASIC + (["random:0"] if m in HEAVY else ["random:0", "random:1"])
            + (["data_parallel+tiny"] if m == "transformer" else [])  # +tiny: 100-byte buckets
            # the loss rides on the gradient all-reduce by default; +eager: on its own;
            # +early: read before backward too, +earlyR: on rank R only
            + (["data_parallel+eager", "random:0+eager", "data_parallel+tiny+early", "data_parallel+early0",
                "data_parallel+tiny+early1", "model_parallel+early0", "random:1+early1"]
               if m in ("rnnlm", "transformer") else [])
            + (["single_device"] if m in ("rnnlm", "lenet") else []),  # rank 1 only receives the loss
            m in ("lenet", "transformer")) for m in ZOO]
CASES_2 += [
    ("branchnet", 5, "eval", BASIC + ["random:0", "random:1", "random:2"], False),
    ("tinylm", 5, "eval", BASIC + ["random:0", "random:1", "random:2"], True),
    ("branchnet", 5, "train", ["bnchannel:0", "bnchannel:1", "model_parallel"], True),
    ("alexnet", 5, "train", ["random:2"], False),
    # element-wise losses (MSE, smooth L1, BCE with logits, Huber, L1) split like their input
    ("regressor", 5, "eval", BASIC + ["random:0", "random:1", "random:2", "data_parallel+early1"], True),
    # sums and means split along what they reduce (partial sums)
    ("handmse", 5, "eval", BASIC + ["random:0", "random:1", "data_parallel+early0"], False),
    # nn.LSTM / nn.GRU: 20 random strategies (they once hung both ranks in a receive)
    ("recurrent", 5, "eval", BASIC + [f"random:{k}" for k in range(20)], True),
]
# "@3,1": the strategy's devices 0, 1 on ranks 3, 1 (ranks 0 and 2 hold nothing but still
# return the outputs); "#3": on the first 3 ranks
CASES_4 = [(m, 6, "eval", BASIC + ["random:0", "random:1", "random:2"]
            + (["random:0+tiny", "random:1@3,1", "data_parallel#3", "data_parallel+early2"]
               if m == "tinylm" else [])
            + (["model_parallel@2,0,3"] if m == "lenet" else []), m == "rnnlm")
           for m in ("lenet", "rnnlm", "transformer", "branchnet", "tinylm")]
CASES_4 += [("nmt", 6, "eval", ["expert", "random:3"], False),
            ("branchnet", 6, "train", ["bnchannel:4", "bnchannel:5"], True)]


def _ids(cases):
    return [f"{m}-{mode}" for m, _, mode, _, _ in cases]


@pytest.fixture(scope="module")
def suite_2():
    """One spawn of 2 ranks: every 2-rank equivalence case, then the refusal checks."""
    return launch(W.suite, 2, CASES_2, True, timeout_s=120)


@pytest.fixture(scope="module")
def results_2(suite_2):
    return [r["equivalence"] for r in suite_2]


@pytest.fixture(scope="module")
def results_4():
    return [r["equivalence"] for r in launch(W.suite, 4, CASES_4, timeout_s=120)]


def _check(results, model, mode):
    recs = [r for r in results[0] if r["model"] == model and r["mode"] == mode]
    assert recs, f"no results for {model} ({mode})"
    bad = []
    for rec in recs:
        where = f"{model} {mode} {rec['spec']}"
        if rec["loss_err"] > TOL or rec["param_err"] > TOL:
            bad.append(f"{where}: loss err {rec['loss_err']:.2e}, worst param {rec['worst']} "
                       f"err {rec['param_err']:.2e}")
        if not rec["keys_match"]:
            bad.append(f"{where}: state_dict keys differ from the module's")
        for other in results[1:]:  # every rank returns the same loss
            o = next(x for x in other if x["model"] == model and x["mode"] == mode and x["spec"] == rec["spec"])
            if o["losses"] != rec["losses"]:
                bad.append(f"{where}: ranks disagree on the loss: {rec['losses']} vs {o['losses']}")
        if "gathered_loads" in rec:
            for k in ("gathered_loads", "scatter_exact", "forward_after_load_equal"):
                if not rec[k]:
                    bad.append(f"{where}: state_dict round trip: {k} failed")
            if rec["fresh_forward_err"] > TOL:
                bad.append(f"{where}: original module with gathered state: err {rec['fresh_forward_err']:.2e}")
    assert not bad, "\n".join(bad)
    return recs


@pytest.mark.slow
@pytest.mark.parametrize("model,mode", [(c[0], c[2]) for c in CASES_2], ids=_ids(CASES_2))
def test_equivalence_2_ranks(results_2, model, mode):
    recs = _check(results_2, model, mode)
    if mode == "eval" and model in ZOO:
        assert any(r["exchanges"] > 0 for r in recs), "no strategy moved activations between ranks"
    if model in ("transformer", "handmse"):  # position embedding replicated, as DDP has it; the mean split
        assert next(r for r in recs if r["spec"] == "data_parallel")["exchanges"] == 0


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="thread policies are Linux's")
def test_gloo_loop_threads_of_the_runtime_do_not_preempt(results_2):
    """The event-loop threads of the groups a runtime creates run under SCHED_BATCH
    (``runtime.gloo.batch_gloo_loops``): every 2-rank case found some and moved them all."""
    for rank, recs in enumerate(results_2):
        for rec in recs:
            where = f"rank {rank}, {rec['model']} {rec['spec']}"
            assert rec["loop_threads"], f"{where}: no gloo loop thread of the runtime's groups found"
            assert all(rec["loop_threads"]), f"{where}: loop threads not under SCHED_BATCH: {rec['loop_threads']}"


@pytest.mark.slow
@pytest.mark.parametrize("model,mode", [(c[0], c[2]) for c in CASES_4], ids=_ids(CASES_4))
def test_equivalence_4_ranks(results_4, model, mode):
    _check(results_4, model, mode)


@pytest.mark.slow
def test_refused_strategies_on_every_rank(suite_2):
    """Every rank refuses (no rank hangs: the launch would fail at its timeout)."""
    results = suite_2
    assert len(results) == 2  # launch returns each rank's result
    for rank, res in enumerate(results):
        out = res["refusals"]
        assert "another graph" in out["other_graph"], (rank, out)
        assert "device" in out["too_many_devices"] and "StrategyError" in out["too_many_devices"]
        assert out["bad_on_one_rank"] != "accepted", (rank, out)
        assert "rank 1" in out["bad_on_one_rank"] or rank == 1
        assert "example_inputs" in out["no_example_inputs"]
        strategy_json, plain_loss = out["searched"]
        assert strategy_json == results[0]["refusals"]["searched"][0]  # one strategy for all ranks
        assert abs(out["after"] - plain_loss) <= TOL * abs(plain_loss)


def _failure(how: str, timeout_s: float) -> str:
    """launch's report when rank 1 of 2 dies or hangs; rank 0's error from the step it
    was in (the exchange it waited on, the peer, the timeout in force) is in it."""
    with pytest.raises(LaunchError) as e:
        launch(W.failing_peer, 2, how, timeout_s, timeout_s=60, grace_s=1.0)
    msg = str(e.value)
    assert "--- rank 0 failed" in msg, msg
    assert re.search(rf"rank 0 failed: ExecutorError: rank 0, step 1: .*rank\(s\) \[1\].*\(timeout {timeout_s:g} s\)",
                     msg), msg
    return msg


@pytest.mark.slow
def test_rank_that_dies_fails_the_others():
    """Rank 1 raises right after parallelize: launch reports both ranks' tracebacks,
    and rank 0 fails on the closed connection, not by waiting out its timeout."""
    msg = _failure("dies", timeout_s=20.0)
    assert "--- rank 1 failed" in msg and "rank 1 exits on purpose" in msg
    assert not re.search(r"timed out", msg, re.IGNORECASE), msg


@pytest.mark.slow
def test_rank_that_hangs_times_out():
    """Rank 1 hangs: rank 0 fails at its receive's timeout (parallelize(timeout_s=3)),
    rank 1 is stopped."""
    msg = _failure("hangs", timeout_s=3.0)
    assert "rank 1 was stopped" in msg
    assert re.search(r"timed out", msg, re.IGNORECASE), msg


@pytest.mark.slow
def test_single_process_matches_module():
    for name in ("lenet", "transformer", "rnnlm"):
        module, inputs = ff.models.get(name, batch_size=3, size="small")
        module.eval()
        ref = copy.deepcopy(module)
        model = parallelize(module, example_inputs=inputs)
        assert [n for n, _ in model.named_parameters()] == [n for n, _ in ref.named_parameters()]
        # whole parameters are held in the module's own shapes (an LSTM cell's
        # gates too, which the rules read in a (4, H, .) view)
        assert [tuple(p.shape) for p in model.parameters()] == [tuple(p.shape) for p in ref.parameters()]
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        for _ in range(2):
            for m, o in ((model, opt), (ref, ref_opt)):
                o.zero_grad()
                loss = m(*inputs)
                loss.backward()
                o.step()
            assert torch.allclose(model(*inputs), ref(*inputs), rtol=TOL)
        state = model.state_dict()
        for k, v in ref.state_dict().items():
            assert torch.allclose(state[k], v, rtol=TOL, atol=1e-7), k
        fresh = parallelize(copy.deepcopy(ref), example_inputs=inputs)
        fresh.load_state_dict({k: v + 1 for k, v in state.items()})
        for k, v in fresh.state_dict().items():
            assert torch.allclose(v, state[k] + 1, rtol=TOL, atol=1e-6), k


def test_single_process_errors():
    module, inputs = ff.models.get("lenet", batch_size=3, size="small")
    with pytest.raises(ValueError, match="example_inputs"):
        parallelize(module)
    with pytest.raises(ValueError, match="devices"):
        parallelize(module, 2, example_inputs=inputs)
    with pytest.raises(ValueError, match="reduce_outputs must be one of 'eager', 'with_gradients'"):
        parallelize(module, example_inputs=inputs, reduce_outputs="later")
    graph = ff.trace(module, inputs)
    dp2 = Strategy.data_parallel(graph, Machine.preset("cpu", devices=2))
    with pytest.raises(StrategyError, match="device 1"):
        parallelize(module, example_inputs=inputs, strategy=dp2)
    model = parallelize(module, example_inputs=inputs)
    bigger = ff.models.get("lenet", batch_size=4, size="small")[1]
    with pytest.raises(RuntimeError, match="traced"):
        model(*bigger)


def test_an_index_of_a_region_is_one_index_of_the_held_tensor():
    """x[:, t] of a partition's region runs as the module's own index: the region
    and the index composed, not a slice and then an index (one op, one backward
    node per time step of an unrolled nn.LSTMCell loop)."""
    from flexflow.graph.ops import RULES
    from flexflow.graph.ops.nodes import index_attrs
    from flexflow.graph.ir import Op

    x = torch.arange(4 * 6 * 5, dtype=torch.float32).reshape(4, 6, 5)
    rule = RULES["index"]
    # (the module's index, the region of x a partition reads, what that partition computes)
    cases = [((slice(None), 3), (slice(1, 3), slice(3, 4), slice(0, 5)), x[1:3, 3]),
             ((slice(None), slice(1, 3), None), (slice(0, 4), slice(2, 3), slice(0, 5)), x[:, 2:3, None, :]),
             ((2,), (slice(2, 3), slice(0, 6), slice(1, 4)), x[2, :, 1:4])]
    for idx, region, expected in cases:
        attrs = index_attrs((4, 6, 5), idx)
        op = Op(name="getitem", kind="getitem", rule="index", inputs=["x"], output_shape=tuple(x[idx].shape),
                input_shapes=[(4, 6, 5)], attrs=attrs, dtype=torch.float32)
        two_steps = rule.bind(op, None)([x[region]], None)
        composed = rule.bind(op, None, within=region)([x], None)
        assert torch.equal(two_steps, expected), idx
        assert torch.equal(composed, expected), idx
    with pytest.raises(ValueError, match="step"):
        rule.bind(op, None, within=(slice(0, 4, 2), slice(0, 6), slice(0, 5)))
