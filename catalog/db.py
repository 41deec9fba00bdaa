"""The catalog database: one DuckDB file per data root, schema from ``schema.sql``.

Only ``catalog merge`` and ``catalog manifest`` open it for writing; every other reader opens
it read-only, so many readers can query while nothing writes. Workers on other nodes never
touch it: they write sidecar parquets that merge loads.
"""

from __future__ import annotations

import os
import re
import socket
import time
from functools import cache
from pathlib import Path

import duckdb

from reelcache import UserError

# pyarrow is imported by sidecar_table, the writers' function: `catalog query` starts without it.

SCHEMA_FILE = Path(__file__).with_name("schema.sql")
DB_NAME = "catalog.duckdb"
# A writer that finds the catalog held waits this long for its readers to let go (a viewer closes its
# connection IDLE_S after its last request, and at once when it sees WRITER), then says who holds it.
WRITE_WAIT_S = 6.0
WRITER = ".writer"  # catalog.duckdb.writer: "pid host" of a writer waiting for the file; readers step aside

# version -> SQL that upgrades version-1 to version: the one way a catalog's tables change after it was
# made. Explicit, applied in order by `open_catalog` when it opens a catalog for writing.
MIGRATIONS: dict[int, str] = {
    # 2: anamorphic video (SAR) and the size a source table states
    2: """ALTER TABLE clips ADD COLUMN sar_num INTEGER;
          ALTER TABLE clips ADD COLUMN sar_den INTEGER;
          ALTER TABLE clips ADD COLUMN stated_width INTEGER;
          ALTER TABLE clips ADD COLUMN stated_height INTEGER;""",
    # 3: the content hash of a clip's raw bytes (lineage, takedown; the table `withdrawn` is new: schema.sql)
    3: "ALTER TABLE clips ADD COLUMN content_hash VARCHAR;",
    # 4: the columns `latents` gained without a version of their own: `view` (caches of several views, 0
    # for the rows already there) and the store's (cache format 2, NULL before it). A catalog of version
    # 2 or 3 may hold some of them already (merges added them before this migration existed): IF NOT EXISTS.
    4: """ALTER TABLE latents ADD COLUMN IF NOT EXISTS view INTEGER DEFAULT 0;
          ALTER TABLE latents ADD COLUMN IF NOT EXISTS video_key VARCHAR;
          ALTER TABLE latents ADD COLUMN IF NOT EXISTS reused BOOLEAN;
          ALTER TABLE latents ADD COLUMN IF NOT EXISTS text_key VARCHAR;
          ALTER TABLE latents ADD COLUMN IF NOT EXISTS text_shard VARCHAR;
          ALTER TABLE latents ADD COLUMN IF NOT EXISTS text_offset BIGINT;""",
}


def schema_sql() -> str:
    return SCHEMA_FILE.read_text()


def schema_version() -> int:
    m = re.search(r"schema_version:\s*(\d+)", schema_sql())
    assert m, "schema.sql must declare its schema_version"
    return int(m.group(1))


def db_path(root: str | Path) -> Path:
    return Path(root) / DB_NAME


def _locked(e: Exception) -> bool:
    return "lock" in str(e).lower()


