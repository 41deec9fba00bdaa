"""`ingest run UNIT` (ingest/run.py): ingest's steps of the unit runner on real tiny files (fast), and
their slow twins in real processes: SIGKILL mid-unit then a rerun equals a clean run, GNU parallel with
two slots, a file past its deadline is a timeout reject and the unit goes on."""

from __future__ import annotations

import csv
import json
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
from support import ingest, plan_ingest, sql

from reelcache.base.shards import ShardWriter
from reelcache.base.units import worker_reject
from reelcache.cli import main
from reelcache.ingest.filters import PROBE_FILTERS, Rejected, Thresholds
from reelcache.ingest.run import mismatch, take_probe, write
from reelcache.rejects import Reason


def _csv_rows(data: Path) -> int:
    with open(data / "OpenVid-demo.csv", newline="") as f:
        return sum(1 for _ in csv.reader(f)) - 1


def _row(path: Path, **over) -> dict:
    """An ingest row as the plan gives it and the probe filled it in."""
    return {
        "clip_id": "openvid-c0",
        "path": str(path),
        "relpath": path.name,
        "text": "A dog runs on a beach.",
        "file_size": path.stat().st_size if path.exists() else 3000,
        "num_frames": 48,
        "duration": 2.0,
        "status": "ok",
    } | over


def test_the_write_step_keeps_a_readable_clip_and_rejects_a_missing_or_shrunk_one(tmp_path):
    """A step of the unit runner: None keeps the row (now in the shard, with its content hash), (reason, detail)
    rejects it and leaves the shard as it was; the shard reads back with plain webdataset. A video whose bytes
    a takedown withdrew is rejected under any name."""
    import hashlib

    import webdataset as wds

    clip = tmp_path / "c0.mp4"
    clip.write_bytes(b"\x00\x00\x00\x18ftypmp42" + bytes(range(256)) * 8)
    writer = ShardWriter(tmp_path, "000000", 1 << 20, fsync=False)
    kept = _row(clip)
    assert write(kept, writer=writer, sdir=tmp_path, withdrawn={}) is None
    assert (kept["shard"], kept["ext"]) == (f"raw/{tmp_path.name}/000000-00.tar", "mp4")
    assert kept["content_hash"] == hashlib.blake2b(clip.read_bytes(), digest_size=32).hexdigest()
    gone = _row(tmp_path / "gone.mp4", clip_id="openvid-c1")
    reason, detail = write(gone, writer=writer, sdir=tmp_path, withdrawn={})
    assert reason is Reason.missing_file and "cannot read" in detail and "shard" not in gone
    shrunk = _row(clip, clip_id="openvid-c2", file_size=clip.stat().st_size + 1000)  # smaller than probed
    reason, detail = write(shrunk, writer=writer, sdir=tmp_path, withdrawn={})
    assert reason is Reason.truncated and "file changed during ingest" in detail
    (tmp_path / "renamed.mp4").write_bytes(clip.read_bytes())
    again = _row(tmp_path / "renamed.mp4", clip_id="openvid-c3")
    reason, detail = write(again, writer=writer, sdir=tmp_path, withdrawn={kept["content_hash"]: "td-1"})
    assert reason is Reason.withdrawn and "td-1" in detail and "shard" not in again
    (shard,) = writer.close()
    (sample,) = list(wds.WebDataset(str(shard), shardshuffle=False))
    assert sample["__key__"] == "openvid-c0" and sample["mp4"] == clip.read_bytes()
    assert sample["txt"] == b"A dog runs on a beach." and json.loads(sample["json"])["relpath"] == "c0.mp4"
    assert tarfile.open(shard).getmember("openvid-c0.mp4").offset_data == kept["shard_offset"]


def test_the_probe_filters_as_steps_and_what_the_source_table_stated(tmp_path):
    (too_short,) = PROBE_FILTERS
    t = Thresholds(min_frames=17, min_seconds=1.0)
    row = _row(tmp_path / "c.mp4", stated_num_frames=60, stated_fps=24.0)
    take_probe(row, {"num_frames": 16, "fps": 24.0, "duration": 0.67, "width": 256, "height": 144})
    assert too_short(row, t) == (Reason.too_short, "16 frames < --min-frames 17")
    assert row["stated_mismatch"] == "num_frames 60!=16"
    assert too_short(row | {"num_frames": 17}, t) == (Reason.too_short, "0.67 s < --min-seconds 1.0")
    assert too_short(row | {"num_frames": 17, "duration": 1.0}, t) is None
    assert mismatch({"stated_fps": 24.0, "stated_width": 256, "stated_height": 144}, row) is None


