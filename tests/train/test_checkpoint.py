"""train/checkpoint.py's Checkpointer alone, built from its section (``CheckpointConfig.build``)
with a fake snapshot and a one-process fake ``Parallel``: when it saves, and that a run which lost
its lease publishes nothing. Its background writer, pruning and a failed write in real runs are in
test_zero.py and test_train.py (slow)."""

from __future__ import annotations

import json

import pytest
import torch
from support import FakePar


def _checkpointer(tmp_path, at_start: bool, saved_step=None):
    from reelcache.train.checkpoint import CheckpointConfig

    def snapshot():
        w = {"w": torch.ones(2)}
        return w, dict(w), None, {"global_step": 0}, {"version": 2}

    cfg = CheckpointConfig(every=5, at_start=at_start)
    return cfg.build(run_dir=tmp_path / "run", par=FakePar(), snapshot=snapshot, saved_step=saved_step)


def test_at_start_saves_step_0_of_a_run_that_resumes_nothing(tmp_path):
    from reelcache.train.checkpoint import list_checkpoints

    ck = _checkpointer(tmp_path, True)
    assert ck.start(3) is None  # not at step 0
    path = ck.start(0)
    ck.wait()
    assert path.name == "ckpt-00000000" and list_checkpoints(tmp_path / "run") == [path]
    assert sorted(p.name for p in path.iterdir()) == ["config.json", "ema", "model", "state.json"]  # no optimizer yet
    assert ck.start(0) is None and not ck.due(0)  # saved once
    assert _checkpointer(tmp_path, True, saved_step=0).start(0) is None  # a resumed run: never
    assert _checkpointer(tmp_path / "b", False).start(0) is None  # the default


def test_a_run_that_lost_its_lease_publishes_no_checkpoint(tmp_path):
    """A holder frozen past the lease's TTL on another node loses the run to a new start (base/lease.py's
    takeover); when it wakes it must not publish a checkpoint into the run the other now writes. Reference:
    the lease file naming another holder (what a takeover leaves) and the run directory's listing."""
    from reelcache.base.lease import acquire
    from reelcache.train.checkpoint import CheckpointConfig

    run = tmp_path / "run"
    run.mkdir()
    lease = acquire(run / "run.lease")

    def snapshot():
        w = {"w": torch.ones(2)}
        return w, None, None, {"global_step": 0}, {"version": 2}

    ck = CheckpointConfig(every=1).build(run_dir=run, par=FakePar(), snapshot=snapshot, lease=lease)
    ck.save(1)
    ck.wait()
    doc = json.loads((run / "run.lease").read_text())
    (run / "run.lease").write_text(json.dumps({**doc, "pid": 1, "token": "another-start"}))  # taken over
    ck.save(2)
    with pytest.raises(RuntimeError, match="lost the lease"):
        ck.wait()
    assert sorted(p.name for p in run.iterdir()) == ["ckpt-00000001", "run.lease"]
    lease.release()  # not ours any more: left to its holder
    assert json.loads((run / "run.lease").read_text())["token"] == "another-start"
