"""Every command re-runnable: a re-planned source merges, manifest names resolve exactly, manifest
fingerprints are of the rows (not of a file's encoding), and the demo's data steps run twice."""

from __future__ import annotations

import contextlib
import io
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from support import REPO, plan_ingest, sql

from reelcache.cli import main


def _plan(root: Path, data: Path, *extra: str) -> list[str]:
    return plan_ingest(root, data / "OpenVid-demo.csv", data / "videos", "--max-file-mb", "8", *extra)


@pytest.mark.slow  # end to end over the ingested demo
def test_replanned_source_merges_without_duplicates(fresh_root, demo_dataset):
    ((total,),) = sql(fresh_root, "SELECT count(*) FROM clips")
    units = _plan(fresh_root, demo_dataset, "--rows-per-unit", "5", "--replace")  # was 8 rows per unit
    assert len(units) == -(-total // 5)
    # half-way: the old units' sidecars are gone, only the new ones that ran are in the catalog
    assert main(["ingest", "run", "--root", str(fresh_root), *units[:2]]) == 0
    assert main(["catalog", "merge", "--root", str(fresh_root)]) == 0
    assert sql(fresh_root, 'SELECT count(*), count(DISTINCT clip_id), min("row"), max("row") FROM clips') == [
        (10, 10, 0, 9)
    ]
    assert main(["ingest", "run", "--root", str(fresh_root), *units[2:]]) == 0
    assert main(["catalog", "merge", "--root", str(fresh_root)]) == 0
    assert sql(fresh_root, "SELECT count(*), count(DISTINCT clip_id) FROM clips") == [(total, total)]
    assert sql(fresh_root, "SELECT DISTINCT unit FROM units WHERE stage = 'ingest' ORDER BY 1") == [(u,) for u in units]
    snap = sql(fresh_root, "SELECT * FROM clips ORDER BY clip_id")
    from reelcache.catalog.merge import merge

    assert merge(fresh_root)["merged"] == 0 and sql(fresh_root, "SELECT * FROM clips ORDER BY clip_id") == snap


@pytest.mark.slow  # end to end over the ingested demo
def test_a_vanished_unit_leaves_the_catalog_but_an_unmounted_source_does_not(fresh_root, capsys):
    src = fresh_root / "raw/openvid"
    ((total,),) = sql(fresh_root, "SELECT count(*) FROM clips")
    ((in_unit,),) = sql(fresh_root, "SELECT count(*) FROM clips WHERE unit = 'openvid/000001'")
    (src / "000001.parquet").unlink()  # deleted, to be redone
    assert main(["catalog", "merge", "--root", str(fresh_root)]) == 0
    assert sql(fresh_root, "SELECT count(*) FROM clips") == [(total - in_unit,)]
    src.rename(fresh_root / "offline")  # the whole folder gone: not mounted?
    assert main(["catalog", "merge", "--root", str(fresh_root)]) == 0
    assert "raw/openvid not found" in capsys.readouterr().err
    assert sql(fresh_root, "SELECT count(*) FROM clips") == [(total - in_unit,)]


@pytest.mark.slow  # end to end over the ingested demo
def test_manifest_names_resolve_exactly(fresh_root):
    from reelcache.catalog.manifest import make_manifest, resolve_manifest

    stage1 = make_manifest(fresh_root, "stage1", "level <= 3")
    wan = make_manifest(fresh_root, "stage1-wan", "level <= 2")  # newer, and its name starts with 'stage1-'
    assert resolve_manifest(fresh_root, "stage1") == stage1
    assert resolve_manifest(fresh_root, "stage1-wan") == wan
    other = make_manifest(fresh_root, "stage1", "level <= 4")
    assert resolve_manifest(fresh_root, "stage1") == other
    assert make_manifest(fresh_root, "stage1", "level <= 3") == stage1  # made again: the newest again
    assert resolve_manifest(fresh_root, "stage1") == stage1
    (fresh_root / "catalog.duckdb").unlink()  # no catalog: the exact file pattern
    assert resolve_manifest(fresh_root, "stage1-wan") == wan
    assert resolve_manifest(fresh_root, "stage1") == stage1
    with pytest.raises(ValueError, match="no manifest 'stage'"):
        resolve_manifest(fresh_root, "stage")
    for path in (fresh_root / "manifests" / "gone.parquet", "manifests/gone.parquet"):  # a path: not a name
        with pytest.raises(ValueError, match="no manifest file .*gone.parquet"):
            resolve_manifest(fresh_root, path)


@pytest.mark.slow  # end to end over the ingested demo
def test_fingerprint_is_of_the_rows_not_of_the_file(fresh_root, tmp_path):
    import duckdb

    from reelcache.catalog.manifest import fingerprint, make_manifest, read_manifest

    path = make_manifest(fresh_root, "m", "true")
    table, fp = read_manifest(path)
    assert path.name == f"m-{fp[:16]}.parquet"
    # DuckDB writes it back in another row and column order, with other types (int -> double, varchar ids)
    by_duckdb = tmp_path / "duckdb.parquet"
    duckdb.sql(f"""COPY (SELECT text, * EXCLUDE (text) REPLACE (CAST(shard_offset AS DOUBLE) AS shard_offset,
                                                            CAST(num_frames AS BIGINT) AS num_frames)
                       FROM '{path}' ORDER BY clip_id DESC) TO '{by_duckdb}' (FORMAT parquet)""")
    assert pq.read_table(by_duckdb).schema != table.schema
    assert read_manifest(by_duckdb)[1] == fp
    # pyarrow with large strings, many chunks and its own schema metadata
    import pyarrow as pa

    again = pa.Table.from_batches(table.to_batches(max_chunksize=3)).cast(
        pa.schema(
            [pa.field(f.name, pa.large_string() if f.type == pa.string() else f.type) for f in table.schema],
            metadata={b"written_by": b"someone else"},
        )
    )
    assert fingerprint(again) == fp
    moved = tmp_path / "moved.parquet"  # one sample moved by one block
    duckdb.sql(f"""COPY (SELECT * REPLACE (CASE WHEN clip_id = (SELECT min(clip_id) FROM '{path}')
                                          THEN shard_offset + 512 ELSE shard_offset END AS shard_offset)
                       FROM '{path}') TO '{moved}' (FORMAT parquet)""")
    assert read_manifest(moved)[1] != fp
    assert fingerprint(pq.read_table(path).drop_columns(["text"])) != fp  # a column less: other content


def _demo_steps(root: Path, data: Path, out: Path) -> None:
    """`make demo`'s data steps, in-process (GNU parallel's role played by one `run` call)."""

    def units(*args):
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            assert main(list(args)) == 0
        return buf.getvalue().split()

    where = "height >= 240 AND level <= 3 AND noun_pct < 99.99"
    ingest = units(
        "ingest",
        "plan",
        "--root",
        str(root),
        "--source",
        "openvid",
        "--name",
        "openvid",
        "--meta",
        str(data / "OpenVid-demo.csv"),
        "--videos",
        str(data / "videos"),
        "--config",
        "configs/ingest/demo.toml",
    )
    assert main(["ingest", "run", "--root", str(root), *ingest]) == 0
    assert main(["catalog", "merge", "--root", str(root)]) == 0
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["catalog", "manifest", "--root", str(root), "--name", "demo-stage1", "--where", where]) == 0
        assert (
            main(
                [
                    "catalog",
                    "export",
                    "--root",
                    str(root),
                    "--format",
                    "opensora",
                    "--where",
                    "level <= 3",
                    "--out",
                    str(root / "exports/demo-stage1-opensora.csv"),
                ]
            )
            == 0
        )
    cache = units("cache", "plan", "--root", str(root), "--config", "configs/cache/tiny.toml")
    assert main(["cache", "run", "--root", str(root), *cache]) == 0
    assert main(["catalog", "merge", "--root", str(root)]) == 0
    with contextlib.redirect_stdout(io.StringIO()):
        assert (
            main(
                [
                    "catalog",
                    "manifest",
                    "--root",
                    str(root),
                    "--name",
                    "demo-stage1-tiny",
                    "--cache",
                    "tiny",
                    "--where",
                    where,
                ]
            )
            == 0
        )
        assert (
            main(
                [
                    "loader",
                    "simulate",
                    "--root",
                    str(root),
                    "--manifest",
                    "demo-stage1-tiny",
                    "--buckets",
                    "configs/buckets/demo.toml",
                    "--world-size",
                    "2",
                    "--seed",
                    "42",
                    "--epochs",
                    "1",
                    "--out",
                    str(out),
                ]
            )
            == 0
        )


