"""What the pages read from the catalog: one read-only DuckDB connection, queries per page.

The catalog is opened ``read_only`` with ``enable_external_access = false`` (locked), so no query
on it, the user's WHERE clause included, can write a table, COPY out, ATTACH, or read a file
outside the database. The user's clause is also checked to be one condition before it runs
(``catalog/sql.py``'s ``check_where``, the check every ``--where`` of the CLI gets), and is
interrupted after ``USER_SQL_S`` seconds. A bad clause is a ``BadQuery`` with one line for the
page. Each request takes its own cursor (DuckDB connections are not shared between threads;
cursors of one connection are).

The connection is held only while pages are being answered: DuckDB lets one process write a
database file only while no other process has it open, even read-only, so a viewer holding it for
its lifetime would make every ``catalog merge`` and ``catalog manifest`` (a Slurm array's ``--then``
merge included) fail as "busy" for as long as it runs. It is closed once no request has used it for
``IDLE_S`` seconds and opened again by the next one (about 10 ms). While a writer holds the file (or
waits for it: catalog/db.py's ``WRITER`` file) a request is a ``Busy``, answered 503 with Retry-After.

The user's queries are bounded as a whole: at most ``queries`` requests run them at once (another waits
``SLOT_WAIT_S`` on the event loop, holding no thread, then is a ``Busy``), all of one request's together
get ``request_s`` seconds, a request whose
client has left is interrupted (``Budget.interrupt``), each query holds at most ``MEMORY_LIMIT`` and
spills at most ``MAX_SPILL`` to ``ROOT/view-cache/duckdb-tmp/`` (never beside the catalog).
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from pathlib import Path

import duckdb

from reelcache import UserError
from reelcache.catalog.db import db_path, open_error, writer_waiting
from reelcache.catalog.sql import check_where, where_sql

USER_SQL_S = 10.0  # all the user's queries of one request together
USER_QUERIES = 2  # requests running user queries at once
SLOT_WAIT_S = 2.0  # how long a request waits for one of them (on the event loop, holding no thread)
MAX_SPILL = "1GB"  # what DuckDB may write to view-cache/duckdb-tmp/ for one connection
TMP_DIR = "view-cache/duckdb-tmp"
RETRY_S = 2  # Retry-After of a Busy
# What one query may hold in memory (DuckDB's own limit; a query past it fails with one line): a
# WHERE typed in the browser must not take the memory of the machine that serves the catalog.
MEMORY_LIMIT = "2GB"
IDLE_S = 2.0  # the catalog is closed after this long without a request (a writer may then open it)
OPEN_WAIT_S = 10.0  # how long a request waits for this process's other connection to the catalog to close
START_WAIT_S = 10.0  # how long the viewer, starting, waits for a writer (a merge) to let go of the catalog
PAGE = 60  # clips per grid page
REJECTS_PAGE = 50
CLIP_COLUMNS = (
    "clip_id, source, text, level, noun_count, width, height, fps, duration, num_frames, codec, file_size, "
    "status, reject_reason"
)


# The orders the grid offers: name in the URL -> column (a fixed list: no SQL from the URL here).
SORTS = {
    "clip_id": "clip_id", "duration": "duration", "fps": "fps", "size": "file_size", "level": "level",
    "nouns": "noun_count", "resolution": "resolution", "aesthetic": "aesthetic_score", "motion": "motion_score",
    "temporal": "temporal_consistency_score",
}  # fmt: skip


class BadQuery(ValueError):
    """A user's SQL fragment that is not one read-only SELECT, or that failed: one line for the page."""


class Busy(Exception):
    """Not now (a writer holds the catalog, the user's queries are at their limit): 503, retry after."""

    def __init__(self, text: str, retry_after: int = RETRY_S):
        super().__init__(text)
        self.retry_after = retry_after


