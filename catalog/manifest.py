"""``catalog manifest``: freeze a curriculum selection into a fingerprinted parquet.

A manifest is the list of ok clips a stage trains on, with what the loader and the bucket
planner need (shard, offset, frames, fps, size, level), sorted by clip id. Its fingerprint is a
function of the selected rows' values only: SHA-256 over every column (by name, in name order)
of the rows in clip-id order, each value in a canonical form (integers, and floats that hold
integers, as int64; other numbers as float64; text as UTF-8 with lengths; lists flattened with
lengths; nulls as a validity mask). Arrow types, chunking and schema metadata do not enter it,
so the same content rewritten by pandas or DuckDB keeps its fingerprint, and any changed value
(one offset) changes it. The same selection over the same catalog gives the same file name, and
a data position saved against one manifest can be refused for another.

With ``--cache`` of a cache of K views (``views = K``), a clip has a row per view it has a latent
for, with ``view`` (0 .. K-1) and ``views`` (K); the loader shows one view per epoch. A cache of one
view gives the columns it always gave (no ``view``), so its manifests keep their fingerprints.

Files live in ``ROOT/manifests/<name>-<fp16>.parquet`` with a ``.json`` beside them that records
the query; the `manifests` table lists them all. A name resolves exactly: the newest row of that
name in the `manifests` table, else the newest file matching ``<name>-<16 hex>.parquet`` (so
``stage1`` never resolves to ``stage1-wan-...``).
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from reelcache import UserError
from reelcache.catalog.db import db_path, open_catalog
from reelcache.catalog.sql import check_where, read_only_connection, where_sql
from reelcache.files import atomic_path
from reelcache.log import say

MANIFEST_COLUMNS = [
    "clip_id",
    "source",
    "shard",
    "shard_offset",
    "ext",
    "file_size",
    "num_frames",
    "fps",
    "duration",
    "width",
    "height",
    "aspect_ratio",
    "resolution",
    "noun_count",
    "level",
    "noun_pct",
    "text",
]
# With --cache: the loader's columns (latent shard and offset, bucket) first, the raw ones renamed; a
# row per view, and the cache's number of views K (its rows, rejected ones included, have views 0..K-1).
LATENT_QUERY = """
SELECT c.clip_id, l.view, l.bucket, l.shard, l.shard_offset, l.text_shard, l.text_offset,
       l.num_frames AS latent_frames, l.height AS latent_height, l.width AS latent_width, l.shape, l.text_len,
       c.source, c.shard AS raw_shard,
       c.shard_offset AS raw_shard_offset, c.num_frames, c.fps, c.width, c.height, c.noun_count, c.level,
       c.noun_pct, c.text, (SELECT max(view) + 1 FROM latents WHERE cache = $cache)::INTEGER AS views
FROM (SELECT * FROM clips WHERE status = 'ok' AND ({where})) c
JOIN latents l ON l.clip_id = c.clip_id AND l.cache = $cache AND l.status = 'ok'
    AND (l.text_key IS NULL OR l.text_shard IS NOT NULL)
ORDER BY c.clip_id, l.view
"""


FINGERPRINT_VERSION = b"reelcache-manifest-rows-v1"


def _canonical(h, arr) -> None:
    """Feed one column's values to `h` in a form independent of its Arrow type and layout."""
    t = arr.type
    if pa.types.is_dictionary(t):
        arr, t = arr.dictionary_decode(), t.value_type
    valid = arr.is_valid().to_numpy(zero_copy_only=False)
    h.update(b"V" + np.packbits(valid).tobytes())
    if pa.types.is_boolean(t) or pa.types.is_integer(t):
        h.update(b"I" + arr.cast(pa.int64()).fill_null(0).to_numpy().astype("<i8").tobytes())
    elif pa.types.is_floating(t) or pa.types.is_decimal(t):
        x = arr.cast(pa.float64()).fill_null(0.0).to_numpy(zero_copy_only=False)
        if np.all(np.isfinite(x)) and np.all(x == np.round(x)) and np.all(np.abs(x) < 2**53):
            h.update(b"I" + x.astype("<i8").tobytes())  # 25.0 written by one tool is 25 by another
        else:
            h.update(b"F" + x.astype("<f8").tobytes())
    elif pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        h.update(b"L" + pc.list_value_length(arr).fill_null(0).to_numpy().astype("<i8").tobytes())
        _canonical(h, pc.list_flatten(arr))
    else:
        text = arr.cast(pa.large_string()).fill_null("")
        h.update(b"S" + pc.binary_length(text).to_numpy().astype("<i8").tobytes())
        offsets = np.frombuffer(text.buffers()[1], dtype="<i8")[text.offset : text.offset + len(text) + 1]
        if len(text):
            h.update(memoryview(text.buffers()[2])[offsets[0] : offsets[-1]])


