"""One run directory, one writer: the lease a training start takes before it reads or writes its run.

Two starts of one run (a job submitted twice, a requeue racing its own dying predecessor, a human
restarting what still runs) would otherwise both resume from the same checkpoint, write the same
``ckpt-*``, log the same steps twice in metrics and the consumed log, share one wandb run, and the
second would delete the first's ``.tmp-ckpt-*`` while it is being written. So a start takes
``runs/<run>/run.lease``, the lease units already take (base/lease.py: an ``O_EXCL`` file naming
host, boot id, pid and its start time, the Slurm job; a heartbeat; stale when its holder is gone),
before it looks at the run's checkpoints, and gives it back when it exits. Rank 0's checkpointer
verifies the lease before it publishes each checkpoint: a holder frozen on another node for longer
than the lease's TTL, whose run a new start has taken over, fails instead of writing into it.

Rank 0 of the launch holds it; every other rank learns the outcome through the process group
before it does anything, so a refused start is refused on every rank at once. With ``--wait`` (what
the Slurm script runs) rank 0 polls the lease, and the ranks agree on each poll, until the holder
is gone; without it, a live holder is one line naming it. A start refused here, or by any check
after it, leaves nothing in ``runs/<run>/`` that was not there before: the trainer writes nothing
until every check has passed, and the folders made for the lease are removed when they stay empty.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

from reelcache import UserError
from reelcache.base import lease as leases
from reelcache.base.lease import Busy, Lease, acquire
from reelcache.base.s3 import S3Error
from reelcache.log import say, say_error

NAME = "run.lease"


class RunLease:
    """The run directory's lease on rank 0 (None elsewhere); ``release`` gives it back, and removes
    the folders this start made when it leaves them empty (a refused start)."""

    def __init__(self, lease: Lease | None, made: list[Path]):
        self.lease, self.made = lease, made

    def release(self) -> None:
        if self.lease is not None:
            self.lease.release()
            self.lease = None
        for folder in reversed(self.made):  # the run directory first, then runs/ if this start made it
            try:
                os.rmdir(folder)
            except OSError:  # not empty: the run wrote in it
                break
        self.made = []


def take(run_dir: Path, par, *, wait: bool = False, poll_s: float = 1.0, remote=None) -> RunLease:
    """Collective: the lease of ``run_dir`` on rank 0; a UserError (rank 0) or a quiet exit with status 2
    (the other ranks) when a live run holds it and ``wait`` is off, or the directory cannot be written.
    ``remote``: the run's prefix in S3 (train/runfiles.py), where the lease is an object (base/lease.py)."""
    told = False
    while True:
        lease, made, outcome = None, [], ("held", "")
        if par.rank == 0:
            made = [p for p in (run_dir.parent, run_dir) if not p.exists()]
            try:
                run_dir.mkdir(parents=True, exist_ok=True)
                lease = acquire(remote / NAME if remote is not None else run_dir / NAME)
            except Busy as e:
                outcome = ("busy", _busy(run_dir, e, remote) if not wait else f"{e}: waiting for it to end (--wait)")
            except OSError as e:
                outcome = ("error", f"cannot write in {run_dir}: {e.strerror or e}")
            except S3Error as e:
                outcome = ("error", str(e))
        launched = os.environ.get("REELCACHE_LAUNCH")  # `train --nproc`: its launcher says each distinct line once
        if par.rank == 0 and outcome[0] != "held" and not (outcome[0] == "busy" and wait) and not launched:
            # said before the gather: once the others have it they exit, and torchrun then stops this rank with
            # SIGTERM, which under load came before a line said after it (CI saw the refusal with no line)
            say_error(outcome[1])
        state, message = par.gather_objects(outcome)[0]
        if state == "held":
            return RunLease(lease, made)
        RunLease(None, made).release()
        if state == "busy" and wait:
            if par.rank == 0 and not told:
                say(message)
                told = True
            time.sleep(poll_s)
            continue
        if launched:
            raise UserError(message)
        raise SystemExit(2)  # rank 0 said why, once, above


def _busy(run_dir: Path, e: Busy, remote=None) -> str:
    """Why the start is refused, and what ends the wait: a holder on this machine can be stopped; one
    on another node may be dead, so its lease's age and when it turns stale are said; a lease file that
    is not one is abandoned a short while after it was last written (base/lease.py). A run in S3 is stopped
    by its stop object (train/checkpoint.py: ``StopRequest``), not a file."""
    path, h = (remote / NAME if remote is not None else run_dir / NAME), e.holder
    stop = (
        f"put the object {remote / 'stop'}: aws s3 cp /dev/null {remote / 'stop'}"
        if remote is not None
        else f"touch {run_dir / 'stop'}"
    )
    if h.token == "unreadable":
        return (
            f"run {run_dir.name}: {path} is not a lease (not the JSON reelcache writes: another program's "
            f"file, or a write cut off); it counts as abandoned {leases.GUARD_S:g} s after it was last written, "
            f"in {max(0.0, leases.GUARD_S - h.age_s):.0f} s: run this again then (--wait does), or delete it "
            "if no start of this run is running"
        )
    here = h.host == socket.gethostname() and h.boot_id == leases.boot_id()
    if here:
        return (
            f"run {run_dir.name} is running: {path} is held by {h.describe()}: wait for it "
            f"with --wait, or stop it first ({stop}), or train under another run.name"
        )
    return (
        f"run {run_dir.name} is running on another node: {path} is held by {h.describe()}; if that node is "
        f"gone, the lease turns stale when its heartbeat is {leases.TTL_S:g} s old (REELCACHE_LEASE_TTL_S), in "
        f"{max(0.0, leases.TTL_S - h.age_s):.0f} s, and --wait starts then; if it runs, stop it "
        f"({stop}), or train under another run.name"
    )