@pytest.mark.slow  # end to end over the ingested demo
def test_the_demo_data_steps_run_twice(demo_dataset, tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)  # the demo configs name each other relative to the repo
    root = tmp_path / "demo-root"
    _demo_steps(root, demo_dataset, tmp_path / "first.parquet")
    first = sql(root, "SELECT clip_id, view, bucket, shard, shard_offset FROM latents ORDER BY clip_id, view")
    assert first
    _demo_steps(root, demo_dataset, tmp_path / "second.parquet")
    assert sql(root, "SELECT clip_id, view, bucket, shard, shard_offset FROM latents ORDER BY clip_id, view") == first
    assert sql(root, "SELECT name, count(*) FROM manifests GROUP BY 1 ORDER BY 1") == [
        ("demo-stage1", 1),
        ("demo-stage1-tiny", 1),
    ]
    a, b = pq.read_table(tmp_path / "first.parquet"), pq.read_table(tmp_path / "second.parquet")
    assert a.equals(b)
    shutil.rmtree(root)


@pytest.mark.slow  # end to end over the ingested demo
def test_a_schema_1_catalog_is_migrated_and_merges(fresh_root):
    """A catalog made before schema 2 (no SAR, no stated size, no content hash) gains the columns on open
    (migrations 2 to 4) and merges."""
    import duckdb

    from reelcache.catalog.db import open_catalog, schema_sql, schema_version

    db = fresh_root / "catalog.duckdb"
    db.unlink()
    v1 = schema_sql()
    for col in ("sar_num", "sar_den", "stated_width", "stated_height", "content_hash"):
        v1 = "\n".join(line for line in v1.splitlines() if not line.strip().startswith(col))
    v1 = v1.replace("caption_column      VARCHAR,", "caption_column      VARCHAR")
    con = duckdb.connect(str(db))
    con.execute(v1)
    con.execute("INSERT INTO meta VALUES ('schema_version', '1')")
    assert "sar_num" not in [r[0] for r in con.execute("DESCRIBE clips").fetchall()]
    con.close()
    con = open_catalog(fresh_root, write=True)
    cols = [r[0] for r in con.execute("DESCRIBE clips").fetchall()]
    con.close()
    assert cols[-5:] == ["sar_num", "sar_den", "stated_width", "stated_height", "content_hash"]
    assert main(["catalog", "merge", "--root", str(fresh_root)]) == 0
    assert sql(fresh_root, "SELECT value FROM meta WHERE key = 'schema_version'") == [(str(schema_version()),)]
    assert sql(fresh_root, "SELECT count(*) FROM clips WHERE status = 'ok' AND sar_num IS NULL") == [(0,)]