def test_a_probes_reject_keeps_its_reason_across_the_worker_boundary():
    """What a probe worker sends back (pickled) is the row's reason; any other error is undecodable."""
    import pickle

    got = pickle.loads(pickle.dumps(Rejected(Reason.no_video_stream, "audio only")))
    assert worker_reject(got, Reason) == (Reason.no_video_stream, "audio only")
    assert worker_reject(ValueError("moov atom not found"), Reason) == (
        Reason.undecodable,
        "ValueError: moov atom not found",
    )


def _cli(*args, **kw):
    return subprocess.Popen(
        [sys.executable, "-m", "reelcache", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw
    )


@pytest.mark.slow  # `ingest run` end to end, in its own processes
def test_sigkill_mid_unit_then_rerun_equals_clean_run(demo_dataset, ingested, tmp_path):
    """Kill a unit right after it made its first shard visible, re-run it, compare with a clean run."""
    root = tmp_path / "killed"
    base = ["--root", str(root)]
    meta, videos = demo_dataset / "OpenVid-demo.csv", demo_dataset / "videos"
    units = plan_ingest(
        root, meta, videos, "--rows-per-unit", "8", "--max-file-mb", "8", "--shard-mb", "0.3", "--verify", "decode"
    )
    unit = units[0]
    src = root / "raw" / "openvid"
    proc = _cli("ingest", "run", *base, unit)
    deadline = time.monotonic() + 60
    while not (src / "000000-00.tar").exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.002)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (src / "000000.parquet").exists(), "the unit finished before it could be killed"
    assert (src / "000000-00.tar").exists()
    from reelcache.catalog.merge import merge

    assert merge(root)["orphans"]  # the half-done unit is reported, not merged
    assert sql(root, "SELECT count(*) FROM clips") == [(0,)]
    for u in units:
        assert main(["ingest", "run", *base, u]) == 0
    merge(root)
    clean = tmp_path / "clean"
    ingest(clean, demo_dataset, "--shard-mb", "0.3", "--verify", "decode")
    q = "SELECT * FROM clips ORDER BY clip_id"
    assert sql(root, q) == sql(clean, q)

    def members(r):
        return {p.name: [(m.name, m.size) for m in tarfile.open(p)] for p in sorted((r / "raw/openvid").glob("*.tar"))}

    assert members(root) == members(clean)
    assert not list(src.glob(".*tmp*"))


@pytest.mark.slow  # `ingest run` end to end, in its own processes
def test_gnu_parallel_two_slots(demo_dataset, tmp_path):
    if not shutil.which("parallel"):
        pytest.skip("GNU parallel is not installed (apt-get install parallel)")
    root = tmp_path / "par"
    meta, videos = demo_dataset / "OpenVid-demo.csv", demo_dataset / "videos"
    units = "\n".join(plan_ingest(root, meta, videos, "--rows-per-unit", "6", "--max-file-mb", "8")) + "\n"
    (tmp_path / "units.txt").write_text(units)
    assert len(units.split()) >= 4

    def run(joblog):
        cmd = [
            "parallel",
            "--will-cite",
            "-j",
            "2",
            "--joblog",
            str(joblog),
            sys.executable,
            "-m",
            "reelcache",
            "ingest",
            "run",
            "--root",
            str(root),
            "{}",
            "::::",
            str(tmp_path / "units.txt"),
        ]
        done = subprocess.run(cmd, check=True, capture_output=True, text=True)
        log = joblog.read_text().splitlines()[1:]
        assert len(log) == len(units.split()) and all(line.split("\t")[6] == "0" for line in log)
        return done.stderr

    run(tmp_path / "joblog1")
    assert run(tmp_path / "joblog2").count("already done") == len(units.split())  # finished units skip
    assert main(["catalog", "merge", "--root", str(root)]) == 0
    ((n,),) = sql(root, "SELECT count(*) FROM clips")
    assert n == _csv_rows(demo_dataset)


@pytest.mark.slow  # `ingest run` end to end, in its own processes
def test_a_file_past_its_deadline_is_a_timeout_reject_and_the_unit_goes_on(demo_dataset, tmp_path):
    from reelcache.ingest.sources import OPENVID_COLUMNS

    meta = tmp_path / "two.csv"
    with open(meta, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(OPENVID_COLUMNS)
        w.writerow(["long_take.mp4", "A long take of a city street.", 5, 1, 1, "static", "", "", ""])
        w.writerow(["not_there.mp4", "A missing file.", 5, 1, 1, "static", "", "", ""])
    root = tmp_path / "r"
    plan_ingest(root, meta, demo_dataset / "videos", "--verify", "decode", "--decode-timeout", "0.005")
    assert main(["ingest", "run", "--root", str(root), "openvid/000000"]) == 0
    assert main(["catalog", "merge", "--root", str(root)]) == 0
    got = sql(root, 'SELECT relpath, reject_reason, reject_detail FROM clips ORDER BY "row"')
    assert [(p, r) for p, r, _ in got] == [("long_take.mp4", "timeout"), ("not_there.mp4", "missing_file")]
    assert "0.005 s" in got[0][2]
