"""No query a user writes can change the catalog, and a busy catalog is one line (catalog/sql.py, db.py).

Each case runs the real CLI on a real DuckDB catalog (a few rows written by the catalog's own
writer path, no video needed) and compares the catalog afterwards with a snapshot taken before
through a separate plain DuckDB connection: the list of tables and views and every table's row
count, and a digest of the `clips` and `manifests` rows.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import duckdb
import pytest
from support import tiny_cache_config

from reelcache.catalog.db import clips_table, db_path, open_catalog
from reelcache.catalog.sql import check_query, check_where
from reelcache.cli import main


def _make_catalog(root) -> None:
    rows = [
        dict(
            clip_id=f"c{i:02d}",
            source="demo",
            unit="demo/000000",
            row=i,
            path=f"v{i}.mp4",
            text=f"a clip (number {i})",
            status="ok" if i % 4 else "rejected",
            height=240 + 120 * (i % 3),
            width=426,
            num_frames=51,
            fps=24.0,
        )
        for i in range(12)
    ]
    con = open_catalog(root, write=True)
    try:
        con.register("new_clips", clips_table(rows))
        con.execute("INSERT INTO clips BY NAME SELECT * FROM new_clips")
        con.execute("INSERT INTO manifests VALUES ('kept', 'f' , 'manifests/kept.parquet', 'true', 9, now())")
    finally:
        con.close()


def _snapshot(root) -> dict:
    """Tables, views, row counts and the rows' digest, read by plain DuckDB (not by the code under test)."""
    con = duckdb.connect(str(db_path(root)), read_only=True)
    try:
        tables = sorted(con.execute("SELECT table_name, table_type FROM information_schema.tables").fetchall())
        counts = {t: con.execute(f'SELECT count(*) FROM "{t}"').fetchone()[0] for t, _ in tables}
        digest = con.execute(
            "SELECT (SELECT sum(hash(c)) FROM clips c), (SELECT sum(hash(m)) FROM manifests m)"
        ).fetchone()
    finally:
        con.close()
    return {"tables": tables, "counts": counts, "digest": digest}


@pytest.fixture()
def root(tmp_path):
    r = tmp_path / "root"
    r.mkdir()
    _make_catalog(r)
    return r


def _breakouts(tmp):
    return [
        "true); DROP TABLE clips; --",
        "true) ; INSERT INTO clips SELECT * FROM clips; --",
        f"true); COPY clips TO '{tmp}/leak.csv'; --",
        f"true); ATTACH '{tmp}/other.duckdb' AS o; CREATE TABLE o.t AS SELECT 1; --",
        "1=1; DROP TABLE manifests",
        "true) UNION ALL SELECT * FROM clips WHERE (true",
        "true)) OR ((true",
        "true) ORDER BY 1; DELETE FROM clips; SELECT (1",
    ]


@pytest.mark.parametrize("command", ["manifest", "export"])
def test_a_where_clause_that_closes_the_query_is_refused_and_the_catalog_is_intact(root, tmp_path, capsys, command):
    before = _snapshot(root)
    for clause in _breakouts(tmp_path):
        extra = ["--name", "x"] if command == "manifest" else ["--out", str(tmp_path / "out.csv")]
        rc = main(["catalog", command, "--root", str(root), "--where", clause, *extra])
        err = capsys.readouterr().err.strip()
        assert rc == 2, (clause, err)
        assert len(err.splitlines()) == 1 and "--where" in err, err
        assert _snapshot(root) == before, clause
        assert not list(tmp_path.glob("*.csv")) and not (tmp_path / "other.duckdb").exists()
        assert not (root / "manifests").exists()


def test_catalog_sql_runs_one_select_only(root, tmp_path, capsys):
    before = _snapshot(root)
    for query in [
        "DROP TABLE clips",
        "SELECT 1; DROP TABLE clips",
        "INSERT INTO clips SELECT * FROM clips",
        f"COPY clips TO '{tmp_path}/leak.csv'",
        f"ATTACH '{tmp_path}/other.duckdb' AS o",
        "CALL checkpoint()",
        "SET threads = 1",
    ]:
        rc = main(["catalog", "sql", "--root", str(root), query])
        err = capsys.readouterr().err.strip()
        assert rc == 2 and len(err.splitlines()) == 1, (query, err)
        assert _snapshot(root) == before, query
    assert not list(tmp_path.glob("leak*")) and not (tmp_path / "other.duckdb").exists()
    # what a user may do still works: one SELECT (a trailing ';' is fine), printed or written
    assert main(["catalog", "sql", "--root", str(root), "SELECT count(*) AS n FROM clips WHERE status = 'ok';"]) == 0
    assert main(["catalog", "sql", "--root", str(root), "DESCRIBE clips"]) == 0
    out = tmp_path / "ok.csv"
    assert main(["catalog", "sql", "--root", str(root), "FROM clips WHERE status = 'ok'", "--out", str(out)]) == 0
    assert len(out.read_text().splitlines()) == 1 + 9
    q = "SELECT clip_id FROM clips WHERE status = 'ok' -- a comment at the end"
    assert main(["catalog", "sql", "--root", str(root), q, "--out", str(out)]) == 0
    assert len(out.read_text().splitlines()) == 1 + 9
    assert _snapshot(root) == before


