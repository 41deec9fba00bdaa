"""One runner for the units of every stage: rows -> isolated work -> steps -> shard writer -> sidecar last.

A unit is a slice of a frozen plan (``plan`` wrote it; ``run UNIT`` runs it anywhere, any number of
times). Ingest and cache run their units the same way; only their steps differ:

1. ``claimed``: the unit's lease is taken and what a killed run left is removed (base/shards.py:
   ``begin_unit``); a unit whose sidecar exists is skipped. The ``Claim`` (sidecar and lease) is handed
   to everything that writes or deletes for the unit (its shard writers, store indexes, ``abort``),
   which check the lease first: a run that lost it publishes and deletes nothing, and says so;
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
   tagging, repeated views, store indexes), and the sidecar is written and renamed into place last: a
   present sidecar means a finished unit.

Errors are a policy (base/shards.py): a source that cannot be read is that row's reject; a failure to
write our own outputs is an OutputError that fails the unit: its shards are removed (``abort`` for what
else the stage wrote), no sidecar is written, and a rerun gives the clean result. The model is
datatrove's ``PipelineStep`` and its filters' ``(keep, reason)``: small steps composed as a list, and
every drop recorded with its reason (counted per reason in the unit's summary line).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from reelcache.base.lease import LostLease
from reelcache.base.shards import Claim, ShardWriter, atomic_path, begin_unit, end_unit
from reelcache.isolate import Failed

# reelcache.progress (tqdm) and pyarrow are imported where used, as base/shards.py does.

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
    writer: ShardWriter  # the unit's shards (given claim.lease): closed before the sidecar, removed when the unit fails
    claim: Claim  # the unit's sidecar, written last by `run` under its lease
    finish: Callable[[list[dict]], Any]  # every row done -> the sidecar's pyarrow table
    reasons: type[Enum]  # the stage's reject vocabulary; it names timeout, crashed, undecodable
    before: list = field(default_factory=list)  # Steps on every row before any work (no file touched)
    todo: Callable[[dict], bool] = lambda row: True  # which kept rows need the work
    abort: Callable[[], None] = lambda: None  # the unit failed: remove what else it wrote (under claim.lease)
    compression: str = "snappy"  # of the sidecar parquet
    what: str = "row"  # what the progress bar counts
    postfix: Callable[[], dict] | None = None  # the progress bar's extra fields


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
def claimed(directory: Path, index: int, *, wait: bool = False):
    """The unit's Claim while this process holds its lease (None: finished already, skip it). A run that
    fails after another run took its lease over fails with LostLease, whatever broke first (a shard
    whose temporary file the new holder removed, say): the message says the lease was lost."""
    claim = begin_unit(directory, index, wait=wait)
    try:
        yield claim
    except Exception as e:
        if claim is not None and not isinstance(e, LostLease) and not claim.lease.held():
            raise claim.lease.lost(e) from e
        raise
    finally:
        end_unit(claim)


def run(unit: Unit) -> dict:
    """Run one claimed unit to its sidecar; on any failure remove what it wrote and re-raise.
    Returns {"seconds", "reasons": Counter of reject reasons}."""
    import pyarrow.parquet as pq

    t0 = time.monotonic()
    try:
        for row in unit.rows:
            if hit := first_reject(unit.before, row):
                reject(row, *hit)
        _through_work(unit)
        unit.writer.close()
        table = unit.finish(unit.rows)
        with atomic_path(unit.claim.sidecar, lease=unit.claim.lease) as tmp:  # last: the unit is now finished
            pq.write_table(table, tmp, compression=unit.compression)
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
