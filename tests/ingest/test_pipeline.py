"""End to end over the ingested demo: every input row accounted for, every reject reason from a real
bad input, shards readable by plain webdataset, idempotent merge, exports and manifests (the unit runs
themselves: tests/ingest/test_run.py)."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import pytest
from support import sql

from reelcache.cli import main
from reelcache.rejects import Reason

pytestmark = pytest.mark.slow  # every test reads the demo ingested end to end (conftest: ingested)

EXPECTED_REJECTS = {
    "bad_row": "broken_row.mp4",
    "duplicate_row": None,
    "empty_caption": None,
    "missing_file": "not_there.mp4",
    "empty_file": "zero_bytes.mp4",
    "too_large": "huge_noise.mp4",
    "no_video_stream": "audio_only.mp4",
    "undecodable": "random_bytes.mp4",
    "truncated": "cut_in_half.mp4",
    "too_short": "short_clip.mp4",
}


def _csv_rows(data: Path) -> int:
    with open(data / "OpenVid-demo.csv", newline="") as f:
        return sum(1 for _ in csv.reader(f)) - 1


def test_every_row_accounted_for(ingested, demo_dataset):
    ((n,),) = sql(ingested, "SELECT count(*) FROM clips")
    assert n == _csv_rows(demo_dataset)
    ((distinct,),) = sql(ingested, "SELECT count(DISTINCT clip_id) FROM clips")
    assert distinct == n
    rows = sql(ingested, 'SELECT "row" FROM clips ORDER BY 1')
    assert [r for (r,) in rows] == list(range(n))
    bad = sql(
        ingested,
        "SELECT count(*) FROM clips WHERE status NOT IN ('ok','rejected') "
        "OR (status = 'rejected') = (reject_reason IS NULL)",
    )
    assert bad == [(0,)]


def test_every_reject_reason_comes_from_a_real_bad_input(ingested):
    got = dict(
        sql(
            ingested,
            "SELECT reject_reason, list(relpath ORDER BY relpath) FROM clips WHERE status = 'rejected' GROUP BY 1",
        )
    )
    for reason, name in EXPECTED_REJECTS.items():
        assert reason in got, f"no {reason} reject; got {sorted(got)}"
        if name:
            assert name in got[reason], (reason, got[reason])
    assert {"cut_in_half.mp4", "cut_no_moov.mp4", "cut_in_half.mkv"} <= set(got["truncated"])
    assert "cover_art.m4a" in got["no_video_stream"]  # an attached picture is not video
    from reelcache.ingest.demo import codec_specials

    if "vp9" in codec_specials():
        assert "cut_in_half.webm" in got["truncated"]
    assert set(got) <= {r.value for r in Reason}


def test_every_encoding_of_the_demo_is_ingested(ingested):
    """HEVC, VP9, AV1, 10-bit, open GOP, VFR, fragmented MP4, anamorphic: all ok, as the probe tests read them."""
    from reelcache.ingest.demo import codec_specials

    specials = codec_specials()
    got = {
        r[0]: r[1:]
        for r in sql(
            ingested,
            "SELECT relpath, status, codec, bit_depth, frames_from, width, height, sar_num, sar_den FROM clips",
        )
    }
    for key, spec in specials.items():
        status, codec, depth, frames_from, w, h, sn, sd = got[spec.name]
        assert status == "ok", (key, got[spec.name])
        assert codec == {"hevc": "hevc", "vp9": "vp9", "av1": "av1"}.get(key, "h264")
        assert depth == (10 if key == "ten_bit" else 8)
        assert frames_from == ("demux" if key in ("vp9", "av1", "fragmented") else "header")
        assert (w, h, sn, sd) == ((427, 240, 4, 3) if key == "anamorphic" else (426, 240, 1, 1))


def test_probe_metadata_is_consistent(ingested):
    rows = sql(
        ingested,
        "SELECT width, height, aspect_ratio, resolution, fps, fps_num, fps_den, num_frames, "
        "duration, noun_count, level, noun_tagger FROM clips WHERE status = 'ok'",
    )
    assert len(rows) >= 15
    for w, h, ar, res, fps, num, den, nf, dur, nouns, level, tagger in rows:
        assert ar == pytest.approx(h / w) and res == h * w
        assert fps == pytest.approx(num / den)
        assert dur == pytest.approx(nf / fps, rel=0.05, abs=0.1)
        assert nouns >= 1 and 1 <= level <= 5 and tagger.startswith("textblob")
    mism = sql(ingested, "SELECT stated_mismatch FROM clips WHERE stated_mismatch IS NOT NULL")
    assert any("num_frames" in m for (m,) in mism) and any("fps" in m for (m,) in mism)


def test_shards_read_by_plain_webdataset(ingested):
    import webdataset as wds

    shards = sorted(str(p) for p in (ingested / "raw" / "openvid").glob("*.tar"))
    assert len(shards) >= 3
    seen = {}
    for s in wds.WebDataset(shards, shardshuffle=False):
        meta = json.loads(s["json"])
        video_ext = next(k for k in s if k not in ("__key__", "__url__", "json", "txt", "__local_path__"))
        seen[s["__key__"]] = (meta, s[video_ext], s["txt"].decode())
    ok = sql(ingested, "SELECT clip_id, path, text, shard, shard_offset, file_size FROM clips WHERE status = 'ok'")
    assert set(seen) == {r[0] for r in ok}
    for clip_id, path, text, shard, offset, size in ok:
        meta, video, txt = seen[clip_id]
        original = Path(path).read_bytes()
        assert video == original and txt == text and meta["clip_id"] == clip_id
        with open(ingested / shard, "rb") as f:  # the recorded offset is random access into the tar
            f.seek(offset)
            assert f.read(size) == original


def test_merge_is_idempotent_and_incremental(fresh_root):
    def snapshot():
        return (
            sql(fresh_root, "SELECT * EXCLUDE (level, noun_pct) FROM clips ORDER BY clip_id"),
            sql(fresh_root, "SELECT unit, signature, num_rows FROM units ORDER BY 1"),
        )

    before = snapshot()
    assert main(["catalog", "merge", "--root", str(fresh_root)]) == 0
    assert snapshot() == before
    # Drop two units from the catalog's memory by removing them and merging a fresh catalog
    # of the others, then add them back: only they are inserted.
    sidecars = sorted((fresh_root / "raw" / "openvid").glob("[0-9]*.parquet"))
    hold = fresh_root / "held"
    hold.mkdir()
    for p in sidecars[:2]:
        shutil.move(p, hold / p.name)
    (fresh_root / "catalog.duckdb").unlink()
    assert main(["catalog", "merge", "--root", str(fresh_root)]) == 0
    assert len(sql(fresh_root, "SELECT * FROM units")) == len(sidecars) - 2
    for p in hold.iterdir():
        shutil.move(p, fresh_root / "raw" / "openvid" / p.name)
    from reelcache.catalog.merge import merge

    assert merge(fresh_root)["merged"] == 2
    assert snapshot()[0] == before[0]


def test_opensora_export_reads_back(ingested, tmp_path):
    out = tmp_path / "stage1.csv"
    assert (
        main(
            [
                "catalog",
                "export",
                "--root",
                str(ingested),
                "--format",
                "opensora",
                "--where",
                "height >= 240",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    with open(out, newline="") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == [
        "path",
        "text",
        "num_frames",
        "height",
        "width",
        "aspect_ratio",
        "resolution",
        "fps",
        "file_size",
    ]
    for r in rows:
        assert Path(r["path"]).is_file() and r["text"]
        assert float(r["aspect_ratio"]) == pytest.approx(int(r["height"]) / int(r["width"]))
        assert int(r["resolution"]) == int(r["height"]) * int(r["width"])
        assert int(r["file_size"]) == Path(r["path"]).stat().st_size
    ((n,),) = sql(ingested, "SELECT count(*) FROM clips WHERE status='ok' AND height >= 240")
    assert len(rows) == n


def test_manifest_is_fingerprinted_and_recorded(fresh_root):
    from reelcache.catalog.manifest import make_manifest, read_manifest

    p1 = make_manifest(fresh_root, "stage1", "level <= 3 AND noun_pct < 99.99")
    p2 = make_manifest(fresh_root, "stage1", "level <= 3 AND noun_pct < 99.99")
    assert p1 == p2 and p1.exists()
    table, fp = read_manifest(p1)
    assert p1.name == f"stage1-{fp[:16]}.parquet"
    assert table.column("clip_id").to_pylist() == sorted(table.column("clip_id").to_pylist())
    assert max(table.column("level").to_pylist()) <= 3
    p3 = make_manifest(fresh_root, "stage1", "level <= 2")
    assert p3 != p1
    assert sql(fresh_root, "SELECT count(*) FROM manifests WHERE name = 'stage1'") == [(2,)]
    from reelcache import UserError

    with pytest.raises(UserError, match="no ok clips"):
        make_manifest(fresh_root, "empty", "height > 100000")


def test_sql_writes_files_and_explains_errors(ingested, tmp_path, capsys):
    for ext in ("csv", "json", "parquet"):
        out = tmp_path / f"rejects.{ext}"
        assert (
            main(
                [
                    "catalog",
                    "sql",
                    "--root",
                    str(ingested),
                    "SELECT * FROM clips WHERE status='rejected'",
                    "--out",
                    str(out),
                ]
            )
            == 0
        )
        assert out.stat().st_size > 0
    assert main(["catalog", "sql", "--root", str(ingested), "SELECT nope FROM clips"]) == 2
    assert "SQL failed" in capsys.readouterr().err


def test_stats_prints_reasons_and_writes_png(ingested, tmp_path, capsys):
    assert main(["catalog", "stats", "--root", str(ingested), "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for reason in EXPECTED_REJECTS:
        assert reason in out
    png = tmp_path / "catalog.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_replan_with_other_config_is_refused(fresh_root, demo_dataset, capsys):
    args = [
        "ingest",
        "plan",
        "--root",
        str(fresh_root),
        "--source",
        "openvid",
        "--meta",
        str(demo_dataset / "OpenVid-demo.csv"),
        "--videos",
        str(demo_dataset / "videos"),
        "--max-file-mb",
        "8",
    ]
    assert main(args + ["--rows-per-unit", "8"]) == 0  # same plan: a no-op
    assert main(args + ["--rows-per-unit", "5"]) == 2
    assert "--replace" in capsys.readouterr().err
