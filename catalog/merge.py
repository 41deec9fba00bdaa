"""``catalog merge``: load finished units' sidecars into the catalog, idempotently.

A unit is finished when its sidecar parquet exists (ingest renames it into place last). Merge
compares every sidecar's signature (size and mtime) with the `units` table: new sidecars are
inserted, changed ones (a unit that was deleted and re-run) replace their old rows, unchanged
ones are skipped, so merging twice changes nothing and merging after more units adds only those.
All of it, including the recomputed difficulty levels, happens in one transaction: a merge
killed half-way leaves the catalog as it was.
"""

from __future__ import annotations

import time
from pathlib import Path

from reelcache import UserError
from reelcache.catalog.db import open_catalog
from reelcache.catalog.levels import recompute_levels
from reelcache.progress import bar, say


def _signature(p: Path) -> str:
    st = p.stat()
    return f"{st.st_size}:{st.st_mtime_ns}"


def find_sidecars(root: Path) -> dict[str, Path]:
    """unit name -> sidecar path, for every finished ingest unit under ROOT/raw."""
    out = {}
    for p in sorted((root / "raw").glob("*/[0-9]*.parquet")):
        out[f"{p.parent.name}/{p.stem}"] = p
    return out


def orphan_shards(root: Path, units: dict[str, Path]) -> list[Path]:
    """Shards with no sidecar: left by a killed unit, deleted when that unit re-runs."""
    done = {(p.parent.name, p.stem) for p in units.values()}
    return [t for t in sorted((root / "raw").glob("*/[0-9]*-*.tar"))
            if (t.parent.name, t.name.split("-")[0]) not in done]


def merge(root: str | Path) -> dict:
    root = Path(root)
    t0 = time.monotonic()
    sidecars = find_sidecars(root)
    con = open_catalog(root, write=True)
    try:
        known = dict(con.execute("SELECT unit, signature FROM units").fetchall())
        todo = {u: p for u, p in sidecars.items() if known.get(u) != _signature(p)}
        vanished = sorted(set(known) - set(sidecars))
        con.execute("BEGIN TRANSACTION")
        if todo:
            import pyarrow as pa

            batch = 512  # sidecars per INSERT: few statements (fast), bounded file lists, visible progress
            items = sorted(todo.items())
            rerun = [u for u, _ in items if u in known]       # re-run units replace their rows
            if rerun:
                con.execute("DELETE FROM clips WHERE unit IN (SELECT unnest(?))", [rerun])
                con.execute("DELETE FROM units WHERE unit IN (SELECT unnest(?))", [rerun])
            with bar(len(items), "merging units", "unit") as pbar:
                for i in range(0, len(items), batch):
                    chunk = items[i:i + batch]
                    con.execute("INSERT INTO clips BY NAME SELECT * FROM read_parquet(?, union_by_name = true)",
                                [[str(p) for _, p in chunk]])
                    pbar.update(len(chunk))
            con.register("_merged", pa.table({
                "unit": [u for u, _ in items], "sidecar": [str(p.relative_to(root)) for _, p in items],
                "signature": [_signature(p) for _, p in items]}))
            con.execute("""
                INSERT INTO units
                SELECT m.unit, split_part(m.unit, '/', 1), m.sidecar, m.signature,
                       count(c.unit), count(c.unit) FILTER (c.status = 'ok'), now()
                FROM _merged m LEFT JOIN clips c ON c.unit = m.unit GROUP BY ALL""")
            con.unregister("_merged")
            dup = con.execute("SELECT clip_id, count(*) FROM clips GROUP BY 1 HAVING count(*) > 1 LIMIT 3").fetchall()
            if dup:
                raise UserError(f"clip ids appear twice in the catalog, e.g. {dup}: two sources share a --name? "
                                "Nothing was merged.")
            recompute_levels(con)
        con.execute("COMMIT")
        rows, ok = con.execute("SELECT count(*), count(*) FILTER (status = 'ok') FROM clips").fetchall()[0]
    except BaseException:
        try:
            con.execute("ROLLBACK")
        except Exception:
            pass
        raise
    finally:
        con.close()
    orphans = orphan_shards(root, sidecars)
    dt = time.monotonic() - t0
    say(f"merged {len(todo)} new or changed unit(s) of {len(sidecars)} in {dt:.1f} s; "
        f"catalog: {rows} clips, {ok} ok, {rows - ok} rejected")
    if vanished:
        say(f"warning: {len(vanished)} merged unit(s) have no sidecar any more (e.g. {vanished[0]}); "
            "their rows stay in the catalog")
    if orphans:
        say(f"warning: {len(orphans)} shard(s) without a sidecar (unfinished units), e.g. {orphans[0]}: "
            "re-run those units")
    return {"merged": len(todo), "units": len(sidecars), "clips": rows, "ok": ok,
            "orphans": [str(p) for p in orphans], "seconds": dt}