def test_one_condition_is_accepted_with_its_strings_comments_and_subqueries(root, tmp_path):
    # a ')' inside a string, a trailing comment, a subquery: one expression all the same
    where = "text LIKE '%(number 1)%' OR height IN (SELECT max(height) FROM clips) -- the tallest too"
    assert check_where(where) == where
    out = tmp_path / "sel.csv"
    assert main(["catalog", "export", "--root", str(root), "--where", where, "--out", str(out)]) == 0
    con = duckdb.connect(str(db_path(root)), read_only=True)
    want = con.execute(
        "SELECT count(*) FROM clips WHERE status = 'ok' AND (text LIKE '%(number 1)%' OR height = 480)"
    ).fetchone()[0]
    con.close()
    assert len(out.read_text().splitlines()) == 1 + want
    before = _snapshot(root)
    path = None
    assert main(["catalog", "manifest", "--root", str(root), "--name", "tall", "--where", where]) == 0
    path = next((root / "manifests").glob("tall-*.parquet"))
    assert path.exists()
    after = _snapshot(root)
    assert after["counts"]["manifests"] == before["counts"]["manifests"] + 1  # the one write a manifest makes
    assert after["counts"]["clips"] == before["counts"]["clips"] and after["tables"] == before["tables"]
    for bad in ["", "   ", "true;", "(true"]:
        with pytest.raises(ValueError):
            check_where(bad)
    assert check_query(" SELECT 1 ; ") == "SELECT 1"


HOLDER = textwrap.dedent(
    """
    import sys
    from reelcache.catalog.db import open_catalog
    con = open_catalog(sys.argv[1], write=True)   # what `catalog merge` holds while it runs
    con.execute("BEGIN TRANSACTION")
    con.execute("DELETE FROM clips WHERE clip_id = 'c01'")  # uncommitted: must never show
    print("held", flush=True)
    sys.stdin.read()
    con.execute("ROLLBACK")
    con.close()
    """
)


def test_a_busy_catalog_is_one_line_for_merge_manifest_sql_and_export(root, tmp_path, capsys, monkeypatch):
    import reelcache.catalog.db as db

    monkeypatch.setattr(db, "WRITE_WAIT_S", 0.3)  # a writer waits for readers to let go: not this holder
    before = _snapshot(root)
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(root)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        for args in [
            ["merge"],
            ["manifest", "--name", "busy", "--where", "height > 0"],
            ["sql", "SELECT count(*) FROM clips"],
            ["export", "--out", str(tmp_path / "e.csv")],
            ["stats", "--out", str(tmp_path / "stats")],
        ]:
            rc = main(["catalog", args[0], "--root", str(root), *args[1:]])
            err = capsys.readouterr().err.strip()
            assert rc == 2, (args, err)
            assert len(err.splitlines()) == 1, err
            assert "busy" in err and f"process {holder.pid}" in err and "run this again" in err, err
    finally:
        holder.stdin.close()
        assert holder.wait(timeout=60) == 0
    assert _snapshot(root) == before
    assert not (root / "manifests").exists() and not (tmp_path / "e.csv").exists()
    assert main(["catalog", "merge", "--root", str(root)]) == 0  # free again: the same command now runs


def test_cache_plan_naming_a_missing_manifest_is_one_line(root, tmp_path):
    """Issue 26.5: `cache plan` with a manifest that is neither a file nor a name in the catalog ends in one
    line, exit 2, nothing planned (train and the loader already said it so)."""

    cfg = tiny_cache_config(tmp_path / "c.toml", "nosuch")
    p = subprocess.run(
        [sys.executable, "-m", "reelcache", "cache", "plan", "--root", str(root), "--config", str(cfg)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert p.stderr.strip().splitlines() == [
        f"reelcache: error: manifest = 'nosuch': no manifest 'nosuch': not a file, not in {root}'s catalog, and no "
        f"{root / 'manifests' / 'nosuch-<16 hex>.parquet'}"
    ]
    assert not (root / "latents").exists()


def test_the_read_only_connection_writes_no_file_even_past_the_parse_check(root, tmp_path, monkeypatch, capsys):
    """Issue 30.4: the parse check is not the only guard. A clause that closes the query and copies the
    catalog out, run past the check, writes nothing: the read-only connection reaches no file."""
    from reelcache.catalog import manifest, query
    from reelcache.catalog.sql import read_only_connection

    leak = tmp_path / "leak.csv"
    clause = f"true); COPY clips TO '{leak}'; --"
    with read_only_connection(root) as con:  # the statement list itself, straight to the connection
        with pytest.raises(duckdb.Error, match="disabled by configuration"):
            con.execute(f"SELECT 1 FROM clips WHERE (true); COPY clips TO '{leak}'")
        with pytest.raises(duckdb.Error, match="locked"):
            con.execute("SET enable_external_access = true")
    assert not leak.exists()
    before = _snapshot(root)
    monkeypatch.setattr(manifest, "check_where", lambda w, option="--where": w)  # the parse check, disabled
    monkeypatch.setattr(query, "check_where", lambda w, option="--where": w)
    for command, extra in [("manifest", ["--name", "x"]), ("export", ["--out", str(tmp_path / "out.csv")])]:
        rc = main(["catalog", command, "--root", str(root), "--where", clause, *extra])
        err = capsys.readouterr().err.strip()
        assert rc == 2 and "Traceback" not in err, (command, err)
        assert not leak.exists(), command
    assert _snapshot(root) == before and not (tmp_path / "out.csv").exists()
    # what the connection may still do: export and `sql --out` write their result through a writer of their own
    out = tmp_path / "ok.parquet"
    assert (
        main(["catalog", "export", "--root", str(root), "--where", "height >= 240", "--out", str(tmp_path / "e.csv")])
        == 0
    )
    assert main(["catalog", "sql", "--root", str(root), "FROM clips WHERE status = 'ok'", "--out", str(out)]) == 0
    import pyarrow.parquet as pq

    assert pq.read_table(out).num_rows == 9 and len((tmp_path / "e.csv").read_text().splitlines()) == 1 + 9