def fingerprint(table) -> str:
    """SHA-256 of the rows' values (see the module docstring): not of their Arrow encoding."""
    if "clip_id" in table.column_names and table.num_rows > 1:
        ids = table.column("clip_id")
        if not pc.all(pc.less_equal(ids.slice(0, len(ids) - 1), ids.slice(1))).as_py():
            table = table.sort_by("clip_id")  # rows are a set: fingerprint them in id order
    h = hashlib.sha256(FINGERPRINT_VERSION)
    h.update(table.num_rows.to_bytes(8, "little"))
    for name in sorted(n for n in table.column_names if not n.startswith("__")):  # "__": pandas' index
        h.update(b"\0C" + name.encode() + b"\0")
        col = table.column(name)
        _canonical(h, col.combine_chunks() if col.num_chunks != 1 else col.chunk(0))
    return h.hexdigest()


def _select(root: Path, where: str, cache: str | None):
    """(rows to freeze, ok clips matching `where`), read on a read-only connection (catalog/sql.py)."""
    query = (
        f"SELECT {', '.join(MANIFEST_COLUMNS)} FROM clips WHERE status = 'ok' AND {where_sql(where)} ORDER BY clip_id"
    )
    with read_only_connection(root) as con:
        try:
            table = con.sql(query).to_arrow_table()
            selected = table.num_rows
            if cache is not None and selected:
                table = con.sql(LATENT_QUERY.format(where=where_sql(where)), params={"cache": cache}).to_arrow_table()
                if table.num_rows and table["views"][0].as_py() == 1:  # one view: the columns it always had
                    table = table.drop_columns(["view", "views"])
        except duckdb.Error as e:
            raise UserError(f"--where {where!r} failed: {str(e).splitlines()[0]}") from e
    return table, selected


def make_manifest(root, name: str, where: str = "true", cache: str | None = None) -> Path:
    """Freeze ok clips matching `where`; with `cache`, only those it encoded, with their latents."""
    if not name.replace("-", "").replace("_", "").isalnum():
        raise UserError(f"--name {name!r}: use letters, digits, '-' and '_' only")
    where = check_where(where)
    root = Path(root)
    if not db_path(root).exists():  # never create an empty catalog to select nothing from
        raise UserError(f"no catalog at {db_path(root)}: run `reelcache catalog merge --root {root}` first")
    # busy (a merge runs) is said here, before any work; an older catalog is migrated (catalog/db.py)
    open_catalog(root, write=True).close()
    # The user's condition runs where it cannot write; the catalog is opened for writing again only to
    # record the manifest (a merge in between changes nothing: the file is named by its rows' content).
    table, selected = _select(root, where, cache)
    if selected == 0:
        raise UserError(f"no ok clips match --where {where!r}: no manifest written")
    clips = len(pc.unique(table["clip_id"])) if "view" in table.column_names else table.num_rows
    if table.num_rows == 0:
        raise UserError(
            f"none of the {selected} clips matching --where has latents in cache {cache!r}: "
            "run `reelcache cache run` on its units and `catalog merge` first"
        )
    if clips < 0.5 * selected:
        say(
            f"warning: only {clips} of {selected} selected clips have latents in cache {cache!r} "
            f"({100 * clips / selected:.1f}%)"
        )
    path = _write(root, name, where, cache, table, clips)
    views = f" ({table.num_rows} rows: {table['views'][0].as_py()} views)" if "view" in table.column_names else ""
    say(f"manifest {name!r}: {clips} clips{views}, fingerprint {path.stem[-16:]}")
    return path


