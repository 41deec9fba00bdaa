"""catalog/db.py: one migration mechanism. A catalog made by an older reelcache, written here in that
version's own SQL (not derived from schema.sql), opens for writing and comes out as a new one: the same
columns, in the same order, with the same types, its rows kept and the new columns' defaults filled."""

from __future__ import annotations

from pathlib import Path

import duckdb

import reelcache.catalog as catalog
from reelcache.catalog.db import db_path, open_catalog, schema_version

# schema version 1, as catalog/schema.sql stated it before version 2 (comments dropped)
V1 = """
CREATE TABLE meta (key VARCHAR PRIMARY KEY, value VARCHAR);
CREATE TABLE clips (
    clip_id VARCHAR NOT NULL, source VARCHAR NOT NULL, unit VARCHAR NOT NULL, "row" BIGINT NOT NULL,
    path VARCHAR, relpath VARCHAR, text VARCHAR, status VARCHAR NOT NULL, reject_reason VARCHAR,
    reject_detail VARCHAR, num_frames BIGINT, frames_from VARCHAR, fps DOUBLE, fps_num BIGINT,
    fps_den BIGINT, duration DOUBLE, width INTEGER, height INTEGER, coded_width INTEGER,
    coded_height INTEGER, rotation INTEGER, aspect_ratio DOUBLE, resolution BIGINT, codec VARCHAR,
    pix_fmt VARCHAR, bit_depth INTEGER, container VARCHAR, bit_rate BIGINT, has_audio BOOLEAN,
    file_size BIGINT, stated_num_frames BIGINT, stated_fps DOUBLE, stated_duration DOUBLE,
    stated_mismatch VARCHAR, noun_count INTEGER, noun_tagger VARCHAR, level TINYINT, noun_pct DOUBLE,
    shard VARCHAR, shard_offset BIGINT, ext VARCHAR, aesthetic_score DOUBLE, motion_score DOUBLE,
    temporal_consistency_score DOUBLE, camera_motion VARCHAR, mira_clip_id VARCHAR, mira_source VARCHAR,
    video_url VARCHAR, video_id VARCHAR, "timestamp" VARCHAR, framestamp VARCHAR, short_caption VARCHAR,
    dense_caption VARCHAR, background_caption VARCHAR, main_object_caption VARCHAR, style_caption VARCHAR,
    camera_caption VARCHAR, caption_column VARCHAR
);
CREATE TABLE units (
    stage VARCHAR NOT NULL, unit VARCHAR NOT NULL, source VARCHAR NOT NULL, sidecar VARCHAR NOT NULL,
    signature VARCHAR NOT NULL, num_rows BIGINT NOT NULL, num_ok BIGINT NOT NULL,
    merged_at TIMESTAMP NOT NULL, PRIMARY KEY (stage, unit)
);
CREATE VIEW shards AS SELECT shard, source, unit, count(*) AS num_clips, sum(file_size) AS video_bytes
    FROM clips WHERE shard IS NOT NULL GROUP BY ALL;
CREATE TABLE latents (
    clip_id VARCHAR NOT NULL, cache VARCHAR NOT NULL, unit VARCHAR NOT NULL, status VARCHAR NOT NULL,
    reject_reason VARCHAR, reject_detail VARCHAR, bucket VARCHAR, num_frames INTEGER, height INTEGER,
    width INTEGER, window_start BIGINT, shape INTEGER[], text_len INTEGER, shard VARCHAR, shard_offset BIGINT
);
CREATE TABLE manifests (
    name VARCHAR NOT NULL, fingerprint VARCHAR NOT NULL, path VARCHAR NOT NULL, where_sql VARCHAR,
    num_clips BIGINT NOT NULL, created_at TIMESTAMP NOT NULL, PRIMARY KEY (name, fingerprint)
);
INSERT INTO meta VALUES ('schema_version', '1');
INSERT INTO clips (clip_id, source, unit, "row", status, width, height)
    VALUES ('c0', 'demo', 'demo/000000', 0, 'ok', 640, 360);
INSERT INTO latents (clip_id, cache, unit, status, bucket, shape, shard, shard_offset)
    VALUES ('c0', 'lat', 'lat/000000', 'ok', '144p/4/0.56', [4, 1, 18, 32], 'latents/lat/000000-000000.tar', 512);
"""


def columns(con, table: str) -> list[tuple[str, str]]:
    return [(r[0], r[1]) for r in con.execute(f"DESCRIBE {table}").fetchall()]


def _fresh(tmp_path):
    con = open_catalog(tmp_path / "fresh", write=True)
    shape = {t: columns(con, t) for t in ("clips", "latents")}
    con.close()
    return shape


def _old(root, sql: str) -> None:
    root.mkdir()
    con = duckdb.connect(str(db_path(root)))
    con.execute(sql)
    con.close()


def test_a_version_1_catalog_migrates_on_open_to_a_new_one(tmp_path):
    root = tmp_path / "v1"
    _old(root, V1)
    con = open_catalog(root, write=True)
    try:
        assert con.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchall() == [
            (str(schema_version()),)
        ]
        assert {t: columns(con, t) for t in ("clips", "latents")} == _fresh(tmp_path)
        # the rows kept; the new columns: `view` 0, the store's and the clip's NULL
        assert con.execute("SELECT clip_id, width, sar_num, content_hash FROM clips").fetchall() == [
            ("c0", 640, None, None)
        ]
        assert con.execute(
            "SELECT clip_id, shard_offset, view, video_key, reused, text_key, text_shard, text_offset FROM latents"
        ).fetchall() == [("c0", 512, 0, None, None, None, None, None)]
        # the tables new since version 1 exist
        tables = {r[0] for r in con.execute("SELECT table_name FROM information_schema.tables").fetchall()}
        assert {"captions", "withdrawn"} <= tables
    finally:
        con.close()
    # opening it again changes nothing (each step ran once, with its version)
    con = open_catalog(root, write=True)
    assert con.execute("SELECT count(*), min(view) FROM latents").fetchall() == [(1, 0)]
    con.close()


def test_a_version_3_catalog_with_some_of_the_latents_columns_migrates(tmp_path):
    """Before version 4, merge added `latents`' columns itself: a version-3 catalog may have `view` and not
    the store's columns. The same one path brings it to the new shape."""
    root = tmp_path / "v3"
    v3 = V1.replace("'schema_version', '1'", "'schema_version', '3'").replace(
        "caption_column VARCHAR\n",
        "caption_column VARCHAR, sar_num INTEGER, sar_den INTEGER, stated_width INTEGER, stated_height INTEGER,"
        " content_hash VARCHAR\n",
    )
    v3 += "ALTER TABLE latents ADD COLUMN view INTEGER DEFAULT 0; UPDATE latents SET view = 1;"
    _old(root, v3)
    con = open_catalog(root, write=True)
    try:
        assert {t: columns(con, t) for t in ("clips", "latents")} == _fresh(tmp_path)
        assert con.execute("SELECT view, video_key FROM latents").fetchall() == [(1, None)]
    finally:
        con.close()


def test_merge_and_manifest_hold_no_migration_of_their_own():
    """One mechanism: no module but catalog/db.py alters a catalog table."""
    here = Path(catalog.__file__).parent
    altering = sorted(p.name for p in here.glob("*.py") if "ALTER TABLE" in p.read_text())
    assert altering == ["db.py"], altering
