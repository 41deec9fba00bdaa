"""``catalog merge``: load finished units' sidecars into the catalog, idempotently.

Two stages write sidecars: ingest (``raw/<source>/NNNNNN.parquet`` -> table ``clips``) and cache
(``latents/<cache>/NNNNNN.parquet`` -> table ``latents``); both go through the same code.
A unit is finished when its sidecar parquet exists (units rename it into place last). Merge
compares every sidecar's signature (size and mtime) with the `units` table: new sidecars are
inserted, changed ones (a unit that was deleted and re-run) replace their old rows, unchanged
ones are skipped, so merging twice changes nothing and merging after more units adds only those.
Units merged before whose sidecar is gone (``ingest plan --replace`` re-created the source, or a
unit was deleted to be redone) lose their rows: the catalog mirrors the sidecars on disk, so a
re-planned source never leaves a clip id twice. Only when the source's folder itself is missing
(an unmounted path looks exactly like that) do its rows stay, with a warning.
All of it, including the recomputed difficulty levels, happens in one transaction: a merge
killed half-way leaves the catalog as it was.

A catalog made by an older reelcache gains its missing columns when merge opens it
(``open_catalog``: catalog/db.py's ``MIGRATIONS``, the one way a table changes). Every merge reloads table
``captions`` from the store's caption indexes and fills the caption location of latent rows whose
caption another unit of their plan encoded (``merge_captions``), and table ``withdrawn`` from the
takedowns' record (catalog/withdrawn.py).

A root in S3 (``s3://bucket/prefix``, docs/STORAGE.md) is merged through its local mirror (base/s3.py:
``mirror_dir``): the sidecars, the store's caption indexes and the takedowns' record are brought down where
the mirror's copy differs from the object (size, Last-Modified), copies whose object is gone are removed, and
the catalog is ``<mirror>/catalog.duckdb``, on the local disk, as DuckDB needs. Orphan shards are not
counted there yet.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pyarrow as pa

from reelcache import UserError
from reelcache.base import s3
from reelcache.catalog.db import open_catalog
from reelcache.catalog.levels import recompute_levels
from reelcache.catalog.withdrawn import reload as reload_withdrawn
from reelcache.log import say
from reelcache.progress import bar


def _signature(p: Path) -> str:
    st = p.stat()
    return f"{st.st_size}:{st.st_mtime_ns}"


# stage -> (folder under ROOT holding <name>/NNNNNN.parquet sidecars, catalog table)
STAGES = {"ingest": ("raw", "clips"), "cache": ("latents", "latents")}


def merge_captions(con, root: Path) -> int:
    """Reload table ``captions`` from the store's caption indexes (cache/store.py) and give every ok
    latent row whose caption another unit encoded its location (``text_shard``, ``text_offset``,
    ``text_len``). Returns the number of stored caption embeddings."""
    con.execute("DELETE FROM captions")
    files = sorted(str(p) for p in (root / "store" / "text").glob("*/*.parquet"))
    if files:
        con.execute("INSERT INTO captions BY NAME SELECT * FROM read_parquet(?)", [files])
    con.execute(
        """UPDATE latents SET text_shard = c.shard, text_offset = c.shard_offset, text_len = c.text_len
           FROM (SELECT text_key, any_value(shard) AS shard, any_value(shard_offset) AS shard_offset,
                        any_value(text_len) AS text_len FROM captions GROUP BY text_key) c
           WHERE latents.text_key = c.text_key AND latents.text_shard IS NULL"""
    )
    return len(files) and con.execute("SELECT count(*) FROM captions").fetchone()[0]


def find_sidecars(root: Path, stage: str = "ingest") -> dict[str, Path]:
    """unit name -> sidecar path, for every finished unit of a stage."""
    folder = STAGES[stage][0]
    return {f"{p.parent.name}/{p.stem}": p for p in sorted((root / folder).glob("*/[0-9]*.parquet"))}


def orphan_shards(root: Path, units: dict[str, Path], stage: str = "ingest") -> list[Path]:
    """Shards with no sidecar: left by a killed unit, deleted when that unit re-runs."""
    done = {(p.parent.name, p.stem) for p in units.values()}
    return [
        t
        for t in sorted((root / STAGES[stage][0]).glob("*/[0-9]*-*.tar"))
        if (t.parent.name, t.name.split("-")[0]) not in done
    ]


def _merge_stage(con, root: Path, stage: str, sidecars: dict[str, Path], pbar) -> tuple[int, list[str], list[Path]]:
    """Load one stage's new or changed sidecars; returns (units merged, vanished units, orphan shards)."""
    table = STAGES[stage][1]
    known = dict(con.execute("SELECT unit, signature FROM units WHERE stage = ?", [stage]).fetchall())
    items = sorted((u, p) for u, p in sidecars.items() if known.get(u) != _signature(p))
    gone = sorted(set(known) - set(sidecars))
    vanished = [u for u in gone if (root / STAGES[stage][0] / u.split("/")[0]).is_dir()]
    if missing := sorted({u.split("/")[0] for u in gone} - {u.split("/")[0] for u in vanished}):
        say(
            f"warning: {', '.join(f'{STAGES[stage][0]}/{m}' for m in missing)} not found (not mounted?): "
            "its rows stay in the catalog; to drop a removed source, delete catalog.duckdb and merge again"
        )
    # The catalog mirrors the sidecars on disk: vanished units lose their rows, re-run units replace them.
    if drop := vanished + [u for u, _ in items if u in known]:
        con.execute(f"DELETE FROM {table} WHERE unit IN (SELECT unnest(?))", [drop])
        con.execute("DELETE FROM units WHERE stage = ? AND unit IN (SELECT unnest(?))", [stage, drop])
    if items:
        batch = 512  # sidecars per INSERT: few statements (fast), bounded file lists, visible progress
        for i in range(0, len(items), batch):
            chunk = items[i : i + batch]
            con.execute(
                f"INSERT INTO {table} BY NAME SELECT * FROM read_parquet(?, union_by_name = true)",
                [[str(p) for _, p in chunk]],
            )
            pbar.update(len(chunk))
        con.register(
            "_merged",
            pa.table(
                {
                    "unit": [u for u, _ in items],
                    "sidecar": [str(p.relative_to(root)) for _, p in items],
                    "signature": [_signature(p) for _, p in items],
                }
            ),
        )
        con.execute(
            f"""
            INSERT INTO units
            SELECT ?, m.unit, split_part(m.unit, '/', 1), m.sidecar, m.signature,
                   count(c.unit), count(c.unit) FILTER (c.status = 'ok'), now()
            FROM _merged m LEFT JOIN {table} c ON c.unit = m.unit GROUP BY ALL""",
            [stage],
        )
        con.unregister("_merged")
    return len(items), vanished, orphan_shards(root, sidecars, stage)


