"""The withdrawn record: clips a takedown removed (lineage/takedown.py), read by every stage that must refuse them.

    ROOT/withdrawn/<takedown>.parquet   one row per withdrawn clip (the `withdrawn` table of schema.sql)
    ROOT/withdrawn/<takedown>.json      the takedown's journal: what it removes, and whether it finished

The parquet files are the record; the catalog's `withdrawn` table is reloaded from them by every merge (and
written by the takedown itself), as `captions` is from the store's indexes. Ingest units and training ranks
read the files, never the catalog: ingest rejects a video whose content hash is withdrawn (reason
``withdrawn``), and a training run whose manifests hold a withdrawn clip refuses to start unless told to skip
it. A record is written before any shard is touched, so from the moment a takedown starts, nothing new
takes the clip in.
"""

from __future__ import annotations

from pathlib import Path

# pyarrow is imported where used: ingest's and the trainer's imports of this module stay light.

DIR = "withdrawn"
VIEW_CACHE = "view-cache"  # the viewer's files (view/preview.py)


def withdrawn_dir(root) -> Path:
    return Path(root) / DIR


def record_files(root) -> list[Path]:
    """The record's files, one per takedown, in name order."""
    d = withdrawn_dir(root)
    return sorted(p for p in d.glob("*.parquet") if not p.name.startswith(".")) if d.is_dir() else []


def read_record(root, columns: list[str] | None = None):
    """Every withdrawn row of the root as one Arrow table (the `withdrawn` table's schema); empty when none."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from reelcache.catalog.db import arrow_schema

    schema = arrow_schema("withdrawn")
    tables = [pq.read_table(p, schema=schema, columns=columns) for p in record_files(root)]
    return pa.concat_tables(tables) if tables else schema.empty_table().select(columns or schema.names)


def withdrawn_hashes(root) -> dict[str, str]:
    """content hash -> the takedown that withdrew it."""
    t = read_record(root, ["content_hash", "takedown"])
    return {h: td for h, td in zip(t["content_hash"].to_pylist(), t["takedown"].to_pylist()) if h}


def view_cache_key(clip_id: str) -> str:
    """How the name of every file the viewer derives from a clip begins (ROOT/view-cache/<kind>/[<cache>/]:
    its thumbnail, its views' windows and latent previews; view/preview.py), so a takedown finds them."""
    import hashlib

    return hashlib.sha1(clip_id.encode()).hexdigest()[:24]


def view_cache_files(root, clip_id: str) -> list[Path]:
    """The viewer's files of a clip that exist now (view_cache_key)."""
    d, key = Path(root) / VIEW_CACHE, view_cache_key(clip_id)
    return sorted(p for pattern in (f"*/{key}*", f"*/*/{key}*") for p in d.glob(pattern) if p.is_file())


def withdrawn_clips(root) -> dict[str, str]:
    """clip id -> the takedown that withdrew it."""
    t = read_record(root, ["clip_id", "takedown"])
    return dict(zip(t["clip_id"].to_pylist(), t["takedown"].to_pylist()))


def reload(con, root) -> int:
    """Reload the catalog's `withdrawn` table from the record's files (inside the caller's transaction)."""
    con.execute("DELETE FROM withdrawn")
    files = [str(p) for p in record_files(root)]
    if files:
        con.execute("INSERT INTO withdrawn BY NAME SELECT * FROM read_parquet(?, union_by_name = true)", [files])
    return con.execute("SELECT count(*) FROM withdrawn").fetchone()[0]
