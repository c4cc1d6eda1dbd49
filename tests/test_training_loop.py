"""ParallelModule in the training loop people write, against single-process PyTorch.

Real multi-process runs with gloo (one spawn per world size for every case,
workers in ``_loop_workers.py``).  Clipping by the global gradient norm --
``par.clip_grad_norm_`` and torch's own ``clip_grad_norm_`` / ``get_total_norm``
over ``par.parameters()`` (foreach and not), norms 2 and inf -- with AdamW (SGD
for the transformer, see ``_loop_workers.optimizer``), under data parallelism,
model parallelism and random strategies, where a rank holds only its shards, a
replicated block sits on several ranks and some rank may hold nothing; and
gradient accumulation over micro-batches, with and without ``no_sync()`` (the
loss read before the backward or not, on every rank or one).  Every parameter,
loss and norm within 1e-5 of one process; the ranks report the same norms and
losses bit for bit; inside ``no_sync()`` no gradient bucket is all-reduced; a
norm over the shards mixed with another module's tensors raises the error that
names ``par.clip_grad_norm_``.
"""
from __future__ import annotations

import math

import pytest
import torch

import _loop_workers as W
import flexflow as ff
from flexflow.launch import launch

TOL = 1e-5
# shard levels: zero:S and fsdp (data parallelism sharded), shard:SEED (a random strategy
# with random levels 1-3 on the ops whose parameters have replicas)
# rc:SEED: shard:SEED with every other op recomputed
CASES_2 = [("mlp", 9, ["data_parallel", "model_parallel", "random:0", "random:1", "zero:1", "zero:2", "fsdp",
                       "shard:1", "rc:0"]),
           ("transformer", 8, ["data_parallel", "model_parallel", "random:0", "fsdp", "shard:0", "rc:1"])]
CASES_4 = [("mlp", 6, ["data_parallel", "model_parallel", "random:2", "fsdp", "shard:2", "rc:3"])]
LOOPS_4 = ["clip2_torch", "clipinf_par", "accum_no_sync", "accum_no_sync_early1"]


@pytest.fixture(scope="module")
def results_2():
    return launch(W.suite, 2, CASES_2, timeout_s=120)


@pytest.fixture(scope="module")
def results_4():
    return launch(W.suite, 4, CASES_4, LOOPS_4, timeout_s=120)


def _problems(results) -> list:
    bad = []
    for i, rec in enumerate(results[0]):
        where = f"{rec['model']} {rec['spec']} {rec['loop']}"
        if rec["loop"] == "mixed":
            if "par.clip_grad_norm_" not in rec["error"]:
                bad.append(f"{where}: torch's clip_grad_norm_ over shards and another tensor did not raise "
                           f"the error naming par.clip_grad_norm_ ({rec['error']!r})")
            continue
        for key in ("loss_err", "param_err", "norm_err", "seen_err"):
            if rec.get(key) is not None and not rec[key] <= TOL:
                bad.append(f"{where}: {key} {rec[key]:.2e}" + (f" ({rec['errs']})" if key == "param_err" else ""))
        for rank, r in enumerate(results):
            if r[i]["early_same"] is False:
                bad.append(f"{where}: rank {rank}: the loss read before backward differs from after")
        for rank, other in enumerate(results[1:], 1):  # every rank computed the same norms and losses
            o = other[i]
            if o["norms"] != rec["norms"] or o["seen"] != rec["seen"] or o["losses"] != rec["losses"]:
                bad.append(f"{where}: rank {rank} disagrees: norms {o['norms']} vs {rec['norms']}, "
                           f"seen {o['seen']} vs {rec['seen']}")
        for rank, r in enumerate(results):
            for sizes in r[i]["inside"] or ():
                if any(n > 2 for n in sizes):  # the outputs (the loss) and a count ride alone
                    bad.append(f"{where}: rank {rank} all-reduced gradient buckets {sizes} inside no_sync()")
    return bad


def test_loop_2_ranks(results_2):
    assert not _problems(results_2), "\n".join(_problems(results_2))
    loops = {r["loop"] for r in results_2[0]}
    assert loops == {n for n, _ in W.LOOPS} | {"mixed"}
    # the strategies are what they claim: a rank holds only part of the model, and
    # data parallelism exchanges every gradient, skipped inside no_sync
    mp = [r for r in results_2[1] if r["spec"] == "model_parallel" and r["model"] == "mlp"][0]
    assert set(mp["holds"]) != set(results_2[0][0]["holds"])
    dp = [r for r in results_2[0] if r["spec"] == "data_parallel" and r["loop"] == "accum_no_sync"]
    assert dp and all(sizes for r in dp for sizes in r["inside"]), "the loss rides alone inside no_sync"


def test_loop_4_ranks(results_4):
    assert not _problems(results_4), "\n".join(_problems(results_4))
    # model parallelism of a 3-layer MLP on 4 ranks leaves a rank without any parameter
    # block: torch's clip_grad_norm_ there takes part in the norm through its placeholder
    mp = [[r for r in recs if r["spec"] == "model_parallel" and r["loop"] == "clip2_torch"][0]["holds"]
          for recs in results_4]
    assert [] in mp, mp


def test_single_process_clip_and_no_sync():
    """Without a process group (one rank holds everything): torch's utilities, the
    module's own methods and no_sync() give the plain module's values."""
    module, example = W.build("mlp", 7)
    par = ff.parallelize(module, example_inputs=example, strategy=None)
    ref = W.MLP()
    ref.load_state_dict(module.state_dict())
    for model in (par, ref):
        with model.no_sync() if model is par else torch.enable_grad():
            model(*W.batch_for(module, 7, 1)).backward()
        model(*W.batch_for(module, 7, 2)).backward()
    inf = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()], math.inf)
    assert float(par.grad_norm(math.inf)) == pytest.approx(float(inf), rel=1e-6)
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), W.CLIP)
    assert float(par.grad_norm()) == pytest.approx(float(want), rel=1e-6)
    got = torch.nn.utils.clip_grad_norm_(par.parameters(), W.CLIP)
    assert float(got) == pytest.approx(float(want), rel=1e-6)
    for (k, p), q in zip(par.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.as_subclass(torch.Tensor), q.grad, rtol=1e-6, atol=1e-8)
    with pytest.raises(ValueError, match="norm_type"):
        par.grad_norm(0)
