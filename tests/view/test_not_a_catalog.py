"""`view` (and any catalog command) over a catalog.duckdb that is not a DuckDB file: one line saying so and
how to build it again, no traceback, no server (issue 30.5; was "... is a merge running?")."""

from __future__ import annotations

import subprocess
import sys

from support import REPO, free_port, quiet_env


def test_view_over_a_file_that_is_not_a_catalog_is_one_line(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    (root / "catalog.duckdb").write_text("id,text\n1,not a database\n")
    cmd = [sys.executable, "-m", "reelcache", "view", "--root", str(root), "--port", str(free_port())]
    p = subprocess.run(cmd, cwd=REPO, env=quiet_env(), capture_output=True, text=True, timeout=120)
    db = root / "catalog.duckdb"
    line = (
        f'reelcache: error: {db} is not a DuckDB catalog (The file "{db}" exists, but it is not a valid DuckDB '
        f"database file!): --root must be a reelcache data root; if it is one, move catalog.duckdb away and run "
        f"`reelcache catalog merge --root {root}` to build it again from the units' sidecars"
    )
    assert p.returncode == 2 and "Traceback" not in p.stderr and p.stderr.splitlines() == [line], p.stderr
    p = subprocess.run(
        [*cmd[:3], "catalog", "stats", "--root", str(root)],
        cwd=REPO,
        env=quiet_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 2 and p.stderr.splitlines() == [line], p.stderr
    assert (root / "catalog.duckdb").read_text() == "id,text\n1,not a database\n"
