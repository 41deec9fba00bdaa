"""``ingest run UNIT``: probe, filter and shard one unit's rows; write its sidecar last.

Ingest's part of the unit runner (base/units.py), for each row of the unit:

1. before: the row filters (malformed row, duplicate, empty caption); no file is touched;
2. work: the probe, in an isolated worker process with a deadline (ingest/probe.py, reelcache/isolate.py);
3. steps: the probe filters (too short), then ``write``: the file's content hash is taken (blake2b-256 of
   its bytes, ``clips.content_hash``; a video a takedown withdrew is rejected here, ``withdrawn``, under any
   name: catalog/withdrawn.py) and the clip is appended to a size-capped tar shard (base/shards.py).

Then captions of accepted clips are tagged in one batch (noun_count), and the sidecar parquet,
one row per input row with the `clips` schema, is written and renamed into place. A unit whose
sidecar exists is skipped; anything else a killed run left behind is deleted first, once the
unit's lease is held (a second run of the same unit refuses, or waits with ``--wait``).

Reading a source may reject a clip; writing our outputs may not: a failed write of a shard or
the sidecar (reelcache/files.py: OutputError) fails the unit with no sidecar and no shards left.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from pathlib import Path

from reelcache import UserError
from reelcache.base import s3, units
from reelcache.base.shards import ShardWriter, ShortRead, SourceError, content_hash, write_all
from reelcache.base.units import Reject, Unit, claimed, parse_unit, unit_rows
from reelcache.catalog.db import clips_table
from reelcache.catalog.levels import count_nouns, tagger_name
from reelcache.catalog.withdrawn import withdrawn_hashes
from reelcache.files import OutputError, tmp_name
from reelcache.ingest.filters import PROBE_FILTERS, ROW_FILTERS
from reelcache.ingest.plan import finished_units, load_plan, remote_dir, source_dir
from reelcache.ingest.probe import probe
from reelcache.isolate import isolated_map
from reelcache.log import say
from reelcache.rejects import Reason

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
    "content_hash",
}


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


def run_unit(root: str, unit: str, wait: bool = False) -> dict:
    source, index = parse_unit(unit)
    cfg, plan = load_plan(root, source)
    if not 0 <= index < plan["num_units"]:
        raise UserError(f"{unit}: the plan for {source!r} has units 0..{plan['num_units'] - 1}")
    sdir, remote = source_dir(root, source), remote_dir(root, source)
    if remote is not None:  # the takedowns' record, read from the mirror (catalog/withdrawn.py)
        s3.sync_down(s3.parse(root) / "withdrawn", sdir.parent.parent / "withdrawn", lambda r: r.endswith(".parquet"))
    with claimed(sdir, index, wait=wait, remote=remote) as claim:
        if claim is None:
            say(f"{unit}: already done, skipped")
            return {"unit": unit, "skipped": True}
        return _run(unit, cfg, plan, sdir, index, claim, root)


def take_probe(row: dict, probed: dict, read: dict | None = None, held: dict | None = None) -> None:
    """The probe's fields into the row (the file wins), and what the source table stated otherwise. A probe of an
    object in S3 says how many bytes it fetched: counted in `read` (the unit's summary), not kept in the row; a
    small object's bytes it read whole are kept in `held` (by clip id) for this row's ``write``, the next step."""
    probed = dict(probed)
    data = probed.pop("probe_data", None)
    if held is not None:
        held.clear()  # a row's bytes are used by its own write, right after, or never (the row was rejected)
        if data is not None:
            held[row["clip_id"]] = data
    fetched = probed.pop("probe_bytes", None)
    if fetched is not None and read is not None:
        read["probed"] += 1
        read["bytes"] += fetched
        read["of"] += probed["file_size"]
    row.update(probed)
    row["stated_mismatch"] = mismatch(row, probed)


def write(
    row: dict, *, writer: ShardWriter, sdir: Path, withdrawn: dict[str, str], held: dict | None = None
) -> Reject | None:
    """A step, the last: hash the video's bytes (a withdrawn one is rejected) and append the clip (video
    bytes, .json meta, .txt caption) to the unit's shard. A source that cannot be read is the clip's
    reject; a failed write (OutputError) fails the unit. The hash reads the file once, and the copy into
    the shard then comes from the page cache."""
    ext = Path(row["path"]).suffix.lower().lstrip(".") or "video"
    if s3.is_url(row["path"]):
        data = (held or {}).pop(row["clip_id"], None)
        if data is not None and len(data) == row["file_size"]:  # read whole by its probe: no request
            row["content_hash"] = hashlib.blake2b(data, digest_size=32).hexdigest()
            if (td := withdrawn.get(row["content_hash"])) is not None:
                return Reason.withdrawn, f"the same video was withdrawn by takedown {td}"
            return _append(row, ext, data, writer=writer, sdir=sdir)
        return _write_object(row, ext, writer=writer, sdir=sdir, withdrawn=withdrawn)
    try:
        row["content_hash"] = content_hash(row["path"], 0, row["file_size"])
    except ShortRead as e:
        return Reason.truncated, f"{e}; file changed during ingest"
    except OSError as e:
        return Reason.missing_file, f"cannot read for hashing: {e}"
    if (td := withdrawn.get(row["content_hash"])) is not None:
        return Reason.withdrawn, f"the same video was withdrawn by takedown {td}"
    return _append(row, ext, row["path"], writer=writer, sdir=sdir)


def _append(row: dict, ext: str, video, *, writer: ShardWriter, sdir: Path) -> Reject | None:
    meta = {k: v for k, v in row.items() if k not in _NOT_IN_JSON and v is not None}
    try:
        name, offsets = writer.write_sample(
            row["clip_id"],
            [
                (ext, video, row["file_size"]),
                ("json", json.dumps(meta, sort_keys=True).encode(), None),
                ("txt", (row["text"] or "").encode(), None),
            ],
        )
    except ShortRead as e:
        return Reason.truncated, str(e)
    except SourceError as e:
        return Reason.missing_file, f"cannot read for sharding: {e}"
    row.update(shard=f"raw/{sdir.name}/{name}", shard_offset=offsets[ext], ext=ext)
    return None


FETCH_BYTES = 8 * 1024 * 1024  # an object is copied into the shard in ranged reads of this size


def _write_object(row: dict, ext: str, *, writer: ShardWriter, sdir: Path, withdrawn: dict) -> Reject | None:
    """``write`` of a source video in S3: its bytes streamed by ranged reads of FETCH_BYTES (each exact, base/s3.py:
    ``get_range``) into a local temporary file beside the staged shard, hashed on the way; a withdrawn one is
    rejected; then appended to the shard as a local file is, and the temporary removed. The object gone or
    resized since it was probed is the row's reject naming it; a store failure after its retries (ours, not the
    row's) fails the unit."""
    url, size = row["path"], row["file_size"]
    h = s3.head(url)
    if h is None:
        return Reason.missing_file, f"{url}: no such object (deleted since it was probed?)"
    if int(h["ContentLength"]) != size:
        return Reason.truncated, f"{url}: {h['ContentLength']} bytes, {size} when probed; object changed during ingest"
    tmp = tmp_name(sdir / f"{writer.stem}-source.{ext}")  # a killed run's is removed by its rerun (Claim.clear)
    try:
        digest = hashlib.blake2b(digest_size=32)
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as e:
            raise OutputError(tmp, e) from e
        try:
            for start in range(0, size, FETCH_BYTES):
                try:
                    chunk = s3.get_range(url, start, min(FETCH_BYTES, size - start))
                except s3.S3Error:
                    if s3.head(url) is None:
                        return Reason.missing_file, f"{url}: no such object (deleted while it was copied)"
                    raise
                digest.update(chunk)
                try:
                    write_all(fd, chunk)
                except OSError as e:
                    raise OutputError(tmp, e) from e
        finally:
            os.close(fd)
        row["content_hash"] = digest.hexdigest()
        if (td := withdrawn.get(row["content_hash"])) is not None:
            return Reason.withdrawn, f"the same video was withdrawn by takedown {td}"
        return _append(row, ext, tmp, writer=writer, sdir=sdir)
    finally:
        tmp.unlink(missing_ok=True)