# What of a root in S3 the merge reads: the units' sidecars, the caption indexes, the takedowns' record.
MERGED = re.compile(r"(raw|latents)/[^/]+/[0-9][^/]*\.parquet|store/text/[^/]+/[^/]+\.parquet|withdrawn/[^/]+\.parquet")
MERGED_UNDER = ("raw/", "latents/", "store/text/", "withdrawn/")  # the folders listed: not the runs, not store/video


def local_root(root) -> Path:
    """The folder merge works in: the root, or for a root in S3 its local mirror, brought up to date first."""
    if not s3.is_url(root):
        return Path(root)
    local = s3.mirror_dir(root)
    files = s3.sync_down(root, local, lambda rel: MERGED.fullmatch(rel) is not None, under=MERGED_UNDER)
    say(f"{root}: {len(files)} sidecar and index files mirrored in {local}")
    return local


def merge(root: str | Path) -> dict:
    root = local_root(root)
    t0 = time.monotonic()
    sidecars = {stage: find_sidecars(root, stage) for stage in STAGES}
    con = open_catalog(root, write=True)
    merged, removed, orphans = {}, {}, []
    try:
        con.execute("BEGIN TRANSACTION")
        with bar(sum(map(len, sidecars.values())), "merging units", "unit") as pbar:
            for stage in STAGES:
                merged[stage], removed[stage], orph = _merge_stage(con, root, stage, sidecars[stage], pbar)
                orphans += orph
        captions = merge_captions(con, root)
        reload_withdrawn(con, root)  # the takedowns' record (catalog/withdrawn.py)
        vanished = [u for stage in STAGES for u in removed[stage]]
        if merged["ingest"] or removed["ingest"]:
            dup = con.execute("SELECT clip_id, count(*) FROM clips GROUP BY 1 HAVING count(*) > 1 LIMIT 3").fetchall()
            if dup:
                raise UserError(
                    f"clip ids appear twice in the catalog, e.g. {dup}: two sources share a --name? Nothing was merged."
                )
            recompute_levels(con)
        con.execute("COMMIT")
        rows, ok = con.execute("SELECT count(*), count(*) FILTER (status = 'ok') FROM clips").fetchall()[0]
        lat, lat_ok = con.execute("SELECT count(*), count(*) FILTER (status = 'ok') FROM latents").fetchall()[0]
    except BaseException:
        try:
            con.execute("ROLLBACK")
        except Exception:
            pass
        raise
    finally:
        con.close()
    dt = time.monotonic() - t0
    say(
        f"merged {sum(merged.values())} new or changed unit(s) in {dt:.1f} s; catalog {root / 'catalog.duckdb'}: "
        f"{rows} clips, {ok} ok, "
        f"{rows - ok} rejected"
        + (f"; latents: {lat_ok} ok, {lat - lat_ok} rejected" if lat else "")
        + (f"; {captions} caption embeddings in the store" if captions else "")
    )
    if vanished:
        say(
            f"{len(vanished)} merged unit(s) have no sidecar any more (e.g. {vanished[0]}): their rows were "
            "removed from the catalog"
        )
    if orphans:
        say(
            f"warning: {len(orphans)} shard(s) without a sidecar (unfinished units), e.g. {orphans[0]}: "
            "re-run those units"
        )
    return {
        "merged": merged["ingest"],
        "merged_by_stage": merged,
        "clips": rows,
        "ok": ok,
        "latents": lat,
        "orphans": [str(p) for p in orphans],
        "catalog": str(root / "catalog.duckdb"),
        "vanished": vanished,
        "seconds": dt,
    }