def _command(pid: int) -> str | None:
    """The command line of a process of this machine, shortened: who holds the catalog (a viewer, a merge)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    words = [os.path.basename(a.decode(errors="replace")) if i == 0 else a.decode(errors="replace")
             for i, a in enumerate(argv) if a]  # fmt: skip
    if len(words) > 2 and words[1] == "-m":  # python -m reelcache view ...
        words = words[2:]
    text = " ".join(" ".join(words).split())  # one line, whatever the arguments hold
    return text if len(text) <= 120 else text[:117] + "..."


def _busy(path: Path, e: Exception, want: str, waited: float = 0.0) -> UserError:
    """One line for a catalog another process holds (DuckDB's lock: one writer, or many readers)."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    if not _locked(e):
        return UserError(f"cannot open {path}: {text}")
    pid = re.search(r"\(PID (\d+)\)", text)
    holder = f"process {pid.group(1)}" if pid else "another process"
    cmd = _command(int(pid.group(1))) if pid else None
    holder += f" ({cmd})" if cmd else ""
    after = f" after waiting {waited:.1f} s" if waited else ""
    return UserError(
        f"the catalog {path} is busy{after}: {holder} holds it (a `catalog merge` or `catalog manifest` writes "
        f"it, readers such as `reelcache view` share it); wait for that to end, then run this again to {want}"
    )


# A read-only connection touches no other file: no COPY TO, ATTACH, read_csv, extension download
# (catalog/sql.py), and the setting is locked, so no statement can turn it back on.
NO_FILES = {"enable_external_access": False, "lock_configuration": True}


def open_error(path: Path, e: Exception, want: str) -> UserError:
    """One line for a catalog file DuckDB cannot open: not a DuckDB file at all, or busy (``_busy``)."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    if "not a valid DuckDB database" in text:
        return UserError(
            f"{path} is not a DuckDB catalog ({text.removeprefix('IO Error: ')}): --root must be a reelcache data "
            f"root; if it is one, move {path.name} away and run `reelcache catalog merge --root {path.parent}` "
            "to build it again from the units' sidecars"
        )
    return _busy(path, e, want)


def writer_waiting(path: str | Path) -> str | None:
    """Who waits to write the catalog at ``path`` ("process N on HOST"), or None: a reader that sees one
    closes the file as soon as it can (the viewer does). A file left by a dead writer of this machine, or
    older than the longest wait, is no one."""
    marker = Path(str(path) + WRITER)
    try:
        pid_s, host = marker.read_text().split()[:2]
        age = time.time() - marker.stat().st_mtime
        pid = int(pid_s)
    except (OSError, ValueError):
        return None
    if age > WRITE_WAIT_S + 5:
        return None
    if host == socket.gethostname():
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
    return f"process {pid} on {host} waits to write it"


def _connect_writer(path: Path):
    """A write connection, waiting up to WRITE_WAIT_S (announced in the WRITER file) while others hold it."""
    deadline, start, marker = time.monotonic() + WRITE_WAIT_S, time.monotonic(), None
    try:
        while True:
            try:
                return duckdb.connect(str(path))
            except duckdb.IOException as e:
                if not _locked(e):
                    raise open_error(path, e, "write it") from e
                if time.monotonic() >= deadline:
                    raise _busy(path, e, "write it", waited=time.monotonic() - start if marker else 0.0) from e
                if marker is None:
                    marker = Path(str(path) + WRITER)
                    tmp = marker.with_name(f".{marker.name}.{os.getpid()}")
                    tmp.write_text(f"{os.getpid()} {socket.gethostname()}\n")
                    tmp.replace(marker)
                time.sleep(0.1)
    finally:
        if marker is not None:
            marker.unlink(missing_ok=True)


def open_catalog(root: str | Path, *, write: bool = False, files: bool = False):
    """Open ROOT/catalog.duckdb; create it when writing, refuse a foreign schema version. Read-only, it
    reaches no other file unless `files` (``catalog sql``, whose one SELECT may read parquet files)."""
    path = db_path(root)
    if not write:
        if not path.exists():
            raise UserError(f"no catalog at {path}: run `reelcache catalog merge --root {root}` first")
        try:
            return duckdb.connect(str(path), read_only=True, config={} if files else NO_FILES)
        except duckdb.IOException as e:
            raise open_error(path, e, "read it") from e
    path.parent.mkdir(parents=True, exist_ok=True)
    con = _connect_writer(path)
    con.execute(schema_sql())
    row = next(iter(con.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchall()), None)
    want = schema_version()
    if row is None:
        con.execute("INSERT INTO meta VALUES ('schema_version', ?)", [str(want)])
    else:
        have = int(row[0])
        if have > want:
            raise UserError(f"{path} has schema version {have}, newer than this reelcache ({want}): upgrade reelcache")
        for v in range(have + 1, want + 1):
            if v not in MIGRATIONS:
                raise UserError(f"{path} has schema version {have}; no migration to {v} exists")
            con.execute("BEGIN TRANSACTION")  # a migration and its version together, or neither
            con.execute(MIGRATIONS[v])
            con.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'", [str(v)])
            con.execute("COMMIT")
    return con


@cache
def arrow_schema(table: str):
    """The Arrow schema of a catalog table, derived from schema.sql: what a stage's sidecar is cast to
    (ingest: `clips`, cache: `latents`), so a column added there reaches every writer."""
    con = duckdb.connect()
    con.execute(schema_sql())
    schema = con.sql(f"SELECT * FROM {table} LIMIT 0").to_arrow_table().schema
    con.close()
    return schema


def clips_arrow_schema():
    """The Arrow schema of `clips`, derived from schema.sql: what every ingest sidecar is cast to."""
    return arrow_schema("clips")


def sidecar_table(table: str, rows: list[dict], *, strict: bool = True):
    """Rows (dicts keyed by the table's columns) -> Arrow table with exactly that table's schema.

    `strict`: a key that is no column is an error (ingest: a probe field without a column would vanish);
    otherwise such keys are the caller's own and are left out (cache: its rows also carry their plan)."""
    import pyarrow as pa

    schema = arrow_schema(table)
    unknown = set().union(*(r.keys() for r in rows)) - set(schema.names) if rows and strict else set()
    assert not unknown, f"columns not in schema.sql's {table}: {sorted(unknown)}"
    cols = {name: [r.get(name) for r in rows] for name in schema.names}
    return pa.table(cols, schema=schema)


def clips_table(rows: list[dict]):
    """Rows (dicts keyed by clips column) -> Arrow table with exactly the clips schema."""
    return sidecar_table("clips", rows)
