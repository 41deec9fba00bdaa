"""``ingest run UNIT``: probe, filter and shard one unit's rows; write its sidecar last.

The steps, in order, for each row of the unit:

1. row filters (malformed row, duplicate, empty caption): no file is touched;
2. probe in an isolated worker process with a deadline (ingest/probe.py, ingest/isolate.py);
3. probe filters (too short);
4. accepted clips are appended to a size-capped tar shard (ingest/shards.py).

Then captions of accepted clips are tagged in one batch (noun_count), and the sidecar parquet,
one row per input row with the `clips` schema, is written and renamed into place. A unit whose
sidecar exists is skipped; anything else a killed run left behind is deleted first, once the
unit's lease is held (a second run of the same unit refuses, or waits with ``--wait``).

Reading a source may reject a clip; writing our outputs may not: a failed write of a shard or
the sidecar (catalog/shards.py: OutputError) fails the unit with no sidecar and no shards left.
"""

from __future__ import annotations

import functools
import json
import time
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq

from reelcache import UserError
from reelcache.catalog.db import clips_table
from reelcache.catalog.levels import count_nouns, tagger_name
from reelcache.catalog.shards import (
    ShardWriter,
    ShortRead,
    SourceError,
    atomic_path,
    begin_unit,
    end_unit,
    parse_unit,
    unit_rows,
)
from reelcache.ingest.filters import PROBE_FILTERS, ROW_FILTERS, Reason, Rejected, first_reject
from reelcache.ingest.plan import load_plan, source_dir
from reelcache.ingest.probe import probe
from reelcache.isolate import Failed, isolated_map
from reelcache.progress import bar, say

# Metadata columns that are not copied into the sample's .json inside the shard.
_NOT_IN_JSON = {
    "shard",
    "shard_offset",
    "status",
    "reject_reason",
    "reject_detail",
    "unit",
    "row_error",
    "duplicate_of",
    "level",
    "noun_pct",
    "noun_count",
    "noun_tagger",
}


# How an isolated probe that returned no result is recorded.
FAILED_REASON = {"timeout": Reason.timeout, "crashed": Reason.crashed}


def mismatch(stated: dict, p: dict) -> str | None:
    """What the source table claims and the file disagrees with (the file wins)."""
    out = []
    sf, sr, sd = stated.get("stated_num_frames"), stated.get("stated_fps"), stated.get("stated_duration")
    if sf is not None and abs(sf - p["num_frames"]) > 1:
        out.append(f"num_frames {sf}!={p['num_frames']}")
    if sr is not None and p["fps"] and abs(sr - p["fps"]) > 0.005 * p["fps"]:
        out.append(f"fps {sr:g}!={p['fps']:.4g}")
    if sd is not None and p["duration"] is not None and abs(sd - p["duration"]) > max(0.1, 0.01 * p["duration"]):
        out.append(f"duration {sd:g}!={p['duration']:.3g}")
    sw, sh = stated.get("stated_width"), stated.get("stated_height")
    if sw is not None and sh is not None and (sw, sh) != (p["width"], p["height"]):
        out.append(f"size {sw}x{sh}!={p['width']}x{p['height']}")
    return "; ".join(out) or None


def _reject(row: dict, reason: Reason | str, detail: str) -> None:
    row.update(status="rejected", reject_reason=Reason(reason).value, reject_detail=str(detail)[:2000])


def run_unit(root: str, unit: str, wait: bool = False) -> dict:
    source, index = parse_unit(unit)
    cfg, plan = load_plan(root, source)
    if not 0 <= index < plan["num_units"]:
        raise UserError(f"{unit}: the plan for {source!r} has units 0..{plan['num_units'] - 1}")
    sdir = source_dir(root, source)
    sidecar = begin_unit(sdir, index, wait=wait)
    if sidecar is None:
        say(f"{unit}: already done, skipped")
        return {"unit": unit, "skipped": True}
    try:
        return _run(unit, cfg, plan, sdir, index, sidecar)
    finally:
        end_unit(sidecar)


