"""Functions that tests hand to isolated worker processes (reelcache/isolate.py). A spawned worker
imports the function's module by name: test files are imported by path (--import-mode=importlib), so
such functions live here, importable through the tests/ folder on sys.path, and light (no torch)."""

from __future__ import annotations

import os
import signal
import time


def work(x):
    """Doubles x; "hang" sleeps past any deadline, "segv" crashes its worker, "raise" raises."""
    if x == "hang":
        time.sleep(60)
    if x == "segv":
        os.kill(os.getpid(), signal.SIGSEGV)
    if x == "raise":
        raise ValueError("bad item")
    return x * 2


def allocate(mb):
    """Allocates mb MiB and returns how many it got."""
    return len(bytearray(mb * 1024 * 1024)) // (1024 * 1024)
