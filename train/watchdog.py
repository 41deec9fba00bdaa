"""Hang watchdog: a step far slower than usual leaves every rank's stack in the run directory.

Each rank runs a daemon thread that watches the time since its current step began (data wait
included: a stuck read is the usual hang), and then the logging, checkpoint and stop-agreement
collectives after the step (a node lost while the others wait there is the same hang; that time
is watched but kept out of the median, and ``limit_s`` must exceed a checkpoint's gather). When
it exceeds ``max(floor_s, factor x median of the recent step times)``, the rank writes, into
``runs/<run>/hangs/step-<N>/rank<R>.txt``, what it was doing (step, epoch, the batch it trains or
the one it waits for: bucket and clip ids) and all its threads' Python stacks (faulthandler), and
rank 0 logs an alert. No collective is involved, so every rank that is stuck reports, also when
the others are waiting in NCCL. With ``limit_s > 0`` a step that lasts that long ends the process
with a message naming the stacks, instead of waiting out the collective timeout, naming the ranks
that wrote no report for the step (stopped answering: a dead, frozen or cut-off node), and the
launcher then stops the other ranks. A rank's hang report comes at the threshold, so ``floor_s``
well below ``limit_s`` lets every live rank report first.

Independently of hangs, every rank's stacks can be asked for at any time with SIGUSR1 (what
``reelcache cluster dump`` falls back to without py-spy): they go to ``runs/<run>/stacks/``.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import statistics
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from reelcache.settings import setting


@dataclass
class WatchdogConfig:
    """[watchdog]: when a slow step counts as a hang (stacks dumped) and when it ends the run."""

    factor: float = setting(
        10.0, "a step slower than this x the median step time is a hang (above 1: a median step is none) ...", gt=1
    )
    floor_s: float = setting(600.0, "... and slower than this many seconds: every rank dumps its stacks", ge=0)
    limit_s: float = setting(0.0, "a step this long ends the run with a message (0 = wait for NCCL)", ge=0)

    def build(self, *, run_dir, rank: int, alert=None) -> Watchdog:
        """This rank's watchdog over ``run_dir``; ``alert``: where a hang is said (rank 0's log)."""
        return Watchdog(self, run_dir=run_dir, rank=rank, alert=alert)


def install_stack_signal(run_dir, rank: int):
    """SIGUSR1 appends all threads' stacks to runs/<run>/stacks/rank<R>.txt. Returns the file."""
    d = Path(run_dir) / "stacks"
    d.mkdir(parents=True, exist_ok=True)
    f = open(d / f"rank{rank:05d}.txt", "a")  # kept open for the process's life (faulthandler's need)
    faulthandler.register(signal.SIGUSR1, file=f, all_threads=True, chain=False)
    return f


# step times the median is taken over
WINDOW = 50


class Watchdog:
    """One rank's watchdog (``WatchdogConfig.build``): its [watchdog] section, and the run's directory and rank."""

    def __init__(self, cfg: WatchdogConfig, *, run_dir, rank: int, alert=None):
        self.cfg = cfg
        self.dir, self.rank = Path(run_dir) / "hangs", rank
        self.times: deque[float] = deque(maxlen=WINDOW)
        self.alert = alert or (lambda msg: None)
        self._lock = threading.Lock()
        self._start: float | None = None
        self._info: dict = {}
        self._fired = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="reelcache-watchdog", daemon=True)
        self._thread.start()

    def begin(self, step: int, **info) -> None:
        """A step starts (its data wait included); ``info``: what it will work on, if known."""
        with self._lock:
            self._start, self._fired = time.monotonic(), False
            self._info = {"step": step, **info}

    def working_on(self, **info) -> None:
        with self._lock:
            self._info.update(info)

    def end(self, record: bool = True) -> None:
        """The watched span ends; its time joins the median unless ``record`` is false (the log and
        checkpoint collectives after a step are watched, but are no step time)."""
        with self._lock:
            if self._start is not None and record:
                self.times.append(time.monotonic() - self._start)
            self._start = None

    def threshold(self) -> float:
        median = statistics.median(self.times) if self.times else 0.0
        return max(self.cfg.floor_s, self.cfg.factor * median)

    def _run(self) -> None:
        while not self._stop.wait(min(1.0, max(0.05, self.cfg.floor_s / 10))):
            with self._lock:
                start, info, fired = self._start, dict(self._info), self._fired
            if start is None:
                continue
            elapsed = time.monotonic() - start
            if not fired and elapsed > self.threshold():
                with self._lock:
                    self._fired = True
                path = self.report(info, elapsed)
                self.alert(
                    f"step {info.get('step')} has run {elapsed:.0f} s (threshold {self.threshold():.0f} s): "
                    f"rank stacks in {path.parent}"
                )
            if self.cfg.limit_s and elapsed > self.cfg.limit_s:
                path = self.report(info, elapsed)
                os.write(
                    2,
                    f"reelcache: rank {self.rank}: step {info.get('step')} exceeded the hard limit "
                    f"({elapsed:.0f} s > watchdog.limit_s = {self.cfg.limit_s:.0f} s); stacks in {path}. "
                    f"{self.silent_ranks(path.parent)}"
                    "Ending this process instead of waiting for the collective timeout.\n".encode(),
                )
                os._exit(3)

    def silent_ranks(self, step_dir: Path) -> str:
        """The ranks of the run that wrote no report into this step's folder: every live rank stuck in
        the step writes one (its threshold is below the limit), so these are the ranks that stopped
        answering (dead, frozen, or cut off with their storage), named with their hosts."""
        from reelcache.cluster import ranks

        try:
            recs = ranks.read(self.dir.parent)
        except Exception:  # no records (a run without them): nothing to name
            return ""
        reported = {int(p.stem[4:]) for p in step_dir.glob("rank*.txt") if p.stem[4:].isdigit()}
        silent = [r for r in recs if r.rank not in reported]
        if not silent:
            return ""
        named = ", ".join(f"rank {r.rank} on {r.host} (pid {r.pid})" for r in silent)
        return f"Stopped answering (no report for this step): {named}. "

    def report(self, info: dict, elapsed: float) -> Path:
        d = self.dir / f"step-{info.get('step', 0):08d}"
        d.mkdir(parents=True, exist_ok=True)
        path = d / f"rank{self.rank:05d}.txt"
        with open(path, "w") as f:
            f.write(
                json.dumps(
                    {
                        **info,
                        "rank": self.rank,
                        "pid": os.getpid(),
                        "elapsed_s": round(elapsed, 3),
                        "threshold_s": round(self.threshold(), 3),
                        "time": time.time(),
                    },
                    default=str,
                )
                + "\n"
            )
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
        return path

    def close(self) -> None:
        self._stop.set()
