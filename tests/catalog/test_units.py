"""The unit protocol under failure: a full disk fails the unit (never rejects its clips), and two
runs of one unit never delete each other's files. Real processes, real size limits, real leases."""

from __future__ import annotations

import csv
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from support import sql

from reelcache import UserError
from reelcache.cli import main

UNIT = "openvid/000000"


def _plan(root: Path, data: Path, meta: Path | None = None) -> list[str]:
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert (
            main(
                [
                    "ingest",
                    "plan",
                    "--root",
                    str(root),
                    "--source",
                    "openvid",
                    "--meta",
                    str(meta or data / "OpenVid-demo.csv"),
                    "--videos",
                    str(data / "videos"),
                    "--rows-per-unit",
                    "8",
                    "--max-file-mb",
                    "8",
                ]
            )
            == 0
        )
    return buf.getvalue().split()


def _file_size_limit(nbytes: int):
    def apply():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of a core dump, as on a full disk
        resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, nbytes))

    return apply


def _run(root: Path, *units: str, preexec=None, wait=False, **kw) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "reelcache", "ingest", "run", "--root", str(root), *units] + (
        ["--wait"] if wait else []
    )
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=preexec, **kw)


def _unit_files(src: Path) -> list[str]:
    return sorted(p.name for p in src.iterdir() if p.name != "_plan")


def _same_as_clean(root: Path, clean: Path, stem: str = "000000") -> None:
    """The unit's sidecar and shards equal those of an undisturbed run (the session's `ingested` root)."""
    a, b = root / "raw/openvid", clean / "raw/openvid"
    assert pq.read_table(a / f"{stem}.parquet").to_pylist() == pq.read_table(b / f"{stem}.parquet").to_pylist()

    def members(d):
        return {p.name: [(m.name, m.size) for m in tarfile.open(p)] for p in sorted(d.glob(f"{stem}-*.tar"))}

    assert members(a) == members(b) and members(a)


def test_a_full_disk_fails_the_unit_and_its_rerun_is_clean(demo_dataset, ingested, tmp_path):
    root = tmp_path / "r"
    _plan(root, demo_dataset)
    src = root / "raw/openvid"
    proc = _run(root, UNIT, preexec=_file_size_limit(100_000))  # the unit's first shard is ~1 MB
    _, err = proc.communicate(timeout=120)
    assert proc.returncode != 0
    assert "cannot write" in err and "EFBIG" in err and str(src / ".000000-00.tar.tmp") in err, err
    assert "Traceback" not in err
    assert _unit_files(src) == [], "a failed unit leaves no sidecar, no shards, no lease"
    # space is back: the re-run gives exactly the clean result, no clip was turned into a reject
    proc = _run(root, UNIT)
    assert proc.communicate(timeout=120) and proc.returncode == 0
    _same_as_clean(root, ingested)


