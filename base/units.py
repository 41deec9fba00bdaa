"""One runner for the units of every stage: rows -> isolated work -> steps -> shard writer -> sidecar last.

A unit is a slice of a frozen plan (``plan`` wrote it; ``run UNIT`` runs it anywhere, any number of
times). Ingest and cache run their units the same way; only their steps differ:

1. ``claimed``: the unit's lease is taken and what a killed run left is removed (``begin_unit``); a unit
   whose sidecar exists is skipped. The unit's ``Claim`` holds the lease and publishes and deletes the
   unit's files: its shards (``ShardWriter(..., claim=)``), store indexes (``claim.publish``), what a
   failed run leaves (``claim.unlink``, ``claim.clear``) and, last, its sidecar (``claim.write_sidecar``).
   Each checks first that the lease is still this run's: a run that lost it publishes and deletes
   nothing, and says so;
2. the unit's rows are its sidecar's rows, one per planned row; the ``before`` steps run on each, touching
   no file (a malformed row, a clip that fits no bucket);
3. the rows still kept that need it (``todo``) go through the stage's isolated map (reelcache/isolate.py:
   a probe, a decode in worker processes with a deadline, results in row order). A worker's answer is
   the row's value (``take``) or its reject (``worker_reject``: timeout, crashed, undecodable, or the
   reason the work raised);
4. each row then passes the stage's ``steps``, a plain list, in order. A step is a function of the row
   returning None (keep) or ``(reason, detail)`` (reject: recorded, the row goes no further). A ``Batch``
   in the list gathers rows of one key and runs one function over them (the VAE encodes a bucket's
   clips together); the steps after it run on those rows then. The last step usually appends the row
   to the unit's shard writer;
5. the shard writer is closed, the stage's ``finish`` makes the sidecar's table from all rows (caption
   tagging, repeated views, store indexes), and the claim writes the sidecar and renames it into place
   last: a present sidecar means a finished unit.

Errors are a policy (base/shards.py): a source that cannot be read is that row's reject; a failure to
write our own outputs is an OutputError that fails the unit: its shards are removed (``abort`` for what
else the stage wrote), no sidecar is written, and a rerun gives the clean result. The model is
datatrove's ``PipelineStep`` and its filters' ``(keep, reason)``: small steps composed as a list, and
every drop recorded with its reason (counted per reason in the unit's summary line).
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections import Counter
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from reelcache import UserError
from reelcache.base import lease as leases
from reelcache.base import s3
from reelcache.base.shards import ShardWriter
from reelcache.files import OutputError, atomic_path, tmp_name
from reelcache.isolate import Failed

# reelcache.progress (tqdm) and pyarrow are imported where used: `reelcache --help` starts without them.

Reject = tuple  # (reason: a member of the stage's vocabulary, detail: str | None)
Step = Callable[[dict], "Reject | None"]


@dataclass
class Batch:
    """A step that gathers rows of one ``key`` and runs ``run`` over up to ``size`` of them at once;
    the steps after it run on those rows then. Rows left over are run together at the end, in the
    order their keys first came."""

    key: Callable[[dict], Hashable]
    size: int
    run: Callable[[list[dict]], None]


@dataclass
class Unit:
    """What a stage hands the runner for one unit."""

    name: str  # as `plan` prints it, e.g. 'openvid/000012'
    rows: list[dict]  # the sidecar's rows, one per planned row, status 'ok' or rejected already
    work: Callable[[list[dict]], Iterator[tuple[Any, Any]]]  # the isolated map: rows -> (item, result), in order
    take: Callable[[dict, Any], None]  # a worker's result that is no reject, into its row
    steps: list  # Step | Batch, in order, on each row after its work
    writer: ShardWriter  # the unit's shards (given the claim): closed before the sidecar, removed when the unit fails
    claim: Claim  # writes the unit's sidecar last, while this run holds the unit's lease
    finish: Callable[[list[dict]], Any]  # every row done -> the sidecar's pyarrow table
    reasons: type[Enum]  # the stage's reject vocabulary; it names timeout, crashed, undecodable
    before: list = field(default_factory=list)  # Steps on every row before any work (no file touched)
    todo: Callable[[dict], bool] = lambda row: True  # which kept rows need the work
    abort: Callable[[], None] = lambda: None  # the unit failed: remove what else it wrote (through the claim)
    compression: str = "snappy"  # of the sidecar parquet
    what: str = "row"  # what the progress bar counts
    postfix: Callable[[], dict] | None = None  # the progress bar's extra fields


def parse_unit(unit: str) -> tuple[str, int]:
    """'<name>/<NNNNNN>' (as `plan` prints it) -> (name, index)."""
    try:
        name, idx = unit.strip().rsplit("/", 1)
        return name, int(idx)
    except ValueError:
        raise UserError(f"{unit!r} is not a unit: expected '<name>/<NNNNNN>' as printed by `plan`") from None


def unit_rows(directory: Path, index: int) -> list[dict]:
    """The unit's slice of the frozen plan: row group `index` of `_plan/input.parquet`."""
    import pyarrow.parquet as pq

    return pq.ParquetFile(Path(directory) / "_plan" / "input.parquet").read_row_group(index).to_pylist()


