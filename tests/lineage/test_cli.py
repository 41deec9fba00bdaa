"""`reelcache lineage` and `takedown` on a catalog older than lineage (schema 2: no clips.content_hash, no
table withdrawn, as a root not merged since): one line saying to merge once, before any query needs them."""

from __future__ import annotations

import duckdb
import pytest

from reelcache.catalog.db import db_path, open_catalog
from reelcache.cli import main


@pytest.mark.parametrize(
    "args",
    [["lineage", "--like", "{video}"], ["takedown", "--like", "{video}", "--reason", "r"], ["lineage", "c1"]],
)
def test_an_older_catalog_is_one_line_saying_merge_once(tmp_path, capsys, args):
    root = tmp_path / "root"
    open_catalog(root, write=True).close()
    con = duckdb.connect(str(db_path(root)))
    con.execute("ALTER TABLE clips DROP COLUMN content_hash; DROP TABLE withdrawn")
    con.close()
    video = tmp_path / "request.mp4"
    video.write_bytes(b"any bytes")
    assert main([args[0], "--root", str(root), *(a.format(video=video) for a in args[1:])]) == 2
    err = capsys.readouterr().err
    assert "predates lineage" in err and f"catalog merge --root {root}" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
