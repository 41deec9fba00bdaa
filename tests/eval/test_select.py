"""eval/evaluate.py's choice of checkpoints alone (the server over a real run: test_eval.py, slow)."""

from __future__ import annotations

from pathlib import Path


def test_every_selects_a_stable_grid_of_saves():
    from reelcache.eval.evaluate import select

    ckpts = [Path(f"ckpt-{s:08d}") for s in (200, 300, 400, 600, 700, 1000, 1050)]  # 100 and 500 pruned
    assert [int(c.name[5:]) for c in select(ckpts, 2, 100)] == [200, 400, 600, 1000, 1050]
    assert select(ckpts, 1, 100) == ckpts