def test_a_failed_sidecar_write_fails_the_unit(demo_dataset, tmp_path):
    from reelcache.ingest.sources import OPENVID_COLUMNS

    meta = tmp_path / "missing.csv"  # every row a reject: no shard, only the sidecar is written
    with open(meta, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(OPENVID_COLUMNS)
        for i in range(5):
            w.writerow([f"gone_{i}.mp4", "A clip that is not there.", 5, 1, 1, "static", 10, 30, 1])
    root = tmp_path / "r"
    _plan(root, demo_dataset, meta)
    src = root / "raw/openvid"
    proc = _run(root, UNIT, preexec=_file_size_limit(2_000))
    _, err = proc.communicate(timeout=120)
    assert proc.returncode != 0 and "cannot write" in err and str(src / "000000.parquet") in err, err
    assert _unit_files(src) == []
    proc = _run(root, UNIT)
    proc.communicate(timeout=120)
    assert proc.returncode == 0 and main(["catalog", "merge", "--root", str(root)]) == 0
    assert sql(root, "SELECT reject_reason, count(*) FROM clips GROUP BY 1") == [("missing_file", 5)]


HOLDER = """
import os, sys
from pathlib import Path
from reelcache.catalog.shards import begin_unit, end_unit
sidecar = begin_unit(Path(sys.argv[1]), 0)
Path(sys.argv[1], f".000000-00.tar.tmp{os.getpid()}").write_bytes(b"half a shard")   # work in progress
print("held", flush=True)
sys.stdin.readline()
end_unit(sidecar)
"""


def _holder(directory: Path) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(directory)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_run_is_refused_names_the_holder_and_touches_nothing(demo_dataset, ingested, tmp_path):
    root = tmp_path / "r"
    _plan(root, demo_dataset)
    src = root / "raw/openvid"
    holder = _holder(src)
    try:
        proc = _run(root, UNIT)
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 2
        assert f"pid {holder.pid}" in err and "--wait" in err, err
        assert (src / f".000000-00.tar.tmp{holder.pid}").read_bytes() == b"half a shard"
        assert not (src / "000000.parquet").exists()
        lease = json.loads((src / "000000.lease").read_text())
        assert lease["pid"] == holder.pid and lease["host"] and lease["started_at"]
        # --wait: blocks while the holder lives, then does the unit
        waiter = _run(root, UNIT, wait=True)
        line = waiter.stderr.readline()
        assert "waiting for" in line and f"pid {holder.pid}" in line, line
        time.sleep(0.5)
        assert waiter.poll() is None and not (src / "000000.parquet").exists()
        holder.communicate("\n", timeout=30)
        waiter.communicate(timeout=120)
        assert waiter.returncode == 0
    finally:
        holder.kill()
    _same_as_clean(root, ingested)
    assert not (src / "000000.lease").exists() and not list(src.glob(".*tmp*"))


def test_the_lease_of_a_killed_run_is_stale_at_once(demo_dataset, ingested, tmp_path):
    root = tmp_path / "r"
    _plan(root, demo_dataset)
    src = root / "raw/openvid"
    holder = _holder(src)
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    assert (src / "000000.lease").exists()
    proc = _run(root, UNIT)
    proc.communicate(timeout=120)
    assert proc.returncode == 0
    _same_as_clean(root, ingested)


def test_another_hosts_lease_is_stale_only_after_its_heartbeat_stops(tmp_path):
    from reelcache.catalog import lease as leases
    from reelcache.catalog.shards import begin_unit, end_unit

    lease = tmp_path / "000003.lease"
    lease.write_text(
        json.dumps(
            {
                "host": "gpu-node-17",
                "boot_id": "x",
                "pid": 1,
                "pid_start": 1,
                "started_at": "2026-01-01T00:00:00Z",
                "token": "abc",
            }
        )
    )
    (tmp_path / "000003-00.tar").write_bytes(b"the other node's shard")
    with pytest.raises(UserError, match="gpu-node-17 pid 1"):
        begin_unit(tmp_path, 3)
    assert (tmp_path / "000003-00.tar").exists()
    old = time.time() - leases.TTL_S - 60
    os.utime(lease, (old, old))  # no heartbeat for longer than the TTL: the node is gone
    sidecar = begin_unit(tmp_path, 3)
    assert sidecar == tmp_path / "000003.parquet" and not (tmp_path / "000003-00.tar").exists()
    assert json.loads(lease.read_text())["pid"] == os.getpid()
    end_unit(sidecar)
    assert not lease.exists()


def test_a_lease_with_its_pid_start_as_a_string_still_reads(tmp_path):
    """Leases written before pid_start was an int hold the start ticks as a string: read as the int, so
    the same-host rule still tells a live holder from a pid now used by another process."""
    from reelcache.catalog import lease as leases

    ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])  # field 22
    me = {"host": socket.gethostname(), "boot_id": leases.boot_id(), "pid": os.getpid()}
    lease = tmp_path / "000004.lease"
    for start, stale in ((ticks, False), (ticks - 1, True)):
        lease.write_text(
            json.dumps({**me, "pid_start": str(start), "started_at": "2026-01-01T00:00:00Z", "token": "a"})
        )
        holder = leases.read_holder(lease)
        assert holder.pid_start == start and leases.is_stale(holder) == stale
    assert leases.pid_start(os.getpid()) == ticks


# `ingest run` with a heartbeat every 0.05 s (30 s in production) and a unit slowed by 2 s before
# its work, so that a test sees many heartbeats while the unit runs.
HEARTBEAT_RUN = """
import sys, time
from reelcache.catalog import lease
from reelcache.ingest import run
lease.HEARTBEAT_S = 0.05
rows = run.unit_rows
run.unit_rows = lambda *a: time.sleep(2) or rows(*a)
from reelcache.cli import main
sys.exit(main(["ingest", "run", "--root", sys.argv[1], sys.argv[2]]))
"""