class Claim:
    """A unit this process runs, holding the unit's lease (base/lease.py): every file of the unit is published
    and deleted through it, wherever the file lives (the unit's directory, the latent store), and each of its
    methods checks first that the lease is still this run's. A run that lost it (frozen past the lease's TTL
    on another node, its unit taken over) neither publishes over nor deletes the new holder's files, and
    fails saying it lost the lease. Made by ``begin_unit``; ``release`` gives the lease back.

    A unit whose folder is in object storage (``remote``, an ``s3://`` folder, docs/STORAGE.md) writes each file
    in ``directory``, a local staging folder, under a temporary name as before; publishing it uploads it whole
    under its name in ``remote`` (one PUT, or a multipart upload completed after the lease is checked: no reader
    sees part of it) and removes the local copy; removals delete the objects; its lease is an object too."""

    def __init__(self, directory: Path, stem: str, lease: leases.Lease, remote: s3.Url | None = None):
        self.directory, self.stem, self.lease, self.remote = Path(directory), stem, lease, remote
        self.sidecar = self.directory / f"{stem}.parquet"  # present (locally, or as an object): the unit is finished

    def where(self, path) -> s3.Url | Path:
        """Where a file of the unit named by its local `path` is published: the path, or its object."""
        if self.remote is None:
            return Path(path)
        path = Path(path)
        if path.is_relative_to(self.directory):
            return self.remote / path.relative_to(self.directory).as_posix()
        # a file of the unit outside its folder (a cache unit's store shards): the same place under the root,
        # the local folder that mirrors the remote's bucket being the unit's folder less the remote's key
        up = len([p for p in self.remote.key.split("/") if p])
        top = self.directory.parents[up - 1] if up else self.directory
        if self.directory.relative_to(top).as_posix() != self.remote.key.strip("/"):
            raise ValueError(f"{path}: not a file of the unit {self.directory} mirrored at {self.remote}")
        return s3.Url(self.remote.bucket, path.relative_to(top).as_posix())

    def place(self, tmp, path) -> None:
        """A written, durable temporary file of the unit into place as `path`, the lease checked just before it
        becomes visible: renamed, or uploaded whole to its object (and the local copy removed)."""
        if self.remote is None:
            self.verify()
            os.replace(tmp, path)
            return
        with s3.Upload(self.where(path)) as up, open(tmp, "rb") as f:
            while chunk := f.read(s3.PART_BYTES):
                up.write(chunk)
            self.verify()  # parts sent; nothing visible yet
            up.complete()
        Path(tmp).unlink(missing_ok=True)

    def held(self) -> bool:
        return self.lease.held()

    def verify(self) -> None:
        """Raise LostLease unless the lease is still this run's (before a file is renamed into place)."""
        self.lease.verify()

    @contextmanager
    def publish(self, path):
        """``atomic_path`` for a file of the unit: the lease is checked once the body wrote the file, before
        it is made durable and renamed into place (a sidecar, a store index)."""
        if self.remote is not None:
            tmp = tmp_name(Path(path))
            try:
                yield tmp
                self.place(tmp, path)
            finally:
                tmp.unlink(missing_ok=True)
            return
        try:
            with atomic_path(path) as tmp:
                yield tmp
                self.verify()
        except OutputError as e:  # a unit's file: the unit is not finished
            raise OutputError(path, e.__cause__) from e.__cause__

    def write_sidecar(self, table, compression: str = "snappy") -> None:
        """The unit's sidecar, `table` as parquet, renamed into place last: the unit is finished."""
        import pyarrow.parquet as pq

        with self.publish(self.sidecar) as tmp:
            pq.write_table(table, tmp, compression=compression)

    def unlink(self, paths) -> int:
        """Remove `paths` while the lease is this run's, checked before each removal; the first time it is
        not, stop: the files under those names are the new holder's. Returns how many were removed."""
        n = 0
        for p in paths:
            if not self.held():
                break
            if s3.is_url(p):
                s3.delete(p)
            else:
                if self.remote is not None:  # a staged file's object
                    s3.delete(self.where(p))
                Path(p).unlink(missing_ok=True)
            n += 1
        return n

    def clear(self, directory: Path | None = None, stem: str | None = None) -> int:
        """Remove what a killed run of this unit may have left under `stem` in `directory` (by default the
        unit's own): temporaries and unclaimed shards, through ``unlink``."""
        directory, stem = Path(directory or self.directory), stem or self.stem
        found = [
            *directory.glob(f".{stem}-*.tar.tmp*"),
            *directory.glob(f"{stem}-*.tar"),
            *directory.glob(f".{stem}.parquet.tmp*"),
            *directory.glob(f".{stem}-source.*.tmp*"),  # a source object being copied (ingest/run.py)
        ]
        if self.remote is not None:
            remote = self.remote if directory == self.directory else self.where(directory)
            shard = re.compile(rf"{re.escape(stem)}-\d+\.tar")
            found += [o for o in s3.list_objects(f"{remote}/{stem}-") if shard.fullmatch(o["Key"].rsplit("/", 1)[-1])]
            found = [s3.Url(remote.bucket, o["Key"]) if isinstance(o, dict) else o for o in found]
            for up in s3.list_uploads(f"{remote}/{stem}-"):  # a killed run's unfinished shard uploads
                if self.held():
                    s3.abort_upload(remote.bucket, up["Key"], up["UploadId"])
        return self.unlink(found)

    def release(self) -> None:
        """Give the unit's lease back (idempotent; never another run's): when the run ended, whichever way."""
        self.lease.release()


