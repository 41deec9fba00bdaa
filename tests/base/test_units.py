"""The unit runner (base/units.py) and the unit protocol under failure.

Fast: the runner on tiny rows in this process (real worker processes, a real shard writer and lease):
steps keep or reject in order, a batch runs its rows together, a worker's failure is a reason, and a
failed write of our own output fails the unit and leaves nothing (the sidecar schemas:
tests/catalog/test_sidecar_schema.py).
Slow, their twins through `ingest run` in real processes: a full disk fails the unit (never rejects
its clips), and two runs of one unit never delete each other's files."""

from __future__ import annotations

import contextlib
import csv
import json
import os
import resource
import signal
import subprocess
import sys
import tarfile
import time
from enum import Enum
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from support import plan_ingest, sql
from workers import work

from reelcache.base import units
from reelcache.base.shards import ShardWriter
from reelcache.base.units import Batch, Unit, claimed, worker_reject
from reelcache.cli import main
from reelcache.files import OutputError
from reelcache.isolate import Failed, isolated_map

UNIT = "openvid/000000"


def _plan(root: Path, data: Path, meta: Path | None = None) -> list[str]:
    meta = meta or data / "OpenVid-demo.csv"
    return plan_ingest(root, meta, data / "videos", "--rows-per-unit", "8", "--max-file-mb", "8")


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


class Why(str, Enum):
    """A stage's vocabulary, as small as the runner needs: its own reasons and the three of a worker."""

    no_value = "no_value"
    too_big = "too_big"
    timeout = "timeout"
    crashed = "crashed"
    undecodable = "undecodable"


def _unit(directory, rows, claim, steps, **kw) -> Unit:
    """Rows {"clip_id", "x"} through a real isolated map of tests/workers.py's `work` (doubles x)."""
    writer = kw.pop("writer", None) or ShardWriter(directory, "000000", 10_000, fsync=False, claim=claim)
    return Unit(
        name="t/000000",
        rows=rows,
        before=[lambda r: (Why.no_value, "x is None") if r["x"] is None else None],
        work=lambda todo: isolated_map(work, [r["x"] for r in todo], workers=1, timeout=30),
        take=lambda r, y: r.update(y=y),
        steps=steps(writer),
        writer=writer,
        claim=claim,
        finish=lambda rows: pa.Table.from_pylist([{k: r.get(k) for k in COLUMNS} for r in rows]),
        reasons=Why,
        **kw,
    )


COLUMNS = ("clip_id", "status", "reject_reason", "reject_detail", "y", "batch", "shard")


def _store(writer):
    """The last step: write the row's value, as bytes, into the unit's shard."""

    def store(r):
        name, _ = writer.write_sample(r["clip_id"], [("bin", b"v" * r["y"], None)])
        r["shard"] = name

    return store


def _steps(writer):
    too_big = lambda r: (Why.too_big, f"{r['y']} > 8") if r["y"] > 8 else None  # noqa: E731
    batch = Batch(key=lambda r: r["y"] % 4, size=2, run=lambda rows: [r.update(batch=len(rows)) for r in rows])
    return [too_big, batch, _store(writer)]


def test_steps_keep_or_reject_in_order_and_a_batch_runs_its_rows_together(tmp_path):
    xs = [1, None, 2, "raise", 5, 3, 4]  # y = 2x: 2, -, 4, -, 10, 6, 8
    rows = [{"clip_id": f"c{i}", "x": x, "status": "ok"} for i, x in enumerate(xs)]
    with claimed(tmp_path, 0) as claim:
        done = units.run(_unit(tmp_path, rows, claim, _steps))
    got = {r["clip_id"]: r for r in pq.read_table(claim.sidecar).to_pylist()}
    assert [got[f"c{i}"]["status"] for i in range(7)] == ["ok", "rejected", "ok", "rejected", "rejected", "ok", "ok"]
    assert got["c1"]["reject_reason"] == "no_value" and got["c1"]["y"] is None  # never given to a worker
    assert got["c3"]["reject_reason"] == "undecodable" and got["c3"]["reject_detail"] == "ValueError: bad item"
    assert (got["c4"]["reject_reason"], got["c4"]["reject_detail"]) == ("too_big", "10 > 8")
    # y % 4: 2 -> {c0 (2), c5 (6)} a full batch; 0 -> {c2 (4), c6 (8)} a full batch
    assert [got[c]["batch"] for c in ("c0", "c2", "c5", "c6")] == [2, 2, 2, 2]
    assert done["reasons"] == {"no_value": 1, "undecodable": 1, "too_big": 1}
    members = [m.name for m in tarfile.open(tmp_path / "000000-00.tar")]
    assert members == ["c0.bin", "c5.bin", "c2.bin", "c6.bin"]  # written as each batch filled
    assert not (tmp_path / "000000.lease").exists()


