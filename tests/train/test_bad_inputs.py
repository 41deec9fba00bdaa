"""Bad inputs a training start meets end in one line, before any work, and leave nothing behind (issue 30.5).

Each case runs the real trainer (one process, the debug stage) on latent shards written by the tests
(tests/latent_data.py) and checks the exact line it ends in, that no traceback follows, and that the run
directory is as it was: absent, or (a planted lease) holding that one file, unchanged.
"""

from __future__ import annotations

import json
import os
import re
import tarfile
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from latent_data import write_latents
from support import data_args, train


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> tuple[Path, Path]:
    r = tmp_path_factory.mktemp("bad-inputs")
    return r, write_latents(r, 24, name="train")


def errors(out: str) -> list[str]:
    assert "Traceback" not in out and "Error:" not in out.replace("reelcache: error:", ""), out[-3000:]
    return [line for line in out.splitlines() if line.strip()]


def the_last_member(manifest: Path, shard: str) -> tuple[int, int]:
    """(rows naming `shard`, its last member's data offset), read from the manifest with pyarrow."""
    rows = [r for r in pq.read_table(manifest).to_pylist() if r["shard"] == shard]
    return len(rows), max(r["shard_offset"] for r in rows)


def repair(r: Path, manifest: Path, shard: str, problem: str, n: int) -> str:
    return (
        f"latent shard {shard} {problem}: it was written by unit train/000000 of cache 'train'; write it again: "
        f"delete latents/train/000000.parquet (the unit's sidecar), run `reelcache cache run --root {r} "
        f"train/000000` and `reelcache catalog merge --root {r}`, then make the manifest again (or re-plan the "
        f"cache: `reelcache cache plan`) (named by {n} of {manifest.name}'s rows)"
    )


@pytest.mark.slow  # starts the trainer (a torch import)
def test_a_missing_shard_is_one_line_before_the_run_starts(root):
    r, manifest = root
    shard = "latents/train/000000-01.tar"
    saved = (r / shard).read_bytes()
    n, _ = the_last_member(manifest, shard)
    (r / shard).unlink()
    try:
        # -X importtime: the modules the refused start imported, one line each on stderr
        entry = ("-X", "importtime", "-m", "reelcache.train")
        out = train(r, data_args(manifest, "--run.name=missing"), entry=entry, ok=False, timeout=120)
    finally:
        (r / shard).write_bytes(saved)
    imported = [ln.rsplit("|", 1)[-1].strip() for ln in out.splitlines() if ln.startswith("import time:")]
    out = "\n".join(ln for ln in out.splitlines() if not ln.startswith("import time:"))
    assert errors(out) == [f"reelcache: error: {repair(r, manifest, shard, 'is missing', n)}"], out[-3000:]
    assert not (r / "runs").exists()
    # a refused start never pays for ColossalAI's import (about 5 CPU-s: peft, transformers, bitsandbytes)
    assert "torch.distributed" in imported and "reelcache.train.trainer" in imported
    assert not [m for m in imported if m.startswith(("colossalai", "peft", "bitsandbytes"))]


def test_a_short_shard_is_refused_when_the_loader_is_made(root):
    from reelcache import UserError
    from reelcache.base.buckets import BucketConfig
    from reelcache.train.loader import LatentLoader

    r, manifest = root
    shard = "latents/train/000000-02.tar"
    saved = (r / shard).read_bytes()
    n, last = the_last_member(manifest, shard)
    with tarfile.open(r / shard) as tar:  # the last member's size, by the tar module (the reference)
        size = next(m.size for m in tar.getmembers() if m.offset_data == last)
    buckets = BucketConfig.from_toml("configs/buckets/tiny.toml")
    (r / shard).write_bytes(saved[: last + 100])  # cut inside its last member
    try:
        with pytest.raises(UserError) as e:
            LatentLoader([manifest], buckets, root=r)
        problem = f"is short: {last + 100} bytes, but its member at byte {last} ends at byte {last + size}"
        assert str(e.value) == repair(r, manifest, shard, problem, n)
        LatentLoader([manifest], buckets, root=r, read=False)  # what plans without reading (simulate) is not refused
    finally:
        (r / shard).write_bytes(saved)
    assert len(LatentLoader([manifest], buckets, root=r).clip_id) == 24


def plant_lease(run: Path, text: str, age_s: float) -> None:
    run.mkdir(parents=True, exist_ok=True)
    (run / "run.lease").write_text(text)
    t = time.time() - age_s
    os.utime(run / "run.lease", (t, t))


@pytest.mark.slow  # starts the trainer (a torch import)
def test_a_lease_that_is_not_json_is_named_as_such(root):
    r, manifest = root
    run = r / "runs/garbled"
    plant_lease(run, "{host: not json", 10)
    before = {p.name: p.read_bytes() for p in run.iterdir()}
    out = train(r, data_args(manifest, "--run.name=garbled", "--resume"), ok=False, timeout=120)
    lines = errors(out)
    assert len(lines) == 1, out[-3000:]
    m = re.fullmatch(
        rf"reelcache: error: run garbled: {run}/run.lease is not a lease \(not the JSON reelcache writes: another "
        r"program's file, or a write cut off\); it counts as abandoned 30 s after it was last written, in (\d+) s: "
        r"run this again then \(--wait does\), or delete it if no start of this run is running",
        lines[0],
    )
    assert m and 0 < int(m[1]) <= 20, lines[0]
    assert {p.name: p.read_bytes() for p in run.iterdir()} == before


@pytest.mark.slow  # starts the trainer (a torch import)
def test_a_lease_of_a_dead_node_says_when_it_turns_stale(root):
    r, manifest = root
    run = r / "runs/orphan"
    holder = {
        "host": "node-gone",
        "boot_id": "0000",
        "pid": 4242,
        "pid_start": 1,
        "started_at": "2026-12-01T00:00:00Z",
        "slurm_job": "77",
        "token": "t0",
    }
    plant_lease(run, json.dumps(holder), 100)
    out = train(r, data_args(manifest, "--run.name=orphan", "--resume"), ok=False, timeout=120)
    lines = errors(out)
    assert len(lines) == 1, out[-3000:]
    m = re.fullmatch(
        rf"reelcache: error: run orphan is running on another node: {run}/run.lease is held by host node-gone "
        r"pid 4242, Slurm job 77 \(started 2026-12-01T00:00:00Z, heartbeat (\d+) s ago\); if that node is gone, the "
        r"lease turns stale when its heartbeat is 300 s old \(REELCACHE_LEASE_TTL_S\), in (\d+) s, and --wait starts "
        rf"then; if it runs, stop it \(touch {run}/stop\), or train under another run.name",
        lines[0],
    )
    assert m and 100 <= int(m[1]) < 160 and abs(int(m[1]) + int(m[2]) - 300) <= 1, lines[0]
    assert json.loads((run / "run.lease").read_text()) == holder and sorted(os.listdir(run)) == ["run.lease"]