def finished(directory: Path, stem: str, remote: s3.Url | None = None) -> bool:
    """Whether the unit's sidecar exists (as a file, or as an object in `remote`): the unit is finished."""
    return (
        s3.head(remote / f"{stem}.parquet") is not None
        if remote is not None
        else (directory / f"{stem}.parquet").exists()
    )


def begin_unit(directory: Path, index: int, *, wait: bool = False, remote: s3.Url | None = None) -> Claim | None:
    """The unit protocol shared by every stage: None when the unit finished (its sidecar exists), else the
    unit's Claim, once this process holds the unit's lease and has removed whatever a killed run left behind
    in `directory`. `remote`: the unit's folder in S3, its files staged in `directory` (``Claim``).

    Another live run holding the lease is a UserError naming it, or with `wait`, waited for. The lease is
    released by ``Claim.release`` (``claimed`` does it), or at exit.
    """
    from reelcache.log import say

    directory = Path(directory)
    stem = f"{index:06d}"
    if finished(directory, stem, remote):
        return None
    try:  # a file-size limit (ulimit -f) is then EFBIG, an OutputError, not a core dump
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    except (ValueError, AttributeError):
        pass  # not the main thread, or no such signal here
    unit = f"{directory.name}/{stem}"
    try:
        lease = leases.acquire(
            remote / f"{stem}.lease" if remote is not None else directory / f"{stem}.lease",
            wait=wait,
            on_wait=lambda h: say(f"{unit}: waiting for the run of {h.describe()}"),
        )
    except leases.Busy as e:
        raise UserError(
            f"{unit} is being run by {e.holder.describe()}; not touching its files. Use --wait to "
            f"wait for it. If that run is gone on another host, its lease {e.path} goes stale "
            f"{max(0, leases.TTL_S - e.holder.age_s):.0f} s from now ({leases.TTL_S:g} s without a "
            "heartbeat), or delete that file."
        ) from None
    except OSError as e:
        raise OutputError(directory / f"{stem}.lease", e) from e
    if finished(directory, stem, remote):  # the run we waited for finished it
        lease.release()
        return None
    claim = Claim(directory, stem, lease, remote)
    claim.clear()
    return claim