def test_rows_left_in_a_batch_run_at_the_end_in_the_order_their_keys_came(tmp_path):
    rows = [{"clip_id": f"c{i}", "x": x, "status": "ok"} for i, x in enumerate([3, 1, 2, 4])]  # y % 4: 2 2 0 0
    with claimed(tmp_path, 0) as claim:

        def steps(writer):
            batch = Batch(key=lambda r: r["y"] % 4, size=3, run=lambda rs: [r.update(batch=len(rs)) for r in rs])
            return [batch, _store(writer)]

        units.run(_unit(tmp_path, rows, claim, steps))
    assert [m.name for m in tarfile.open(tmp_path / "000000-00.tar")] == ["c0.bin", "c1.bin", "c2.bin", "c3.bin"]
    assert {r["batch"] for r in pq.read_table(claim.sidecar).to_pylist()} == {2}


def test_rows_a_last_flush_hands_to_a_later_batch_are_run_too(tmp_path):
    """Two batches in a row: the end's flush of the first fills the second after the loop began; every
    row still reaches the last step (none is left waiting in the second batch)."""
    rows = [{"clip_id": f"c{i}", "x": x, "status": "ok"} for i, x in enumerate([3, 1, 2])]  # y % 4: 2 2 0
    with claimed(tmp_path, 0) as claim:

        def steps(writer):
            first = Batch(key=lambda r: r["y"] % 4, size=5, run=lambda rs: None)
            second = Batch(key=lambda r: 0, size=5, run=lambda rs: [r.update(batch=len(rs)) for r in rs])
            return [first, second, _store(writer)]

        units.run(_unit(tmp_path, rows, claim, steps))
    assert [m.name for m in tarfile.open(tmp_path / "000000-00.tar")] == ["c0.bin", "c1.bin", "c2.bin"]
    assert [r["batch"] for r in pq.read_table(claim.sidecar).to_pylist()] == [3, 3, 3]


def test_a_workers_answer_is_a_reason_of_the_stage():
    class Refused(Exception):  # as a probe's Rejected: the reason it found
        def __init__(self, reason, detail):
            super().__init__(detail)
            self.reason, self.detail = reason, detail

    assert worker_reject(Failed("timeout", "no answer within 2 s"), Why) == (Why.timeout, "no answer within 2 s")
    assert worker_reject(Failed("crashed", "worker killed by SIGSEGV"), Why)[0] is Why.crashed
    assert worker_reject(Failed("error", "unpicklable"), Why) == (Why.undecodable, "unpicklable")
    assert worker_reject(OSError("no such file"), Why) == (Why.undecodable, "OSError: no such file")
    assert worker_reject(Refused(Why.too_big, "11 MB"), Why) == (Why.too_big, "11 MB")
    assert worker_reject({"num_frames": 17}, Why) is None and worker_reject(0, Why) is None


@contextlib.contextmanager
def _file_size_limit_here(nbytes: int):
    """This process may write no file past `nbytes` (EFBIG, as a full disk) until the context ends."""
    old, handler = resource.getrlimit(resource.RLIMIT_FSIZE), signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, old[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old)
        signal.signal(signal.SIGXFSZ, handler)


