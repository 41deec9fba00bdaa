"""Source tables: exact headers refused with a useful message, every row kept, stable ids."""

from __future__ import annotations

import csv
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from support import sql

from reelcache import UserError
from reelcache.ingest.sources import MIRADATA_COLUMNS, OPENVID_COLUMNS, clip_id, read_source


def _write_csv(path, header, rows):
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(rows)
    return path


def mira_row(i, path):
    return [
        f"mira{i}",
        "youtube",
        f"https://example.invalid/{i}",
        f"vid{i}",
        1280,
        720,
        30,
        12.5,
        "['0:00:01.000', '0:00:13.500']",
        375,
        "[30, 405]",
        path,
        f"short {i}",
        f"dense caption {i} " * 40,
        "bg",
        "main object",
        "style",
        "camera pans",
    ]


def test_openvid_header_is_checked_and_other_format_named(tmp_path):
    bad = _write_csv(tmp_path / "m.csv", MIRADATA_COLUMNS, [mira_row(0, "a.mp4")])
    with pytest.raises(UserError) as e:
        read_source("openvid", "openvid", str(bad), str(tmp_path))
    msg = str(e.value)
    assert "'video'" in msg and "'caption'" in msg and "--source miradata" in msg
    missing = _write_csv(tmp_path / "o.csv", OPENVID_COLUMNS[:-1], [["a.mp4", "cap", 5, 1, 1, "static", 10, 30]])
    with pytest.raises(UserError, match="'seconds'"):
        read_source("openvid", "openvid", str(missing), str(tmp_path))


def test_openvid_rows_scores_and_stated_metadata(tmp_path):
    rows = [
        ["a.mp4", "A dog.", "5.1", "2.0", "0.97", "pan_left", "120", "30", "4.0"],
        ["sub/b.mp4", "A cat.", "x", "", "", "static", "abc", "", ""],
        ["a.mp4", "Again.", "5", "1", "1", "static", "1", "1", "1"],
    ]
    meta = _write_csv(tmp_path / "OpenVid.csv", OPENVID_COLUMNS, rows)
    with open(meta, "a") as f:
        f.write("short,row\n")
    t = read_source("openvid", "openvid", str(meta), str(tmp_path)).to_pylist()
    assert len(t) == 4 and [r["row"] for r in t] == [0, 1, 2, 3]
    assert t[0]["aesthetic_score"] == 5.1 and t[0]["stated_num_frames"] == 120 and t[0]["camera_motion"] == "pan_left"
    assert t[0]["path"] == str(tmp_path / "a.mp4") and t[1]["relpath"] == "sub/b.mp4"
    assert t[1]["aesthetic_score"] is None and t[1]["stated_num_frames"] is None  # unparseable -> NULL, row kept
    assert t[2]["duplicate_of"] == 0 and t[2]["clip_id"] != t[0]["clip_id"]
    assert t[3]["row_error"] and "2 fields" in t[3]["row_error"]
    assert t[0]["clip_id"] == clip_id("openvid", "a.mp4")  # stable across runs


def test_miradata_caption_must_be_chosen_and_all_are_kept(tmp_path):
    meta = _write_csv(tmp_path / "mira.csv", MIRADATA_COLUMNS, [mira_row(0, "000/a.mp4"), mira_row(1, "000/b.mp4")])
    with pytest.raises(UserError, match="--caption"):
        read_source("miradata", "miradata", str(meta), str(tmp_path))
    t = read_source("miradata", "miradata", str(meta), str(tmp_path), caption="short").to_pylist()
    assert t[0]["text"] == "short 0" and t[0]["caption_column"] == "short_caption"
    assert t[0]["dense_caption"].startswith("dense caption 0") and t[0]["camera_caption"] == "camera pans"
    assert t[1]["mira_clip_id"] == "mira1" and t[1]["stated_duration"] == 12.5 and t[1]["stated_num_frames"] == 375
    t = read_source("miradata", "miradata", str(meta), str(tmp_path), caption="dense_caption").to_pylist()
    assert t[0]["text"].startswith("dense caption")


