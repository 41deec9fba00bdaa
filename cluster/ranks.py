"""The rank record: which process runs each rank of a training run, ``RUN/ranks/rank<R>.json``.

A pid alone is not an identity: pids are reused, and a decoy with the very same command line is
indistinguishable to ``pkill -f``. A record names its process by (host, pid, the kernel's start
time of that pid, boot id), a triple no later process can match, so ``cluster dump`` and
``cluster stop`` reach exactly the rank and skip a pid that now belongs to someone else. The
launcher's pid and start time are recorded too (torchrun restarts what a stop kills), and the
file the rank's faulthandler appends its stacks to on SIGUSR1.

Every rank writes its own record when it starts (:func:`write`), atomically: a reader sees the
previous record or the new one, never half of one. Rank 0 also removes the records of ranks at or
above its world size, left by an earlier launch with more ranks: they are not this run's. The
file is one JSON object whose keys are :class:`RankRecord`'s fields; :func:`read` refuses a
malformed one by name rather than act on a guess, and ignores keys it does not know (a newer
writer's).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from reelcache import UserError
from reelcache.base.lease import boot_id, pid_start
from reelcache.files import atomic_path

_NAME = re.compile(r"rank(\d+)\.json")


def proc_start(pid: int) -> int | None:
    """The kernel's start time of a process: clock ticks after boot, ``/proc/<pid>/stat`` field 22
    (None: gone, a zombie, or no /proc). The unit leases identify their holders by the same number."""
    return pid_start(pid)


@dataclass(frozen=True)
class RankRecord:
    rank: int
    world_size: int
    local_rank: int
    host: str  # socket.gethostname() of the rank's node
    pid: int
    proc_start: int | None  # see proc_start(); None where the node has no /proc
    boot_id: str  # the kernel's boot id ("" where it has none): a reboot makes every pid another's
    started: float  # time.time() when the rank wrote the record
    launcher_pid: int | None  # torchrun's or colossalai run's agent, or `reelcache train --nproc`
    launcher_proc_start: int | None
    stacks: str | None  # absolute path of the file SIGUSR1 makes the rank append its stacks to

    def __post_init__(self):
        for name in ("rank", "world_size", "local_rank", "pid"):
            _check(name, getattr(self, name), int)
        for name in ("proc_start", "launcher_pid", "launcher_proc_start"):
            _check(name, getattr(self, name), int, optional=True)
        _check("host", self.host, str)
        _check("boot_id", self.boot_id, str)
        _check("started", self.started, (int, float))
        _check("stacks", self.stacks, str, optional=True)
        if not self.host or self.world_size < 1 or self.pid < 1:
            raise ValueError(f"host {self.host!r}, world_size {self.world_size} or pid {self.pid} is impossible")

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, doc: dict) -> RankRecord:
        """A record from its JSON object; ValueError names what is missing or of the wrong type."""
        if not isinstance(doc, dict):
            raise ValueError(f"a rank record is a JSON object, not {type(doc).__name__}")
        # records written before the launcher was recorded have no launcher fields
        doc = {"launcher_pid": None, "launcher_proc_start": None, **doc}
        names = [f.name for f in dataclasses.fields(cls)]
        missing = [n for n in names if n not in doc]
        if missing:
            raise ValueError(f"no {', '.join(missing)}")
        return cls(**{n: doc[n] for n in names})

    def save(self, run_dir) -> Path:
        """Write this record as ``run_dir/ranks/rank<R>.json``, atomically; returns its path."""
        path = Path(run_dir) / "ranks" / f"rank{self.rank:05d}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(path) as tmp:
            Path(tmp).write_text(json.dumps(self.to_json()))
        return path


def _check(name: str, value, types, optional: bool = False) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, types) or (isinstance(value, int) and value < 0):
        want = "a number" if types == (int, float) else {int: "an integer >= 0", str: "a string"}[types]
        raise ValueError(f"{name} must be {want}{' or null' if optional else ''}, not {value!r}")


def write(run_dir, rank: int, world_size: int, local_rank: int, stacks_path) -> Path:
    """Record the calling process as `rank` of the run in `run_dir` (host, pid, start times, boot id
    filled in here); `stacks_path`: its SIGUSR1 stacks file, or None. Returns the record's path."""
    pid = os.getpid()
    # the launcher: the rank's parent (torchrun's or colossalai run's agent), or the `reelcache train --nproc` that
    # names itself in REELCACHE_LAUNCH (train/launch.py: its ranks may be children of its fork server)
    parent = int(os.environ.get("REELCACHE_LAUNCH") or os.getppid())
    rec = RankRecord(
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        host=socket.gethostname(),
        pid=pid,
        proc_start=proc_start(pid),
        boot_id=boot_id(),
        started=time.time(),
        launcher_pid=parent,
        launcher_proc_start=proc_start(parent),
        stacks=None if stacks_path is None else str(Path(stacks_path).resolve()),
    )
    path = rec.save(run_dir)
    if rank == 0:  # records of a launch with more ranks are not this run's
        for other in path.parent.iterdir():
            m = _NAME.fullmatch(other.name)
            if m and int(m[1]) >= world_size:
                other.unlink(missing_ok=True)
    return path


def read(run_dir) -> list[RankRecord]:
    """The run's rank records, by rank. A UserError names a malformed record (or says there is none)."""
    folder = Path(run_dir) / "ranks"
    recs = []
    for path in sorted(folder.glob("rank*.json")):
        m = _NAME.fullmatch(path.name)
        if not m:
            continue  # not a record (the trainer never writes such a name)
        try:
            rec = RankRecord.from_json(json.loads(path.read_text()))
        except FileNotFoundError:
            continue  # removed by rank 0 since the listing: a record of an earlier, larger launch
        except (OSError, ValueError) as e:
            raise UserError(f"malformed rank record {path}: {e}; move it away if it is not this run's") from None
        if rec.rank != int(m[1]):
            raise UserError(f"malformed rank record {path}: it records rank {rec.rank}")
        recs.append(rec)
    if not recs:
        raise UserError(f"no rank records in {folder}: is {run_dir} a run directory whose trainer has started?")
    return sorted(recs, key=lambda r: r.rank)