def reject(row: dict, reason, detail: str | None) -> None:
    """Record a row's reject: its reason's name in the vocabulary, and what exactly was wrong."""
    row.update(
        status="rejected",
        reject_reason=reason.value if isinstance(reason, Enum) else reason,
        reject_detail=None if detail is None else str(detail)[:2000],
    )


def first_reject(steps: list, row: dict) -> Reject | None:
    """The first (reason, detail) a list of steps gives for a row, or None: every step keeps it."""
    for step in steps:
        if hit := step(row):
            return hit
    return None


def worker_reject(result, reasons: type[Enum]) -> Reject | None:
    """An isolated worker's answer as a reject, or None when it is a result: a probe's ``Rejected`` keeps
    its reason; a worker past its deadline or dead is ``timeout`` or ``crashed``; any other error (and a
    worker's ``Failed("error")``) means the file could not be read: ``undecodable``."""
    if isinstance(result, Failed):
        return reasons(result.reason if result.reason in ("timeout", "crashed") else "undecodable"), result.detail
    if isinstance(result, BaseException):
        if isinstance(getattr(result, "reason", None), reasons):
            return result.reason, getattr(result, "detail", str(result))
        return reasons("undecodable"), f"{type(result).__name__}: {result}"
    return None


@contextmanager
def claimed(directory: Path, index: int, *, wait: bool = False, remote: s3.Url | None = None):
    """The unit's Claim while this process holds its lease (None: finished already, skip it). A run that
    fails after another run took its lease over fails with LostLease, whatever broke first (a shard
    whose temporary file the new holder removed, say): the message says the lease was lost."""
    claim = begin_unit(directory, index, wait=wait, remote=remote)
    try:
        yield claim
    except Exception as e:
        if claim is not None and not isinstance(e, leases.LostLease) and not claim.held():
            raise claim.lease.lost(e) from e
        raise
    finally:
        if claim is not None:
            claim.release()


def run(unit: Unit) -> dict:
    """Run one claimed unit to its sidecar; on any failure remove what it wrote and re-raise.
    Returns {"seconds", "reasons": Counter of reject reasons}."""
    t0 = time.monotonic()
    try:
        for row in unit.rows:
            if hit := first_reject(unit.before, row):
                reject(row, *hit)
        _through_work(unit)
        unit.writer.close()
        unit.claim.write_sidecar(unit.finish(unit.rows), unit.compression)  # last: the unit is now finished
    except BaseException:
        unit.writer.abort()  # no sidecar will name its shards: remove them (while the lease is ours)
        unit.abort()
        raise
    reasons = Counter(r["reject_reason"] for r in unit.rows if r["status"] != "ok")
    return {"seconds": time.monotonic() - t0, "reasons": reasons}


def _through_work(unit: Unit) -> None:
    from reelcache.progress import bar

    todo = [r for r in unit.rows if r["status"] == "ok" and unit.todo(r)]
    pending: dict[tuple[int, Hashable], list[dict]] = {}
    results = unit.work(todo)
    try:
        with bar(len(unit.rows), unit.name, unit.what) as pbar:
            pbar.update(len(unit.rows) - len(todo))
            for row, (_, result) in zip(todo, results):
                pbar.update(1)
                if hit := worker_reject(result, unit.reasons):
                    reject(row, *hit)
                    continue
                unit.take(row, result)
                _through(unit.steps, row, 0, pending)
                if unit.postfix:
                    pbar.set_postfix(**unit.postfix())
            # what is left of each batch, in the order the keys came (a flush may fill a later batch)
            while key := next((k for k, rows in pending.items() if rows), None):
                _flush(unit.steps, key, pending)
    finally:
        if hasattr(results, "close"):
            results.close()


def _through(steps: list, row: dict, start: int, pending: dict) -> None:
    """Row through steps[start:]: it stops at its first reject, or waits in a batch."""
    for i in range(start, len(steps)):
        step = steps[i]
        if isinstance(step, Batch):
            key = (i, step.key(row))
            pending.setdefault(key, []).append(row)
            if len(pending[key]) >= step.size:
                _flush(steps, key, pending)
            return
        if hit := step(row):
            reject(row, *hit)
            return


def _flush(steps: list, key: tuple[int, Hashable], pending: dict) -> None:
    rows, pending[key] = pending[key], []
    if rows:
        steps[key[0]].run(rows)
        for row in rows:
            _through(steps, row, key[0] + 1, pending)
