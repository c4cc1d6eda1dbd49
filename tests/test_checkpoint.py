"""Sharded checkpoints with torch.distributed.checkpoint (DCP), against one process.

Real runs on 2 gloo ranks (workers in ``_ckpt_workers.py``, one spawn for every
case) and in this process without a process group.  A model (an MLP with AdamW;
an LSTM language model with SGD + momentum, whose gate blocks under a random
strategy are no boxes of its weights) is trained two steps under one strategy
(model parallel, random, ZeRO-3 flat slices, or one process), saved with
``dcp.save({"model": par.state_dict(full=False), "optim": par.optim_state_dict(opt)})``
and loaded under another strategy or number of processes: each rank writes only
the boxes it holds (one holder per box), reads exactly the chunks covering its
boxes, and nothing is gathered on either side; the loaded state equals the
saved one bit for bit, and the step after it equals the uninterrupted run's and
one process's (plain module) within 1e-5.  The full state dict saves as the
same checkpoint; both load into the plain module.
"""
from __future__ import annotations

import math
import re
import warnings

import _ckpt_workers as W
import pytest
import torch
import torch.distributed.checkpoint as dcp

from flexflow.launch import launch
from flexflow.runtime import checkpoint as ckpt
from flexflow.runtime.plan import ExecutorError

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
TOL = 1e-5
MODELS = {"mlp": 8, "rnnlm": 4}  # model -> batch
SAVES = [("mp", "mlp", 8, "model_parallel"),  # whole layers on either rank
         ("lstm", "rnnlm", 4, "random:1"),  # LSTM gates split along H: 4 boxes of each weight per rank
         ("z3", "mlp", 8, "zero:3"),  # flat slices of replicated regions (rows cut mid-row)
         ("pipe", "mlp", 8, "pipe:2")]  # two pipeline stages, 1F1B over 2 micro-batches
LOADS = [("mp>z3", "mlp", 8, "zero:3", "mp"),
         ("lstm>dp", "rnnlm", 4, "data_parallel", "lstm"),
         ("one>mp", "mlp", 8, "model_parallel", "one"),  # saved by one process
         ("pipe>z3", "mlp", 8, "zero:3", "pipe"),  # saved under a pipeline, loaded under fsdp
         ("z3>pipe", "mlp", 8, "pipe:2", "z3")]  # and back


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ckpt"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = {name: W.plain_run(name, batch) for name, batch in MODELS.items()}
        one = W.save_run("mlp", 8, "default", f"{root}/one")
    ranks = launch(W.suite, 2, root, SAVES, LOADS, timeout_s=120)
    return {"root": root, "ref": ref, "one": one, "ranks": ranks}


def _err(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max()) / max(float(b[k].abs().max()), 1e-3)
               for k in b)


def _writers(folder: str) -> dict:
    """(key, offsets, sizes) -> the rank whose file holds it, for the model's chunks."""
    md = dcp.FileSystemReader(folder).read_metadata()
    out = {}
    for index, info in md.storage_data.items():
        if index.fqn.startswith("model."):
            chunk = next(c for c in md.state_dict_metadata[index.fqn].chunks if c.offsets == index.offset)
            rank = int(re.match(r"__(\d+)_", info.relative_path).group(1))
            out[(index.fqn[6:], tuple(chunk.offsets), tuple(chunk.sizes))] = rank
    return out


@pytest.mark.slow
def test_each_rank_writes_only_its_boxes_once(run):
    for tag, name, _, _ in SAVES:
        want = {}
        for rank, out in enumerate(run["ranks"]):
            for key, bx in out[tag]["boxes"].items():
                for off, sizes, writes in bx:
                    if writes:
                        assert (key, off, sizes) not in want, f"{tag}: {key} {off} written twice"
                        want[(key, off, sizes)] = rank
        got = _writers(f"{run['root']}/{tag}")
        assert got == want, tag
        # every element of every tensor once
        for key, value in run["ranks"][0][tag]["after"].items():
            assert sum(math.prod(s) for (k, _, s) in got if k == key) == value.numel(), (tag, key)
        assert set(got.values()) == {0, 1}, f"{tag}: one rank wrote everything"
        # the full state dict (the contract's form) saves as the same checkpoint
        assert _writers(f"{run['root']}/{tag}-full") == got, tag
    # the strategies are what they claim
    mp = [out["mp"]["holds"] for out in run["ranks"]]
    assert not set(mp[0]) & set(mp[1]), mp
    lstm = run["ranks"][0]["lstm"]["boxes"]["cells.0.weight_ih"]
    assert len(lstm) == 4 and all(s == (8, 16) for _, s, _ in lstm), lstm


