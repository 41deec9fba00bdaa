"""The demo's clip writer (ingest/demo.py: write_clip) leaves the process's scheduling as it found it.

SVT-AV1 (the AV1 special's encoder), run as root, puts the thread that opens it under SCHED_FIFO 99 and leaves it
there: a test session's workers that wrote the demo (or a probe test's clips) then ran real-time, and so did every
process they started after (ffprobe, decode workers, GNU parallel), starving the 2-core machine when one spun.
The reference is the kernel's: the policy and priority the thread has after the clip is written."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from support import REPO

WRITE_AV1 = """
import os, sys
from dataclasses import replace
from pathlib import Path
from reelcache.ingest.demo import codec_specials, write_clip
before = (os.sched_getscheduler(0), os.sched_getparam(0).sched_priority)
write_clip(Path(sys.argv[1]) / "av1.mkv", replace(codec_specials()["av1"], seconds=0.4))
print(*before, os.sched_getscheduler(0), os.sched_getparam(0).sched_priority)
"""


def test_writing_an_av1_clip_as_root_leaves_the_process_scheduled_as_before(tmp_path):
    from reelcache.ingest.demo import codec_specials

    if "av1" not in codec_specials():
        pytest.skip("this PyAV/FFmpeg has no libsvtav1")
    if os.geteuid() != 0:
        pytest.skip("SVT-AV1 switches to real time only when run as root")
    # Without the test session's mark: tests/conftest.py's watcher would put it back itself, and hide a regression.
    env = {k: v for k, v in os.environ.items() if k != "REELCACHE_TEST_SESSION"}
    p = subprocess.run(
        [sys.executable, "-c", WRITE_AV1, str(tmp_path)], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 0 and (tmp_path / "av1.mkv").stat().st_size > 0, p.stderr[-3000:]
    assert p.stdout.split() == [str(os.SCHED_OTHER), "0"] * 2, p.stdout  # policy, priority: before and after