def test_generic_csv_and_parquet_with_opensora_columns(tmp_path):
    rows = [{"path": "x.mp4", "text": "t", "num_frames": 51, "fps": 24.0, "height": 240, "width": 426}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "m.parquet")
    t = read_source("parquet", "mine", str(tmp_path / "m.parquet"), str(tmp_path)).to_pylist()
    assert t[0]["stated_num_frames"] == 51 and t[0]["stated_fps"] == 24.0
    meta = _write_csv(tmp_path / "m.csv", ["path", "text"], [["x.mp4", "t"]])
    assert read_source("csv", "mine", str(meta), str(tmp_path)).num_rows == 1
    with pytest.raises(UserError, match="'text'"):
        read_source(
            "csv", "mine", str(_write_csv(tmp_path / "n.csv", ["path", "caption"], [["x", "y"]])), str(tmp_path)
        )


def test_folder_with_sidecar_captions(tmp_path):
    (tmp_path / "v" / "sub").mkdir(parents=True)
    (tmp_path / "v" / "a.mp4").write_bytes(b"x")
    (tmp_path / "v" / "a.txt").write_text("A red kite.\n")
    (tmp_path / "v" / "sub" / "b.MKV").write_bytes(b"x")
    (tmp_path / "v" / "notes.md").write_text("not a video")
    t = read_source("folder", "mine", None, str(tmp_path / "v")).to_pylist()
    assert [(r["relpath"], r["text"]) for r in t] == [("a.mp4", "A red kite."), ("sub/b.MKV", "")]
    assert [r["row_error"] for r in t] == [None, None]
    # a latin-1 caption is that row's error (a reject naming the file), never a caption with U+FFFD
    (tmp_path / "v" / "sub" / "b.txt").write_bytes("un café".encode("latin-1"))
    (tmp_path / "v" / "a.txt").write_bytes(b"\xef\xbb\xbf" + "A red kite, naïve.".encode())  # a BOM is fine
    t = read_source("folder", "mine", None, str(tmp_path / "v")).to_pylist()
    assert t[0]["text"] == "A red kite, naïve." and t[0]["row_error"] is None
    assert t[1]["text"] is None and t[1]["row_error"] == "caption file b.txt is not UTF-8 (byte 0xe9 at 6)"


@pytest.mark.slow
def test_miradata_parquet_and_folder_sources_end_to_end(tmp_path):
    """Three sources over the same real clips, one root, one merge: every row there, as each table says."""
    import contextlib
    import io
    from fractions import Fraction

    from reelcache.cli import main
    from reelcache.ingest.demo import ClipSpec, write_clip

    videos = tmp_path / "videos"
    (videos / "000").mkdir(parents=True)
    files = {"000/a.mp4": (96, 64), "000/b.mkv": (64, 96), "c.mp4": (80, 80)}
    for rel, (w, h) in files.items():
        write_clip(videos / rel, ClipSpec(Path(rel).name, w, h, Fraction(25), 1.0))
        (videos / rel).with_suffix(".txt").write_text(f"Folder caption of {rel}.")
    mira = _write_csv(tmp_path / "mira.csv", MIRADATA_COLUMNS, [mira_row(i, rel) for i, rel in enumerate(files)])
    table = [
        {
            "path": rel,
            "text": f"Parquet caption of {rel}.",
            "num_frames": 25,
            "fps": 25.0,
            "height": h,
            "width": w + (8 if rel == "c.mp4" else 0),
        }
        for rel, (w, h) in files.items()
    ]
    pq.write_table(pa.Table.from_pylist(table), tmp_path / "table.parquet")
    root = tmp_path / "root"
    units = []
    for args in (
        ["--source", "miradata", "--caption", "dense", "--meta", str(mira)],
        ["--source", "parquet", "--name", "pq", "--meta", str(tmp_path / "table.parquet")],
        ["--source", "folder", "--name", "fold"],
    ):
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            assert (
                main(["ingest", "plan", "--root", str(root), "--videos", str(videos), "--rows-per-unit", "2", *args])
                == 0
            )
        units += buf.getvalue().split()
    assert main(["ingest", "run", "--root", str(root), *units]) == 0
    assert main(["catalog", "merge", "--root", str(root)]) == 0
    rows = sql(
        root,
        "SELECT source, relpath, status, text, width, height, stated_width, stated_height, "
        "stated_mismatch, mira_clip_id, caption_column, path, shard, shard_offset, file_size "
        "FROM clips ORDER BY source, relpath",
    )
    assert len(rows) == 9 and len({(r[0], r[1]) for r in rows}) == 9
    assert len(sql(root, "SELECT DISTINCT clip_id FROM clips")) == 9  # same file, three sources, three ids
    for source, rel, status, text, w, h, sw, sh, mism, mira_id, capcol, path, shard, off, size in rows:
        assert status == "ok" and (w, h) == files[rel], (source, rel)
        with open(root / shard, "rb") as f:  # real bytes at the recorded offset
            f.seek(off)
            assert f.read(size) == Path(path).read_bytes()
        if source == "miradata":
            assert text.startswith(f"dense caption {list(files).index(rel)}") and capcol == "dense_caption"
            assert mira_id == f"mira{list(files).index(rel)}" and (sw, sh) == (1280, 720)
            assert "size 1280x720!=" in mism and "num_frames 375!=25" in mism
        elif source == "pq":
            assert text == f"Parquet caption of {rel}." and sh == h
            assert (mism is not None) == (rel == "c.mp4") and (rel != "c.mp4" or "size 88x80!=80x80" in mism)
        else:
            assert source == "fold" and text == f"Folder caption of {rel}." and sw is None and mism is None