class Budget:
    """One request's user queries: a deadline for all of them, and ``interrupt`` (its client left)."""

    def __init__(self, seconds: float):
        self.seconds, self.deadline = seconds, time.monotonic() + seconds
        self.stopped: str | None = None
        self._cur = None
        self._lock = threading.Lock()

    def interrupt(self, why: str) -> None:
        with self._lock:
            self.stopped = self.stopped or why
            if self._cur is not None:
                self._cur.interrupt()

    def run(self, cur, fn):
        """``fn()`` with ``cur`` interrupted at the deadline or by ``interrupt``."""
        with self._lock:
            left = self.deadline - time.monotonic()
            if left <= 0:
                self.stopped = self.stopped or f"stopped after {self.seconds:g} s (what one page's queries may take)"
            if self.stopped:
                raise BadQuery(self.stopped)
            self._cur = cur
        timer = threading.Timer(
            left, self.interrupt, [f"stopped after {self.seconds:g} s (what one page's queries may take)"]
        )
        timer.start()
        try:
            return fn()
        except duckdb.InterruptException:
            raise BadQuery(self.stopped or "interrupted") from None
        finally:
            timer.cancel()
            with self._lock:
                self._cur = None


class Store:
    def __init__(
        self,
        root: str | Path,
        queries: int = USER_QUERIES,
        request_s: float = USER_SQL_S,
        memory: str = MEMORY_LIMIT,
        spill: str = MAX_SPILL,
        named=None,
    ):
        self.root = Path(root).resolve()  # the catalog's folder: the root, or a root in S3's mirror (`named`)
        self.path = db_path(self.root)
        if not self.path.exists():
            raise UserError(f"no catalog at {self.path}: run `reelcache catalog merge --root {named or root}` first")
        self._con, self._users, self._used, self._timer = None, 0, 0.0, None
        self._guard = threading.Lock()
        self.queries, self.request_s, self.memory, self.spill = queries, request_s, memory, spill
        self._slots = threading.BoundedSemaphore(queries)
        deadline = time.monotonic() + START_WAIT_S
        while True:  # a merge that holds the catalog as the viewer starts: wait for it, then one line
            try:
                self.tables = {r[0] for r in self.rows("SELECT table_name FROM information_schema.tables")}
                break
            except Busy as e:
                if time.monotonic() >= deadline:
                    raise UserError(f"{e} (waited {START_WAIT_S:.0f} s): start the viewer when it ends") from None
                time.sleep(0.2)

    def take_slot(self) -> bool:
        """A slot for one request's user queries, if one is free now (``release_slot`` gives it back)."""
        return self._slots.acquire(blocking=False)

    def release_slot(self) -> None:
        self._slots.release()

    def busy_slots(self) -> Busy:
        return Busy(f"the viewer runs {self.queries} pages of queries already (its limit): retry in a few seconds")

    @contextmanager
    def _cursor(self):
        """A cursor of the shared read-only connection, opened if it was closed; closed again by
        ``_release`` once it has been idle for ``IDLE_S`` (a UserError while a merge holds the file)."""
        with self._guard:
            waiting = writer_waiting(self.path)
            if waiting:
                if self._con is not None and self._users == 0:
                    self._con.close()  # step aside: the writer gets the file as soon as nothing reads it
                    self._con = None
                raise Busy(f"the catalog is being written ({waiting}): retry in a few seconds")
            if self._con is None:
                self._con = self._connect()
            self._users += 1
            cur = self._con.cursor()
        try:
            yield cur
        finally:
            cur.close()
            with self._guard:
                self._users -= 1
                self._used = time.monotonic()
                if self._users == 0 and writer_waiting(self.path):
                    self._con.close()  # the last reader out lets a waiting writer in now
                    self._con = None
                elif self._users == 0:
                    if self._timer is not None:
                        self._timer.cancel()
                    self._timer = threading.Timer(IDLE_S, self._release)
                    self._timer.daemon = True
                    self._timer.start()

    def _connect(self):
        """The read-only connection. DuckDB refuses a second connection of this process to the file with
        another configuration while one is open: catalog/manifest.py's name lookup (a Stage page's loader)
        holds one for a moment, so that refusal is waited out (``OPEN_WAIT_S``), never a 500."""
        deadline = time.monotonic() + OPEN_WAIT_S
        try:
            (self.root / TMP_DIR).parent.mkdir(exist_ok=True)  # DuckDB makes duckdb-tmp/ in it, not its parent
        except OSError:
            pass  # a root this user cannot write: a query that would spill fails, in one line
        while True:
            try:
                return duckdb.connect(
                    str(self.path),
                    read_only=True,
                    config={
                        "enable_external_access": False,
                        "memory_limit": self.memory,
                        "temp_directory": str(self.root / TMP_DIR),
                        "max_temp_directory_size": self.spill,
                        "lock_configuration": True,
                    },
                )
            except duckdb.ConnectionException as e:
                if time.monotonic() > deadline:
                    raise UserError(f"cannot open {self.path} read-only: {_one_line(e)}") from e
                time.sleep(0.05)
            except duckdb.IOException as e:
                if "lock" in str(e).lower():
                    raise Busy(
                        f"the catalog is being written (a `catalog merge` or `catalog manifest`): {_one_line(e)}"
                    ) from e
                raise open_error(self.path, e, "read it") from e  # e.g. not a DuckDB catalog at all

    def _release(self) -> None:
        with self._guard:
            if self._con is not None and self._users == 0 and time.monotonic() - self._used >= IDLE_S * 0.99:
                self._con.close()
                self._con = None

    def close(self) -> None:
        """Closes the connection and cancels the idle timer: a daemon timer left to close DuckDB's
        connection while the interpreter shuts down aborts the process."""
        with self._guard:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            if self._con is not None:
                self._con.close()
                self._con = None

    def rows(self, sql: str, params=None) -> list[tuple]:
        with self._cursor() as cur:
            return cur.execute(sql, params or []).fetchall()

    def dicts(self, sql: str, params=None) -> list[dict]:
        with self._cursor() as cur:
            return _dicts(cur, sql, params)

    # -- the user's WHERE clause -------------------------------------------------------------
    def user_rows(self, budget: Budget, where: str, sql: str, params=None, members=None) -> list[dict]:
        """``sql`` with ``{where}`` replaced by the user's clause, after checking it is one SELECT, within
        the request's ``budget`` (pages.py's ``_user_queries``); ``members``: an Arrow table of clip ids the clause is
        narrowed to (a manifest's), registered as ``members`` on the query's cursor."""
        try:
            cond = where_sql(check_where(where, option="WHERE"))
        except UserError as e:
            raise BadQuery(str(e)) from None
        if members is not None:
            cond = f"clip_id IN (SELECT clip_id FROM members) AND {cond}"
        query = sql.replace("{where}", cond)
        with self._cursor() as cur:
            if members is not None:
                cur.register("members", members)
            try:
                return budget.run(cur, lambda: _dicts(cur, query, params))
            except duckdb.Error as e:
                raise BadQuery(_one_line(e)) from None

    # -- pages -------------------------------------------------------------------------------
    def overview(self) -> dict:
        out = {
            "sources": self.dicts(
                """SELECT source, count(*) AS rows, count(*) FILTER (status = 'ok') AS ok,
                   count(*) FILTER (status = 'rejected') AS rejected,
                   round(sum(file_size) FILTER (status = 'ok') / 1e9, 3) AS ok_gb,
                   round(sum(duration) FILTER (status = 'ok') / 3600, 2) AS ok_hours
                   FROM clips GROUP BY 1 ORDER BY 1"""
            ),
            "units": self.dicts(
                "SELECT stage, source, count(*) AS units, sum(num_rows) AS rows, sum(num_ok) AS ok "
                "FROM units GROUP BY ALL ORDER BY 1, 2"
            ),
            "shards": self.dicts(
                "SELECT source, count(*) AS shards, sum(num_clips) AS clips, round(sum(video_bytes) / 1e9, 3) AS gb "
                "FROM shards GROUP BY 1 ORDER BY 1"
            ),
            "caches": self.dicts(
                "SELECT cache, count(DISTINCT clip_id) FILTER (status = 'ok') AS clips, "
                "count(*) FILTER (status = 'ok') AS views, count(*) FILTER (status = 'rejected') AS rejected, "
                "count(DISTINCT bucket) AS buckets, max(view) + 1 AS views_per_clip FROM latents GROUP BY 1 ORDER BY 1"
            ),
            "manifests": self.manifests(),
        }
        return out

    def manifests(self) -> list[dict]:
        return self.dicts(
            "SELECT name, fingerprint, path, where_sql, num_clips, created_at FROM manifests ORDER BY created_at DESC"
        )

    def reject_reasons(self) -> list[dict]:
        return self.dicts(
            "SELECT reject_reason AS reason, count(*) AS n FROM clips WHERE status = 'rejected' "
            "GROUP BY 1 ORDER BY 2 DESC"
        )

    def rejects(self, reason: str | None, page: int) -> tuple[list[dict], int]:
        cond, params = ("AND reject_reason = ?", [reason]) if reason else ("", [])
        (total,) = self.rows(f"SELECT count(*) FROM clips WHERE status = 'rejected' {cond}", params)[0]
        rows = self.dicts(
            f"""SELECT clip_id, source, unit, "row", path, relpath, reject_reason, reject_detail, file_size, codec
                FROM clips WHERE status = 'rejected' {cond} ORDER BY source, unit, "row"
                LIMIT {REJECTS_PAGE} OFFSET ?""",
            [*params, page * REJECTS_PAGE],
        )
        return rows, total

    def clips(
        self, budget: Budget, where: str, page: int, sort: str = "clip_id", desc: bool = False, members=None
    ) -> dict:
        """One grid page of the clips matching ``where`` (among ``members``, if given), in the order of ``sort``
        (a key of SORTS), and its counts per level, source, status (one query) and cache bucket (clips: their
        view 0; views: all of their ok views)."""
        order = f"{SORTS[sort]} {'DESC' if desc else 'ASC'} NULLS LAST, clip_id"
        grid = self.user_rows(
            budget,
            where,
            f"SELECT {CLIP_COLUMNS} FROM clips WHERE {{where}} ORDER BY {order} LIMIT {PAGE} OFFSET ?",
            [page * PAGE],
            members,
        )
        sets = self.user_rows(
            budget,
            where,
            """SELECT level, source, status, grouping(level) AS no_level, grouping(source) AS no_source,
                      count(*) AS n
               FROM clips WHERE {where} GROUP BY GROUPING SETS ((level), (source), (status))""",
            None,
            members,
        )
        counts: dict = {"level": [], "source": [], "status": []}
        for r in sets:  # the grouping set of a row: the one column not aggregated away
            what = "level" if not r["no_level"] else "source" if not r["no_source"] else "status"
            counts[what].append({"key": r[what], "n": r["n"]})
        for rows in counts.values():
            rows.sort(key=lambda r: (r["key"] is None, r["key"]))
        counts["bucket"] = self.user_rows(
            budget,
            where,
            """SELECT l.cache, l.bucket, count(DISTINCT l.clip_id) AS n, count(*) AS views FROM latents l
               WHERE l.status = 'ok' AND l.clip_id IN (SELECT clip_id FROM clips WHERE {where})
               GROUP BY 1, 2 ORDER BY 1, 2""",
            None,
            members,
        )
        total = sum(r["n"] for r in counts["source"])
        return {"grid": grid, "counts": counts, "total": total}

    def clip(self, clip_id: str) -> dict | None:
        rows = self.dicts("SELECT * FROM clips WHERE clip_id = ?", [clip_id])
        return rows[0] if rows else None

    def clip_latents(self, clip_id: str) -> list[dict]:
        return self.dicts(
            """SELECT cache, view, status, reject_reason, reject_detail, bucket, num_frames, height, width,
                      window_start, shape, shard, shard_offset
               FROM latents WHERE clip_id = ? ORDER BY cache, view""",
            [clip_id],
        )

    def lineage(self, clip_id: str) -> dict:
        """The clip's lineage (lineage/lineage.py): the catalog's part on this locked connection, the manifests
        and consumed logs on an in-memory one of its own (as view/runs.py reads the logs). {"error": ...} when
        the catalog predates it."""
        from reelcache.lineage.lineage import lineage

        files = duckdb.connect()
        try:
            with self._cursor() as cur:
                (item,) = lineage(cur, self.root, [clip_id], files=files)
            return item
        except (UserError, duckdb.Error, OSError) as e:  # an old catalog, an unreadable log part: one line
            return {"error": _one_line(e)}
        finally:
            files.close()

    def latent(self, cache: str, clip_id: str, view: int) -> dict | None:
        rows = self.dicts(
            "SELECT * FROM latents WHERE cache = ? AND clip_id = ? AND view = ? AND status = 'ok'",
            [cache, clip_id, view],
        )
        return rows[0] if rows else None

    def clips_by_id(self, ids: list[str]) -> dict[str, dict]:
        if not ids:
            return {}
        rows = self.dicts(f"SELECT {CLIP_COLUMNS} FROM clips WHERE clip_id IN (SELECT unnest(?))", [ids])
        return {r["clip_id"]: r for r in rows}

    def manifest(self, name: str, fingerprint: str | None = None) -> dict | None:
        cond, params = ("AND fingerprint = ?", [name, fingerprint]) if fingerprint else ("", [name])
        rows = self.dicts(f"SELECT * FROM manifests WHERE name = ? {cond} ORDER BY created_at DESC LIMIT 1", params)
        return rows[0] if rows else None

    def breakdown(self, table) -> dict:
        """Counts of the rows of an Arrow table with ``clip_id`` (and maybe ``bucket``) per level and source
        (joined to the catalog, in one pass) and per bucket: a manifest's, a step's, an epoch plan's samples."""
        with self._cursor() as cur:
            cur.register("sel", table)
            pairs = cur.execute("SELECT c.level, c.source, count(*) FROM sel JOIN clips c USING (clip_id) GROUP BY ALL")
            level: dict = {}
            source: dict = {}
            for lv, src, n in pairs.fetchall():
                level[lv] = level.get(lv, 0) + n
                source[src] = source.get(src, 0) + n
            out = {k: [{"key": key, "n": n} for key, n in sorted(d.items(), key=lambda kv: (kv[0] is None, kv[0]))]
                   for k, d in (("level", level), ("source", source))}  # fmt: skip
            if "bucket" in table.column_names:
                out["bucket"] = _dicts(cur, "SELECT bucket AS key, count(*) AS n FROM sel GROUP BY 1 ORDER BY 1")
            return out

    def lookup(self, ids, columns: tuple[str, ...]) -> dict:
        """For an Arrow array of clip ids: {column: (names, code per id)} from one join with the catalog
        (a clip the catalog lacks gets the name None)."""
        import numpy as np
        import pyarrow as pa
        import pyarrow.compute as pc

        with self._cursor() as cur:
            cur.register("ids", pa.table({"i": pa.array(np.arange(len(ids))), "clip_id": ids}))
            cols = ", ".join(f"c.{c}" for c in columns)
            got = cur.sql(f"SELECT {cols} FROM ids LEFT JOIN clips c USING (clip_id) ORDER BY ids.i").to_arrow_table()
        out = {}
        for c in columns:
            enc = pc.dictionary_encode(got[c].combine_chunks())
            names = enc.dictionary.to_pylist()
            code = enc.indices.fill_null(len(names)).to_numpy(zero_copy_only=False)
            order = sorted(range(len(names)), key=lambda k: (names[k] is None, names[k]))  # names sorted
            rank = np.empty(len(names) + 1, np.int64)
            rank[order] = np.arange(len(names))
            rank[len(names)] = len(names)
            out[c] = ([names[k] for k in order] + [None], rank[code])
        return out


def _dicts(cur, sql: str, params=None) -> list[dict]:
    rel = cur.execute(sql, params or [])
    cols = [d[0] for d in rel.description]
    return [dict(zip(cols, r)) for r in rel.fetchall()]


def _one_line(e: Exception) -> str:
    return " ".join(str(e).split())[:500]