def _run(unit: str, cfg, plan: dict, sdir: Path, index: int, sidecar: Path) -> dict:
    source, stem = sdir.name, f"{index:06d}"
    t0 = time.monotonic()
    rows = unit_rows(sdir, index)
    for r in rows:
        r.update(source=source, unit=unit, status="ok")
        if hit := first_reject(ROW_FILTERS, r, cfg.thresholds):
            _reject(r, *hit)
    todo = [r for r in rows if r["status"] == "ok"]
    timeout = cfg.decode_timeout if cfg.verify == "decode" else cfg.probe_timeout
    fn = functools.partial(probe, max_file_mb=cfg.thresholds.max_file_mb, verify=cfg.verify)

    writer = ShardWriter(sdir, stem, int(cfg.shard_mb * 1e6))
    nbytes = 0
    try:
        with bar(len(rows), desc=unit, unit="file") as pbar:
            pbar.update(len(rows) - len(todo))
            results = isolated_map(
                fn,
                [r["path"] for r in todo],
                workers=cfg.workers,
                timeout=timeout,
                memory_mb=cfg.worker_memory_mb,
            )
            for r, (_, res) in zip(todo, results):
                pbar.update(1)
                if isinstance(res, Rejected):
                    _reject(r, res.reason, res.detail)
                elif isinstance(res, Failed):
                    _reject(r, FAILED_REASON.get(res.reason, Reason.undecodable), res.detail)
                elif isinstance(res, BaseException):
                    _reject(r, Reason.undecodable, f"{type(res).__name__}: {res}")
                else:
                    r.update(res)
                    r["stated_mismatch"] = mismatch(r, res)
                    if hit := first_reject(PROBE_FILTERS, r, cfg.thresholds):
                        _reject(r, *hit)
                        continue
                    _write(writer, r, sdir)
                    if r["status"] == "ok":
                        nbytes += r["file_size"]
        writer.close()

        ok = [r for r in rows if r["status"] == "ok"]
        if ok:
            for r, n in zip(ok, count_nouns([r["text"] for r in ok], cfg.tagger)):
                r["noun_count"], r["noun_tagger"] = n, tagger_name(cfg.tagger)
        for r in rows:
            r.pop("row_error", None), r.pop("duplicate_of", None)
        table = clips_table(rows)
        with atomic_path(sidecar) as tmp:  # last: the unit is now visible as finished
            pq.write_table(table, tmp, compression="zstd")
    except BaseException:
        writer.abort()  # its shards are named by no sidecar: remove them
        raise

    dt = time.monotonic() - t0
    reasons = Counter(r["reject_reason"] for r in rows if r["status"] != "ok")
    say(
        f"{unit}: {len(rows)} rows, {len(ok)} ok, {len(rows) - len(ok)} rejected"
        + (f" ({', '.join(f'{k} {v}' for k, v in reasons.most_common())})" if reasons else "")
        + f"; {len(writer.finished)} shard(s), {nbytes / 1e6:.1f} MB in {dt:.1f} s "
        f"({len(rows) / dt:.0f} rows/s, {nbytes / 1e6 / dt:.1f} MB/s); "
        f"{len(list(sdir.glob('[0-9]*.parquet')))} of {plan['num_units']} units of {sdir.name} done"
    )
    return {
        "unit": unit,
        "rows": len(rows),
        "ok": len(ok),
        "rejected": dict(reasons),
        "shards": [p.name for p in writer.finished],
        "bytes": nbytes,
        "seconds": dt,
    }


def _write(writer: ShardWriter, r: dict, sdir: Path) -> None:
    ext = Path(r["path"]).suffix.lower().lstrip(".") or "video"
    meta = {k: v for k, v in r.items() if k not in _NOT_IN_JSON and v is not None}
    try:
        name, offsets = writer.write_sample(
            r["clip_id"],
            [
                (ext, r["path"], r["file_size"]),
                ("json", json.dumps(meta, sort_keys=True).encode(), None),
                ("txt", (r["text"] or "").encode(), None),
            ],
        )
    except ShortRead as e:
        _reject(r, Reason.truncated, str(e))
        return
    except SourceError as e:  # a write failure (OutputError) is not the clip's fault: it fails the unit
        _reject(r, Reason.missing_file, f"cannot read for sharding: {e}")
        return
    r.update(shard=f"raw/{sdir.name}/{name}", shard_offset=offsets[ext], ext=ext)