def test_a_failed_write_of_our_output_fails_the_unit_and_leaves_nothing(tmp_path):
    """The fast twin of test_a_full_disk_fails_the_unit_and_its_rerun_is_clean: the unit's second shard
    hits a file-size limit (EFBIG) after its first shard was finished; no row becomes a reject, the
    unit fails with no sidecar, no shard, no lease, and its rerun gives the clean result."""
    rows = lambda: [{"clip_id": f"c{i}", "x": x, "status": "ok"} for i, x in enumerate([1, 3, 2, 4])]  # noqa: E731
    aborted = []
    with claimed(tmp_path, 0) as claim:
        # shards of 10 kB at most: c0's 2 kB finish the first, c1's 6 kB open a second and pass the 5 kB limit
        big = lambda writer: [_store(writer)]  # noqa: E731
        unit = _unit(tmp_path, rows(), claim, big, abort=lambda: aborted.append(True))
        unit.take = lambda r, y: r.update(y=y * 1000)
        with _file_size_limit_here(5000), pytest.raises(OutputError, match="File too large"):
            units.run(unit)
    assert aborted and sorted(p.name for p in tmp_path.iterdir()) == []
    clean = tmp_path / "clean"
    for d in (tmp_path, clean):
        d.mkdir(exist_ok=True)
        with claimed(d, 0) as claim:
            unit = _unit(d, rows(), claim, big)
            unit.take = lambda r, y: r.update(y=y * 1000)
            units.run(unit)
    assert pq.read_table(tmp_path / "000000.parquet").equals(pq.read_table(clean / "000000.parquet"))
    assert {r["status"] for r in pq.read_table(tmp_path / "000000.parquet").to_pylist()} == {"ok"}


@pytest.mark.slow  # `ingest run` in its own processes
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


@pytest.mark.slow  # `ingest run` in its own processes
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
from reelcache.base.units import begin_unit
claim = begin_unit(Path(sys.argv[1]), 0)
Path(sys.argv[1], f".000000-00.tar.tmp{os.getpid()}").write_bytes(b"half a shard")   # work in progress
print("held", flush=True)
sys.stdin.readline()
claim.release()
"""


def _holder(directory: Path) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(directory)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "held"
    return proc


@pytest.mark.slow  # `ingest run` in its own processes
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
        assert waiter.poll() is None and not (src / "000000.parquet").exists()  # it said it waits, and does
        holder.communicate("\n", timeout=30)
        waiter.communicate(timeout=120)
        assert waiter.returncode == 0
    finally:
        holder.kill()
    _same_as_clean(root, ingested)
    assert not (src / "000000.lease").exists() and not list(src.glob(".*tmp*"))


@pytest.mark.slow  # `ingest run` in its own processes
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


# `ingest run` with a heartbeat every 0.05 s (30 s in production) and a unit held before its work until
# the file argv[3] exists (the test makes it once it has seen the heartbeats it wants; 120 s at most).
HEARTBEAT_RUN = """
import os, sys, time
from reelcache.base import lease
from reelcache.ingest import run
lease.HEARTBEAT_S = 0.05
rows = run.unit_rows
def held(*a):
    deadline = time.monotonic() + 120
    while not os.path.exists(sys.argv[3]) and time.monotonic() < deadline:
        time.sleep(0.01)
    return rows(*a)
run.unit_rows = held
from reelcache.cli import main
sys.exit(main(["ingest", "run", "--root", sys.argv[1], sys.argv[2]]))
"""


@pytest.mark.slow  # `ingest run` in its own processes
def test_a_held_leases_heartbeat_advances_while_the_unit_runs(demo_dataset, ingested, tmp_path):
    """What another host judges staleness by: the lease file's mtime, refreshed by the holder's heartbeat
    thread. Set back 1000 s, it is brought back to now, and keeps advancing, while the unit runs."""
    root = tmp_path / "r"
    _plan(root, demo_dataset)
    lease = root / "raw/openvid/000000.lease"
    go = tmp_path / "go"
    proc = subprocess.Popen(
        [sys.executable, "-c", HEARTBEAT_RUN, str(root), UNIT, str(go)],
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
        go.touch()
        _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert not lease.exists()


def _lease_pid(lease: Path):
    try:
        return json.loads(lease.read_text())["pid"]
    except (OSError, ValueError, KeyError):  # not there, or being written
        return None


@pytest.mark.slow  # `ingest run` in its own processes
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
