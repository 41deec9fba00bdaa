"""Unit leases: at most one run of a unit at a time, on one node or many sharing a file system.

Two runs of one unit (two GNU parallel jobs, an ssh job retried while the first still runs, a
human) would otherwise each clear the other's files on start. A run takes the unit's lease first:
the file ``<stem>.lease`` beside the unit's outputs, created with ``O_CREAT | O_EXCL`` (atomic on
local file systems and on NFSv3+, unlike ``fcntl`` locks, which some network file systems ignore).
It names its holder: host name, boot id, pid, the pid's start time, when it started, the Slurm job
it runs in (if any), and a token.

A lease is *stale* (its holder is gone) when:

- same host (equal host name and boot id): the pid is not running, or it is a zombie, or it runs
  with another start time (the pid was reused);
- another host, or the same host after a reboot: its heartbeat is older than ``TTL_S`` (300 s, or
  ``REELCACHE_LEASE_TTL_S``). The holder's daemon thread refreshes the file's mtime every
  ``HEARTBEAT_S`` (a tenth of it, at most 30 s); the age is measured by
  the storage's own clock (the mtime of a file just created beside it), so clock skew between
  nodes does not matter, only how long a holder can be frozen (SIGSTOP, a hung mount).

A stale lease is taken over under a short-lived guard file (``.<stem>.lease.takeover``, itself
stale after ``GUARD_S``), re-read under the guard, so that two runs finding the same stale lease
cannot both take it. The trade-off of the age rule: a holder on another node frozen for longer
than ``TTL_S`` loses its lease; it checks that the lease is still its own (``Lease.verify``,
``Lease.held``) before each file it publishes (a shard, a store index, its sidecar) and each it deletes,
wherever the unit writes (base/units.py: ``Claim``), so the loser fails, saying it lost the lease,
instead of overwriting or deleting the winner's files.

The same lease lives in object storage when the unit's outputs do (a root ``s3://bucket/prefix``,
docs/STORAGE.md): the lease is then an object, ``<stem>.lease`` beside the unit's objects, and each file
operation has its conditional-write twin (base/s3.py), one mechanism with two places (``_Files``,
``_Objects``):

- taken by a create that only succeeds when no object is there (``If-None-Match: *``: a second create gets
  412 and loses, as ``O_EXCL`` does);
- refreshed by rewriting it with ``If-Match`` on the ETag this holder last wrote, its heartbeat count one up
  (new bytes, so a new ETag; a holder whose lease was taken over gets 412 and stops refreshing);
- its age is the server's clock's: the response's ``Date`` minus the object's ``Last-Modified`` (the POSIX
  lease uses the storage's mtime);
- a stale one is taken over by overwriting it with ``If-Match`` on the ETag it was judged stale by: of two
  runs finding it stale, one wins (no guard object needed);
- released by a delete with ``If-Match`` on our ETag, checked to hold our token first.
"""

from __future__ import annotations

import atexit
import json
import os
import secrets
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from reelcache import UserError
from reelcache.base import s3
from reelcache.settings import env_seconds


def _ttl_from_env() -> tuple[float, str]:
    """``REELCACHE_LEASE_TTL_S`` (default 300): a shorter staleness for tests and small clusters whose
    storage never freezes long. A bad value is reported by ``acquire`` (one line, before any work)."""
    try:
        return env_seconds("REELCACHE_LEASE_TTL_S", 300, ge=1, le=86400), ""
    except UserError as e:
        return 300.0, str(e)


TTL_S, _TTL_ERROR = _ttl_from_env()  # another host's lease without a heartbeat for this long is stale
HEARTBEAT_S = min(30.0, TTL_S / 10)  # how often a holder refreshes its leases' mtime
GUARD_S = 30.0  # a takeover guard (or a lease still being written) older than this is stale


def boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def pid_start(pid: int) -> int | None:
    """The pid's start time in clock ticks since boot, /proc/<pid>/stat field 22 (None: gone, a
    zombie, or no /proc). With the boot id it names one process for good: rank records hold it too."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # the command name may contain spaces
    return None if fields[0] == "Z" else int(fields[19])


def _pid_alive(pid: int, start: int | None) -> bool:
    if Path("/proc/self/stat").exists():
        now = pid_start(pid)
        return now is not None and (start is None or now == start)
    try:  # no /proc: existence only
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _storage_now(directory: Path) -> float:
    """Current time by the clock that stamps files in `directory` (a file server's, on NFS)."""
    probe = directory / f".lease-clock-{os.getpid()}-{secrets.token_hex(4)}"
    fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        return os.fstat(fd).st_mtime
    finally:
        os.close(fd)
        probe.unlink(missing_ok=True)


@dataclass
class Holder:
    host: str
    boot_id: str
    pid: int
    pid_start: int | None
    started_at: str
    token: str
    age_s: float = 0.0  # seconds since its last heartbeat, by the storage clock
    slurm_job: str | None = None  # SLURM_JOB_ID of the holder, where it runs in a Slurm job
    tag: str | None = None  # an object lease's ETag when it was read (what a takeover's If-Match names)

    def describe(self) -> str:
        job = f", Slurm job {self.slurm_job}" if self.slurm_job else ""
        return f"host {self.host} pid {self.pid}{job} (started {self.started_at}, heartbeat {self.age_s:.0f} s ago)"


def _me() -> dict:
    pid = os.getpid()
    return {
        "host": socket.gethostname(),
        "boot_id": boot_id(),
        "pid": pid,
        "pid_start": pid_start(pid),
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "slurm_job": os.environ.get("SLURM_JOB_ID"),
    }


def _holder(raw: bytes | str, age_s: float, tag: str | None = None) -> Holder:
    try:
        doc = json.loads(raw)
        holder = Holder(**{k: doc[k] for k in ("host", "boot_id", "pid", "pid_start", "started_at", "token")})
        holder.slurm_job = doc.get("slurm_job")
        if isinstance(holder.pid_start, str):  # leases written before it was an int hold a string
            holder.pid_start = int(holder.pid_start)
    except (ValueError, TypeError, KeyError):
        holder = Holder("?", "?", -1, None, "?", "unreadable")
    holder.age_s, holder.tag = age_s, tag
    return holder


def read_holder(path) -> Holder | None:
    """Who holds the lease at `path` (a file, or an object ``s3://...``; None: no lease). A lease still being
    written reads as live."""
    return _place(path).read(path)


def is_stale(holder: Holder) -> bool:
    if holder.token == "unreadable":
        return holder.age_s > GUARD_S
    if holder.host == socket.gethostname() and holder.boot_id == boot_id():  # this machine, this boot
        return not _pid_alive(holder.pid, holder.pid_start)
    return holder.age_s > TTL_S


class Busy(Exception):
    """The lease is held by a live run."""

    def __init__(self, path: Path, holder: Holder):
        super().__init__(f"{path} is held by {holder.describe()}")
        self.path, self.holder = path, holder


class Lease:
    """A held lease; `release()` removes it (also at interpreter exit)."""

    def __init__(self, path, token: str, body: bytes = b"", tag: str | None = None):
        self.path, self.token = path, token
        self.body, self.tag = body, tag  # an object lease: what it holds and the ETag of our last write of it
        self.owner = os.getpid()  # a forked child inherits this object (and atexit), not the lease
        # the heartbeat's refresh and release, one at a time: an object lease refreshed between release's read of
        # its ETag and its conditional delete would make the delete fail, and the lease stay behind until stale
        self._turn, self.released = threading.Lock(), False

    def held(self) -> bool:
        """Whether the lease (file or object) is still ours."""
        try:
            return _place(self.path).token(self.path) == self.token
        except (OSError, ValueError, s3.S3Error):
            return False

    def refresh(self) -> None:
        """The heartbeat: the lease's age back to zero, by the storage's clock (nothing once released)."""
        with self._turn:
            if not self.released:
                _place(self.path).refresh(self)

    def verify(self) -> None:
        """Raise LostLease unless the lease (file or object) is still ours (checked before publishing results). An
        object lease that cannot be read (the store failing past its retries, a stall) is that S3Error, naming the
        lease's object: not knowing is not having lost it, and nothing is published either way."""
        try:
            ours = _place(self.path).token(self.path) == self.token
        except s3.S3Error:  # a UserError, so a ValueError: told apart from an unreadable lease first
            raise
        except (OSError, ValueError):
            ours = False
        if not ours:
            raise self.lost()

    def lost(self, failure: BaseException | None = None) -> LostLease:
        """The error of a run whose lease is no longer its own (`failure`: what then failed in it)."""
        try:
            holder = read_holder(self.path)
        except (OSError, s3.S3Error):
            holder = None
        now = f"{holder.describe()} holds it now" if holder is not None else "its file is gone"
        then = f"; this run then failed: {str(failure).splitlines()[0][:300]}" if failure is not None else ""
        return LostLease(
            f"lost the lease {self.path} ({now}; a run whose heartbeat stops for longer than {TTL_S:g} s, "
            f"frozen or cut off, is taken over{then}): not publishing this run's results, and leaving the "
            "files under its names to the run that holds the lease now"
        )

    def release(self) -> None:
        if os.getpid() != self.owner:
            return
        _HELD.pop(str(self.path), None)
        with self._turn:
            if self.released:
                return
            self.released = True
            try:
                _place(self.path).remove(self)
            except (OSError, ValueError, s3.S3Error):
                pass


class LostLease(UserError):
    """Another run took this run's lease over (it was frozen for longer than TTL_S)."""


_HELD: dict[str, Lease] = {}
_lock = threading.Lock()
_beat: threading.Thread | None = None


def _heartbeat() -> None:
    while True:
        time.sleep(HEARTBEAT_S)
        with _lock:
            held = list(_HELD.values())
        for lease in held:
            try:
                lease.refresh()
            except (OSError, s3.S3Error):
                pass  # a missed beat; a lease lost for good is found by `held` before anything is published


def _release_all() -> None:
    for lease in list(_HELD.values()):
        lease.release()


atexit.register(_release_all)


def _body() -> tuple[str, bytes]:
    token = secrets.token_hex(8)
    return token, json.dumps({**_me(), "token": token}).encode()


class _Files:
    """A lease as a file: O_EXCL create, mtime heartbeat, takeover under a guard file, removal if ours."""

    @staticmethod
    def create(path) -> Lease | None:
        token, body = _body()
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return None
        try:
            os.write(fd, body)
            os.fsync(fd)
        finally:
            os.close(fd)
        return Lease(Path(path), token)

    @staticmethod
    def read(path) -> Holder | None:
        path = Path(path)
        try:
            st = path.stat()
            raw = path.read_text()
        except FileNotFoundError:
            return None
        return _holder(raw, max(0.0, _storage_now(path.parent) - st.st_mtime))

    @staticmethod
    def token(path) -> str | None:
        return json.loads(Path(path).read_text()).get("token")

    @staticmethod
    def refresh(lease: Lease) -> None:
        os.utime(lease.path)  # no times given: stamped by the storage's clock

    @staticmethod
    def take_over(path, stale: Holder) -> Lease | None:
        _remove_if_stale(Path(path), stale)
        return None  # the caller creates it anew

    @staticmethod
    def remove(lease: Lease) -> None:
        if json.loads(Path(lease.path).read_text()).get("token") == lease.token:
            Path(lease.path).unlink()


class _Objects:
    """A lease as an object in S3: every step a conditional write (the module's docstring)."""

    @staticmethod
    def create(path) -> Lease | None:
        token, body = _body()
        try:
            tag = s3.put(path, body, if_none_match=True)
        except s3.PreconditionFailed:
            return None
        return Lease(s3.parse(path), token, body, tag)

    @staticmethod
    def read(path) -> Holder | None:
        got = s3.get_with_age(path)
        return None if got is None else _holder(got[0], got[2], got[1])

    @staticmethod
    def token(path) -> str | None:
        holder = _Objects.read(path)
        return None if holder is None else holder.token

    @staticmethod
    def refresh(lease: Lease) -> None:
        """Rewrite it with its heartbeat count one up: a new body, so a new ETag (an ETag is the body's MD5 on most
        stores: the same bytes again would keep the ETag a takeover judged stale, and let it through)."""
        doc = json.loads(lease.body)
        body = json.dumps({**doc, "beat": doc.get("beat", 0) + 1}).encode()
        try:
            lease.tag, lease.body = s3.put(lease.path, body, if_match=lease.tag), body
        except s3.PreconditionFailed:
            pass  # taken over: no longer ours to refresh (`held` says so)

    @staticmethod
    def take_over(path, stale: Holder) -> Lease | None:
        token, body = _body()
        try:
            tag = s3.put(path, body, if_match=stale.tag)
        except s3.PreconditionFailed:
            return None  # refreshed, or taken by another run meanwhile
        return Lease(s3.parse(path), token, body, tag)

    @staticmethod
    def remove(lease: Lease) -> None:
        holder = _Objects.read(lease.path)
        if holder is not None and holder.token == lease.token:
            try:
                s3.delete(lease.path, if_match=holder.tag)
            except s3.PreconditionFailed:
                pass


def _place(path):
    return _Objects if s3.is_url(path) else _Files


def take_over(path, stale: Holder) -> Lease | None:
    """Take over the lease at `path` that `stale` was read from and judged stale: an object lease is overwritten
    on the ETag it was read with (None: it changed since, refreshed or taken by another run); a file lease is
    removed under its guard, and None returned: create it anew (``acquire`` does both)."""
    return _place(path).take_over(path, stale)


def _remove_if_stale(path: Path, stale: Holder) -> None:
    """Remove the lease `stale` was read from, unless someone replaced it meanwhile (under a guard)."""
    guard = path.parent / f".{path.name}.takeover"
    try:
        fd = os.open(guard, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        os.close(fd)
    except FileExistsError:
        try:
            if _storage_now(path.parent) - guard.stat().st_mtime > GUARD_S:
                guard.unlink(missing_ok=True)  # a takeover that died half-way
        except FileNotFoundError:
            pass
        time.sleep(0.05)
        return
    try:
        now = read_holder(path)
        if now is not None and now.token == stale.token and is_stale(now):
            path.unlink(missing_ok=True)
    finally:
        guard.unlink(missing_ok=True)


def acquire(path, *, wait: bool = False, poll_s: float = 1.0, on_wait=None) -> Lease:
    """Take the lease at `path` (a file, or an object ``s3://...``): raise Busy if a live run holds it, or with
    `wait`, wait until it is free."""
    if _TTL_ERROR:
        raise UserError(_TTL_ERROR)
    global _beat
    place = _place(path)
    path = s3.parse(path) if s3.is_url(path) else Path(path)
    told = False
    while True:
        held = _HELD.get(str(path))
        if held is not None and held.owner == os.getpid():  # this process holds it (a unit re-run in-process)
            return held
        lease = place.create(path)
        if lease is None and (holder := read_holder(path)) is not None and is_stale(holder):
            lease = take_over(path, holder)
            if lease is None:
                continue
        if lease is not None:
            with _lock:
                _HELD[str(path)] = lease
                if _beat is None:
                    _beat = threading.Thread(target=_heartbeat, name="reelcache-lease-heartbeat", daemon=True)
                    _beat.start()
            return lease
        if holder is None:
            continue  # released between our create and our read: try again
        if not wait:
            raise Busy(path, holder)
        if not told and on_wait is not None:
            on_wait(holder)
            told = True
        time.sleep(poll_s)


def live_holders(directory: Path) -> list[tuple[Path, Holder]]:
    """Leases in `directory` whose holders are alive (e.g. to refuse deleting a source under them)."""
    out = []
    for p in sorted(Path(directory).glob("*.lease")):
        h = read_holder(p)
        if h is not None and not is_stale(h):
            out.append((p, h))
    return out