def test_a_held_leases_heartbeat_advances_while_the_unit_runs(demo_dataset, ingested, tmp_path):
    """What another host judges staleness by: the lease file's mtime, refreshed by the holder's heartbeat
    thread. Set back 1000 s, it is brought back to now, and keeps advancing, while the unit runs."""
    root = tmp_path / "r"
    _plan(root, demo_dataset)
    lease = root / "raw/openvid/000000.lease"
    proc = subprocess.Popen(
        [sys.executable, "-c", HEARTBEAT_RUN, str(root), UNIT],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while _lease_pid(lease) != proc.pid:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.002)
        token = json.loads(lease.read_text())["token"]
        old = time.time() - 1000
        os.utime(lease, (old, old))
        beats = []
        for _ in range(20):
            time.sleep(0.05)
            beats.append(lease.stat().st_mtime)
        assert proc.poll() is None, "the unit ended before its heartbeats were seen"
        assert beats[-1] > time.time() - 2, (
            f"the heartbeat did not refresh the lease: {time.time() - beats[-1]:.0f} s old"
        )
        assert len(set(beats)) >= 5 and beats == sorted(beats), beats  # it keeps advancing
        assert json.loads(lease.read_text())["token"] == token  # refreshed, not replaced
    finally:
        _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert not lease.exists()


def _lease_pid(lease: Path):
    try:
        return json.loads(lease.read_text())["pid"]
    except (OSError, ValueError, KeyError):  # not there, or being written
        return None


def test_two_runs_of_one_unit_at_once_leave_one_clean_result(demo_dataset, ingested, tmp_path):
    """The runs provably overlap: the first is paused (SIGSTOP) as soon as its lease file names it, and
    the second starts then. The lease rule: the second exits 2 naming the first and touches nothing;
    the first, resumed, writes the clean result."""
    root = tmp_path / "r"
    _plan(root, demo_dataset)
    src = root / "raw/openvid"
    lease = src / "000000.lease"
    first = _run(root, UNIT)
    try:
        deadline = time.monotonic() + 120
        while _lease_pid(lease) != first.pid:
            assert first.poll() is None and time.monotonic() < deadline, "the first run never held the lease"
            time.sleep(0.002)
        first.send_signal(signal.SIGSTOP)
        files = {p.name: p.read_bytes() for p in src.iterdir() if p.is_file()}
        second = _run(root, UNIT)
        _, err = second.communicate(timeout=120)
        assert second.returncode == 2 and "is being run by" in err and f"pid {first.pid}" in err, err
        assert {p.name: p.read_bytes() for p in src.iterdir() if p.is_file()} == files, "the second run touched files"
    finally:
        first.send_signal(signal.SIGCONT)
    _, err = first.communicate(timeout=180)
    assert first.returncode == 0, err
    _same_as_clean(root, ingested)
    assert not list(src.glob(".*tmp*")) and not lease.exists()


def test_a_run_that_lost_its_lease_does_not_publish(tmp_path):
    from reelcache.catalog.lease import LostLease
    from reelcache.catalog.shards import atomic_path, begin_unit, end_unit

    sidecar = begin_unit(tmp_path, 5)
    lease = tmp_path / "000005.lease"
    taken = json.loads(lease.read_text()) | {"host": "gpu-node-3", "pid": 77, "token": "theirs"}
    lease.write_text(json.dumps(taken))  # another node took the unit over while this run was frozen
    with pytest.raises(LostLease, match="lost the lease"):
        with atomic_path(sidecar) as tmp:
            tmp.write_bytes(b"results")
    assert not sidecar.exists() and json.loads(lease.read_text())["token"] == "theirs"
    end_unit(sidecar)
    assert json.loads(lease.read_text())["token"] == "theirs"  # releasing never removes another's lease


def test_the_shard_writer_tells_a_bad_source_from_a_failed_write(tmp_path):
    """Source problems are the sample's (SourceError, shard cut back); the writer goes on."""
    import webdataset as wds

    from reelcache.catalog.shards import ShardWriter, ShortRead, SourceError

    src = tmp_path / "v.bin"
    src.write_bytes(b"x" * 3000)
    w = ShardWriter(tmp_path, "000000", 1 << 20, fsync=False)
    w.write_sample("a", [("bin", str(src), 3000), ("txt", b"first", None)])
    with pytest.raises(ShortRead, match="read 3000 of 5000 bytes"):
        w.write_sample("b", [("bin", str(src), 5000), ("txt", b"second", None)])
    with pytest.raises(SourceError, match="cannot open"):
        w.write_sample("c", [("bin", str(tmp_path / "gone.bin"), 10)])
    w.write_sample("d", [("bin", str(src), 3000), ("txt", b"fourth", None)])
    shards = w.close()
    got = [(s["__key__"], s["txt"]) for s in wds.WebDataset([str(p) for p in shards], shardshuffle=False)]
    assert got == [("a", b"first"), ("d", b"fourth")]
