"""Read-only SQL on the catalog: print a table, or write csv/json/parquet; and exports. What a user
writes is checked and run read-only (catalog/sql.py).

Exports write what other trainers read. ``opensora``: the CSV Open-Sora's trainer takes,
``path,text,num_frames,height,width,aspect_ratio,resolution,fps,file_size`` with
``aspect_ratio = height/width`` and ``resolution = height*width``, original video paths.
"""

from __future__ import annotations

from pathlib import Path

import duckdb

from reelcache import UserError
from reelcache.catalog.db import open_catalog
from reelcache.catalog.sql import check_query, check_where, where_sql
from reelcache.files import atomic_path

OPENSORA_COLUMNS = ["path", "text", "num_frames", "height", "width", "aspect_ratio", "resolution", "fps", "file_size"]
WRITERS = {".csv": "(FORMAT csv, HEADER)", ".json": "(FORMAT json, ARRAY true)", ".parquet": "(FORMAT parquet)"}


def _sql_error(e, query):
    return UserError(
        f"SQL failed: {str(e).splitlines()[0]}\n  query: {query}\n"
        "  (table `clips` has one row per input row; see catalog/schema.sql for columns)"
    )


def copy_to(con, query: str, out: str) -> int:
    """`query`'s rows written to `out`: read as Arrow batches on `con` (which may reach no file), written
    by a connection of its own that sees only those batches, never the user's text; the row count."""
    ext = Path(out).suffix.lower()
    if ext not in WRITERS:
        raise UserError(f"--out {out}: use a .csv, .json or .parquet file name")
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    try:
        rows = con.sql(f"SELECT * FROM (\n{query}\n)").to_arrow_reader()  # own lines: a trailing -- comment ends there
    except duckdb.Error as e:
        raise _sql_error(e, query) from e
    writer = duckdb.connect()
    try:
        writer.register("result", rows)
        with atomic_path(out) as tmp:
            try:
                return writer.execute(f"COPY result TO '{tmp}' {WRITERS[ext]}").fetchall()[0][0]
            except duckdb.Error as e:
                raise _sql_error(e, query) from e
    finally:
        writer.close()


def run_sql(root, query: str, out: str | None = None, limit: int = 50) -> None:
    """One SELECT (catalog/sql.py checks it) on a read-only connection: printed, or written to `out`."""
    query = check_query(query)
    con = open_catalog(root, files=True)  # its one SELECT may read parquet files (docs/TRAIN.md's join)
    try:
        if out:
            n = copy_to(con, query, out)
            print(f"wrote {n} rows to {out}")
            return
        try:
            rel = con.sql(query)
        except duckdb.Error as e:
            raise _sql_error(e, query) from e
        if rel is None:
            return
        print_table(rel.columns, rel.limit(limit + 1).fetchall(), limit)
    finally:
        con.close()


def print_table(columns, rows, limit: int) -> None:
    def cell(v):
        s = "NULL" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)
        return s if len(s) <= 60 else s[:57] + "..."

    shown = [[cell(v) for v in r] for r in rows[:limit]]
    widths = [max([len(c)] + [len(r[i]) for r in shown]) for i, c in enumerate(columns)]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    print("  ".join("-" * w for w in widths))
    for r in shown:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths)))
    if len(rows) > limit:
        print("... (more rows; use --limit or --out)")


def export(root, fmt: str, where: str, out: str) -> int:
    if fmt != "opensora":
        raise UserError(f"unknown export format {fmt!r}")
    where = check_where(where)
    con = open_catalog(root)
    try:
        query = (
            f"SELECT {', '.join(OPENSORA_COLUMNS)} FROM clips WHERE status = 'ok' AND {where_sql(where)} "
            'ORDER BY source, "row"'
        )
        n = copy_to(con, query, out)
    finally:
        con.close()
    if n == 0:
        raise UserError(f"no ok clips match --where {where!r}: nothing exported")
    print(f"wrote {n} clips to {out} (Open-Sora columns: {','.join(OPENSORA_COLUMNS)})")
    return n
