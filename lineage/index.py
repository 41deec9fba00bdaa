"""A run's consumed log, indexed by clip: what makes one clip's lineage a lookup, not a scan of the whole log.

The trainer writes its consumed log as small parts per rank (train/loader.py ConsumedLog: a part every
checkpoint interval), tens of thousands of files over a long run on many ranks. Finding one clip in them means
reading every part's clip ids. The index keeps the same rows sorted by clip id in few large files, whose row
groups' min/max statistics let DuckDB skip all but the few that can hold the clips asked for:

    ROOT/runs/<run>/lineage/seg-NNNNNN.parquet        (clip_id, generation, epoch, step, rank, view) of its parts,
                                                      padding left out, sorted by clip_id
    ROOT/runs/<run>/lineage/seg-NNNNNN.steps.parquet  every (generation, epoch, step) of its parts
    ROOT/runs/<run>/lineage/seg-NNNNNN.json           the parts it covers (name, size); written last

A segment covers the parts that existed when it was made; ``update`` (run by `reelcache lineage`) adds one
segment for the parts written since, so a live run's log is indexed as it grows. Reading never needs the index
to be current: parts no segment covers are read from the log itself (the viewer, which writes nothing, reads
that way). A part whose size changed since it was indexed (a log rewritten by hand) makes ``update`` drop the
index and build it again. Parts are written once (atomically, under names that carry their generation) and
never change, so a segment stays right.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import duckdb

from reelcache.files import atomic_path

DIR = "lineage"
ROW_GROUP = 65_536  # rows per row group: the unit DuckDB skips by its clip_id statistics


def parts(run_dir: Path) -> dict[str, int]:
    """The consumed log's parts: name -> size, by name. One ``scandir``: a long run's log has tens of thousands
    of parts; listing them through pathlib (a Path and a stat each) took 0.4 s of CPU at 19,200 parts, 0.1 s
    this way (bench/bench_lineage.py at full scale)."""
    try:
        with os.scandir(Path(run_dir) / "consumed") as it:
            found = {e.name: e.stat().st_size for e in it if e.name.endswith(".parquet") and not e.name.startswith(".")}
    except FileNotFoundError:
        return {}
    return dict(sorted(found.items()))


def segments(run_dir: Path) -> list[tuple[Path, dict[str, int]]]:
    """Complete segments (their .json exists), oldest first, with the parts each covers."""
    d = run_dir / DIR
    out = []
    for j in sorted(d.glob("seg-*.json")) if d.is_dir() else []:
        try:
            out.append((j.with_suffix(""), json.loads(j.read_text())["parts"]))
        except (OSError, ValueError, KeyError):
            continue  # unreadable: as if absent (its parts are read from the log)
    return out


def covered(run_dir: Path) -> tuple[list[Path], list[str]]:
    """(segment stems whose parts are all unchanged, the names of the parts none of them covers), from one
    listing of the log."""
    now = parts(run_dir)
    segs, cov = [], set()
    for stem, ps in segments(run_dir):
        if all(now.get(n) == s for n, s in ps.items()):
            segs.append(stem)
            cov.update(ps)
    return segs, [n for n in now if n not in cov]


def _sql_text(path: Path) -> str:
    """A path inside a SQL string literal (COPY TO takes no parameter): a quote in a root or run name doubled."""
    return str(path).replace("'", "''")


def update(run_dir: Path) -> int:
    """Index the parts no segment covers yet; returns how many. A changed part rebuilds the index."""
    run_dir = Path(run_dir)
    now = parts(run_dir)
    old = segments(run_dir)
    if any(now.get(n) != s for _, ps in old for n, s in ps.items()):
        shutil.rmtree(run_dir / DIR, ignore_errors=True)
        old = []
    done = {n for _, ps in old for n in ps}
    new = {n: s for n, s in now.items() if n not in done}
    if not new:
        return 0
    d = run_dir / DIR
    d.mkdir(parents=True, exist_ok=True)
    seq = 1 + max((int(stem.name.split("-")[1]) for stem, _ in old), default=0)
    stem = d / f"seg-{seq:06d}"
    files = [str(run_dir / "consumed" / n) for n in sorted(new)]
    con = duckdb.connect()
    try:
        con.execute("SET preserve_insertion_order = false")
        with atomic_path(stem.with_suffix(".parquet")) as tmp:
            con.execute(
                f"""COPY (SELECT clip_id, generation, epoch, step, rank, view FROM read_parquet($files)
                          WHERE NOT pad ORDER BY clip_id)
                    TO '{_sql_text(tmp)}' (FORMAT parquet, ROW_GROUP_SIZE {ROW_GROUP}, COMPRESSION zstd)""",
                {"files": files},
            )
        with atomic_path(Path(f"{stem}.steps.parquet")) as tmp:
            con.execute(
                f"""COPY (SELECT DISTINCT generation, epoch, step FROM read_parquet($files))
                    TO '{_sql_text(tmp)}' (FORMAT parquet)""",
                {"files": files},
            )
    finally:
        con.close()
    with atomic_path(stem.with_suffix(".json")) as tmp:
        tmp.write_text(json.dumps({"parts": new}))
    return len(new)