def _plan(root, kind, meta, videos, capsys):
    """`ingest plan` through the CLI: (exit status, error lines, units printed); progress lines left out."""
    from reelcache.cli import main

    rc = main(["ingest", "plan", "--root", str(root), "--source", kind, "--name", "s", "--meta", str(meta),
               "--videos", str(videos)])  # fmt: skip
    out = capsys.readouterr()
    assert "Traceback" not in out.err
    return rc, [e for e in out.err.splitlines() if not e.endswith(" ...")], out.out.split()


BAD_TABLES = [
    ("parquet", "fake.parquet", "not a readable parquet file"),
    ("csv", "fake.parquet", "not a readable parquet file"),
    ("parquet", "numbers.parquet", "column 'path' is int64, it must be text"),
    ("parquet", "float_text.parquet", "column 'text' is double, it must be text"),
    ("csv", "latin1.csv", "is not UTF-8: line(s) 3, 5 hold bytes"),
]


@pytest.mark.parametrize("kind,name,says", BAD_TABLES)
def test_bad_tables_are_one_line_and_leave_nothing(tmp_path, capsys, kind, name, says):
    root = tmp_path / "root"
    root.mkdir()
    # a file named .parquet that is a CSV; parquets whose path is an int, whose text is a float
    (tmp_path / "fake.parquet").write_text("path,text\nx.mp4,a\n")
    pq.write_table(pa.table({"path": [1, 2], "text": ["a", "b"]}), tmp_path / "numbers.parquet")
    pq.write_table(pa.table({"path": ["1.mp4", "2.mp4"], "text": [0.5, 1.5]}), tmp_path / "float_text.parquet")
    # latin-1 captions (what a Windows export writes): 'café' is b'caf\xe9', not UTF-8
    text = "path,text\na.mp4,ok\nb.mp4,un café\nc.mp4,fine\nd.mp4,naïve\n"
    (tmp_path / "latin1.csv").write_bytes(text.encode("latin-1"))
    rc, err, units = _plan(root, kind, tmp_path / name, tmp_path, capsys)
    assert rc == 2 and len(err) == 1 and says in err[0], err
    assert not units and sorted(p.name for p in root.iterdir()) == []


def test_a_csv_with_a_byte_order_mark_is_read(tmp_path):
    """Excel's 'CSV UTF-8' starts with EF BB BF: the header's first name is still 'path', the text intact."""
    rows = [["a.mp4", "un café"], ["b.mp4", "naïve"]]
    plain = _write_csv(tmp_path / "plain.csv", ["path", "text"], rows)
    bom = tmp_path / "bom.csv"
    bom.write_bytes(b"\xef\xbb\xbf" + plain.read_bytes())
    assert bom.read_bytes()[:3] == "\ufeff".encode()
    t = read_source("csv", "s", str(bom), str(tmp_path)).to_pylist()
    assert [(r["relpath"], r["text"]) for r in t] == [tuple(r) for r in rows]
    assert t == read_source("csv", "s", str(plain), str(tmp_path)).to_pylist()
