"""``catalog manifest``: freeze a curriculum selection into a fingerprinted parquet.

A manifest is the list of ok clips a stage trains on, with what the loader and the bucket
planner need (shard, offset, frames, fps, size, level), sorted by clip id. Its fingerprint is
the SHA-256 of its content (the Arrow IPC stream of the sorted table), so the same selection
over the same catalog gives the same file name, and a data position saved against one
manifest can be refused for another. Files live in ``ROOT/manifests/<name>-<fp16>.parquet``
with a ``.json`` beside them that records the query; the `manifests` table lists them all.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

from reelcache import UserError
from reelcache.catalog.db import open_catalog
from reelcache.catalog.shards import atomic_path

MANIFEST_COLUMNS = ["clip_id", "source", "shard", "shard_offset", "ext", "file_size", "num_frames", "fps",
                    "duration", "width", "height", "aspect_ratio", "resolution", "noun_count", "level",
                    "noun_pct", "text"]
# With --cache: the loader's columns (latent shard and offset, bucket) first, the raw ones renamed.
LATENT_QUERY = """
SELECT c.clip_id, l.bucket, l.shard, l.shard_offset, l.num_frames AS latent_frames, l.height AS latent_height,
       l.width AS latent_width, l.shape, l.text_len, c.source, c.shard AS raw_shard,
       c.shard_offset AS raw_shard_offset, c.num_frames, c.fps, c.width, c.height, c.noun_count, c.level,
       c.noun_pct, c.text
FROM (SELECT * FROM clips WHERE status = 'ok' AND ({where})) c
JOIN latents l ON l.clip_id = c.clip_id AND l.cache = $cache AND l.status = 'ok'
ORDER BY c.clip_id
"""


def fingerprint(table) -> str:
    import pyarrow as pa

    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table.combine_chunks())
    return hashlib.sha256(sink.getvalue()).hexdigest()


def make_manifest(root, name: str, where: str = "true", cache: str | None = None) -> Path:
    """Freeze ok clips matching `where`; with `cache`, only those it encoded, with their latents."""
    import duckdb
    import pyarrow.parquet as pq

    if not name.replace("-", "").replace("_", "").isalnum():
        raise UserError(f"--name {name!r}: use letters, digits, '-' and '_' only")
    root = Path(root)
    con = open_catalog(root, write=True)
    try:
        query = (f"SELECT {', '.join(MANIFEST_COLUMNS)} FROM clips WHERE status = 'ok' AND ({where}) "
                 "ORDER BY clip_id")
        try:
            table = con.sql(query).to_arrow_table()
            selected = table.num_rows
            if cache is not None and selected:
                table = con.sql(LATENT_QUERY.format(where=where), params={"cache": cache}).to_arrow_table()
        except duckdb.Error as e:
            raise UserError(f"--where {where!r} failed: {str(e).splitlines()[0]}") from e
        if selected == 0:
            raise UserError(f"no ok clips match --where {where!r}: no manifest written")
        if table.num_rows == 0:
            raise UserError(f"none of the {selected} clips matching --where has latents in cache {cache!r}: "
                            "run `reelcache cache run` on its units and `catalog merge` first")
        if table.num_rows < 0.5 * selected:
            from reelcache.progress import say

            say(f"warning: only {table.num_rows} of {selected} selected clips have latents in cache {cache!r} "
                f"({100 * table.num_rows / selected:.1f}%)")
        fp = fingerprint(table)
        mdir = root / "manifests"
        mdir.mkdir(parents=True, exist_ok=True)
        path = mdir / f"{name}-{fp[:16]}.parquet"
        if not path.exists():
            with atomic_path(path) as tmp:
                pq.write_table(table, tmp, compression="zstd")
        info = {"name": name, "fingerprint": fp, "where": where, "cache": cache, "num_clips": table.num_rows,
                "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "path": path.name}
        path.with_suffix(".json").write_text(json.dumps(info, indent=2))
        con.execute("INSERT INTO manifests VALUES (?, ?, ?, ?, ?, now()) ON CONFLICT DO NOTHING",
                    [name, fp, str(path.relative_to(root)), where, table.num_rows])
    finally:
        con.close()
    from reelcache.progress import say

    say(f"manifest {name!r}: {table.num_rows} clips, fingerprint {fp[:16]}")
    return path


def resolve_manifest(root, name_or_path) -> Path:
    p = Path(name_or_path)
    if p.exists():
        return p
    found = sorted(Path(root or ".").joinpath("manifests").glob(f"{name_or_path}-*.parquet"),
                   key=lambda q: q.stat().st_mtime)
    if not found:
        raise ValueError(f"no manifest {name_or_path!r}: not a file, and nothing matches "
                         f"{Path(root or '.') / 'manifests' / (str(name_or_path) + '-*.parquet')}")
    return found[-1]


def read_manifest(path) -> tuple[object, str]:
    """(table, fingerprint) of a manifest file, the fingerprint re-derived from its content."""
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    return table, fingerprint(table)