@pytest.mark.slow
def test_each_rank_reads_only_the_chunks_of_its_boxes(run):
    for tag, *_ in LOADS:
        for rank, out in enumerate(run["ranks"]):
            rec = out[tag]
            for key, bx in rec["boxes"].items():
                held = sum(math.prod(s) for _, s, _ in bx)
                assert rec["read"].get("model." + key, 0) == held, (tag, rank, key)


@pytest.mark.slow
def test_loaded_state_and_resumed_step_equal_one_process(run):
    ref, ranks = run["ref"], run["ranks"]
    saved = {tag: ranks[0][tag] for tag, *_ in SAVES}
    saved["one"] = run["one"]
    for tag, name, *_ in SAVES:
        for rank, out in enumerate(ranks):
            assert out[tag]["lazy_ok"], (tag, rank)
        assert _err(saved[tag]["after"], ref[name]["after"]) <= TOL, tag
    for tag, name, _, _, src in LOADS:
        got = ranks[0][tag]
        # the loaded state is the saved one, bit for bit
        for k, v in saved[src]["after"].items():
            assert torch.equal(got["after"][k], v), (tag, k)
        # the step after the load: the uninterrupted run's, and one process's
        assert math.isclose(got["losses"][0], saved[src]["losses"][-1], rel_tol=TOL), tag
        assert math.isclose(got["losses"][0], ref[name]["losses"][-1], rel_tol=TOL), tag
        assert _err(got["final"], saved[src]["final"]) <= TOL, tag
        assert _err(got["final"], ref[name]["final"]) <= TOL, tag
        assert ranks[1][tag]["losses"] == got["losses"], tag


@pytest.mark.slow
def test_a_two_rank_checkpoint_loads_into_one_process_and_the_plain_module(run):
    for tag, name, batch, _ in SAVES:
        saved = run["ranks"][0][tag]
        got = W.load_run(name, batch, "default", f"{run['root']}/{tag}")
        for k, v in saved["after"].items():
            assert torch.equal(got["after"][k], v), (tag, k)
        assert math.isclose(got["losses"][0], saved["losses"][-1], rel_tol=TOL), tag
        assert _err(got["final"], saved["final"]) <= TOL, tag
        for folder in (tag, tag + "-full"):
            module, _ = W.build(name, batch, seed=7)
            state = {"model": module.state_dict()}
            dcp.load(state, checkpoint_id=f"{run['root']}/{folder}")
            for k, v in saved["after"].items():
                assert torch.equal(state["model"][k], v), (folder, k)


# --------------------------------------------------------------------------- one process
def _trained(name="mlp", batch=8, seed=0):
    module, par = W.parallelized(name, batch, "default", seed)
    opt = W.optimizer(par, name)
    W.train(par, module, batch, opt, range(2))
    return module, par, opt


def test_sharded_values_behave_as_full_tensors_when_read():
    _, par, _ = _trained()
    lazy, full = par.state_dict(full=False), par.state_dict()
    v = lazy["fc1.weight"]
    assert isinstance(v, ckpt.ShardedState) and isinstance(full["fc1.weight"], ckpt.FullState)
    assert v.shape == (24, 12) and v.dtype == torch.float32
    with W.no_gather():  # shape, repr and detach gather nothing
        assert "fc1.weight" in repr(v) and "[24, 12]" in repr(v)
        assert isinstance(v.detach(), ckpt.ShardedState)
    assert torch.equal(v * 2, full["fc1.weight"] * 2)
    assert type(v + 1) is torch.Tensor and type(full["fc1.weight"] + 1) is torch.Tensor
    with pytest.raises(RuntimeError, match="copy_ into it"):
        v.mul_(2)
    v.copy_(torch.zeros(24, 12))  # writes the shards themselves
    assert float(par.state_dict()["fc1.weight"].abs().sum()) == 0.0


def test_torch_save_of_either_state_dict_is_plain(tmp_path):
    _, par, _ = _trained()
    for full in (True, False):
        torch.save(par.state_dict(full=full), tmp_path / "s.pt")
        loaded = torch.load(tmp_path / "s.pt", weights_only=True)
        assert all(type(t) is torch.Tensor for t in loaded.values())
        W.MLP().load_state_dict(loaded)


