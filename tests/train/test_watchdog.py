"""train/watchdog.py alone: what it watches and what it counts. A hang in a real two-rank run:
test_train.py::test_watchdog_writes_every_ranks_stack_when_a_read_hangs (slow); the trainer keeping it
armed after a step: test_train.py::test_the_watchdog_watches_the_collectives_after_a_step (slow)."""

from __future__ import annotations

import json


def test_the_watchdog_watches_the_collectives_after_a_step_but_counts_no_step_time(tmp_path):
    """After a step the trainer keeps the watchdog armed over its log, checkpoint and stop-agreement
    collectives (a node lost there hangs the others as surely as one lost in the step): a span begun
    after a step reports a hang like a step does, and ``end(record=False)`` keeps it out of the median."""
    import time

    from reelcache.train.watchdog import WatchdogConfig

    dog = WatchdogConfig(factor=3.0, floor_s=0.05).build(run_dir=tmp_path, rank=0)
    try:
        dog.begin(0)
        dog.end()
        dog.begin(1, after_step=True)
        report = tmp_path / "hangs/step-00000001/rank00000.txt"
        deadline = time.monotonic() + 30
        while not report.exists():
            assert time.monotonic() < deadline, "no hang report for the span after step 1"
            time.sleep(0.02)
        dog.end(record=False)
        assert len(dog.times) == 1 and json.loads(report.read_text().splitlines()[0])["after_step"] is True
    finally:
        dog.close()