def _write(root: Path, name: str, where: str, cache: str | None, table, clips: int) -> Path:
    """Write the manifest file and its .json, and record it in the `manifests` table."""
    fp = fingerprint(table)
    mdir = root / "manifests"
    mdir.mkdir(parents=True, exist_ok=True)
    path = mdir / f"{name}-{fp[:16]}.parquet"
    if not path.exists():
        with atomic_path(path) as tmp:
            pq.write_table(table, tmp, compression="zstd")
    info = {
        "name": name,
        "fingerprint": fp,
        "where": where,
        "cache": cache,
        "num_clips": clips,
        **({"num_rows": table.num_rows, "views": table["views"][0].as_py()} if "view" in table.column_names else {}),
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "path": path.name,
    }
    with atomic_path(path.with_suffix(".json")) as tmp:
        tmp.write_text(json.dumps(info, indent=2))
    con = open_catalog(root, write=True)
    try:
        # the newest row of a name is what the name resolves to: making an older selection again re-dates it
        con.execute(
            "INSERT INTO manifests VALUES (?, ?, ?, ?, ?, now()) ON CONFLICT (name, fingerprint) DO UPDATE "
            "SET path = excluded.path, where_sql = excluded.where_sql, num_clips = excluded.num_clips, "
            "created_at = excluded.created_at",
            [name, fp, str(path.relative_to(root)), where, clips],
        )
    finally:
        con.close()
    return path


def _from_catalog(root: Path, name: str) -> Path | None:
    """The newest manifest of exactly this name in the catalog's `manifests` table, if readable."""
    if not db_path(root).exists():
        return None
    try:
        con = duckdb.connect(str(db_path(root)), read_only=True)
    except duckdb.Error:
        return None  # a merge holds the file: the file pattern below still answers
    try:
        row = con.execute(
            "SELECT path FROM manifests WHERE name = ? ORDER BY created_at DESC LIMIT 1", [name]
        ).fetchone()
    except duckdb.Error:
        row = None
    finally:
        con.close()
    return root / row[0] if row and (root / row[0]).exists() else None


def resolve_manifest(root, name_or_path) -> Path:
    """A manifest file by path, or by exact name (never a longer name that starts with it)."""
    p = Path(name_or_path)
    if p.is_file():
        return p
    # UserError (a ValueError, which callers catch to add their option's name): a command that passes it
    # on, `cache plan` among them, says it in one line, never a traceback
    if p.is_absolute() or len(p.parts) > 1:  # a path, not a name: glob() takes no absolute pattern
        raise UserError(f"no manifest file {p}")
    root = Path(root or ".")
    name = str(name_or_path)
    if found := _from_catalog(root, name):
        return found
    pattern = re.compile(re.escape(name) + r"-[0-9a-f]{16}\.parquet")
    files = [q for q in root.joinpath("manifests").glob(f"{name}-*.parquet") if pattern.fullmatch(q.name)]
    if not files:
        raise UserError(
            f"no manifest {name!r}: not a file, not in {root}'s catalog, and no "
            f"{root / 'manifests' / (name + '-<16 hex>.parquet')}"
        )

    def made(q: Path) -> float:  # the .json is rewritten each time the manifest is made
        j = q.with_suffix(".json")
        return (j if j.exists() else q).stat().st_mtime

    return max(files, key=made)


def read_manifest(path) -> tuple[object, str]:
    """(table, fingerprint) of a manifest file, the fingerprint re-derived from its content."""
    table = pq.read_table(path)
    return table, fingerprint(table)
