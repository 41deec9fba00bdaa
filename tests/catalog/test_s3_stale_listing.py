"""A briefly stale listing (tests/s3_local.py: FaultProxy's 'stale', a ListObjectsV2 answer that leaves out the
newest sidecars) is never taken for the truth by `catalog merge --root s3://`: a sidecar merged before and left
out of a later listing keeps its rows (it is judged gone by a HEAD of it, not by its absence from a listing), a new
one left out is merged by the next merge, and no row is lost or counted twice (the rows of the same units
ingested onto a local folder, conftest's `ingested`, are the reference)."""

from __future__ import annotations

import duckdb
from support import plan_ingest

from reelcache.base import s3
from reelcache.cli import main

ARGS = ("--name", "openvid", "--rows-per-unit", "8", "--max-file-mb", "8")  # as support.ingest plans the reference


def rows(root, units) -> list[tuple]:
    """The catalog's clips of `units` (less level and noun_pct: they rank a clip in the whole catalog)."""
    with duckdb.connect(str(root / "catalog.duckdb"), read_only=True) as db:
        cols = [c for c in db.sql("SELECT * FROM clips LIMIT 0").columns if c not in ("level", "noun_pct")]
        marks = ", ".join("?" for _ in units)
        q = f"SELECT {', '.join(cols)} FROM clips WHERE unit IN ({marks}) ORDER BY clip_id"
        return db.sql(q, params=list(units)).fetchall()


def count(root) -> int:
    with duckdb.connect(str(root / "catalog.duckdb"), read_only=True) as db:
        return db.sql("SELECT count(*) FROM clips").fetchall()[0][0]


def test_merge_never_takes_a_stale_listing_for_the_truth(
    s3_server, s3_proxy, demo_dataset, ingested, tmp_path, monkeypatch
):
    monkeypatch.setenv("REELCACHE_S3_MIRROR", str(tmp_path / "mirror"))
    root = s3_proxy.root
    units = plan_ingest(root, demo_dataset / "OpenVid-demo.csv", demo_dataset / "videos", *ARGS)
    assert main(["ingest", "run", "--root", root, units[0], units[1]]) == 0
    assert main(["catalog", "merge", "--root", root]) == 0
    local = s3.mirror_dir(root)
    want = rows(ingested, units[:2])
    assert rows(local, units[:2]) == want and count(local) == len(want)
    listing = lambda m, p: m == "GET" and "list-type=2" in p  # noqa: E731
    stale = s3_proxy.add("stale", listing, times=1000, hide=lambda key: key.endswith("/raw/openvid/000001.parquet"))
    assert main(["catalog", "merge", "--root", root]) == 0  # unit 1's sidecar left out of the listing
    assert stale.hits and rows(local, units[:2]) == want and count(local) == len(want)  # its rows are kept
    stale.hide = lambda key: key.endswith("/raw/openvid/000002.parquet")
    assert main(["ingest", "run", "--root", root, units[2]]) == 0
    assert main(["catalog", "merge", "--root", root]) == 0  # unit 2's new sidecar not listed yet: not merged yet
    assert rows(local, units[:2]) == want and count(local) == len(want)
    s3_proxy.clear()  # the listing catches up
    assert main(["catalog", "merge", "--root", root]) == 0
    want = rows(ingested, units[:3])
    assert rows(local, units[:3]) == want and count(local) == len(want)