def test_load_state_dict_errors_and_keys():
    _, par, _ = _trained()
    state = par.state_dict()
    del state["fc1.bias"]
    with pytest.raises(RuntimeError, match='Missing key.*"fc1.bias"'):
        par.load_state_dict(state)
    state["extra"] = torch.zeros(1)
    keys = par.load_state_dict(state, strict=False)
    assert keys.missing_keys == ["fc1.bias"] and keys.unexpected_keys == ["extra"]
    with pytest.raises(RuntimeError, match="size mismatch"):
        par.load_state_dict({**par.state_dict(), "fc2.weight": torch.zeros(3, 3)})


def test_optimizer_state_errors():
    _, par, opt = _trained()
    _, other, other_opt = _trained(seed=3)
    with pytest.raises(ValueError, match="another parallel module"):
        par.load_optim_state_dict(opt, other.optim_state_dict(other_opt))
    osd = par.optim_state_dict(opt)
    with pytest.raises(ValueError, match="1 parameter groups, the optimizer 2"):
        two = torch.optim.AdamW([{"params": [par.fc1.weight]}, {"params": [par.fc2.weight]}])
        par.load_optim_state_dict(two, osd)
    with pytest.raises(ValueError, match="not a parameter of this parallel module"):
        par.optim_state_dict(torch.optim.SGD([torch.nn.Parameter(torch.ones(3))], lr=0.1))
    with pytest.raises(ValueError, match="'state' and 'param_groups'"):
        par.load_optim_state_dict(opt, {"state": {}})


def test_optimizer_state_from_full_tensors_and_a_fresh_optimizer():
    """A consolidated (full) optimizer state loads too; an optimizer without state gets
    it by a step that changes no parameter."""
    module, par, opt = _trained()
    full = {"state": {n: {k: v.full_tensor() if isinstance(v, ckpt.ShardedState) else v for k, v in st.items()}
                      for n, st in par.optim_state_dict(opt)["state"].items()},
            "param_groups": par.optim_state_dict(opt)["param_groups"]}
    _, par2 = W.parallelized("mlp", 8, "default", seed=0)
    before = {k: v.clone() for k, v in par2.state_dict().items()}
    opt2 = W.optimizer(par2, "mlp")
    par2.optim_state_dict(opt2)
    assert all(torch.equal(par2.state_dict()[k], v) for k, v in before.items())
    par2.load_state_dict(par.state_dict())
    par2.load_optim_state_dict(opt2, full)
    losses = [W.train(m, module, 8, o, [2]) for m, o in ((par, opt), (par2, opt2))]
    assert losses[0] == losses[1]
    after = [m.state_dict() for m in (par, par2)]
    assert all(torch.equal(after[0][k], after[1][k]) for k in after[0])  # the same AdamW step


@pytest.mark.parametrize("shape,lo,hi", [((4, 6), 3, 17), ((4, 6), 0, 24), ((5, 24), 60, 120),
                                         ((4, 3, 5), 7, 52), ((3,), 1, 2), ((2, 2), 4, 4)])
def test_flat_slices_as_boxes(shape, lo, hi):
    boxes = ckpt._flat_boxes(shape, lo, hi)
    seen = torch.zeros(shape, dtype=torch.int64)
    flat = torch.arange(math.prod(shape)).view(shape)
    for off, sizes, a, b in boxes:
        block = flat[ckpt._index(off, sizes)]
        assert block.is_contiguous() or block.numel() == 0
        assert block.reshape(-1).tolist() == list(range(a, b))  # contiguous elements a..b
        seen[ckpt._index(off, sizes)] += 1
    assert seen.reshape(-1)[lo:hi].eq(1).all() and int(seen.sum()) == hi - lo


def test_view_blocks_as_boxes_of_the_tensor():
    """A block of an LSTM weight's (4, H, I) gate view is one box per gate of its (4H, I) rows."""
    native, view = (64, 16), (4, 16, 16)
    w = torch.arange(64 * 16).view(native)
    for start, sizes in [((0, 8, 0), (4, 8, 16)), ((1, 0, 0), (2, 16, 16)), ((0, 0, 4), (4, 16, 8))]:
        block = w.view(view)[ckpt._index(start, sizes)].contiguous()
        covered = 0
        for off, sz, take in ckpt._native_boxes("w", native, view, start, sizes):
            assert torch.equal(take(block), w[ckpt._index(off, sz)])
            covered += math.prod(sz)
        assert covered == block.numel()
    with pytest.raises(ExecutorError, match="not a box of its shape"):
        ckpt._native_boxes("w", (16, 64), (4, 16, 16), (0, 0, 0), (4, 8, 16))