def tagged_table(rows: list[dict], tagger: str):
    """The sidecar: the accepted clips' captions tagged in one batch (noun_count), every row as `clips`."""
    ok = [r for r in rows if r["status"] == "ok"]
    if ok:
        for r, n in zip(ok, count_nouns([r["text"] for r in ok], tagger)):
            r["noun_count"], r["noun_tagger"] = n, tagger_name(tagger)
    for r in rows:
        r.pop("row_error", None), r.pop("duplicate_of", None)
    return clips_table(rows)


def _run(unit: str, cfg, plan: dict, sdir: Path, index: int, claim, root) -> dict:
    rows = unit_rows(sdir, index)
    for r in rows:
        r.update(source=sdir.name, unit=unit, status="ok")
    fn = functools.partial(probe, max_file_mb=cfg.thresholds.max_file_mb, verify=cfg.verify)
    timeout = cfg.decode_timeout if cfg.verify == "decode" else cfg.probe_timeout
    limits = {
        "workers": cfg.workers,
        "timeout": timeout,
        "memory_mb": cfg.worker_memory_mb,
        "init": functools.partial(bound_stall, timeout),
    }
    writer = ShardWriter(sdir, f"{index:06d}", int(cfg.shard_mb * 1e6), claim=claim)
    read = {"probed": 0, "bytes": 0, "of": 0}  # probes of objects in S3: bytes fetched, of the objects' sizes
    held: dict[str, bytes] = {}  # a small object's bytes from its probe, for its write (take_probe)
    done = units.run(
        Unit(
            name=unit,
            rows=rows,
            before=[functools.partial(f, t=cfg.thresholds) for f in ROW_FILTERS],
            work=lambda todo: _probed(isolated_map(fn, [r["path"] for r in todo], **limits)),
            take=functools.partial(take_probe, read=read, held=held),
            steps=[functools.partial(f, t=cfg.thresholds) for f in PROBE_FILTERS]
            + [
                functools.partial(
                    write, writer=writer, sdir=sdir, withdrawn=withdrawn_hashes(sdir.parent.parent), held=held
                )
            ],
            writer=writer,
            claim=claim,
            finish=functools.partial(tagged_table, tagger=cfg.tagger),
            reasons=Reason,
            compression="zstd",
            what="file",
        )
    )
    dt, reasons = done["seconds"], done["reasons"]
    ok = [r for r in rows if r["status"] == "ok"]
    nbytes = sum(r["file_size"] for r in ok)
    say(
        f"{unit}: {len(rows)} rows, {len(ok)} ok, {len(rows) - len(ok)} rejected"
        + (f" ({', '.join(f'{k} {v}' for k, v in reasons.most_common())})" if reasons else "")
        + f"; {len(writer.finished)} shard(s), {nbytes / 1e6:.1f} MB in {dt:.1f} s "
        f"({len(rows) / dt:.0f} rows/s, {nbytes / 1e6 / dt:.1f} MB/s); "
        + (
            f"probes of {read['probed']} objects in S3 read {read['bytes'] / 1e6:.1f} MB of their "
            f"{read['of'] / 1e6:.1f} MB; "
            if read["probed"]
            else ""
        )
        + f"{len(finished_units(root, sdir.name))} of {plan['num_units']} units of {sdir.name} done"
    )
    return {
        "unit": unit,
        "rows": len(rows),
        "ok": len(ok),
        "rejected": dict(reasons),
        "shards": [p.name for p in writer.finished],
        "bytes": nbytes,
        "seconds": dt,
        "probe_bytes": read["bytes"],
    }


def bound_stall(timeout: float) -> None:
    """In a probe worker: a read of an object in S3 with no byte for a third of the probe's deadline ends as a
    stall (``S3Error``: the unit fails, its rerun reads again), so that a stalled store is never the row's
    'timeout' reject, which blames the video. A file slow for its own sake still meets the deadline."""
    os.environ["REELCACHE_S3_STALL_S"] = f"{max(0.1, min(s3.stall_s(), timeout / 3)):g}"


def _probed(results):
    """The isolated probes' results, in order; a store failure of a probe of an object in S3 (after its retries,
    or a stall) is not the row's reject: it fails the unit (the probe of a missing object is the row's reject)."""
    try:
        for item, res in results:
            if isinstance(res, s3.S3Error):
                raise res
            yield item, res
    finally:
        results.close()  # the workers stopped now, not when the generator is collected
