"""Faults on 2 gloo ranks: a rank killed mid-step, a rank that raises, a rank
slower than the timeout.  In each case the survivor fails (at once when its peer
is gone, at its timeout when the peer is slow) with an error naming its rank, the
step, the exchange it waited on and the timeout in force;
launch reports every rank; no process, rendezvous folder or shared-memory
file is left behind; and a checkpoint written before the fault loads."""
from __future__ import annotations

import glob
import multiprocessing
import os
import re
import tempfile

import pytest
import torch

import _dist_workers as W
from flexflow.launch import LaunchError, launch

pytestmark = pytest.mark.slow  # every test here spawns ranks and waits on faults


def _leftovers():
    # torch's shared-memory tensors (other jobs on the host may own other /dev/shm entries)
    shm = {f for f in os.listdir("/dev/shm") if f.startswith("torch_")} if os.path.isdir("/dev/shm") else set()
    return shm, set(os.listdir(tempfile.gettempdir()))


def _children_alive() -> list[int]:
    """PIDs of live processes whose parent is this test process (but
    multiprocessing's resource tracker, which lives as long as its parent)."""
    me, out = os.getpid(), []
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat) as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        pid = int(stat.split("/")[2])
        if int(fields[1]) == me and fields[0] != "Z":
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if b"resource_tracker" in f.read():
                        continue
            except OSError:
                continue
            out.append(pid)
    return out


@pytest.mark.parametrize("how,timeout_s", [("killed", 20.0), ("raises", 20.0), ("slow", 3.0)])
def test_survivor_fails_cleanly_and_checkpoint_loads(tmp_path, monkeypatch, how, timeout_s):
    scratch = tmp_path / "scratch"  # launch's rendezvous folder goes here, and must go away
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    shm0, dirs0 = _leftovers()
    ckpt = str(tmp_path / "step1.pt")
    with pytest.raises(LaunchError) as e:
        launch(W.faulty, 2, how, timeout_s, ckpt, timeout_s=timeout_s, grace_s=5.0)
    msg = str(e.value)
    # the survivor: its own traceback, naming rank, step and the exchange and peer it waited on,
    # and the timeout in force
    assert "--- rank 0 failed" in msg, msg
    assert re.search(rf"rank 0 failed: ExecutorError: rank 0, step 2: backward exchange \d+ \(.+\).*rank\(s\) \[1\]"
                     rf".*\(timeout {timeout_s:g} s\)", msg), msg
    # a peer that is gone fails the survivor at once; only the slow one makes it wait out its timeout
    assert bool(re.search(r"timed out", msg, re.IGNORECASE)) == (how == "slow"), msg
    # the faulty rank, as launch saw it
    if how == "killed":
        assert "--- rank 1 exited with code -9" in msg, msg
    elif how == "raises":
        assert "--- rank 1 failed" in msg and "rank 1 raises mid-step on purpose" in msg, msg
    else:
        assert "--- rank 1 was stopped" in msg, msg
    # nothing left behind
    assert not multiprocessing.active_children()
    assert not _children_alive()
    shm1, dirs1 = _leftovers()
    assert shm1 <= shm0, f"new shared-memory files: {sorted(shm1 - shm0)}"
    assert dirs1 <= dirs0, f"files left in the temporary folder: {sorted(dirs1 - dirs0)}"
    # the checkpoint written before the fault loads, and is one single-process SGD step
    module, _ = W.build("lenet", 4)
    ref, _ = W.build("lenet", 4)
    opt = torch.optim.SGD(ref.parameters(), lr=W.LR)
    ref(*W.batch_for_step(ref, 4, 0)).backward()
    opt.step()
    module.load_state_dict(torch.load(ckpt))
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(module.state_dict()[k], v, rtol=1e-5, atol=1e-7)


def test_every_rank_exits_zero():
    """A successful launch is one where every rank exited 0 (an abort at exit,
    after the work is done, is a failure): launch returns each rank's result."""
    out = launch(W.equivalence, 2, [("lenet", 4, "eval", ["data_parallel"], False)], timeout_s=60)
    assert len(out) == 2 and all(r and r[0]["spec"] == "data_parallel" for r in out)
    assert not _children_alive()


def test_mismatched_programs_fail_at_setup_on_every_rank():
    """Rank 0 drops a send from its plan: both ranks refuse at setup, naming the
    receive that would have waited forever; matching programs pass."""
    out = launch(W.mismatched_programs, 2, timeout_s=60)
    for r in out:
        assert r["error"] and "has no matching send" in r["error"], r["error"]
        assert "rank 1 will recv" in r["error"] and "from rank 0" in r["error"], r["error"]
    assert out[0]["error"] == out[1]["error"]  # every rank names the same first mismatch
    assert "run    conv1" in out[0]["program"] and "send   " in out[0]["program"]
    assert "wait   " in out[1]["program"]


def test_profiled_steps_end_cleanly():
    """torch.profiler keeps the last steps' autograd graphs (and their work
    objects) in reference cycles; the launch must still exit 0 (they are
    collected before the process groups go), and every partition this rank
    computes is a named range, as the simulator names its tasks."""
    assert launch(W.profiled_steps, 2, timeout_s=120) == ["ok", "ok"]
