"""train/checkpoint.py's Checkpointer alone, with a fake snapshot and a one-process fake ``Parallel``:
when it saves. Its background writer, pruning and a failed write in real runs are in test_zero.py
and test_train.py (slow)."""

from __future__ import annotations

import torch
from support import FakePar


def _checkpointer(tmp_path, at_start: bool, saved_step=None):
    from reelcache.train.checkpoint import CheckpointConfig, Checkpointer

    def snapshot():
        w = {"w": torch.ones(2)}
        return w, dict(w), None, {"global_step": 0}, {"version": 2}

    cfg = CheckpointConfig(every=5, at_start=at_start)
    return Checkpointer(cfg, tmp_path / "run", FakePar(), snapshot=snapshot, saved_step=saved_step)


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
